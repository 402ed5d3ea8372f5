"""MLflowLogger: one MLflow run per training run, delivered through a local outbox.

    from ragen_core.tracking import MLflowLogger, default_tracking_uri
    log = MLflowLogger(default_tracking_uri(), "ragen", run_name="bandit-starpo-s-001",
                       outbox_dir=Path("data/runs/bandit-starpo-s-001"), tags={"algo": "starpo-s"})
    log.log_metrics({"env/success": 0.4, "actor/grad_norm": 0.8}, step=1)
    log.close()                       # FINISHED; resume later with MLflowLogger(..., run_id=log.run_id)

Why an outbox: training must never crash and never lose a metric
when the tracking server is unreachable or dies mid-run. Each call first appends to
``<outbox_dir>/tracking-outbox.jsonl`` (see :mod:`.outbox`), then tries to send every
pending entry in as few ``MlflowClient.log_batch`` calls as MLflow's limits allow
(1000 metrics / 100 params / 100 tags per call; on sqlite each separate call costs
~4 ms, a batch of 100 metrics about the same). On any failure it warns once per
outage, keeps logging locally, and tries again on a later call after ``retry_interval_s``
(doubling per failed attempt, up to 10x); ``flush()`` and ``close()`` always try, so
call them at the end rather than every iteration. A run that cannot be created yet (server down at
start) is created when the server is reachable; ``run_id`` is None until then.

Always the explicit ``run_id`` with ``MlflowClient``, never the fluent active run: it is
per-thread, and Prefect runs tasks in threads (STYLE.md rule 7).

How runs look in MLflow 3.17's UI:

- every experiment the logger creates or opens gets the tag ``mlflow.experimentKind`` =
  ``custom_model_development`` ("Machine learning"): MLflow 3.x's marker for an experiment of training runs,
  which the UI opens on its runs (``genai_development`` opens on traces; untagged, the UI guesses from whether
  the experiment holds traces or runs). The 3.17.2 UI, though, has its workflow switch on (a feature flag
  that returns true): the kind then comes from the sidebar's GenAI / Machine learning switch (kept per
  browser, GenAI by default) or from ``?workflowType=machine_learning`` in the address, not from the tag.
  So :func:`ui_url` links with that parameter, and the tag keeps saying what the experiment is for UIs and
  tools that read it;
- the chart view makes one section per metric prefix (``actor``, ``env/Bandit``, ...) sorted by name, each
  chart sorted by metric name, so the four curves that compare runs (validation success, reward std, entropy,
  grad norm: RAGEN's Echo Trap signals) would be scattered; :data:`CHART_FIRST` logs them a second time under
  ``0_compare/`` names that sort first;
- a nested run (a sweep trial) goes into its parent's experiment, whatever its own config names: MLflow nests
  runs only within one experiment;
- tables (``log_table``) and the final model (``log_model``, see :mod:`.model_registry`) go through the
  outbox like everything else.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ragen_core.config import data_file
from ragen_core.store.run_dir import RunDir
from ragen_core.tracking.logger import check_metric_names, check_status, check_table
from ragen_core.tracking.outbox import Outbox, OutboxMismatch

if TYPE_CHECKING:
    from mlflow import MlflowClient

__all__ = ["CHART_FIRST", "EXPERIMENT_KIND", "EXPERIMENT_KIND_TAG", "MLflowLogger", "browse_hint",
           "default_tracking_uri", "deliver_pending", "ui_url"]

log = logging.getLogger(__name__)

# MLflow's log_batch limits (mlflow.utils.validation.MAX_*_PER_BATCH).
MAX_METRICS_PER_BATCH = 1000
MAX_PARAMS_TAGS_PER_BATCH = 100

# MLflow's HTTP defaults are 120 s per request and 7 retries with exponential back-off
# (minutes per call against a dead server). The outbox is our retry loop, so one short
# attempt per call is right. A refused connection fails in milliseconds; a hung server
# costs at most the 5 s timeout per attempt, and attempts thin out (see _deliver).
# Set in os.environ (MLflow reads them per request) only where the user chose nothing.
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "5", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"}
MAX_BACKOFF_FACTOR = 10  # waits grow retry_interval_s x 1, 2, 4, 8, 10, 10, ... during one outage
# A local sqlite store is busy, not down, while another process writes (the workers of a study share one file):
# sqlite says "database is locked" after the 20 s busy timeout MLflow sets, or at once where two transactions
# would wait for each other. Closing a run tries again after these waits, so that its final status lands instead
# of waiting in the outbox.
BUSY_CLOSE_WAITS_S = (1.0, 2.0, 4.0)

# MLflow 3.17's UI (mlflow/server/js/build/static/js/main.c2f5f8d4.js): the ExperimentKind enum
# (GENAI_DEVELOPMENT = "genai_development", CUSTOM_MODEL_DEVELOPMENT = "custom_model_development", ...) and the
# experiment tag it reads and writes, "mlflow.experimentKind" (no Python constant exists for either).
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"

CHART_FIRST: dict[str, str] = {
    "val/success": "0_compare/1_val_success",
    "rollout/reward_std_all": "0_compare/2_reward_std",
    "actor/entropy": "0_compare/3_entropy",
    "actor/grad_norm": "0_compare/4_grad_norm",
}
"""Metrics logged a second time under these names, so that they are the first section of MLflow's chart view.

