"""The sweep flow: an Optuna study whose trials are runs of the train flow (RAGEN §5 ablations).

    ragen sweep sweeps/smoke.yaml                      # one process, trials as sub-flows
    ragen sweep sweeps/table2-responses-per-prompt.yaml --workers 4
    ragen study studies/echo-trap-bandit.yaml          # a sweep with group_by: the study report too
    python -c "from flows.sweep import sweep; print(sweep('sweeps/smoke.yaml'))"
    optuna-dashboard sqlite:///data/optuna.db          # watch the study

One MLflow parent run per study and a nested run per trial (tags study, trial and the
Prefect flow-run id); each trial runs ``flows.train.train`` itself (no second copy of the
training code), reports validation success per evaluation and may be pruned. ``--workers N``
starts N processes (the hidden command ``ragen sweep-worker``, flows/cli.py) on the same storage;
with ``dispatch: deployment`` each trial is a run of the ``ragen-train-trial`` deployment on the work
pool instead. Interrupted? Run the same command again: the study resumes. At the end the
results table (CSV, Markdown, PNG) and the best params go on the parent run.
Tests: tests/flows/test_sweep_flow.py, test_sweep_workers.py, test_study_flow.py.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Any

import optuna
import prefect.deployments
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.runtime import flow_run
from prefect.settings import get_current_settings

from flows._ui import publish_markdown
from ragen_core.config import ConfigError, load_experiment
from ragen_core.sweeps import (
    RESULT_ATTRS,
    DuplicateTrial,
    SweepPlan,
    dashboard_command,
    duplicate_of,
    finished_count,
    objective_value,
    open_study,
    plan_sweep,
    redact,
    remaining_trials,
    requeue_interrupted,
    settle,
    stop_when_done,
    storage_url,
    suggest_params,
    trial_experiment,
    trial_record,
    trial_spec,
    worker_name,
)
from ragen_core.sweeps.aggregate import study_metrics
from ragen_core.tracking import MetricLogger, MLflowLogger, NullLogger, flatten_config
from ragen_core.tracking.factory import tracking_uri
from ragen_core.tracking.history import fetch_runs
from ragen_core.tracking.outbox import OutboxMismatch
from ragen_core.tracking.run_history import RunHistory
from ragen_core.tracking.run_meta import experiment_name
from tasks import sweep_steps as steps

PARENT_ATTR = "mlflow_parent_run_id"
"""Study user attribute holding the parent run's id, so every worker and a resumed sweep nest under it."""


@flow(name="ragen-sweep")
def sweep(sweep_file: str, workers: int = 1, overrides: list[str] | None = None) -> str:
    """Run (or resume) the study of ``sweep_file``; returns a summary with the results table."""
    overrides = list(overrides or [])
    plan = plan_sweep(sweep_file, overrides)
    url = storage_url(plan.sweep)
    study = open_study(plan.sweep, plan.grid, url)
    parent = open_parent_run(plan, study, url, flow_run.id)
    print(f"[sweep] study {plan.sweep.name} in {redact(url)}: {plan.target} trials; watch it with "
          f"{dashboard_command(url)}")
    status = "FAILED"
    try:
        run_trials(plan, study, url, overrides, parent.run_id, workers)
        close_lost_runs(plan, study.get_trials(deepcopy=False))
        summary = steps.publish_results(plan, study, parent, url)
        if plan.sweep.group_by:
            summary += "\n\n" + steps.publish_study(plan, trial_histories(plan, study.get_trials(deepcopy=False)),
                                                    parent)
        status = "FINISHED"
    finally:
        parent.close(status)
    publish_markdown(f"sweep-{plan.sweep.name}", summary, f"results of the study {plan.sweep.name}")
    return summary


def run_trials(plan: SweepPlan, study: optuna.Study, url: str, overrides: list[str], parent_run_id: str | None,
               workers: int) -> None:
    """Rounds of trials until none is left to start: each round queues interrupted trials again, runs
    what is left (here, or in ``workers`` processes), then waits for running trials (a lost worker's go
    FAIL and are queued again). Ends early when a round finishes no trial, so a stuck study stops."""
    finished = None
    while True:
        requeue_interrupted(study, plan.sweep.retries)
        todo = remaining_trials(study, plan.target, plan.grid)
        if not todo and finished is not None:
            return
        if todo and workers > 1:
            steps.spawn_workers(worker_command(plan, overrides, parent_run_id), worker_env(), min(workers, todo))
        elif todo:
            run_worker(plan, url, parent_run_id)
        settle(study)
        now = finished_count(study)
        if now == finished:
            print(f"[sweep] no trial finished in the last round; {todo} left undone")
            return
        finished = now


