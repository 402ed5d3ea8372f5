"""The process's resident memory: its peak over a run and over each step of an iteration, and freed heap given back.

    memory = PeakMemory()                 # a run opens: the peak counts from here
    with memory.step("update") as peak:   # peak["perf/peak_rss_gib/update"] once the block ends
        ...
    memory.run_peak()                     # bytes

Freed memory is not always given back. glibc's malloc keeps freed blocks below its mmap threshold (at most 32 MiB)
in its heaps for reuse, and a run's many tensors of a few MiB (KV caches of a long rollout, activations of an
update) leave gigabytes of free heap resident after the step that made them. Measured in a FrozenLake study: a
sweep worker process that had finished one run held 14.6 GiB resident before the next run's first iteration, and
``malloc_trim(0)`` brought it to 3.7 GiB. :func:`release_free_memory` gives it back; each step of
:class:`PeakMemory` does so at its end, so the next step starts from the memory the run actually holds.

Large tensors are new pages. Above glibc's mmap threshold every allocation is a fresh mapping, and its first
touch faults in each 4 KiB page: writing a new 175 MB tensor of vocabulary-sized logits took 160 ms where the same
arithmetic in place took 21. :func:`use_huge_pages` has torch's CPU allocator ask for transparent huge pages
(2 MiB) instead; the ``ragen`` command turns it on before anything is allocated.

Tests: ``.venv/bin/python -m pytest tests/unit/test_memory.py tests/unit/test_session.py -q``.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import os
import resource
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

__all__ = ["HUGE_PAGES_ENV", "PeakMemory", "peak_rss_bytes", "release_free_memory", "reset_peak_rss", "use_huge_pages"]

HUGE_PAGES_ENV = "THP_MEM_ALLOC_ENABLE"
"""torch's switch for its CPU allocator: allocations of 2 MiB or more aligned to 2 MiB and ``madvise``-d
``MADV_HUGEPAGE`` (Linux; the kernel's transparent huge pages set to ``always`` or ``madvise``)."""


def use_huge_pages() -> None:
    """Large CPU tensors of this process (and of the processes it starts) on transparent huge pages, unless
    :data:`HUGE_PAGES_ENV` is set already (``0`` keeps them off). torch reads the variable once, at the process's
    first allocation of 2 MiB or more, so this must run before that. On the vanilla StarPO update of the Bandit
    study's batch (fp32, 2 AVX2 cores, 3 updates in each of 2 processes a setting, alternated): 13.3 s an update
    against 14.4 (1.08×), the vocabulary-sized log-prob and entropy pass 82 + 51 ms against 172 + 102. On a 2-core
    AMX virtual machine they cost time instead (bf16 update 4.30-4.61 s against 4.05-4.28 s without them:
    docs/benchmarks.md); ``THP_MEM_ALLOC_ENABLE=0`` keeps them off. Where the kernel gives no huge pages, nothing
    changes."""
    os.environ.setdefault(HUGE_PAGES_ENV, "1")


def reset_peak_rss() -> bool:
    """Start this process's peak resident memory afresh where the kernel allows it (Linux: ``clear_refs`` 5 resets
    VmHWM); elsewhere :func:`peak_rss_bytes` keeps counting from the process's start. Whether it was reset."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def peak_rss_bytes() -> int:
    """This process's peak resident memory: Linux's VmHWM (since :func:`reset_peak_rss`), else ``ru_maxrss``."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # in kB
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux and the BSDs


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library is not glibc (musl, macOS, Windows)."""
    name = ctypes.util.find_library("c")
    if not sys.platform.startswith("linux") or name is None:
        return None
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_free_memory() -> bool:
    """Give the C heap's free memory back to the system (glibc's ``malloc_trim(0)``: every arena, free pages in the
    middle of a heap too). Whether any was given back; False where the C library has no such call."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False


class PeakMemory:
    """A run's peak resident memory (``perf/peak_rss_gib``) and, where the kernel lets the peak be reset (Linux),
    each step's own (``perf/peak_rss_gib/<step>``: rollout, diagnose, grad_buckets, update, eval), so that a run
    too large for its machine says which step to shrink. Each step resets the process's peak and reads it at its
    end, then gives the free heap back (``release``, :func:`release_free_memory`); the run's peak is the largest of
    the steps' and of what came between. Elsewhere only the run's peak is logged, counted from the process's
    start."""

    def __init__(self, release: bool = True) -> None:
        self.per_step = reset_peak_rss()
        self.peak = peak_rss_bytes()
        self.release = release

    def run_peak(self) -> int:
        """The run's peak so far, in bytes."""
        self.peak = max(self.peak, peak_rss_bytes())
        return self.peak

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[dict[str, float]]:
        """Measure the block's peak; the dict it yields holds ``perf/peak_rss_gib/<name>`` once the block ends
        (empty where the peak cannot be reset)."""
        out: dict[str, float] = {}
        if self.per_step:
            self.run_peak()
            reset_peak_rss()
        try:
            yield out
        finally:
            if self.per_step:
                step_peak = peak_rss_bytes()
                self.peak = max(self.peak, step_peak)
                out[f"perf/peak_rss_gib/{name}"] = step_peak / 2**30
            if self.release:
                release_free_memory()
