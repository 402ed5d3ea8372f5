"""Read training runs back from MLflow, and add results to runs afterwards (``ragen compare``, ``ragen eval``).

    from ragen_core.tracking.history import fetch_runs, log_onto_run, log_compare_run, run_id_of
    runs = fetch_runs("sqlite:///data/mlflow.db", ["bandit-starpo-20260101-120000", "3f2c..."])  # [RunHistory]
    record = export_run(uri, run_id)                  # a finished run as plain JSON data (a study's carry file)
    new_id = import_run(other_uri, record, parent_run_id, {"trial": "4"})  # the same run, made again elsewhere
    log_onto_run(uri, run_id_of(run_dir), {"val/final/success": 0.8}, step=199, files=[Path("eval.md")])
    log_compare_run(uri, runs[0].experiment_id, "compare-20260101-130000", {"kind": "compare"}, files)

A run is named by its MLflow run id or by its run name (the ``mlflow.runName`` tag; our runs are
named after their run directory), searched across all active experiments. An unknown or
ambiguous name raises LookupError (``ragen`` turns it into a message and exit status 2).
Everything goes through an explicit ``MlflowClient`` and run id, never the fluent active run
(STYLE.md rule 7). These are one-shot reads and writes after training, so unlike
:class:`~ragen_core.tracking.MLflowLogger` there is no outbox: a failure raises.

Tests: ``.venv/bin/python -m pytest tests/flows/test_compare_flow.py tests/flows/test_evaluate_flow.py -q``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from ragen_core.store.run_dir import RunDir
from ragen_core.tracking.logger import check_metric_names
from ragen_core.tracking.mlflow_logger import default_tracking_uri
from ragen_core.tracking.outbox import STATE_FILE
from ragen_core.tracking.run_history import RunHistory, wanted_metrics

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities import Run

__all__ = ["FetchedRun", "export_run", "fail_running_runs", "fetch_runs", "find_group", "find_run", "import_run",
           "log_compare_run", "log_onto_run", "metric_histories", "run_id_of", "tracking_uri_for"]

_NOT_FOUND = ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE", "NOT_FOUND")


@dataclass(frozen=True)
class FetchedRun:
    """A run's history plus where it lives in MLflow (a comparison run goes into the same experiment)."""

    history: RunHistory
    experiment_id: str


def _client(uri: str) -> MlflowClient:
    # lazily: importing ragen_core.tracking must not load mlflow (test_tracking_logger.py checks)
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri)


def _by_id(client: MlflowClient, ref: str) -> Run | None:
    # lazily: importing ragen_core.tracking must not load mlflow (test_tracking_logger.py checks)
    from mlflow.exceptions import MlflowException

    try:
        return client.get_run(ref)
    except MlflowException as e:
        if e.error_code in _NOT_FOUND:
            return None
        raise


def find_run(client: MlflowClient, ref: str) -> Run:
    """The run with id ``ref``, else the one run named ``ref`` in any active experiment; LookupError otherwise."""
    run = _by_id(client, ref)
    if run is not None:
        return run
    experiments = [e.experiment_id for e in client.search_experiments()]
    quote = "'" if "'" not in ref else '"'
    matches = list(client.search_runs(experiments, f"tags.mlflow.runName = {quote}{ref}{quote}",
                                      order_by=["attributes.start_time DESC"])) if experiments else []
    if not matches:
        raise LookupError(f"no MLflow run with id or name {ref!r} at {client.tracking_uri}; "
                          "list runs with `mlflow ui` or `mlflow runs list --experiment-id ...`")
    if len(matches) > 1:
        ids = ", ".join(m.info.run_id for m in matches[:5])
        raise LookupError(f"{len(matches)} MLflow runs are named {ref!r} ({ids}); pass a run id instead")
    return matches[0]


def metric_histories(
    client: MlflowClient, run_id: str, names: Iterable[str]
) -> dict[str, tuple[tuple[int, float], ...]]:
    """metric -> ((step, value), ...) sorted by step, for each of ``names`` the run has (others are left out).

    When a step was logged more than once (a resumed run re-logging an iteration) the latest value wins.
    """
    out: dict[str, tuple[tuple[int, float], ...]] = {}
    for name in names:
        by_step: dict[int, tuple[int, float]] = {}
        for m in client.get_metric_history(run_id, name):
            if m.step not in by_step or m.timestamp >= by_step[m.step][0]:
                by_step[m.step] = (m.timestamp, float(m.value))
        if by_step:
            out[name] = tuple((step, value) for step, (_, value) in sorted(by_step.items()))
    return out