def run_worker(plan: SweepPlan, url: str, parent_run_id: str | None) -> None:
    """Run trials on the shared study until nothing is left to start (one worker's loop)."""
    study = open_study(plan.sweep, plan.grid, url)
    if remaining_trials(study, plan.target, plan.grid) == 0:
        return
    # catch: a crashing trial ends FAIL and the worker goes on with the next one
    study.optimize(lambda trial: objective(trial, plan, url, parent_run_id), catch=(Exception,),
                   callbacks=[stop_when_done(plan.target, plan.grid)], gc_after_trial=True)


def objective(trial: optuna.Trial, plan: SweepPlan, url: str, parent_run_id: str | None) -> float | tuple[float, float]:
    """One trial: the train flow on the base experiment plus this trial's overrides."""
    if "failed_trial" in trial_record(trial.study, trial.number).system_attrs:
        # a retry inherits the lost trial's attributes
        for key in RESULT_ATTRS:
            trial.set_user_attr(key, None)
    params = suggest_params(trial, plan)
    trial.set_user_attr("worker", worker_name())  # every trial a worker took, a skipped duplicate too
    other = duplicate_of(trial.study, trial.number)
    if other is not None:
        trial.set_user_attr("skipped", f"same grid point as trial {other}")
        raise DuplicateTrial(f"trial {trial.number} skipped: trial {other} runs the same grid point {params}")
    experiment, overrides = trial_experiment(plan.sweep, params, plan.bases)
    trial.set_user_attr("overrides", overrides)
    try:
        result = train_trial(plan, experiment, overrides, parent_run_id, trial.number,
                             trial_spec(plan.sweep, url, trial.number))
    except BaseException as e:
        if not isinstance(e, Exception):  # Ctrl-C or a termination signal: run it again on resume
            trial.set_user_attr("interrupted", type(e).__name__)
        raise
    if result is not None:
        trial.set_user_attr("mlflow_run_id", result.mlflow_run_id)
    attrs = trial_record(trial.study, trial.number).user_attrs  # written by the trial's reporter
    if attrs.get("pruned_at") is not None:
        raise optuna.TrialPruned(f"{plan.sweep.metric} below the median at iteration {attrs['pruned_at']}")
    if attrs.get("health_stop") and plan.sweep.prune_on_health:
        raise optuna.TrialPruned(attrs["health_stop"])
    value = objective_value(attrs.get("curve") or [], plan.sweep.objective, plan.sweep.direction)
    if plan.sweep.cost_objective == "none":
        return value
    return value, float(attrs["cost"][plan.sweep.cost_objective])


def train_trial(plan: SweepPlan, experiment: str, overrides: list[str], parent_run_id: str | None,
                number: int, spec: dict[str, Any]) -> Any:
    """The trial flow (flows/train.py ``train_trial``) in this process (a sub-flow), or a run of its
    deployment on the work pool."""
    kwargs = {"experiment": experiment, "overrides": overrides, "parent_run_id": parent_run_id,
              "run_name": f"{plan.sweep.name}-t{number:03d}-{time.strftime('%Y%m%d-%H%M%S')}",
              "tags": {"study": plan.sweep.name, "trial": str(number)}, "trial": spec}
    if plan.sweep.dispatch == "deployment":
        return run_on_pool(plan, kwargs)
    # imported here: the train flow loads torch, which the sweep's own loop does not need
    from flows.train import train_trial as trial_flow

    return trial_flow(**kwargs)


def run_on_pool(plan: SweepPlan, parameters: dict[str, Any]) -> None:
    """Run the trial as a deployment run and wait; it reports to Optuna through the shared storage."""
    if not get_current_settings().api.url:
        raise ConfigError("dispatch: deployment needs a Prefect server (set PREFECT_API_URL)")
    if parameters["trial"]["storage"].startswith("sqlite"):
        print("[sweep] warning: a sqlite study is reachable only from this machine; workers elsewhere need "
              "a shared storage (a PostgreSQL URL)")
    relative = os.path.relpath(parameters["experiment"])  # the worker runs in its own checkout of the repo
    parameters = {**parameters, "experiment": parameters["experiment"] if relative.startswith("..") else relative}
    # looked up on the module at call time, so that tests can stand in for the deployment run
    run = prefect.deployments.run_deployment(plan.sweep.deployment, parameters=parameters, timeout=None)
    if run.state is None or not run.state.is_completed():
        raise RuntimeError(f"deployment run {run.name} ({run.id}) of {plan.sweep.deployment} ended "
                           f"{run.state.name if run.state else 'without a state'}")


def worker(sweep_file: str, overrides: list[str], parent_run_id: str | None) -> None:
    """One worker process of ``--workers N`` (``ragen sweep-worker``): trials until none is left to start."""
    plan = plan_sweep(sweep_file, overrides)
    run_worker(plan, storage_url(plan.sweep), parent_run_id)


