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
    rollouts/iteration=N/part-0.parquet  one trajectory shard per iteration (store/parquet.py)
    final-model/                         the trained model (or adapter) at the end of a run
    curves.png                           the run's curves at the end of a run

The MLflow outbox (``tracking-outbox.jsonl`` and its state) also lives here; tracking/outbox.py
owns those names. A :class:`RunDir` is ``os.PathLike``, so it goes wherever a path does.

Run its tests: ``.venv/bin/python -m pytest tests/unit/store -q``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from ragen_core.config import ConfigError, check_run_name, data_dir
from ragen_core.store.files import atomic_write_text, fsync_dir, pid_alive
from ragen_core.types import Trajectory

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["CONFIG_END", "CONFIG_FILE", "HISTORY_FILE", "PARTITION_KEY", "SHARD_FILE", "RunDir", "check_run_name",
           "checkpoint_problem", "rollouts_dir", "runs_root", "shard_path"]

CONFIG_FILE = "config.yaml"
CONFIG_END = "# ragen: end of config"
"""The last line of a whole config.yaml (:meth:`RunDir.config_problem`)."""
HISTORY_FILE = "history.jsonl"
SHARD_FILE = "part-0.parquet"


log = logging.getLogger("ragen")

_LEFTOVER = re.compile(r"^\.(?P<kind>tmp|old)-(?P<name>iter=\d+)-(?P<pid>\d+)$")
"""A checkpoint writer's temp or set-aside folder (trainer/checkpoint.py names them so)."""


