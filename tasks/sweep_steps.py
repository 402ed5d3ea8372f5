"""The steps of a sweep that flows/sweep.py chains: the MLflow parent run, worker processes,
waiting for running trials, and the results table on the parent run.

Only ``spawn_workers`` and ``publish_results`` are Prefect tasks (visible steps in the UI;
publishing is idempotent, so it may retry). Trials themselves are train flows, not tasks.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from ragen_core.config import data_dir, load_experiment
from ragen_core.sweeps import (
    SweepPlan,
    dashboard_command,
    fail_stale,
    redact,
    running_trials,
    table_rows,
    write_table,
)
from ragen_core.sweeps.aggregate import (
    group_runs,
    group_table,
    rule_patience,
    study_metrics,
    summary_metrics,
    write_study,
)
from ragen_core.tracking import MetricLogger, NullLogger, flatten_config
from ragen_core.tracking.factory import tracking_uri
from ragen_core.tracking.run_history import RunHistory

PARENT_ATTR = "mlflow_parent_run_id"
"""Study user attribute holding the parent run's id, so every worker and a resumed sweep nest under it."""


def sweep_dir(plan: SweepPlan) -> Path:
    return data_dir() / "sweeps" / plan.sweep.name


def open_parent_run(plan: SweepPlan, study: Any, url: str, flow_run_id: str | None) -> MetricLogger:
    """One MLflow run per study (run name = study name); a resumed study continues the same run."""
    from ragen_core.tracking import MLflowLogger

    base = load_experiment(plan.sweep.base, plan.sweep.overrides)
    if base.tracking.backend == "none":
        return NullLogger(record=False)
    known = study.user_attrs.get(PARENT_ATTR)
    tags = {"study": plan.sweep.name, "sweep": "parent", "optuna.storage": redact(url),
            **({"prefect.flow_run_id": flow_run_id} if flow_run_id else {})}
    outbox = sweep_dir(plan) / "mlflow-parent"
    try:
        logger = MLflowLogger(tracking_uri(base), base.tracking.experiment, run_name=plan.sweep.name,
                              run_id=known, tags=tags, outbox_dir=outbox)
    except ValueError:  # the outbox belongs to an older study of the same name: the study's record wins
        shutil.rmtree(outbox, ignore_errors=True)
        logger = MLflowLogger(tracking_uri(base), base.tracking.experiment, run_name=plan.sweep.name,
                              run_id=known, tags=tags, outbox_dir=outbox)
    if logger.run_id and known != logger.run_id:
        study.set_user_attr(PARENT_ATTR, logger.run_id)
    logger.log_params({f"sweep.{k}": v for k, v in flatten_config(plan.sweep).items()})
    return logger


def worker_env() -> dict[str, str]:
    """The environment of worker processes: this one, pointed at the same Prefect API.

    In Prefect's ephemeral mode the API is a temporary server inside this process; workers
    that report there show their train runs beside the sweep's (and start no server of their own).
    """
    env = dict(os.environ)
    if not env.get("PREFECT_API_URL"):
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            env["PREFECT_API_URL"] = str(client.api_url).rstrip("/")
    return env


@task(name="workers", cache_policy=NO_CACHE)
def spawn_workers(plan: SweepPlan, overrides: list[str], parent_run_id: str | None, n: int) -> list[int]:
    """Start ``n`` worker processes on the study's storage and wait for all; returns their exit codes."""
    cmd = [sys.executable, "-m", "flows.sweep", "worker", plan.path]
    cmd += ["--parent-run-id", parent_run_id] if parent_run_id else []
    for item in overrides:
        cmd += ["--set", item]
    env = worker_env()
    procs = [subprocess.Popen(cmd, env=env) for _ in range(n)]
    return [p.wait() for p in procs]


def settle(study: Any, poll_seconds: float = 2.0, say: Any = print) -> None:
    """Wait until no trial is RUNNING: live workers finish theirs, lost workers' trials go FAIL by heartbeat."""
    announced: set[int] = set()
    while running := running_trials(study):
        if set(running) - announced:
            say(f"[sweep] waiting for running trials {running} (finished, or failed when their heartbeat stops)")
            announced |= set(running)
        fail_stale(study)
        time.sleep(poll_seconds)


def close_lost_runs(plan: SweepPlan, trials: list[Any]) -> None:
    """Mark FAILED the MLflow runs of trials that failed while their run was open (a killed worker)."""
    base = load_experiment(plan.sweep.base, plan.sweep.overrides)
    lost = [t.user_attrs["mlflow_run_id"] for t in trials if t.state.name == "FAIL" and t.user_attrs.get("mlflow_run_id")]
    if not lost or base.tracking.backend == "none":
        return
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri(base))
    for run_id in lost:
        try:
            if client.get_run(run_id).info.status == "RUNNING":
                client.set_terminated(run_id, "FAILED")
        except Exception as e:  # noqa: BLE001 -- a tracking hiccup must not lose the results table
            print(f"[sweep] could not mark MLflow run {run_id} FAILED: {e}")