def worker_command(plan: SweepPlan, overrides: list[str], parent_run_id: str | None) -> list[str]:
    """The command line of one worker process: the hidden ``sweep-worker`` command of flows/cli.py."""
    cmd = [sys.executable, "-m", "flows.cli", "sweep-worker", plan.path]
    cmd += ["--parent-run-id", parent_run_id] if parent_run_id else []
    for item in overrides:
        cmd += ["--set", item]
    return cmd


def worker_env() -> dict[str, str]:
    """The environment of worker processes: this one, pointed at the same Prefect API.

    In Prefect's ephemeral mode the API is a temporary server inside this process; workers
    that report there show their train runs beside the sweep's (and start no server of their own).
    """
    env = dict(os.environ)
    if not env.get("PREFECT_API_URL"):
        with get_client(sync_client=True) as client:
            env["PREFECT_API_URL"] = str(client.api_url).rstrip("/")
    return env


def open_parent_run(plan: SweepPlan, study: optuna.Study, url: str, flow_run_id: str | None) -> MetricLogger:
    """One MLflow run per study (run name = study name); a resumed study continues the same run.

    It goes into the base experiment's MLflow experiment (``ragen-<env family>`` unless tracking.experiment
    names one); the trials, nested under it, follow it there (MLflowLogger).
    """
    base = load_experiment(plan.sweep.base, plan.sweep.overrides)
    if base.tracking.backend == "none":
        return NullLogger(record=False)
    known = study.user_attrs.get(PARENT_ATTR)
    tags = {"study": plan.sweep.name, "sweep": "parent", "optuna.storage": redact(url),
            **({"prefect.flow_run_id": flow_run_id} if flow_run_id else {})}
    outbox = plan.out_dir / "mlflow-parent"
    try:
        logger = MLflowLogger(tracking_uri(base), experiment_name(base), run_name=plan.sweep.name,
                              run_id=known, tags=tags, outbox_dir=outbox)
    except OutboxMismatch:  # the outbox belongs to an older study of the same name: the study's record wins;
        # the old outbox is set aside, never deleted (its undelivered entries are still there to read)
        aside = outbox.with_name(f"{outbox.name}.stale-{time.strftime('%Y%m%d-%H%M%S')}")
        outbox.rename(aside)
        logger = MLflowLogger(tracking_uri(base), experiment_name(base), run_name=plan.sweep.name,
                              run_id=known, tags=tags, outbox_dir=outbox)
    if logger.run_id and known != logger.run_id:
        study.set_user_attr(PARENT_ATTR, logger.run_id)
    logger.log_params({f"sweep.{k}": v for k, v in flatten_config(plan.sweep).items()})
    return logger


def close_lost_runs(plan: SweepPlan, trials: list[optuna.trial.FrozenTrial]) -> None:
    """Mark FAILED the MLflow runs of trials that failed while their run was open (a killed worker)."""
    base = load_experiment(plan.sweep.base, plan.sweep.overrides)
    lost = [t.user_attrs["mlflow_run_id"] for t in trials
            if t.state.name == "FAIL" and t.user_attrs.get("mlflow_run_id")]
    if not lost or base.tracking.backend == "none":
        return
    from mlflow import MlflowClient  # only when a trial was lost: mlflow takes seconds to import

    client = MlflowClient(tracking_uri(base))
    for run_id in lost:
        try:
            if client.get_run(run_id).info.status == "RUNNING":
                client.set_terminated(run_id, "FAILED")
        except Exception as e:  # noqa: BLE001 -- a tracking hiccup must not lose the results table
            print(f"[sweep] could not mark MLflow run {run_id} FAILED: {e}")


def trial_histories(plan: SweepPlan, trials: list[optuna.trial.FrozenTrial]) -> list[RunHistory]:
    """The MLflow histories of the trials that trained (a study's curves and the monitor's signals), each
    run's tags completed with its trial's parameters (so ``group_by`` may name a parameter or a tag)."""
    base = load_experiment(plan.sweep.base, plan.sweep.overrides)
    ran = [t for t in sorted(trials, key=lambda t: t.number)
           if t.state.name in ("COMPLETE", "PRUNED") and t.user_attrs.get("mlflow_run_id")]
    if not ran or base.tracking.backend == "none":
        return []
    fetched = fetch_runs(tracking_uri(base), [t.user_attrs["mlflow_run_id"] for t in ran], study_metrics())
    return [dataclasses.replace(f.history, tags={**f.history.tags, **{k: str(v) for k, v in t.params.items()}})
            for f, t in zip(fetched, ran, strict=True)]
