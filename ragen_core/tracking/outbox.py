"""A local, append-only outbox of tracking entries: nothing is lost while the server is away.

Every logger call becomes one JSON line in ``tracking-outbox.jsonl`` *before* any
attempt to send it. A sidecar, ``tracking-outbox.state.json``, records the byte offset
up to which entries were delivered and the run id, written atomically (temp file +
rename) after each delivered batch. So after a crash or a restart the pending entries
are exactly the lines past that offset: nothing is sent twice and nothing is dropped.
The sidecar also keeps how to create the run (experiment, run name, tags) in case it
could not be created before the process ended.
No MLflow in here; :mod:`ragen_core.tracking.mlflow_logger` does the sending.

    box = Outbox(Path("data/runs/r1"))
    box.append({"kind": "metrics", "step": 1, "ts": 0, "values": {"env/success": 0.5}})
    box.pending()          # [{"kind": "metrics", ...}]
    box.mark_delivered(1)  # persisted

Damage never stops a run and never deletes an entry (a kill mid-write, a disk that filled, a hand edit):

- a torn last line is dropped (its call never returned);
- a corrupt line elsewhere is skipped, with a warning, and copied to ``tracking-outbox.corrupt.jsonl``;
- an empty or corrupt state file is moved aside and the copy written just before it
  (``tracking-outbox.state.json.bak``) is used; without one, delivery starts again from the first entry.
  Re-sending is harmless: MLflow's store keeps one point per (key, step, timestamp, value), and the
  entries carry their timestamps;
- an outbox file shorter than the delivered offset (emptied or replaced) is read from its start, so an
  entry appended after the damage is delivered, not skipped.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from ragen_core.store.files import atomic_write_text

__all__ = ["CORRUPT_FILE", "OUTBOX_FILE", "REJECTED_FILE", "STATE_FILE", "Outbox", "OutboxMismatch"]

OUTBOX_FILE = "tracking-outbox.jsonl"
STATE_FILE = "tracking-outbox.state.json"
REJECTED_FILE = "tracking-rejected.jsonl"
CORRUPT_FILE = "tracking-outbox.corrupt.jsonl"

log = logging.getLogger("ragen")


class OutboxMismatch(ValueError):
    """The outbox in a folder belongs to another MLflow run than the one asked for."""


class Outbox:
    """JSONL entries plus a persisted delivered offset and run id (single writer per directory)."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / OUTBOX_FILE
        self.state_path = self.directory / STATE_FILE
        self.rejected_path = self.directory / REJECTED_FILE
        state = self._read_state()
        self._delivered: int = int(state.get("delivered_offset", 0))
        size = self.path.stat().st_size if self.path.exists() else 0
        if self._delivered > size:
            log.warning("%s has %d bytes but %d were delivered: it was emptied or replaced; reading it from the "
                        "start", self.path, size, self._delivered)
            self._delivered = 0
        self._run_id: str | None = state.get("run_id")
        self._intent: dict[str, Any] | None = state.get("intent")
        self._pending: list[tuple[int, dict[str, Any]]] = self._read_pending()
        """(byte offset just past the entry's line, entry) for every undelivered entry."""

    def _read_pending(self) -> list[tuple[int, dict[str, Any]]]:
        if not self.path.exists():
            return []
        data = self.path.read_bytes()
        complete = data.rfind(b"\n") + 1
        if complete < len(data):
            # A crash mid-write left a torn last line: that entry was never fully recorded
            # (its call did not return), so drop it rather than append after garbage.
            with open(self.path, "r+b") as f:
                f.truncate(complete)
        out: list[tuple[int, dict[str, Any]]] = []
        corrupt: list[bytes] = []
        offset = self._delivered
        for line in data[self._delivered:complete].splitlines(keepends=True):
            offset += len(line)
            try:
                entry = json.loads(line)
                if not isinstance(entry, dict) or "kind" not in entry:
                    raise ValueError("not an outbox entry")
            except ValueError:
                corrupt.append(line if line.endswith(b"\n") else line + b"\n")
                continue
            out.append((offset, entry))
        if corrupt:
            log.warning("%s: skipped %d corrupt line(s), copied to %s", self.path, len(corrupt), CORRUPT_FILE)
            with open(self.directory / CORRUPT_FILE, "ab") as f:
                f.writelines(corrupt)
        return out

    def _read_state(self) -> dict[str, Any]:
        """The state file, else its backup (module docstring); a damaged one is moved aside, never deleted."""
        for path in (self.state_path, self._backup_path):
            if not path.exists():
                continue
            try:
                state = json.loads(path.read_text())
                if not isinstance(state, dict):
                    raise ValueError("not an object")
                return state
            except (OSError, ValueError, UnicodeDecodeError) as e:
                aside = path.with_name(f"{path.name}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}")
                os.replace(path, aside)
                log.warning("%s is damaged (%s): moved to %s", path, e, aside.name)
        return {}

    @property
    def _backup_path(self) -> Path:
        return self.state_path.with_name(STATE_FILE + ".bak")

    def metric_points(self) -> set[tuple[str, int]]:
        """(metric key, step) of every metrics entry the outbox holds, delivered or not."""
        if not self.path.exists():
            return set()
        points: set[tuple[str, int]] = set()
        for line in self.path.read_bytes().splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue  # torn or corrupt: _read_pending reports those
            if isinstance(entry, dict) and entry.get("kind") == "metrics":
                points.update((str(k), int(entry["step"])) for k in entry.get("values", {}))
        return points

    @property
    def run_id(self) -> str | None:
        return self._run_id

    def set_run_id(self, run_id: str) -> None:
        """Remember the run the entries belong to (persisted at once, so a restart resumes it)."""
        self._run_id = run_id
        self._save_state()

    @property
    def intent(self) -> dict[str, Any] | None:
        """How to create the run if it does not exist yet: experiment, run_name, tags."""
        return self._intent

    def set_intent(self, intent: dict[str, Any]) -> None:
        """Remember how to create the run, so a restart or a later drain can create it."""
        self._intent = dict(intent)
        self._save_state()

    def append(self, entry: dict[str, Any]) -> None:
        """Write one entry as a JSON line (flushed to the OS before returning)."""
        line = (json.dumps(entry, separators=(",", ":")) + "\n").encode()
        with open(self.path, "ab") as f:
            f.write(line)
            end = f.tell()
        self._pending.append((end, entry))

    def pending(self) -> list[dict[str, Any]]:
        """Undelivered entries, oldest first (a copy)."""
        return [e for _, e in self._pending]

    def __len__(self) -> int:
        return len(self._pending)

    def mark_delivered(self, n: int) -> None:
        """The first ``n`` pending entries reached the server: advance and persist the offset."""
        if n <= 0:
            return
        self._delivered = self._pending[n - 1][0]
        del self._pending[:n]
        self._save_state()

    def reject(self, n: int, error: str) -> None:
        """The first ``n`` pending entries were refused by the server: move them to the rejected file."""
        with open(self.rejected_path, "a") as f:
            f.writelines(json.dumps({"error": error, "entry": entry}) + "\n" for _, entry in self._pending[:n])
        self.mark_delivered(n)

    def _save_state(self) -> None:
        """Backup first, then the state itself, each atomically and fsynced: one of them is always whole."""
        text = json.dumps({"delivered_offset": self._delivered, "run_id": self._run_id, "intent": self._intent})
        atomic_write_text(self._backup_path, text)
        atomic_write_text(self.state_path, text)
