"""The model cache: provisioned model directories under ``$RAGEN_DATA_DIR/models/``, built atomically.

Every directory that ragen provisions (the converted default model, ``tiny-random-<seed>``, a
format-warmed copy) is built the same way:

    with models_lock(progress):                 # one builder at a time, across processes
        if check_model_dir(target) is None:     # another process finished it while we waited
            return target
        clean_leftovers(target.name)            # temp dirs of interrupted builds
        with staging_dir(target.name) as tmp:   # models/.tmp-<name>-<pid>, removed on failure
            ...write the model into tmp...
            publish(tmp, target, facts)         # marker written last, then renamed into place

A directory whose :data:`MARKER` is missing, or whose files do not match it (a truncated
safetensors file, say), is incomplete and gets rebuilt.

Run its tests: ``.venv/bin/python -m pytest tests/unit/test_models.py -q``.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ragen_core.config import data_dir

__all__ = [
    "MARKER",
    "Progress",
    "check_model_dir",
    "clean_leftovers",
    "models_dir",
    "models_lock",
    "publish",
    "read_marker",
    "say",
    "staging_dir",
]

MARKER = "ragen-model.json"
"""File written last into a provisioned directory; without it the directory is incomplete."""

_MARKER_FORMAT = 1

Progress = Callable[[str], None]
"""Receives one line per provisioning step (``print``, ``console.print``, ``list.append``)."""


def models_dir() -> Path:
    """``data_dir()/models``, created on demand (with the data dir): every provisioned model lives here."""
    path = data_dir() / "models"
    path.mkdir(parents=True, exist_ok=True)
    return path


def say(progress: Progress | None, message: str) -> None:
    """Pass ``message`` to ``progress`` when there is one."""
    if progress is not None:
        progress(message)


@contextlib.contextmanager
def models_lock(progress: Progress | None) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``models/.lock`` (works across processes and threads)."""
    with open(models_dir() / ".lock", "a+b") as handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(progress, "another process is provisioning a model; waiting for it")
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


# --------------------------------------------------------------------------- marker checks


def safetensors_problem(path: Path) -> str | None:
    """Why ``path`` is not a complete safetensors file, or None when its size matches its header.

    Format: 8-byte little-endian header length N, N bytes of JSON, then the tensor data; a
    complete file ends exactly at the largest ``data_offsets`` end. Reading the header is
    cheap, unlike hashing half a gigabyte on every load.
    """
    size = path.stat().st_size
    if size < 8:
        return f"{path.name} is truncated ({size} bytes)"
    with open(path, "rb") as handle:
        (header_len,) = struct.unpack("<Q", handle.read(8))
        if header_len > size - 8:
            return f"{path.name} is truncated (header says {header_len} bytes, file has {size})"
        try:
            header = json.loads(handle.read(header_len))
        except ValueError:
            return f"{path.name} has a corrupt header"
    ends = [entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"]
    expected = 8 + header_len + max(ends, default=0)
    if size != expected:
        return f"{path.name} has {size} bytes, its header says {expected}"
    return None


def check_model_dir(path: Path) -> str | None:
    """Why a provisioned directory is incomplete or corrupt, or None when it is whole.

    Whole means: the marker exists and parses, every file it lists has the listed size, and
    every safetensors file ends where its header says it does.
    """
    if not path.is_dir():
        return "it does not exist"
    marker_path = path / MARKER
    if not marker_path.is_file():
        return f"it has no {MARKER} (an interrupted fetch?)"
    try:
        marker = json.loads(marker_path.read_text())
        files = dict(marker["files"])
        if marker["format"] != _MARKER_FORMAT:
            return f"{MARKER} has format {marker['format']}, expected {_MARKER_FORMAT}"
    except (ValueError, KeyError, TypeError):
        return f"{MARKER} is corrupt"
    if "config.json" not in files or not any(name.endswith(".safetensors") for name in files):
        return f"{MARKER} lists no config.json or no safetensors weights"
    for name, size in files.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != size:
            return f"{name} has {file.stat().st_size} bytes, {MARKER} says {size}"
        if name.endswith(".safetensors"):
            problem = safetensors_problem(file)
            if problem is not None:
                return problem
    return None


def read_marker(path: Path) -> dict[str, Any]:
    """The marker of the directory ``path`` as a dict; empty when it is missing or unreadable."""
    try:
        return dict(json.loads((path / MARKER).read_text()))
    except (OSError, ValueError):
        return {}


# --------------------------------------------------------------------------- building


def publish(tmp: Path, target: Path, facts: dict[str, Any]) -> None:
    """Write the marker last into ``tmp``, then rename ``tmp`` to ``target`` (replacing it)."""
    files = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
    marker = {
        "format": _MARKER_FORMAT,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **facts,
        "files": files,
    }
    with open(tmp / MARKER, "w") as handle:
        json.dump(marker, handle, indent=2)
        handle.flush()
        os.fsync(handle.fileno())
    old = target.with_name(f".old-{target.name}-{os.getpid()}")
    if target.exists():
        # os.replace cannot replace a non-empty directory: move the old one aside first.
        os.replace(target, old)
    os.replace(tmp, target)
    shutil.rmtree(old, ignore_errors=True)


def clean_leftovers(name: str) -> None:
    """Remove temp dirs of earlier interrupted builds of ``name`` (call it holding the lock, so none is live)."""
    for stale in models_dir().glob(f".tmp-{name}-*"):
        shutil.rmtree(stale, ignore_errors=True)
    for stale in models_dir().glob(f".old-{name}-*"):
        shutil.rmtree(stale, ignore_errors=True)


@contextlib.contextmanager
def staging_dir(name: str) -> Iterator[Path]:
    """``models/.tmp-<name>-<pid>``, removed again if the block fails before publishing."""
    tmp = models_dir() / f".tmp-{name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # a no-op after a successful rename