The UI (3.17.2: where main.c2f5f8d4.js builds the default chart set, ``extractChartSectionName``) puts a metric in
the section named by its key up to the last '/', sorts the sections by name (keys without '/' and system metrics
last) and the charts by metric key: '0_compare' sorts before every namespace and the digits keep the four in this
order. Only a chart view not yet arranged by hand: the UI keeps a user's layout per experiment in the browser.
"""


def default_tracking_uri() -> str:
    """``$MLFLOW_TRACKING_URI`` when set (a team server), else ``sqlite:///$RAGEN_DATA_DIR/mlflow.db``."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{data_file('mlflow.db')}"


def _is_busy(exc: Exception | None) -> bool:
    """True when a local sqlite store was busy with another writer (worth a second try soon, unlike a server
    that is down)."""
    return exc is not None and "database is locked" in str(exc)


def _is_rejection(exc: Exception) -> bool:
    """True when the server answered and refused the request (4xx): retrying cannot help.

    Connection errors, timeouts and 5xx surface from MlflowClient as MlflowException with
    HTTP status 500 (INTERNAL_ERROR) and count as an outage instead.
    """
    status = getattr(exc, "get_http_status_code", lambda: 500)()
    return 400 <= status < 500 and status not in (408, 429)


class MLflowLogger:
    """A MetricLogger backed by MLflow; survives tracking outages without losing entries."""

    def __init__(
        self,
        tracking_uri: str | None = None,
        experiment_name: str = "ragen",
        run_name: str | None = None,
        run_id: str | None = None,
        parent_run_id: str | None = None,
        tags: dict[str, str] | None = None,
        outbox_dir: Path | None = None,
        retry_interval_s: float = 30.0,
        *,
        drain_only: bool = False,
        once_per_step: bool = False,
    ) -> None:
        """Create the run, or resume ``run_id`` (or the run recorded in ``outbox_dir``).

        ``parent_run_id`` makes this a nested run (sweep trials: tag ``mlflow.parentRunId``).
        ``outbox_dir`` defaults to ``$RAGEN_DATA_DIR/runs/<run_name or run_id>``.
        ``drain_only`` opens an existing outbox just to deliver it (see :func:`deliver_pending`):
        the run is not set back to RUNNING and logging calls raise.
        ``once_per_step``: a metric already logged at a step (in this outbox, delivered or not) is not logged
        there again. A training run resumed from its last checkpoint redoes the iterations after it, and
        their metrics would otherwise land twice (MLflow keeps both points: their timestamps differ).
        """
        for key, value in HTTP_DEFAULTS.items():
            os.environ.setdefault(key, value)
        self.tracking_uri = tracking_uri or default_tracking_uri()
        self.retry_interval_s = retry_interval_s
        if outbox_dir is None:
            if not (run_name or run_id):
                raise ValueError("MLflowLogger needs outbox_dir, run_name or run_id to place its outbox")
            outbox_dir = RunDir.named(str(run_name or run_id)).path
        self._outbox = Outbox(Path(outbox_dir))
        known = self._outbox.run_id
        if run_id and known and run_id != known:
            raise OutboxMismatch(
                f"outbox {self._outbox.path} belongs to MLflow run {known}, not {run_id}; "
                "use that run's directory or a fresh outbox_dir"
            )
        self._once_per_step = once_per_step
        self._logged: set[tuple[str, int]] = self._outbox.metric_points() if once_per_step else set()
        self._run_id: str | None = run_id or known
        if self._run_id is not None and known is None:
            self._outbox.set_run_id(self._run_id)
        str_tags = {k: str(v) for k, v in (tags or {}).items()}
        fresh = self._outbox.intent is None
        if fresh and not drain_only:
            create_tags = dict(str_tags)
            if parent_run_id:
                create_tags["mlflow.parentRunId"] = parent_run_id
            self._outbox.set_intent({"experiment": experiment_name, "run_name": run_name, "tags": create_tags})
        # a restart before the run ever existed creates it as first intended
        self._intent = self._outbox.intent or {"experiment": experiment_name, "run_name": run_name, "tags": {}}
        self._client: MlflowClient | None = None
        self._experiment: str | None = None  # the run's experiment id, once the run exists
        self._params: dict[str, str] | None = None  # params already on the server (immutable there)
        self._lock = threading.RLock()
        self._failures = 0  # consecutive failed attempts (0 = healthy)
        self._last_error: Exception | None = None  # of the last failed attempt
        self._retry_at = 0.0
        self._closed = False
        if (self._run_id is not None or not fresh) and not drain_only:
            # A resumed run goes back to RUNNING; queued, so it lands in order with the rest.
            self._outbox.append({"kind": "status", "status": "RUNNING", "ts": _now_ms()})
            if str_tags:
                self._outbox.append({"kind": "tags", "tags": str_tags})
        self._deliver(force=True)
        self._closed = drain_only

    @property
    def experiment_name(self) -> str:
        return str(self._intent["experiment"])

    # ------------------------------------------------------------------ MetricLogger

    @property
    def run_id(self) -> str | None:
        return self._run_id

    def run_url(self) -> str | None:
        """The run's page in the MLflow UI when the tracking URI is a server (None before the run exists, or
        for a local store, which has no UI of its own)."""
        if self._run_id is None or not self.tracking_uri.startswith(("http://", "https://")):
            return None
        with self._lock:
            try:
                self._ensure_run()
                assert self._client is not None
                experiment = self._client.get_run(self._run_id).info.experiment_id
            except Exception:  # noqa: BLE001  # a link is a convenience: an unreachable server gives none
                return None
        return f"{self.tracking_uri.rstrip('/')}/#/experiments/{experiment}/runs/{self._run_id}"

    @property
    def experiment_id(self) -> str | None:
        """The id of the run's experiment; None until the run exists on the server."""
        return self._experiment

    @property
    def outbox_path(self) -> Path:
        return self._outbox.path

    @property
    def pending_count(self) -> int:
        """Entries recorded locally but not yet delivered."""
        return len(self._outbox)

    def log_params(self, params: dict[str, Any]) -> None:
        items = [(k, str(v)) for k, v in params.items()]
        for i in range(0, len(items), MAX_PARAMS_TAGS_PER_BATCH):
            self._record({"kind": "params", "params": dict(items[i : i + MAX_PARAMS_TAGS_PER_BATCH])})

    def set_tags(self, tags: dict[str, str]) -> None:
        items = [(k, str(v)) for k, v in tags.items()]
        for i in range(0, len(items), MAX_PARAMS_TAGS_PER_BATCH):
            self._record({"kind": "tags", "tags": dict(items[i : i + MAX_PARAMS_TAGS_PER_BATCH])})

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Namespaced metrics for one step, plus the :data:`CHART_FIRST` copies of those it names."""
        check_metric_names(metrics)
        items = [(k, float(v)) for k, v in metrics.items() if (k, int(step)) not in self._logged]
        if self._once_per_step:
            self._logged.update((k, int(step)) for k, _ in items)
        items += [(CHART_FIRST[k], v) for k, v in items if k in CHART_FIRST]
        ts = _now_ms()  # taken now, so late delivery keeps the true wall-clock time
        for i in range(0, len(items), MAX_METRICS_PER_BATCH):
            chunk = dict(items[i : i + MAX_METRICS_PER_BATCH])
            self._record({"kind": "metrics", "step": int(step), "ts": ts, "values": chunk})

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        # Only the path is queued (a model can be large); it must still exist at delivery.
        self._record({"kind": "artifact", "path": str(Path(path).resolve()), "artifact_path": artifact_path})

    def log_text(self, text: str, artifact_file: str) -> None:
        self._record({"kind": "text", "text": text, "artifact_file": artifact_file})

    def log_table(self, data: dict[str, list[Any]], artifact_file: str) -> None:
        """Rows appended to the run's table ``artifact_file`` (``MlflowClient.log_table``); JSON-able values only.

        Delivery appends; an entry is sent once, except when the process dies between the upload and the
        outbox's note of it, when the next delivery appends those rows again.
        """
        check_table(data, artifact_file)
        self._record({"kind": "table", "data": data, "artifact_file": artifact_file})

    def log_model(self, path: Path, name: str = "model", base_model: Path | None = None, step: int = 0) -> None:
        """The saved model in ``path`` as the run's logged model (see :func:`.model_registry.log_model_dir`).

        Only the paths are queued: the folders must still exist at delivery.
        """
        self._record({"kind": "model", "path": str(Path(path).resolve()), "name": name, "step": int(step),
                      "base_model": None if base_model is None else str(Path(base_model).resolve())})

    def flush(self) -> None:
        self._deliver(force=True)

    def close(self, status: str = "FINISHED") -> None:
        check_status(status)
        if self._closed:
            return
        self._record({"kind": "status", "status": status, "ts": _now_ms()}, deliver=False)
        self._closed = True
        delivered = self._deliver(force=True)
        for wait in BUSY_CLOSE_WAITS_S:
            if delivered or not _is_busy(self._last_error):
                break
            time.sleep(wait)
            delivered = self._deliver(force=True)
        if not delivered:
            log.warning(
                "MLflow tracking at %s: %d entries are still undelivered; they are kept in %s. "
                "Deliver them later with ragen_core.tracking.deliver_pending(%r, %r).",
                self.tracking_uri, len(self._outbox), self._outbox.path,
                str(self._outbox.directory), self.tracking_uri,
            )

    # ------------------------------------------------------------------ delivery

    def _record(self, entry: dict[str, Any], deliver: bool = True) -> None:
        if self._closed:
            raise RuntimeError("MLflowLogger is closed")
        with self._lock:
            self._outbox.append(entry)
        if deliver:
            self._deliver(force=False)

    def _deliver(self, force: bool) -> bool:
        """Try to send all pending entries; never raises. True when nothing is left pending."""
        with self._lock:
            if not force and time.monotonic() < self._retry_at:
                return False
            try:
                self._ensure_run()
                self._send_pending()
            except Exception as exc:  # noqa: BLE001 -- no tracking failure may stop training
                self._last_error = exc
                self._failures += 1
                factor = min(2 ** (self._failures - 1), MAX_BACKOFF_FACTOR)
                self._retry_at = time.monotonic() + self.retry_interval_s * factor
                if self._failures == 1:  # one warning per outage
                    log.warning(
                        "MLflow tracking at %s is unreachable or failing (%s: %s). Training goes on; "
                        "metrics are kept locally in %s and will be delivered when it is back "
                        "(retried every %.0f-%.0f s, and at flush/close).",
                        self.tracking_uri, type(exc).__name__, _short(exc), self._outbox.path,
                        self.retry_interval_s, self.retry_interval_s * MAX_BACKOFF_FACTOR,
                    )
                return False
            if self._failures:
                self._failures = 0
                log.info("MLflow tracking at %s is reachable again; pending entries delivered", self.tracking_uri)
            return True

    def _ensure_run(self) -> None:
        if self._client is None:
            self._client = _make_client(self.tracking_uri)
        if self._run_id is None:
            run = self._client.create_run(
                self._experiment_id(), run_name=self._intent["run_name"], tags=self._intent["tags"]
            )
            self._run_id = run.info.run_id
            self._experiment = run.info.experiment_id
            self._outbox.set_run_id(self._run_id)
            self._params = {}
        elif self._params is None:
            run = self._client.get_run(self._run_id)
            self._experiment = run.info.experiment_id
            self._params = dict(run.data.params)

    def _experiment_id(self) -> str:
        """The experiment the new run goes into: its parent's (a nested run), else the named one (made if new)."""
        assert self._client is not None
        parent = self._intent["tags"].get("mlflow.parentRunId")
        if parent:
            return str(self._client.get_run(parent).info.experiment_id)
        exp = self._client.get_experiment_by_name(self.experiment_name)
        if exp is not None:
            if exp.tags.get(EXPERIMENT_KIND_TAG) is None:  # a kind somebody chose in the UI is left alone
                self._client.set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
            return str(exp.experiment_id)
        try:
            exp_id = self._client.create_experiment(
                self.experiment_name, artifact_location=_artifact_location(self.tracking_uri, self.experiment_name),
                tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND},
            )
        except Exception:  # another process created it in between
            exp = self._client.get_experiment_by_name(self.experiment_name)
            if exp is None:
                raise
            return str(exp.experiment_id)
        return str(exp_id)

    def _send_pending(self) -> None:
        """Send pending entries in order, batched; raises on an outage, sets refused entries aside."""
        entries = self._outbox.pending()
        i = 0
        while i < len(entries):
            n = _batch_length(entries, i)
            refused = self._try_send(entries[i : i + n])
            if refused is not None and n > 1:  # which entry? retry the first one alone
                n = 1
                refused = self._try_send(entries[i : i + 1])
            if refused is None:
                self._outbox.mark_delivered(n)
            else:
                self._reject(refused)
            i += n

    def _try_send(self, entries: list[dict[str, Any]]) -> str | None:
        """None when delivered; the server's reason when it refused (4xx); raises on anything else."""
        try:
            self._send(entries)
        except Exception as exc:
            if not _is_rejection(exc):
                raise
            return _short(exc)
        return None

    def _reject(self, reason: str) -> None:
        """Set the first pending entry aside: retrying what the server refuses would block the rest."""
        self._outbox.reject(1, reason)
        log.warning(
            "MLflow tracking at %s refused an entry (%s); it is saved in %s",
            self.tracking_uri, reason, self._outbox.rejected_path,
        )

    def _send(self, entries: list[dict[str, Any]]) -> None:
        """Deliver ``entries`` (one non-batchable entry, or a run of batchable ones fitting one call)."""
        # lazily: importing ragen_core.tracking must not load mlflow (test_tracking_logger.py checks)
        from mlflow.entities import Metric, Param, RunTag

        client, run_id = self._client, self._run_id
        assert client is not None and run_id is not None and self._params is not None
        kind = entries[0]["kind"]
        if kind in _BATCHABLE:
            metrics: list[Metric] = []
            params: dict[str, str] = {}
            tags: dict[str, str] = {}
            for e in entries:
                if e["kind"] == "metrics":
                    metrics += [Metric(k, v, e["ts"], e["step"]) for k, v in e["values"].items()]
                elif e["kind"] == "params":
                    params.update(self._new_params(e["params"]))
                else:
                    tags.update(e["tags"])
            if metrics or params or tags:  # all params may have been on the server already
                client.log_batch(
                    run_id, metrics=metrics,
                    params=[Param(k, v) for k, v in params.items()],
                    tags=[RunTag(k, v) for k, v in tags.items()],
                )
            self._params.update(params)
        else:
            self._send_one(client, run_id, entries[0])

    def _send_one(self, client: MlflowClient, run_id: str, e: dict[str, Any]) -> None:
        """Deliver one non-batchable entry: a text, table, model, artifact or status change."""
        kind = e["kind"]
        if kind == "text":
            client.log_text(run_id, e["text"], e["artifact_file"])
        elif kind == "table":
            import pandas as pd  # lazily, like mlflow: only a run that logs tables needs it

            client.log_table(run_id, pd.DataFrame(e["data"]), e["artifact_file"])
        elif kind == "model":
            from ragen_core.tracking.model_registry import log_model_dir  # loads mlflow.transformers: only here

            if not Path(e["path"]).exists():
                raise _Refused(f"model folder {e['path']} no longer exists")
            log_model_dir(self.tracking_uri, run_id, Path(e["path"]), e["name"],
                          Path(e["base_model"]) if e.get("base_model") else None, e["step"])
        elif kind == "artifact":
            path, dest = Path(e["path"]), e["artifact_path"]
            if not path.exists():
                raise _Refused(f"artifact {path} no longer exists")
            if path.is_dir():
                client.log_artifacts(run_id, str(path), dest)
            else:
                client.log_artifact(run_id, str(path), dest)
        elif kind == "status":
            if e["status"] == "RUNNING":
                client.update_run(run_id, status="RUNNING")
            else:
                client.set_terminated(run_id, e["status"], end_time=e["ts"])
        else:
            raise _Refused(f"unknown outbox entry kind {kind!r}")

    def _new_params(self, params: dict[str, str]) -> dict[str, str]:
        """Params not yet on the server; MLflow params are immutable, so a changed value is skipped."""
        assert self._params is not None
        out = {}
        for k, v in params.items():
            old = self._params.get(k)
            if old is None:
                out[k] = v
            elif old != v:
                log.warning("MLflow param %r is already %r on run %s; new value %r not recorded",
                            k, old, self._run_id, v)
        return out