def fetch_runs(uri: str, refs: Sequence[str], extra: Sequence[str] = (),
               prefixes: Sequence[str] = ()) -> list[FetchedRun]:
    """Each run of ``refs`` (id or name) with the histories
    :func:`ragen_core.tracking.run_history.wanted_metrics` asks for, those of ``extra`` (a study's curves
    and the monitor's streaks) and every metric of the run whose name starts with one of ``prefixes``
    (``grad/``: names that depend on the run's settings)."""
    client = _client(uri)
    fetched = []
    for ref in refs:
        run = find_run(client, ref)
        tags = dict(run.data.tags)
        wanted = dict.fromkeys((*wanted_metrics(tags.get("env", "")), *extra,
                                *sorted(m for m in run.data.metrics if m.startswith(tuple(prefixes)) and prefixes)))
        names = [m for m in wanted if m in run.data.metrics]
        history = RunHistory(name=run.info.run_name or ref, run_id=run.info.run_id, tags=tags,
                             histories=metric_histories(client, run.info.run_id, names))
        fetched.append(FetchedRun(history, run.info.experiment_id))
    return fetched


def find_group(uri: str, tags: Mapping[str, str] | None = None, parent: str | None = None) -> list[str]:
    """Ids of the training runs (any status) carrying every tag of ``tags`` and, with ``parent`` (a run
    id or name), nested under that run; oldest first. LookupError when none match.

    A group of runs for ``ragen compare --parent STUDY`` or ``--tag study=echo-trap``; comparison runs
    (tag ``kind``) and sweep parents (tag ``sweep=parent``) are left out.
    """
    client = _client(uri)
    clauses = []
    if parent is not None:
        clauses.append(f"tags.mlflow.parentRunId = '{find_run(client, parent).info.run_id}'")
    for key, value in (tags or {}).items():
        if "'" in key or "'" in value or "`" in key:
            raise LookupError(f"tag {key}={value}: quotes are not allowed in a tag filter")
        clauses.append(f"tags.`{key}` = '{value}'")
    if not clauses:
        raise LookupError("a group needs a parent run or at least one tag")
    experiments = [e.experiment_id for e in client.search_experiments()]
    runs = [r for r in client.search_runs(experiments, " and ".join(clauses), order_by=["attributes.start_time ASC"],
                                          max_results=5000)
            if "kind" not in r.data.tags and r.data.tags.get("sweep") != "parent"] if experiments else []
    if not runs:
        what = " and ".join([*([f"parent {parent}"] if parent else []), *(f"{k}={v}" for k, v in (tags or {}).items())])
        raise LookupError(f"no MLflow run with {what} at {uri}")
    return [r.info.run_id for r in runs]


def tracking_uri_for(refs: Sequence[str]) -> str:
    """The tracking URI recorded in the first of ``refs`` that is a local run (its config's tracking.uri),
    else the default (``$MLFLOW_TRACKING_URI`` or ``sqlite:///$RAGEN_DATA_DIR/mlflow.db``)."""
    for ref in refs:
        try:
            cfg = RunDir.find(ref).read_config()
        except (FileNotFoundError, OSError, yaml.YAMLError):
            continue
        uri = (cfg.get("tracking") or {}).get("uri")
        if uri:
            return str(uri)
    return default_tracking_uri()


def run_id_of(run_dir: Path) -> str | None:
    """The MLflow run id a run directory's logger recorded (its outbox state), or None (tracking off, never created)."""
    state = Path(run_dir) / STATE_FILE
    if not state.is_file():
        return None
    return json.loads(state.read_text()).get("run_id")


def log_onto_run(uri: str, run_id: str, metrics: dict[str, float], step: int, files: Sequence[Path],
                 artifact_path: str | None = None) -> None:
    """Add metrics (at ``step``) and files to an existing run without touching its status or other data."""
    # lazily: importing ragen_core.tracking must not load mlflow (test_tracking_logger.py checks)
    from mlflow.entities import Metric

    check_metric_names(metrics)
    client = _client(uri)
    now = int(time.time() * 1000)
    client.log_batch(run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()])
    for path in files:
        client.log_artifact(run_id, str(path), artifact_path)


