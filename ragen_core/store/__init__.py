"""Run folders and the trajectory store (DESIGN §4).

- ``run_dir.py``: :class:`RunDir`, one run's folder under ``$RAGEN_DATA_DIR/runs/<run>`` and its layout
  (config, history, checkpoints, shards), and finding a run by name or path.
- ``parquet.py``: Parquet shards per iteration under ``<run>/rollouts``, written atomically.

    from ragen_core.store import RunDir, write_shard, read_run, read_trajectories

Names are imported lazily (pyarrow loads on first use of a Parquet name). Run the tests:
``.venv/bin/python -m pytest tests/unit/store -q``.
"""

from __future__ import annotations

import importlib
from typing import Any

_RUN_DIR = ("RunDir", "check_run_name", "rollouts_dir", "runs_root", "shard_path")
_PARQUET = ("SCHEMA", "SCHEMA_VERSION", "read_run", "read_shard", "read_trajectories", "to_table", "write_shard")

__all__ = ["SCHEMA", "SCHEMA_VERSION", "RunDir", "check_run_name", "read_run", "read_shard", "read_trajectories",
           "rollouts_dir", "runs_root", "shard_path", "to_table", "write_shard"]


def __getattr__(name: str) -> Any:
    if name in _RUN_DIR:
        return getattr(importlib.import_module("ragen_core.store.run_dir"), name)
    if name in _PARQUET:
        return getattr(importlib.import_module("ragen_core.store.parquet"), name)
    raise AttributeError(f"module 'ragen_core.store' has no attribute {name!r}")