def trial_histories(plan: SweepPlan, trials: list[Any]) -> list[RunHistory]:
    """The MLflow histories of the trials that trained (a study's curves and the monitor's signals), each
    run's tags completed with its trial's parameters (so ``group_by`` may name a parameter or a tag)."""
    from ragen_core.tracking.history import fetch_runs

    base = load_experiment(plan.sweep.base, plan.sweep.overrides)
    ran = [t for t in sorted(trials, key=lambda t: t.number)
           if t.state.name in ("COMPLETE", "PRUNED") and t.user_attrs.get("mlflow_run_id")]
    if not ran or base.tracking.backend == "none":
        return []
    fetched = fetch_runs(tracking_uri(base), [t.user_attrs["mlflow_run_id"] for t in ran], study_metrics())
    return [dataclasses.replace(f.history, tags={**f.history.tags, **{k: str(v) for k, v in t.params.items()}})
            for f, t in zip(fetched, ran)]


@task(name="study-report", cache_policy=NO_CACHE)
def publish_study(plan: SweepPlan, study: Any, parent: MetricLogger) -> str:
    """A study's aggregate (ragen_core/sweeps/aggregate.py) under the sweep's folder and on the parent run."""
    sweep = plan.sweep
    assert sweep.group_by is not None
    runs = trial_histories(plan, study.get_trials(deepcopy=False))
    if not runs:
        return "study: no trial has a tracked run to aggregate"
    patience = rule_patience(load_experiment(sweep.base, sweep.overrides).health)
    paths = write_study(runs, sweep_dir(plan) / "study", group_by=sweep.group_by, drop=sweep.collapse_drop,
                        patience=patience, title=f"{sweep.name}: {len(runs)} runs by {sweep.group_by}")
    for path in paths.values():
        parent.log_artifact(path, "study")
    parent.log_metrics(summary_metrics(group_table(group_runs(runs, sweep.group_by), sweep.collapse_drop)), step=0)
    parent.flush()
    return paths["md"].read_text().strip() + f"\n\nstudy files: {paths['md'].parent}"


@task(name="results", cache_policy=NO_CACHE)
def publish_results(plan: SweepPlan, study: Any, parent: MetricLogger, url: str) -> str:
    """The paper-style table (CSV, Markdown, PNG) and the best params on the parent run; a summary."""
    from optuna.trial import TrialState

    sweep = plan.sweep
    trials = study.get_trials(deepcopy=False)
    close_lost_runs(plan, trials)
    table = table_rows(trials, plan.table_keys, maximize=sweep.direction == "maximize",
                       cost=sweep.cost_objective != "none", base_order=list(plan.bases))
    title = f"{sweep.name}: {sweep.objective} {sweep.metric}"
    paths = write_table(table, sweep_dir(plan), title)
    for path in paths.values():
        parent.log_artifact(path, "results")
    done = [t for t in trials if t.state == TrialState.COMPLETE]
    for t in sorted(done, key=lambda t: t.number):
        parent.log_metrics({"val/objective": t.values[0]}, step=t.number)
    best_line = "best: no completed trial"
    if done and len(study.directions) == 1:
        best = study.best_trial
        parent.log_params({f"best.{k}": v for k, v in best.params.items()})
        parent.log_metrics({"val/best_objective": best.value}, step=best.number)
        parent.set_tags({"best_trial": str(best.number)})
        best_line = f"best: trial {best.number} {best.params} -> {sweep.objective} {sweep.metric} {best.value:.4f}"
    elif done:
        front = sorted(t.number for t in study.best_trials)
        parent.set_tags({"pareto_trials": ",".join(map(str, front))})
        best_line = f"Pareto-optimal trials ({sweep.metric} vs {sweep.cost_objective}): {front}"
    parent.flush()
    counts = {s.name: sum(t.state == s for t in trials) for s in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)}
    return "\n".join([
        (f"study {sweep.name}: {len(trials)} trials ({', '.join(f'{k} {v}' for k, v in counts.items())}) "
        f"in {redact(url)}"),
        best_line,
        "",
        paths["md"].read_text().strip(),
        "",
        f"table: {paths['csv']} | {paths['md'].name} | {paths['png'].name}"
        + (f"; MLflow parent run {parent.run_id}" if parent.run_id else ""),
        f"browse the study: {dashboard_command(url)}",
    ])