def log_compare_run(uri: str, experiment_id: str, run_name: str, tags: dict[str, str], files: Sequence[Path],
                    artifact_path: str | None = None) -> str:
    """A new, finished run in ``experiment_id`` holding ``files`` as artifacts; returns its run id."""
    client = _client(uri)
    run = client.create_run(experiment_id, run_name=run_name, tags=tags)
    try:
        for path in files:
            client.log_artifact(run.info.run_id, str(path), artifact_path)
    except Exception:
        client.set_terminated(run.info.run_id, "FAILED")
        raise
    client.set_terminated(run.info.run_id, "FINISHED")
    return run.info.run_id


def fail_running_runs(uri: str, run_ids: Sequence[str], say: Callable[[str], None] = print) -> None:
    """Mark FAILED those of ``run_ids`` still RUNNING (runs whose process was lost); a tracking error is said, not
    raised (what calls this has results to publish)."""
    client = _client(uri)
    for run_id in run_ids:
        try:
            if client.get_run(run_id).info.status == "RUNNING":
                client.set_terminated(run_id, "FAILED")
        except Exception as e:  # noqa: BLE001 -- a tracking hiccup must not lose the results table
            say(f"[sweep] could not mark MLflow run {run_id} FAILED: {e}")


CARRIED_TAG = "carried_from"
"""Tag of a run made by :func:`import_run`: the id the run had where it was tracked first."""

_NOT_CARRIED_TAGS = ("mlflow.runName", "mlflow.parentRunId")
"""Tags :func:`import_run` sets itself (the run's name; the parent on the machine it is carried to)."""


def export_run(uri: str, run_id: str) -> dict[str, Any]:
    """A finished run as plain JSON data: name, status, start and end time, tags, params and every metric's history
    (``[[step, value], ...]``, the latest value of a step logged twice). Artifacts are not included."""
    client = _client(uri)
    run = client.get_run(run_id)
    histories = metric_histories(client, run_id, sorted(run.data.metrics))
    return {"name": run.info.run_name, "run_id": run_id, "status": run.info.status,
            "start_time": run.info.start_time, "end_time": run.info.end_time,
            "tags": {k: v for k, v in sorted(run.data.tags.items()) if k not in _NOT_CARRIED_TAGS},
            "params": dict(sorted(run.data.params.items())),
            "metrics": {name: [[step, value] for step, value in series] for name, series in histories.items()}}


def import_run(uri: str, record: Mapping[str, Any], parent_run_id: str, tags: Mapping[str, str]) -> str:
    """Make the run of an :func:`export_run` record again at ``uri``, nested under ``parent_run_id`` and in its
    experiment, with ``tags`` added and :data:`CARRIED_TAG` naming the run's first id; returns the new run's id.
    A failure part way leaves the new run FAILED and raises."""
    # lazily: importing ragen_core.tracking must not load mlflow (test_tracking_logger.py checks)
    from mlflow.entities import Metric, Param

    client = _client(uri)
    parent = client.get_run(parent_run_id)
    start = int(record.get("start_time") or time.time() * 1000)
    run_tags = {**dict(record.get("tags") or {}), **tags,
                "mlflow.parentRunId": parent_run_id, CARRIED_TAG: str(record["run_id"])}
    run = client.create_run(parent.info.experiment_id, start_time=start, run_name=str(record["name"]), tags=run_tags)
    run_id = run.info.run_id
    try:
        params = [Param(str(k), str(v)) for k, v in dict(record.get("params") or {}).items()]
        metrics = [Metric(str(name), float(value), start, int(step))
                   for name, series in dict(record.get("metrics") or {}).items() for step, value in series]
        for i in range(0, len(params), 100):  # MLflow's limits for one log_batch call
            client.log_batch(run_id, params=params[i:i + 100])
        for i in range(0, len(metrics), 1000):
            client.log_batch(run_id, metrics=metrics[i:i + 1000])
    except Exception:
        client.set_terminated(run_id, "FAILED")
        raise
    end = record.get("end_time")
    client.set_terminated(run_id, str(record.get("status") or "FINISHED"), end_time=int(end) if end else None)
    return run_id
