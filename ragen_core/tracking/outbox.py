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
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["OUTBOX_FILE", "REJECTED_FILE", "STATE_FILE", "Outbox"]

OUTBOX_FILE = "tracking-outbox.jsonl"
STATE_FILE = "tracking-outbox.state.json"
REJECTED_FILE = "tracking-rejected.jsonl"


class Outbox:
    """JSONL entries plus a persisted delivered offset and run id (single writer per directory)."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / OUTBOX_FILE
        self.state_path = self.directory / STATE_FILE
        self.rejected_path = self.directory / REJECTED_FILE
        state = json.loads(self.state_path.read_text()) if self.state_path.exists() else {}
        self._delivered: int = int(state.get("delivered_offset", 0))
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
        offset = self._delivered
        for line in data[self._delivered:complete].splitlines(keepends=True):
            offset += len(line)
            out.append((offset, json.loads(line)))
        return out

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
        tmp = self.state_path.with_suffix(".tmp")
        state = {"delivered_offset": self._delivered, "run_id": self._run_id, "intent": self._intent}
        tmp.write_text(json.dumps(state))
        os.replace(tmp, self.state_path)
