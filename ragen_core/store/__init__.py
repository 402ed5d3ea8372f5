"""Trajectory store (DESIGN §4): Parquet shards per iteration under ``$RAGEN_DATA_DIR/runs/<run>/rollouts``.

    from ragen_core.store import run_dir, write_shard, read_run, read_trajectories

See ``parquet.py`` for the layout and the atomic write. Names are imported lazily (pyarrow loads
on first use). Run the tests: ``.venv/bin/python -m pytest tests/unit/store -q``.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = ("SCHEMA", "SCHEMA_VERSION", "read_run", "read_shard", "read_trajectories", "rollouts_dir", "run_dir",
            "shard_path", "to_table", "write_shard")

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module("ragen_core.store.parquet"), name)
    raise AttributeError(f"module 'ragen_core.store' has no attribute {name!r}")
