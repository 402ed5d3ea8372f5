"""Files that survive a kill at any instant: atomic publication, fsync, and the leftovers of dead writers.

    atomic_write_text(path, text)        # readers see the old file or the whole new one, never a part
    fsync_dir(folder)                    # make a rename (or a new entry) in ``folder`` durable
    pid_alive(pid)                       # is the process that owns a temp file still running?

A rename is atomic but not durable until its directory is fsynced, and a file's data is not durable until
the file is: :func:`atomic_write_text` does both, in that order (data, rename, directory), so after a crash
of the machine the name points at complete data. Used for a run's config.yaml (store/run_dir.py), the
trajectory shards (store/parquet.py) and checkpoints (trainer/checkpoint.py).

Tests: ``.venv/bin/python -m pytest tests/unit/store -q``.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

__all__ = ["atomic_write_text", "fsync_dir", "fsync_file", "pid_alive"]


def fsync_file(path: str | os.PathLike[str]) -> None:
    """Flush ``path``'s data to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(folder: str | os.PathLike[str]) -> None:
    """Make the entries of ``folder`` (a rename into it, a new file) durable. A no-op where directories
    cannot be opened (not POSIX)."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on a directory; the rename is still atomic
        pass
    finally:
        os.close(fd)


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` through a hidden temp file in the same folder, fsynced, renamed over
    ``path``, and the folder fsynced; returns ``path``."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    fsync_dir(target.parent)
    return target


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this machine (owned by anyone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True
