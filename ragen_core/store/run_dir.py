"""One run's folder and everything about its layout: the only place that knows where a run keeps what.

    from ragen_core.store.run_dir import RunDir
    run = RunDir.new("bandit-starpo-s-20260101-120000")   # $RAGEN_DATA_DIR/runs/<name>, created
    run.write_config(to_dict(cfg))                        # config.yaml
    run.append_history({"iteration": 0, "val/success": 0.4})
    run.read_history()                                    # [{"iteration": 0, "val/success": 0.4}]
    run.latest_checkpoint()                               # checkpoints/iter=NNNNNN, or None
    run = RunDir.find("bandit-starpo-s-20260101-120000")  # a run by name or by path (holds config.yaml)
    run = RunDir.resumable("bandit-starpo-s-20260101-120000")  # a run under $RAGEN_DATA_DIR/runs, to continue

Layout of ``$RAGEN_DATA_DIR/runs/<name>/``::

    config.yaml                          the resolved config (``ragen train --resume`` reads it back)
    history.jsonl                        one JSON row per iteration (and one per final evaluation)
    checkpoints/iter=NNNNNN/             the last few training checkpoints (trainer/checkpoint.py)
    rollouts/iteration=N/part-0.parquet  one trajectory shard per iteration (store/parquet.py; runs written
                                         before 2026-11-25 have rollouts/iter=NNNN/, which readers accept)
    final-model/                         the trained model (or adapter) at the end of a run
    curves.png                           the run's curves at the end of a run

The MLflow outbox (``tracking-outbox.jsonl`` and its state) also lives here; tracking/outbox.py
owns those names. A :class:`RunDir` is ``os.PathLike``, so it goes wherever a path does.

Run its tests: ``.venv/bin/python -m pytest tests/unit/store -q``.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from ragen_core.config import ConfigError, check_run_name, data_dir
from ragen_core.types import Trajectory

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["CONFIG_FILE", "HISTORY_FILE", "PARTITION_KEY", "SHARD_FILE", "RunDir", "check_run_name",
           "legacy_shard_path", "rollouts_dir", "runs_root", "shard_path"]

CONFIG_FILE = "config.yaml"
HISTORY_FILE = "history.jsonl"
SHARD_FILE = "part-0.parquet"


def runs_root() -> Path:
    """``$RAGEN_DATA_DIR/runs``: where named runs live (not created here)."""
    return data_dir() / "runs"


PARTITION_KEY = "iteration"
"""The shards' hive partition key: the column's own name."""


def rollouts_dir(run: str | os.PathLike[str]) -> Path:
    """``<run>/rollouts``: the trajectory shards of a run."""
    return Path(run) / "rollouts"


def shard_path(run: str | os.PathLike[str], iteration: int) -> Path:
    """``<run>/rollouts/iteration=N/part-0.parquet``: a hive partition named as the column, unpadded, so
    pyarrow datasets, pandas and DuckDB read the key as the integer column ``iteration``."""
    if iteration < 0:
        raise ValueError(f"iteration must be >= 0, got {iteration}")
    return rollouts_dir(run) / f"{PARTITION_KEY}={iteration}" / SHARD_FILE


def legacy_shard_path(run: str | os.PathLike[str], iteration: int) -> Path:
    """``<run>/rollouts/iter=NNNN/part-0.parquet``: where runs written before 2026-11-25 keep a shard."""
    return rollouts_dir(run) / f"iter={iteration:04d}" / SHARD_FILE


@dataclass(frozen=True)
class RunDir:
    """One run's folder (``path``) and the files in it (module docstring); nothing is created until asked."""

    path: Path

    # ------------------------------------------------------------------ finding and making

    @classmethod
    def named(cls, name: str) -> RunDir:
        """``$RAGEN_DATA_DIR/runs/<name>`` (not created); ValueError on a name that is not a plain folder name."""
        return cls(runs_root() / check_run_name(name))

    @classmethod
    def new(cls, name: str) -> RunDir:
        """:meth:`named`, created (an existing folder is reused: that is how a run resumes)."""
        return cls.named(name).create()

    @classmethod
    def find(cls, run: str | os.PathLike[str]) -> RunDir:
        """An existing run: a folder holding config.yaml, else the run of that name under $RAGEN_DATA_DIR/runs.

        FileNotFoundError names both places looked at.
        """
        path = Path(run)
        if not (path / CONFIG_FILE).exists():
            # A lookup of an existing folder, so the name is not checked (nothing is created from it).
            path = runs_root() / str(run)
        if not (path / CONFIG_FILE).exists():
            raise FileNotFoundError(f"no run {str(run)!r}: neither {run} nor {path} holds a config.yaml")
        return cls(path)

    @classmethod
    def resumable(cls, run: str | os.PathLike[str], key: str = "resume") -> RunDir:
        """An existing run to continue (``ragen train --resume``, the flow's ``resume``): a run name, or the path
        of a run folder directly under ``$RAGEN_DATA_DIR/runs``; ConfigError otherwise.

        Resuming writes into the folder, so unlike :meth:`find` it never leaves the runs root: '../../etc' or
        '/tmp/x' is refused, as an unknown run is, before any flow starts. ``key`` names the option in messages.
        """
        root = runs_root()
        text = os.fspath(run)
        if os.sep in text or (os.altsep and os.altsep in text):
            try:
                path = Path(text).expanduser().resolve()
            except (OSError, ValueError, RuntimeError) as e:  # a NUL, a symlink loop, an unknown ~user
                raise ConfigError(f"{key}: {text[:200]!r} is no path ({e})") from None
            if path.parent != root.resolve():
                raise ConfigError(f"{key}: {text[:200]!r} is not a run folder under {root}; name a run there")
            name = path.name
        else:
            name = text
        folder = cls.named(check_run_name(name, key))
        if not folder.config_path.is_file():
            raise ConfigError(f"{key}: no run {name!r} under {root} (no {CONFIG_FILE} there)")
        return folder

    @classmethod
    def of_checkpoint(cls, checkpoint: str | os.PathLike[str]) -> RunDir:
        """The run a checkpoint folder (``<run>/checkpoints/iter=NNNNNN``) belongs to (an absolute path)."""
        return cls(Path(checkpoint).resolve().parent.parent)

    def create(self) -> RunDir:
        """Make the folder (and its parents) when missing; returns self."""
        self.path.mkdir(parents=True, exist_ok=True)
        return self

    @property
    def name(self) -> str:
        return self.path.name

    def __fspath__(self) -> str:
        return os.fspath(self.path)

    # ------------------------------------------------------------------ config

    @property
    def config_path(self) -> Path:
        return self.path / CONFIG_FILE

    def write_config(self, data: dict[str, Any]) -> Path:
        """The resolved config (``config.to_dict``) as YAML, fields in the given order; returns the path."""
        self.config_path.write_text(yaml.safe_dump(data, sort_keys=False, allow_unicode=True))
        return self.config_path

    def read_config(self) -> dict[str, Any]:
        """The saved config as plain YAML data ({} for an empty file); use ``load_experiment`` for a checked one."""
        return yaml.safe_load(self.config_path.read_text()) or {}

    # ------------------------------------------------------------------ history

    @property
    def history_path(self) -> Path:
        return self.path / HISTORY_FILE

    def append_history(self, row: dict[str, Any]) -> None:
        """Add one row (one JSON line) to history.jsonl."""
        with open(self.history_path, "a") as fh:
            fh.write(json.dumps(row) + "\n")

    def read_history(self) -> list[dict[str, Any]]:
        """Every row of history.jsonl in order ([] when there is none yet); blank lines are skipped."""
        if not self.history_path.exists():
            return []
        return [json.loads(line) for line in self.history_path.read_text().splitlines() if line.strip()]

    # ------------------------------------------------------------------ checkpoints

    @property
    def checkpoints_dir(self) -> Path:
        return self.path / "checkpoints"

    def checkpoint_path(self, iteration: int) -> Path:
        """``checkpoints/iter=NNNNNN``: where the checkpoint after ``iteration`` updates goes."""
        return self.checkpoints_dir / f"iter={iteration:06d}"

    def checkpoints(self) -> list[Path]:
        """The run's checkpoint folders, oldest first (the zero-padded names sort by iteration)."""
        return sorted(self.checkpoints_dir.glob("iter=*"))

    def latest_checkpoint(self) -> Path | None:
        ckpts = self.checkpoints()
        return ckpts[-1] if ckpts else None

    def prune_checkpoints(self, keep: int) -> list[Path]:
        """Delete all but the newest ``keep`` checkpoints (keep >= 1); returns the ones deleted."""
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        old = self.checkpoints()[:-keep]
        for path in old:
            shutil.rmtree(path, ignore_errors=True)
        return old

    # ------------------------------------------------------------------ trajectory shards and outputs

    @property
    def rollouts_dir(self) -> Path:
        return rollouts_dir(self.path)

    def shard_path(self, iteration: int) -> Path:
        return shard_path(self.path, iteration)

    def write_shard(self, iteration: int, trajectories: Sequence[Trajectory], kept: Sequence[bool] | None = None
                    ) -> Path:
        """Iteration ``iteration``'s trajectories as a Parquet shard (:func:`ragen_core.store.parquet.write_shard`)."""
        from ragen_core.store.parquet import write_shard  # pyarrow is heavy: loaded on first use

        return write_shard(self.path, iteration, trajectories, kept)

    def read_rollouts(self) -> pd.DataFrame:
        """All shards as one DataFrame (:func:`ragen_core.store.parquet.read_run`)."""
        from ragen_core.store.parquet import read_run  # pyarrow is heavy: loaded on first use

        return read_run(self.path)

    @property
    def final_model(self) -> Path:
        return self.path / "final-model"

    @property
    def curves_png(self) -> Path:
        return self.path / "curves.png"
