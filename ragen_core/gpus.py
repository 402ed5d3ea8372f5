"""GPUs as a scheduled resource of a machine: every run holds the devices it computes on, and no two live runs
share one.

    from ragen_core import gpus
    ids = gpus.hold(2)          # two distinct devices of this machine, for the rest of this process's life
    # os.environ["CUDA_VISIBLE_DEVICES"] == ",".join(ids) from here on

The devices a machine offers are those declared in ``RAGEN_GPUS`` (comma-separated device ids), which wins, else
those of ``CUDA_VISIBLE_DEVICES`` when it is set, else every GPU ``nvidia-smi`` lists; none on a machine without
an NVIDIA driver (the run then holds nothing and computes where its config says). ``RAGEN_GPUS`` also declares
slots on a machine without GPUs: the scheduling is the same, the runs compute on the CPU.

A device is held by an exclusive lock on its file in a folder of this machine (``RAGEN_GPU_LOCK_DIR``, default
``<tmp>/ragen-gpus``), named after the GPU's UUID where nvidia-smi knows it. The operating system drops the lock
when the holding process ends, however it ends (a kill included), so a device is never left taken by a dead run.
Prefect's own limits count runs, not devices: a worker's ``--limit`` (start it with the number of GPUs,
``ragen worker``) keeps a machine from taking more one-GPU runs than it has GPUs, and the locks say which device
each run gets, and make a run that needs several wait until that many are free.

Set ``CUDA_VISIBLE_DEVICES`` before CUDA starts in the process: :func:`hold` refuses once torch has initialised
CUDA with another set of devices (the new set would not take effect).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from filelock import FileLock, Timeout

from ragen_core.config import ConfigError

GPUS_ENV = "RAGEN_GPUS"
"""Comma-separated device ids this machine offers; wins over what CUDA reports."""

LOCK_DIR_ENV = "RAGEN_GPU_LOCK_DIR"
"""The folder of this machine's device locks (default ``<tmp>/ragen-gpus``)."""

_held: list[FileLock] = []
_held_ids: tuple[str, ...] = ()