class _Refused(Exception):
    """A local reason why an entry can never be delivered (treated like a 4xx)."""

    def get_http_status_code(self) -> int:
        return 400


_BATCHABLE = ("metrics", "params", "tags")


def _batch_length(entries: list[dict[str, Any]], start: int) -> int:
    """How many entries from ``start`` go into one request (1 for a non-batchable entry).

    Consecutive metrics/params/tags entries share one log_batch within MLflow's limits.
    Entries are never split across requests (log_* already chunked them), so a delivered
    offset always falls on an entry boundary. A param key repeated within a batch ends it,
    because log_batch refuses duplicate param keys.
    """
    if entries[start]["kind"] not in _BATCHABLE:
        return 1
    n_metrics = n_params = n_tags = 0
    param_keys: set[str] = set()
    end = start
    while end < len(entries) and entries[end]["kind"] in _BATCHABLE:
        e = entries[end]
        m = len(e.get("values", ()))
        p = len(e.get("params", ()))
        t = len(e.get("tags", ()))
        clash = not param_keys.isdisjoint(e.get("params", ()))
        if end > start and (
            clash or n_metrics + m > MAX_METRICS_PER_BATCH or n_params + p > MAX_PARAMS_TAGS_PER_BATCH
            or n_tags + t > MAX_PARAMS_TAGS_PER_BATCH
        ):
            break
        n_metrics, n_params, n_tags = n_metrics + m, n_params + p, n_tags + t
        param_keys.update(e.get("params", ()))
        end += 1
    return end - start


