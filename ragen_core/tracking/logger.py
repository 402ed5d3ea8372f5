"""The MetricLogger protocol, the metric-name check, and NullLogger (the null object).

The trainer and the flows talk to a ``MetricLogger`` only (STYLE.md rule 7, after
torchtune's ``MetricLoggerInterface``); ``NullLogger`` stands in when tracking is off
and in tests (nanochat's ``DummyWandb`` idea), recording what it was given in memory.

    from ragen_core.tracking import NullLogger
    log = NullLogger()
    log.log_metrics({"env/success": 0.5}, step=1)
    log.history("env/success")          # [(1, 0.5)]

Metric names must live under one of :data:`NAMESPACES` (the diagnostics of SPEC §6,
grouped by what they measure); a typo such as ``actr/loss`` raises ``ValueError`` at the first call,
not after a long run when somebody looks for the curve.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

__all__ = ["NAMESPACES", "MetricLogger", "NullLogger", "check_metric_names", "check_table"]

NAMESPACES: tuple[str, ...] = (
    "env", "rollout", "actor", "critic", "response", "val", "timing", "perf", "health", "collapse", "grad",
)
"""The only allowed first path segments of a metric name."""

# MLflow accepts alphanumerics, '_', '-', '.', ' ' and '/' in metric keys (max 250 chars);
# checking here means a bad key fails at the call, not later inside the delivery queue.
_KEY_RE = re.compile(r"^[\w\-. /]{1,250}$")
TERMINAL_STATUSES = ("FINISHED", "FAILED", "KILLED")


def check_metric_names(names: Iterable[str]) -> None:
    """Raise ValueError unless every name is ``<namespace>/<rest>`` with a known namespace."""
    for name in names:
        head, sep, rest = name.partition("/")
        if not sep or not rest or head not in NAMESPACES:
            raise ValueError(
                f"metric name {name!r} must look like '<namespace>/<name>' with namespace one of "
                f"{', '.join(NAMESPACES)}"
            )
        if not _KEY_RE.match(name) or posixpath.normpath(name) != name:
            raise ValueError(
                f"metric name {name!r} may only use letters, digits, '_', '-', '.', ' ' and '/' as a "
                "plain path ('a/b', not 'a//b' or 'a/./b'), at most 250 characters"
            )


def check_table(data: dict[str, list[Any]], artifact_file: str) -> None:
    """Raise ValueError unless ``data`` is columns of equal length and ``artifact_file`` a '.json' path."""
    if not artifact_file.endswith(".json"):
        raise ValueError(f"table file {artifact_file!r} must end in '.json' (MLflow's table format)")
    lengths = {len(v) for v in data.values()}
    if len(lengths) > 1:
        raise ValueError(f"table {artifact_file!r}: columns of different lengths {sorted(lengths)}")


def check_status(status: str) -> None:
    """Raise ValueError unless ``status`` is a terminal MLflow run status."""
    if status not in TERMINAL_STATUSES:
        raise ValueError(f"run status {status!r} must be one of {', '.join(TERMINAL_STATUSES)}")


@runtime_checkable
class MetricLogger(Protocol):
    """Where a training run reports params, tags, metrics and artifacts."""

    @property
    def run_id(self) -> str | None:
        """The tracking backend's run id; None when there is none (yet)."""
        ...

    def log_params(self, params: dict[str, Any]) -> None:
        """Record run parameters (immutable once recorded; the same value again is fine)."""
        ...

    def set_tags(self, tags: dict[str, str]) -> None:
        """Set run tags (a later value replaces an earlier one)."""
        ...

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Record namespaced metric values for one step (an iteration); raises ValueError on a bad name."""
        ...

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        """Attach a file or a directory to the run, under ``artifact_path`` if given."""
        ...

    def log_text(self, text: str, artifact_file: str) -> None:
        """Attach ``text`` as the artifact file ``artifact_file`` (e.g. 'samples/iter_0010.txt')."""
        ...

    def log_table(self, data: dict[str, list[Any]], artifact_file: str) -> None:
        """Append rows (equal-length columns) to the run's table ``artifact_file`` (a '.json' file)."""
        ...

    def log_model(self, path: Path, name: str = "model", base_model: Path | None = None, step: int = 0) -> None:
        """Attach a saved model folder as a model the tracking backend can load back and register.

        ``path`` holds a full transformers model, or a peft adapter (adapter_config.json) over ``base_model``;
        ``step`` is the iteration it comes from.
        """
        ...

    def flush(self) -> None:
        """Deliver everything recorded so far, if the backend can be reached."""
        ...

    def close(self, status: str = "FINISHED") -> None:
        """End the run with FINISHED, FAILED or KILLED after a last flush."""
        ...


class NullLogger:
    """A MetricLogger that sends nothing anywhere; with ``record=True`` it keeps every call in memory."""

    def __init__(self, record: bool = True) -> None:
        self.record = record
        self.params: dict[str, Any] = {}
        self.tags: dict[str, str] = {}
        self.metrics: list[tuple[int, dict[str, float]]] = []
        """(step, metrics) per log_metrics call, in call order."""
        self.artifacts: list[tuple[Path, str | None]] = []
        self.texts: dict[str, str] = {}
        self.tables: dict[str, dict[str, list[Any]]] = {}
        """artifact file -> columns, rows of every call appended (as the real table grows)."""
        self.models: list[tuple[Path, str, Path | None, int]] = []
        """(path, name, base_model, step) per log_model call."""
        self.status: str | None = None
        """None while open; the close() status afterwards."""

    @property
    def run_id(self) -> str | None:
        return None

    def log_params(self, params: dict[str, Any]) -> None:
        if self.record:
            self.params.update(params)

    def set_tags(self, tags: dict[str, str]) -> None:
        if self.record:
            self.tags.update(tags)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        check_metric_names(metrics)  # same contract as the real logger, so tests catch typos
        if self.record:
            self.metrics.append((int(step), {k: float(v) for k, v in metrics.items()}))

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        if self.record:
            self.artifacts.append((Path(path), artifact_path))

    def log_text(self, text: str, artifact_file: str) -> None:
        if self.record:
            self.texts[artifact_file] = text

    def log_table(self, data: dict[str, list[Any]], artifact_file: str) -> None:
        check_table(data, artifact_file)
        if self.record:
            table = self.tables.setdefault(artifact_file, {k: [] for k in data})
            for key, values in data.items():
                table.setdefault(key, []).extend(values)

    def log_model(self, path: Path, name: str = "model", base_model: Path | None = None, step: int = 0) -> None:
        if self.record:
            self.models.append((Path(path), name, None if base_model is None else Path(base_model), int(step)))

    def flush(self) -> None:
        pass

    def close(self, status: str = "FINISHED") -> None:
        check_status(status)
        self.status = status

    def history(self, name: str) -> list[tuple[int, float]]:
        """(step, value) pairs of one metric, in logging order."""
        return [(step, m[name]) for step, m in self.metrics if name in m]