def _ids(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def offered() -> list[str]:
    """The device ids of this machine: ``RAGEN_GPUS``, else ``CUDA_VISIBLE_DEVICES``, else nvidia-smi's list."""
    declared = os.environ.get(GPUS_ENV)
    if declared is not None and declared.strip():
        ids = _ids(declared)
        if len(set(ids)) != len(ids):
            raise ConfigError(f"{GPUS_ENV}={declared!r} names a device twice")
        return ids
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return _ids(visible)
    return [row[0] for row in _smi("index")]


def _smi(query: str) -> list[list[str]]:
    """``nvidia-smi --query-gpu=QUERY`` as rows of fields; none without an NVIDIA driver."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    out = subprocess.run([smi, f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True, text=True,
                         check=False, timeout=60)
    if out.returncode != 0:
        return []
    return [[field.strip() for field in line.split(",")] for line in out.stdout.splitlines() if line.strip()]


def _lock_names(devices: list[str]) -> dict[str, str]:
    """The name each device is locked under: the GPU's UUID where nvidia-smi knows the id, so that runs whose
    ``CUDA_VISIBLE_DEVICES`` number the same GPU differently (two scheduler jobs, each seeing its GPU as 0) meet on
    one lock, and runs seeing different GPUs as 0 do not; a declared id (``RAGEN_GPUS``) is its own name."""
    if (os.environ.get(GPUS_ENV) or "").strip():
        return {d: d for d in devices}
    uuids = {row[0]: row[1] for row in _smi("index,uuid") if len(row) == 2}
    return {d: d if d.startswith(("GPU-", "MIG-")) else uuids.get(d, d) for d in devices}


def lock_dir() -> Path:
    folder = Path(os.environ.get(LOCK_DIR_ENV) or Path(tempfile.gettempdir()) / "ragen-gpus")
    if not folder.is_dir():
        folder.mkdir(parents=True, exist_ok=True)
        try:
            folder.chmod(0o1777)  # every user's runs on this machine share the devices
        except OSError:
            pass
    return folder


def _lock(name: str) -> FileLock:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
    return FileLock(str(lock_dir() / f"gpu-{safe}.lock"), mode=0o666, thread_local=False)


def hold(n: int, *, wait_s: float | None = None, poll_s: float = 1.0,
         say: Callable[[str], None] = print) -> tuple[str, ...]:
    """Hold ``n`` distinct devices of this machine until this process ends; returns their ids (also the value
    ``CUDA_VISIBLE_DEVICES`` gets). Empty when the machine offers none.

    Waits, with one line said, while fewer than ``n`` are free; ``wait_s`` bounds the wait (TimeoutError).
    A process that already holds devices keeps them: asking again for at most as many returns the same ids.
    ConfigError when the machine offers fewer than ``n``.
    """
    global _held_ids
    if n < 1:
        raise ConfigError(f"a run holds at least one device, asked for {n}")
    if _held_ids:
        if n > len(_held_ids):
            raise ConfigError(f"this process holds GPU {','.join(_held_ids)} already; a run on {n} GPUs "
                              "needs a process of its own")
        return _held_ids
    devices = offered()
    if not devices:
        return ()
    if n > len(devices):
        raise ConfigError(f"{n} GPUs asked for, this machine offers {len(devices)} ({','.join(devices)}; "
                          f"{GPUS_ENV} or what CUDA reports)")
    started, said = time.monotonic(), False
    while (got := _try_take(devices, n)) is None:
        if wait_s is not None and time.monotonic() - started >= wait_s:
            raise TimeoutError(f"{n} of this machine's GPUs ({','.join(devices)}) were not free within {wait_s:g} s")
        if not said:
            say(f"[gpus] waiting for {n} free GPU{'s' if n > 1 else ''} of {','.join(devices)} "
                "(held by other runs on this machine)")
            said = True
        time.sleep(poll_s)
    ids = tuple(got)
    try:
        _check_cuda_not_started(ids)
    except RuntimeError:
        for lock in got.values():
            lock.release()
        raise
    _held.extend(got.values())
    _held_ids = ids
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(ids)
    return ids


def _try_take(devices: list[str], n: int) -> dict[str, FileLock] | None:
    """Locks on ``n`` free devices (the first free ones, in order), or None, holding nothing, when fewer are free."""
    got: dict[str, FileLock] = {}
    names = _lock_names(devices)
    for device in devices:
        lock = _lock(names[device])
        try:
            lock.acquire(timeout=0)
        except Timeout:
            continue
        got[device] = lock
        if len(got) == n:
            return got
    for lock in got.values():
        lock.release()
    return None


@contextlib.contextmanager
def holding(n: int, *, say: Callable[[str], None] = print) -> Iterator[tuple[str, ...]]:
    """:func:`hold` for a block: devices this call took are given back at its end (and ``CUDA_VISIBLE_DEVICES``
    restored), so one process can run one run after another (a notebook, a test); devices the process held
    before (a sweep worker's) stay held."""
    if _held_ids:
        yield hold(n, say=say)
        return
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = hold(n, say=say)
    try:
        yield ids
    finally:
        if ids:
            release()
            if before is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = before


def release() -> None:
    """Give back the devices this process holds (a process's end does the same)."""
    global _held_ids
    for lock in _held:
        lock.release(force=True)
    _held.clear()
    _held_ids = ()


def _check_cuda_not_started(ids: tuple[str, ...]) -> None:
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return
    if os.environ.get("CUDA_VISIBLE_DEVICES") != ",".join(ids):
        raise RuntimeError(f"CUDA started in this process before it was given GPU {','.join(ids)}: hold the "
                           "devices first (ragen_core.gpus.hold) so that CUDA_VISIBLE_DEVICES takes effect")
