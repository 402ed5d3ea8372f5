"""Native code that torch's extension builder (``torch.utils.cpp_extension.load``) compiles at run time, held
so that a process killed meanwhile never leaves the others waiting.

torch guards each build folder with a lock file that records no owner: the process that makes it builds (ninja
skips what is up to date) and removes it after, and every other loader waits for as long as it exists. A process
killed while it holds it (a SIGKILL, Ctrl-C during a first start, a test's timeout, a lost machine) leaves the
file, and every later load of that folder on the machine waits forever. Two builds run that way here: this
project's CPU decode attention kernel (``ragen_core/rollout/generators/cpu_attention.py``) and DeepSpeed's CPU
shared-memory collective op, which ``deepspeed.init_distributed`` builds at every start
(``ragen_core/trainer/deepspeed_engine.py``: with a lock file left behind, every DeepSpeed start on the machine
hangs, the multi-process tests each until their timeout). So a loader first takes its own lock on the folder
(:func:`exclusive_build`), one the operating system releases when its holder dies; while it holds that, a torch
lock file can only be a dead process's, and is removed. Processes of other programs building in the same folder
do not take it: they keep torch's own protocol.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from filelock import FileLock

__all__ = ["TORCH_LOCK", "exclusive_build"]

TORCH_LOCK = "lock"
"""The file name of torch's own lock in a build folder (``torch.utils.file_baton.FileBaton``)."""


@contextlib.contextmanager
def exclusive_build(directory: Path, timeout_s: float) -> Iterator[None]:
    """Hold this process's lock on the build folder ``directory`` (made if missing) for the block, having removed
    torch's lock file where a dead process left one. Waits at most ``timeout_s`` for another live loader of the
    folder (raises ``filelock.Timeout``)."""
    directory.mkdir(parents=True, exist_ok=True)
    with FileLock(directory / "ragen.lock", timeout=timeout_s):
        # held by nobody alive while we hold ours: every loader of this project takes ours first
        (directory / TORCH_LOCK).unlink(missing_ok=True)
        yield