def checkpoint_problem(path: Path) -> str | None:
    """Why a checkpoint folder is not whole, or None. state.json is written last, into the temp folder,
    before the rename that publishes it: it must parse; every ``*.safetensors`` must end where its header
    says; every ``*.pt`` must be a readable zip (torch's format) whose entries pass their CRC check; and every
    file state.json's ``files`` lists must have the size it lists."""
    from ragen_core.models.cache import safetensors_problem  # lazily: models imports transformers only on use

    try:
        meta = json.loads((path / "state.json").read_text())
    except (OSError, ValueError) as e:
        return f"state.json unreadable ({e})"
    if not isinstance(meta, dict) or not isinstance(meta.get("files"), dict):
        return "state.json lists no files"
    for name, size in meta["files"].items():
        file = path / name
        if not file.is_file() or file.stat().st_size != size:
            return f"{name} is missing or has the wrong size"
    for file in sorted(path.glob("*.safetensors")):
        problem = safetensors_problem(file)
        if problem:
            return problem
    for file in sorted(path.glob("*.pt")):
        try:
            with zipfile.ZipFile(file) as archive:
                broken = archive.testzip()
        except (OSError, zipfile.BadZipFile) as e:
            return f"{file.name} is not a readable torch file ({e})"
        if broken is not None:
            return f"{file.name}: entry {broken} fails its CRC check"
    return None


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
        """The resolved config (``config.to_dict``) as YAML, fields in the given order, written atomically and
        closed by :data:`CONFIG_END` so that a cut file is told from a whole one; returns the path."""
        text = yaml.safe_dump(data, sort_keys=False, allow_unicode=True) + CONFIG_END + "\n"
        return atomic_write_text(self.config_path, text)

    def config_problem(self) -> str | None:
        """Why config.yaml cannot be trusted to be whole (None when it can).

        A cut YAML file often still parses, and its missing keys would silently take their defaults on resume.
        Whole: it ends with :data:`CONFIG_END`, which :meth:`write_config` writes last.
        """
        if not self.config_path.is_file():
            return f"{self.config_path} does not exist"
        text = self.config_path.read_text(encoding="utf-8", errors="replace")
        if text.rstrip("\n").endswith(CONFIG_END):
            return None
        return f"{self.config_path} is cut short (it does not end with {CONFIG_END!r})"

    def read_config(self) -> dict[str, Any]:
        """The saved config as plain YAML data ({} for an empty file); use ``load_experiment`` for a checked one."""
        return yaml.safe_load(self.config_path.read_text()) or {}

    # ------------------------------------------------------------------ history

    @property
    def history_path(self) -> Path:
        return self.path / HISTORY_FILE

    def append_history(self, row: dict[str, Any]) -> None:
        """Add one row (one JSON line) to history.jsonl, fsynced. A torn last line (a kill mid-write) is first
        moved to ``history.jsonl.torn`` (nothing is deleted), so the new row starts a line of its own."""
        self._set_torn_tail_aside()
        with open(self.history_path, "a") as fh:
            fh.write(json.dumps(row) + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    def read_history(self) -> list[dict[str, Any]]:
        """Every row of history.jsonl in order ([] when there is none yet); blank lines are skipped.

        Tolerant, so a kill mid-write never blocks a resume or ``ragen eval``: a torn last line is dropped with
        a warning; a corrupt line in the middle is skipped with a warning and copied to
        ``history.jsonl.corrupt`` (the file itself is left as it is).
        """
        if not self.history_path.exists():
            return []
        raw = self.history_path.read_bytes()
        lines = raw.split(b"\n")
        rows: list[dict[str, Any]] = []
        bad: list[bytes] = []
        for k, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                if not isinstance(row, dict):
                    raise ValueError("not an object")
                rows.append(row)
            except ValueError:
                if k == len(lines) - 1:  # no newline after it: the write was cut
                    log.warning("%s: dropped a torn last line (%d bytes)", self.history_path, len(line))
                else:
                    bad.append(line)
        if bad:
            log.warning("%s: skipped %d corrupt line(s); copied to %s", self.history_path, len(bad),
                        self.history_path.with_name(HISTORY_FILE + ".corrupt"))
            with open(self.history_path.with_name(HISTORY_FILE + ".corrupt"), "ab") as fh:
                fh.write(b"\n".join(bad) + b"\n")
        return rows

    def supersede_history(self, iteration: int) -> list[dict[str, Any]]:
        """Rows of iteration ``iteration`` and later leave history.jsonl for ``history.jsonl.superseded`` (nothing
        is deleted); returns the rows kept. A run resumed from the checkpoint after ``iteration`` updates redoes
        those iterations, and each would otherwise have two rows."""
        rows = self.read_history()
        keep = [r for r in rows if int(r.get("iteration", 0)) < iteration]
        gone = [r for r in rows if int(r.get("iteration", 0)) >= iteration]
        if not gone:
            return keep
        with open(self.history_path.with_name(HISTORY_FILE + ".superseded"), "a") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in gone)
            fh.flush()
            os.fsync(fh.fileno())
        self._set_torn_tail_aside()  # the rewrite below must not lose a torn tail either
        atomic_write_text(self.history_path, "".join(json.dumps(r) + "\n" for r in keep))
        return keep

    def _set_torn_tail_aside(self) -> None:
        try:
            with open(self.history_path, "rb") as fh:
                fh.seek(0, os.SEEK_END)
                size = fh.tell()
                if size == 0:
                    return
                fh.seek(-1, os.SEEK_END)
                if fh.read(1) == b"\n":
                    return
                fh.seek(0)
                data = fh.read()
        except FileNotFoundError:
            return
        keep = data.rfind(b"\n") + 1
        with open(self.history_path.with_name(HISTORY_FILE + ".torn"), "ab") as fh:
            fh.write(data[keep:] + b"\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.truncate(self.history_path, keep)
        log.warning("%s: moved a torn last line (%d bytes) to %s.torn", self.history_path, len(data) - keep,
                    HISTORY_FILE)

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
        """The newest intact checkpoint, after repairing what a kill can leave behind (None: there is none).

        - A kill between the two renames of a re-save (trainer/checkpoint.py) leaves ``.old-iter=N-PID`` and no
          ``iter=N``: the old folder is renamed back.
        - ``.tmp-iter=N-PID`` / ``.old-iter=N-PID`` folders of processes that are gone are removed.
        - A checkpoint that is not whole (:func:`checkpoint_problem`) is passed over, with a warning, for the
          newest one that is; it is left on disk for a person to look at.
        """
        self._recover_checkpoints()
        for path in reversed(self.checkpoints()):
            problem = checkpoint_problem(path)
            if problem is None:
                return path
            log.warning("checkpoint %s is not whole (%s): falling back to an older one", path, problem)
        return None

    def _recover_checkpoints(self) -> None:
        if not self.checkpoints_dir.is_dir():
            return
        for path in sorted(self.checkpoints_dir.iterdir()):
            m = _LEFTOVER.match(path.name)
            if m is None or (pid_alive(int(m.group("pid"))) and int(m.group("pid")) != os.getpid()):
                continue
            final = self.checkpoints_dir / m.group("name")
            if m.group("kind") == "old" and not final.exists() and checkpoint_problem(path) is None:
                os.replace(path, final)
                fsync_dir(self.checkpoints_dir)
                log.warning("restored checkpoint %s from %s (a kill between the renames of a re-save)", final,
                            path.name)
            else:
                shutil.rmtree(path, ignore_errors=True)

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