def _make_client(tracking_uri: str) -> MlflowClient:
    # lazily: importing ragen_core.tracking must not load mlflow (test_tracking_logger.py checks)
    from mlflow import MlflowClient

    if tracking_uri.startswith("sqlite:///"):
        Path(tracking_uri[len("sqlite:///"):]).expanduser().resolve().parent.mkdir(parents=True, exist_ok=True)
    return MlflowClient(tracking_uri=tracking_uri)


def _artifact_location(tracking_uri: str, experiment_name: str) -> str | None:
    """Artifacts of a sqlite store go beside the database, not into the current directory.

    (MLflow's default for a database store is ``./mlruns`` relative to wherever the
    process happens to start.) A server decides its own artifact location: None.
    """
    if not tracking_uri.startswith("sqlite:///"):
        return None
    db = Path(tracking_uri[len("sqlite:///"):]).expanduser().resolve()
    safe = re.sub(r"[^\w.\-]+", "_", experiment_name)
    return (db.parent / "mlartifacts" / safe).as_uri()


def ui_url(tracking_uri: str, experiment_id: str, run_id: str | None = None, base: str | None = None) -> str:
    """The address of an experiment's runs (or of one run) in the MLflow UI, opened as training runs.

    ``base`` is the UI's address; by default the tracking URI itself when it is a server, else what
    ``mlflow ui`` serves (http://127.0.0.1:5000). The ``workflowType=machine_learning`` parameter is what makes
    MLflow 3.17's UI show the runs view rather than the GenAI overview (see the module docstring).
    """
    if base is None:
        base = tracking_uri if tracking_uri.startswith(("http://", "https://")) else "http://127.0.0.1:5000"
    page = f"experiments/{experiment_id}/runs" + (f"/{run_id}" if run_id else "")
    return f"{base.rstrip('/')}/#/{page}?workflowType=machine_learning"


