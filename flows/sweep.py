"""The sweep flow: an Optuna study whose trials are runs of the train flow (RAGEN §5 ablations).

    ragen sweep sweeps/smoke.yaml                      # one process, trials as sub-flows
    ragen sweep sweeps/table2-responses-per-prompt.yaml --workers 4
    python -c "from flows.sweep import sweep; print(sweep('sweeps/smoke.yaml'))"
    optuna-dashboard sqlite:///data/optuna.db          # watch the study

One MLflow parent run per study and a nested run per trial (tags study, trial and the
Prefect flow-run id); each trial runs ``flows.train.train`` itself (no second copy of the
training code), reports validation success per evaluation and may be pruned. ``--workers N``
starts N processes (``python -m flows.sweep worker ...``) on the same storage; with
``dispatch: deployment`` each trial is a run of the ``ragen-train`` deployment on the work
pool instead. Interrupted? Run the same command again: the study resumes. At the end the
results table (CSV, Markdown, PNG) and the best params go on the parent run.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from prefect import flow
from prefect.runtime import flow_run

from ragen_core.config import ConfigError
from ragen_core.sweeps import (
    RESULT_ATTRS,
    DuplicateTrial,
    SweepPlan,
    dashboard_command,
    duplicate_of,
    objective_value,
    open_study,
    plan_sweep,
    redact,
    remaining_trials,
    requeue_interrupted,
    stop_when_done,
    storage_url,
    suggest_params,
    trial_experiment,
    trial_record,
    trial_spec,
    worker_name,
)
from tasks import sweep_steps as st


@flow(name="ragen-sweep")
def sweep(sweep_file: str, workers: int = 1, overrides: list[str] | None = None) -> str:
    """Run (or resume) the study of ``sweep_file``; returns a summary with the results table."""
    overrides = list(overrides or [])
    plan = plan_sweep(sweep_file, overrides)
    url = storage_url(plan.sweep)
    study = open_study(plan.sweep, plan.grid, url)
    parent = st.open_parent_run(plan, study, url, flow_run.id)
    print(f"[sweep] study {plan.sweep.name} in {redact(url)}: {plan.target} trials; watch it with "
          f"{dashboard_command(url)}")
    status = "FAILED"
    try:
        finished = -1
        while True:
            requeue_interrupted(study, plan.sweep.retries)  # a resumed study reruns interrupted trials
            todo = remaining_trials(study, plan.target, plan.grid)
            if not todo and finished >= 0:
                break
            if todo and workers > 1:
                st.spawn_workers(plan, overrides, parent.run_id, min(workers, todo))
            elif todo:
                run_worker(plan, url, parent.run_id)
            st.settle(study)  # lost workers' trials go FAIL (and are queued again) before the next round
            now = sum(t.state.is_finished() for t in study.get_trials(deepcopy=False))
            if now == finished:
                print(f"[sweep] no trial finished in the last round; {todo} left undone")
                break
            finished = now
        summary = st.publish_results(plan, study, parent, url)
        if plan.sweep.group_by:
            summary += "\n\n" + st.publish_study(plan, study, parent)
        status = "FINISHED"
    finally:
        parent.close(status)
    return summary


def run_worker(plan: SweepPlan, url: str, parent_run_id: str | None) -> None:
    """Run trials on the shared study until nothing is left to start (one worker's loop)."""
    study = open_study(plan.sweep, plan.grid, url)
    if remaining_trials(study, plan.target, plan.grid) == 0:
        return
    # catch: a crashing trial ends FAIL and the worker goes on with the next one
    study.optimize(lambda trial: objective(trial, plan, url, parent_run_id), catch=(Exception,),
                   callbacks=[stop_when_done(plan.target, plan.grid)], gc_after_trial=True)


def objective(trial: Any, plan: SweepPlan, url: str, parent_run_id: str | None) -> float | tuple[float, float]:
    """One trial: the train flow on the base experiment plus this trial's overrides."""
    import optuna

    if "failed_trial" in trial_record(trial.study, trial.number).system_attrs:
        # a retry inherits the lost trial's attributes
        for key in RESULT_ATTRS:
            trial.set_user_attr(key, None)
    params = suggest_params(trial, plan)
    other = duplicate_of(trial.study, trial.number)
    if other is not None:
        trial.set_user_attr("skipped", f"same grid point as trial {other}")
        raise DuplicateTrial(f"trial {trial.number} skipped: trial {other} runs the same grid point {params}")
    experiment, overrides = trial_experiment(plan.sweep, params, plan.bases)
    trial.set_user_attr("overrides", overrides)
    trial.set_user_attr("worker", worker_name())
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
    """The train flow in this process (a sub-flow), or a run of the train deployment on the work pool."""
    kwargs = {"experiment": experiment, "overrides": overrides, "parent_run_id": parent_run_id,
              "run_name": f"{plan.sweep.name}-t{number:03d}-{time.strftime('%Y%m%d-%H%M%S')}",
              "tags": {"study": plan.sweep.name, "trial": str(number)}, "trial": spec}
    if plan.sweep.dispatch == "deployment":
        return run_on_pool(plan, kwargs)
    from flows.train import train

    return train(**kwargs)


def run_on_pool(plan: SweepPlan, parameters: dict[str, Any]) -> None:
    """Run the trial as a deployment run and wait; it reports to Optuna through the shared storage."""
    from prefect.deployments import run_deployment
    from prefect.settings import get_current_settings

    if not get_current_settings().api.url:
        raise ConfigError("dispatch: deployment needs a Prefect server (set PREFECT_API_URL)")
    if parameters["trial"]["storage"].startswith("sqlite"):
        print("[sweep] warning: a sqlite study is reachable only from this machine; workers elsewhere need "
              "a shared storage (a PostgreSQL URL)")
    relative = os.path.relpath(parameters["experiment"])  # the worker runs in its own checkout of the repo
    parameters = {**parameters, "experiment": parameters["experiment"] if relative.startswith("..") else relative}
    run = run_deployment(plan.sweep.deployment, parameters=parameters, timeout=None)
    if run.state is None or not run.state.is_completed():
        raise RuntimeError(f"deployment run {run.name} ({run.id}) of {plan.sweep.deployment} ended "
                           f"{run.state.name if run.state else 'without a state'}")


def main(argv: list[str] | None = None) -> None:
    """``python -m flows.sweep worker SWEEP.yaml [--parent-run-id ID] [--set k=v ...]``: one worker process."""
    parser = argparse.ArgumentParser(prog="python -m flows.sweep", description=main.__doc__)
    parser.add_argument("command", choices=["worker"])
    parser.add_argument("sweep_file")
    parser.add_argument("--parent-run-id", default=None)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args(argv)
    plan = plan_sweep(args.sweep_file, args.overrides)
    run_worker(plan, storage_url(plan.sweep), args.parent_run_id)


if __name__ == "__main__":
    main()
