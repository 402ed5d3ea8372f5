"""A stalled run ends instead of holding its machine: :func:`stall_watchdog`.

    with stall_watchdog(cfg.trainer.stall_seconds, say) as progress:
        for step in steps:
            progress()        # each step, each turn of a rollout or evaluation
            step()

A run whose process hangs keeps its Optuna heartbeat and its Prefect flow run alive: the heartbeat thread beats on
while the main thread waits (a collective that never completes because another rank died, a blocked read of a
shared filesystem, a deadlock between a library's threads), so the study's trial stays RUNNING and the pool's GPUs
stay held. Within the block the run must report progress at least every ``seconds``; when it does not, Python's
faulthandler writes every thread's traceback to stderr (where each one waits: the diagnosis) and the process exits
with status 1. A study then retries the trial from its checkpoint (``retries``), a Prefect worker marks the flow run
crashed, and the other ranks of a run, stalled on the same collective, end by their own watchdogs.

faulthandler's timer is a thread of its own in C: it fires while the main thread is blocked inside C code (a
collective, a lock), where a Python timer or a signal handler would wait for it. There is one such timer per
process; the block arms it, each report re-arms it, and leaving the block cancels it.
"""

from __future__ import annotations

import contextlib
import faulthandler
import sys
from collections.abc import Callable, Iterator
from typing import TextIO

__all__ = ["stall_watchdog"]


def _stream() -> TextIO | None:
    """A stream with a file descriptor for faulthandler to write to (stderr, else the process's own), or None."""
    for stream in (sys.stderr, sys.__stderr__):
        try:
            if stream is not None:
                stream.fileno()
                return stream
        except (AttributeError, OSError, ValueError):  # a replaced stderr with no descriptor: UnsupportedOperation
            continue
    return None


@contextlib.contextmanager
def stall_watchdog(seconds: float, say: Callable[[str], None] = print) -> Iterator[Callable[[], None]]:
    """Within the block, the process exits with status 1 and every thread's traceback on stderr when ``seconds``
    pass without a call of the function it yields (module docstring). ``seconds`` 0: no watchdog (the function
    does nothing)."""
    stream = _stream() if seconds > 0 else None
    if stream is None:
        if seconds > 0:
            say("stall watchdog off: stderr has no file descriptor for faulthandler to write to")
        yield lambda: None
        return

    def progress() -> None:
        faulthandler.dump_traceback_later(seconds, exit=True, file=stream)

    progress()
    try:
        yield progress
    finally:
        faulthandler.cancel_dump_traceback_later()