def browse_hint(logger: object, tracking_uri: str) -> str:
    """The summary's last line: how to look at the run (``mlflow ui`` for a local store, then its address).

    Any logger; only an MLflowLogger whose run exists has an experiment to link to.
    """
    if not tracking_uri:
        return ""
    exp, run_id = getattr(logger, "experiment_id", None), getattr(logger, "run_id", None)
    local = tracking_uri.startswith("sqlite")
    line = f"\nbrowse it: mlflow ui --backend-store-uri {tracking_uri}" if local else f"\nbrowse it: {tracking_uri}"
    if exp is None:
        return line
    url = ui_url(tracking_uri, str(exp), run_id)
    return f"{line}, then {url}" if local else f"\nbrowse it: {url}"


def _now_ms() -> int:
    return int(time.time() * 1000)


def _short(exc: Exception, limit: int = 300) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def deliver_pending(outbox_dir: Path, tracking_uri: str | None = None) -> int:
    """Deliver what a run left in its outbox (e.g. the server was down when it ended).

    Creates the run first if it never existed. Returns how many entries are still
    pending (0 when everything arrived). The run's final status is the one close() queued.
    """
    box = Outbox(Path(outbox_dir))
    if len(box) == 0:
        return 0
    if box.run_id is None and box.intent is None:
        raise ValueError(f"{box.state_path} says neither which run {box.path} belongs to nor how to create it")
    logger = MLflowLogger(tracking_uri, outbox_dir=Path(outbox_dir), retry_interval_s=0.0, drain_only=True)
    return logger.pending_count
