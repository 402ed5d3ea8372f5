"""A local study's share of the cores per run, which the study changes while its runs go on.

``ragen study`` on a machine without GPUs runs two runs at a time, each worker process on half the cores
(``OMP_NUM_THREADS``, flows/sweep.py). A round ends when its last worker ends, and a worker ends when no trial is
left for it to start, so at a round's end one worker may still be running its last trial on half the cores while
the other half idles (a 41-minute run of studies/echo-trap-bandit.yaml on 2 cores: its last 4 minutes). The
study therefore writes the torch thread count each worker may use into a file, which it names to the workers in
``$RAGEN_CPU_SHARE`` (:func:`publish`), and writes it again when a worker ends (the cores shared out among those
still running); a worker reads it after each iteration (:func:`follow`) and sets torch's thread count to it.

torch's intra-op threads change between operations (``torch.set_num_threads``: OpenMP, MKL and oneDNN take the
new count from their next parallel region), so a run changes nothing else. A run with its own
``trainer.threads`` keeps it (flows/train.py). A process that started vLLM's CPU engine in-process keeps its
count too: the engine binds its threads to cores and replaces ``torch.set_num_threads`` with a no-op for the
whole process, which :func:`follow` notices (the count did not move) and then stops asking. Outside such a study
the variable is unset and nothing happens.

    from ragen_core import cpu_share
    cpu_share.publish(path, 1)          # the study: one thread each
    cpu_share.follow()                  # a worker, between iterations: 2 once the file says so, else None

Run the tests: ``python -m pytest tests/unit/test_cpu_share.py tests/flows/test_sweep_workers.py -q``.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["SHARE_ENV", "cores", "follow", "publish"]

SHARE_ENV = "RAGEN_CPU_SHARE"
"""The file a worker reads its torch thread count from (one integer), set by the study that started it."""


def cores() -> int:
    """The cores this process may run on, which the study shares out: its CPU affinity where the system keeps one
    (a container's cpuset, ``taskset``: ``os.cpu_count()`` counts the whole machine there), else every core."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


def publish(path: str | Path, threads: int) -> None:
    """Write ``threads`` (at least 1) to ``path`` in one step: a worker reading it meanwhile sees the old count or
    the new one, never a partial file."""
    if threads < 1:
        raise ValueError(f"threads: {threads} is not a thread count (at least 1)")
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(f"{threads}\n")
    os.replace(tmp, path)


_refused: set[int] = set()
"""Counts this process could not take up (an in-process vLLM CPU engine holds torch's threads): not asked again."""


def follow() -> int | None:
    """Set torch's CPU thread count to the one in ``$RAGEN_CPU_SHARE``'s file; the new count when it changed, else
    None (the variable unset, the file gone or not a count, the count already in force, or this process's count
    held by a vLLM CPU engine)."""
    path = os.environ.get(SHARE_ENV)
    if not path:
        return None
    try:
        threads = int(Path(path).read_text().strip())
    except (OSError, ValueError):
        return None
    import torch  # here: the study's own process, which only publishes, never loads torch

    if threads < 1 or threads == torch.get_num_threads() or threads in _refused:
        return None
    torch.set_num_threads(threads)
    if torch.get_num_threads() != threads:
        _refused.add(threads)
        return None
    return threads
