"""The life of a sweep's trials: rounds of trials, a worker's loop, one trial (ask, train, tell), the study's
parent MLflow run and what is read back from the trials' runs.

    from ragen_core.sweeps.trials import open_parent_run, run_trials
    parent = open_parent_run(plan, study, url, flow_run_id)
    run_trials(plan, study, url, parent.run_id, workers, run_trial=..., spawn=...)

How a trial trains and how worker processes start are the caller's (flows/sweep.py: a Prefect sub-flow or a
deployment run, and ``ragen sweep-worker`` processes), passed in as ``run_trial`` and ``spawn``; everything
else a trial's life needs (Optuna's ask and tell, retries of interrupted trials, duplicates, pruning, the
nested MLflow runs) is here. Optuna is imported in the functions that need it (as in study.py).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ragen_core.config import ConfigError, load_experiment
from ragen_core.memory import release_free_memory
from ragen_core.store.run_dir import RunDir
from ragen_core.sweeps.aggregate import STUDY_PREFIXES, study_metrics
from ragen_core.sweeps.carry import carry_writer
from ragen_core.sweeps.objective import objective_value
from ragen_core.sweeps.shards import with_shard_metrics
from ragen_core.sweeps.space import SweepPlan, suggest_params, trial_experiment
from ragen_core.sweeps.study import (
    CRASHED_ATTR,
    PEAK_RSS_ATTR,
    RESULT_ATTRS,
    DuplicateTrial,
    duplicate_of,
    fail_stale,
    finished_count,
    open_study,
    redact,
    remaining_trials,
    requeue_interrupted,
    requeue_lost,
    settle,
    stop_when_done,
    trial_record,
    trial_spec,
    worker_name,
)
from ragen_core.tracking import MetricLogger, MLflowLogger, NullLogger, flatten_config
from ragen_core.tracking.factory import tracking_uri
from ragen_core.tracking.history import fail_running_runs, fetch_runs
from ragen_core.tracking.outbox import OutboxMismatch
from ragen_core.tracking.run_history import RunHistory
from ragen_core.tracking.run_meta import experiment_name

if TYPE_CHECKING:
    import optuna  # lazily: see study.py's note

PARENT_ATTR = "mlflow_parent_run_id"
"""Study user attribute holding the parent run's id, so every worker and a resumed sweep nest under it."""

STALLED_ATTR = "stalled"
"""Study user attribute: why the pool stopped taking trials (a worker wrote it; the sweep stops on it)."""

STOP_GRACE_S = 120.0
"""How long worker processes sent SIGTERM get to end their trials before they are killed: a trial's run closes its
MLflow run KILLED and marks the trial interrupted, which took a FrozenLake worker more than 5 s."""

TrialRunner = Callable[[dict[str, Any]], Any]
"""Runs one trial from its parameters (:func:`trial_parameters`); returns the run's result (with
``mlflow_run_id``) or None when it ran elsewhere."""


class NoWorker(RuntimeError):
    """No worker of the pool took a trial up within the sweep's ``pickup_timeout_s``."""


def trial_parameters(plan: SweepPlan, experiment: str, overrides: list[str], parent_run_id: str | None,
                     number: int, url: str, resume: str | None = None) -> dict[str, Any]:
    """The parameters of the trial flow (flows/train.py ``train_trial``): plain JSON, no secret (the storage URL
    travels without its password; the worker adds it, study.trial_storage). ``resume``: the run this trial
    continues (:func:`resumable_run`)."""
    return {"experiment": experiment, "overrides": overrides, "parent_run_id": parent_run_id,
            "run_name": f"{plan.sweep.name}-t{number:03d}-{time.strftime('%Y%m%d-%H%M%S')}",
            "tags": {"study": plan.sweep.name, "trial": str(number)}, "trial": trial_spec(plan.sweep, url, number),
            **({"resume": resume} if resume else {})}


def resumable_run(run_dir: str | None) -> str | None:
    """The name of an interrupted trial's run when it can be continued here (its folder, with a whole config, is
    under this machine's runs root), else None: the retry then starts a new run."""
    if not run_dir:
        return None
    try:
        folder = RunDir.resumable(Path(run_dir).name)
    except ConfigError:
        return None
    return None if folder.config_problem() else folder.name


def run_memory(plan: SweepPlan, url: str, default_bytes: int) -> tuple[int, str]:
    """Memory one run of the study needs, in bytes, and where the figure comes from: the larger of the sweep's
    ``run_memory_gib`` and the largest peak its runs measured so far (a resumed study), else ``default_bytes``. A
    measured peak above the setting wins: the setting was then too low, and two runs that do not fit thrash a
    machine without swap until neither makes progress."""
    import optuna  # lazily: see the note at the top

    try:
        trials = optuna.load_study(study_name=plan.sweep.name, storage=url).get_trials(deepcopy=False)
    except KeyError:  # a new study
        trials = []
    measured = max((int(t.user_attrs.get(PEAK_RSS_ATTR) or 0) for t in trials), default=0)
    stated = int(plan.sweep.run_memory_gib * 2**30) if plan.sweep.run_memory_gib is not None else 0
    if measured > stated:
        return measured, "the largest peak its runs measured" + (
            f", above its run_memory_gib {plan.sweep.run_memory_gib:g}" if stated else "")
    if stated:
        return stated, "run_memory_gib"
    return default_bytes, "the default"


def wait_workers(procs: Sequence[subprocess.Popen[bytes]], study: optuna.Study, poll_s: float = 10.0,
                 say: Callable[[str], None] = print, on_alive: Callable[[int], None] | None = None) -> list[int]:
    """Wait for the worker processes; their exit codes. Meanwhile trials whose heartbeat stopped go FAIL (and get
    their retry), and a worker still alive after the trial it ran went FAIL that way is killed: a hung process (a
    deadlock, a stuck collective) stops beating with its trial but never exits, and the round would wait for it
    forever. A trial that failed by raising has no retry, and its worker goes on to the next one. ``on_alive``: called
    with the number of workers still running each time some have ended and some are left (the study then shares
    the cores among fewer: ragen_core/cpu_share.py)."""
    host, since = socket.gethostname(), datetime.datetime.now() - datetime.timedelta(seconds=5)
    running = len(procs)
    while any(p.poll() is None for p in procs):
        alive = sum(p.poll() is None for p in procs)
        if on_alive is not None and 0 < alive < running:
            on_alive(alive)
        running = alive
        fail_stale(study)
        trials = study.get_trials(deepcopy=False)
        retried = {t.system_attrs["failed_trial"] for t in trials if "failed_trial" in t.system_attrs}
        # trials these processes started (a pid of an earlier session's worker may have come back)
        lost = {t.user_attrs.get("worker"): t.number for t in trials
                if t.state.name == "FAIL" and t.number in retried and not t.user_attrs.get("interrupted")
                and t.datetime_start is not None and t.datetime_start >= since}
        for p in procs:
            number = lost.get(f"{host}:{p.pid}")
            if number is not None and p.poll() is None:
                say(f"[sweep] worker {p.pid} is alive but trial {number} it ran stopped beating: killing it "
                    "(its retry continues the run from its last checkpoint)")
                p.kill()
                p.wait()
        time.sleep(poll_s)
    return [int(p.returncode) for p in procs]


def stop_workers(procs: Sequence[subprocess.Popen[bytes]], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM the worker processes still running and wait for them, SIGKILL those alive ``grace_s`` later. A worker
    sent SIGTERM ends its trial interrupted (the trial's run closed KILLED), so a resumed study continues that run."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def run_trials(plan: SweepPlan, study: optuna.Study, url: str, parent_run_id: str | None, workers: int,
               run_trial: TrialRunner, spawn: Callable[[int], Any]) -> None:
    """Rounds of trials until none is left to start: each round queues interrupted trials again (and lost ones
    whose retry was never written), runs what is left (here, or in ``spawn``-ed worker processes), then waits
    for running trials (a lost worker's go FAIL and are queued again). Ends early when a round finishes no
    trial, so a stuck study stops; raises :class:`NoWorker` when the pool took no trial up."""
    finished = None
    study.set_user_attr(STALLED_ATTR, None)
    while True:
        requeue_interrupted(study)
        requeue_lost(study, plan.sweep.retries)
        todo = remaining_trials(study, plan.target, plan.grid)
        if not todo and finished is not None:
            return
        if todo and workers > 1:
            spawn(min(workers, todo))
        elif todo:
            run_worker(plan, url, parent_run_id, run_trial)
        stalled = study.user_attrs.get(STALLED_ATTR)  # a fresh read: workers write it from their processes
        if stalled:
            raise NoWorker(stalled)
        settle(study)
        now = finished_count(study)
        if now == finished:
            print(f"[sweep] no trial finished in the last round; {todo} left undone")
            return
        finished = now


def run_worker(plan: SweepPlan, url: str, parent_run_id: str | None, run_trial: TrialRunner) -> None:
    """Run trials on the shared study until nothing is left to start (one worker's loop)."""
    study = open_study(plan.sweep, plan.grid, url)
    if remaining_trials(study, plan.target, plan.grid) == 0:
        return
    # catch: a crashing trial ends FAIL and the worker goes on with the next one. After each trial (and Optuna's
    # garbage collection) the freed heap goes back to the system: a worker that had run one FrozenLake run held
    # 14.6 GiB resident before its next run, 3.7 GiB of it live (ragen_core/memory.py)
    study.optimize(lambda trial: objective(trial, plan, url, parent_run_id, run_trial), catch=(Exception,),
                   callbacks=[carry_writer(plan), stop_when_done(plan.target, plan.grid),
                              _release_after_trial], gc_after_trial=True)


def _release_after_trial(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
    release_free_memory()


def objective(trial: optuna.Trial, plan: SweepPlan, url: str, parent_run_id: str | None,
              run_trial: TrialRunner) -> float | tuple[float, float]:
    """One trial: the train flow on the base experiment plus this trial's overrides. A trial that raises is
    marked ``crashed`` (its grid point is not run again), unless it was interrupted or skipped."""
    import optuna  # lazily: see study.py's note

    try:
        return _objective(trial, plan, url, parent_run_id, run_trial)
    except (optuna.TrialPruned, DuplicateTrial, NoWorker):
        raise
    except Exception as e:
        trial.set_user_attr(CRASHED_ATTR, f"{type(e).__name__}: {e}"[:500])
        raise


def _objective(trial: optuna.Trial, plan: SweepPlan, url: str, parent_run_id: str | None,
               run_trial: TrialRunner) -> float | tuple[float, float]:
    import optuna  # lazily: see study.py's note

    resume = resumable_run(trial_record(trial.study, trial.number).user_attrs.get("run_dir"))
    experiment, overrides = trial_experiment(plan.sweep, _start_trial(trial, plan, keep_curve=bool(resume)),
                                             plan.bases)
    trial.set_user_attr("overrides", overrides)
    try:
        result = run_trial(trial_parameters(plan, experiment, overrides, parent_run_id, trial.number, url, resume))
    except NoWorker as e:  # the pool is not there: run it again on resume, and stop this sweep
        trial.set_user_attr("interrupted", type(e).__name__)
        trial.study.set_user_attr(STALLED_ATTR, str(e))
        trial.study.stop()
        raise
    except BaseException as e:
        if not isinstance(e, Exception):  # Ctrl-C or a termination signal: run it again on resume
            trial.set_user_attr("interrupted", type(e).__name__)
            if not isinstance(e, KeyboardInterrupt):  # Optuna ends a trial FAIL on Exception and Ctrl-C only:
                trial.study.tell(trial, state=optuna.trial.TrialState.FAIL)  # else it stays RUNNING until stale
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


def _start_trial(trial: optuna.Trial, plan: SweepPlan, keep_curve: bool = False) -> dict[str, Any]:
    """The trial's parameters. A retry starts clean, or, when it continues the lost trial's run
    (``keep_curve``), with that run's folder and the curve it reported so far; a trial whose grid point another
    trial has run or is running is skipped (DuplicateTrial)."""
    if "failed_trial" in trial_record(trial.study, trial.number).system_attrs:
        kept = ("curve", "run_dir", "mlflow_run_id", PEAK_RSS_ATTR) if keep_curve else ()
        for key in RESULT_ATTRS:  # a retry inherits the lost trial's attributes
            if key not in kept:
                trial.set_user_attr(key, None)
    params = suggest_params(trial, plan)
    trial.set_user_attr("worker", worker_name())  # every trial a worker took, a skipped duplicate too
    other = duplicate_of(trial.study, trial.number)
    if other is not None:
        trial.set_user_attr("skipped", f"same grid point as trial {other}")
        raise DuplicateTrial(f"trial {trial.number} skipped: trial {other} runs the same grid point {params}")
    return params


def check_pool_launch(plan: SweepPlan, probe_s: float = 10.0) -> None:
    """ConfigError, before anything starts, unless a sweep whose trials run on a work pool has what the workers
    need: a tracking server they can reach (not a local file; it must answer) and a data folder named by
    ``RAGEN_DATA_DIR`` (the workers' runs, checkpoints and shards; shared, so any machine can resume a run)."""
    if plan.sweep.dispatch != "deployment":
        return
    if not os.environ.get("RAGEN_DATA_DIR", "").strip():
        raise ConfigError("dispatch: deployment: RAGEN_DATA_DIR is not set: export it as the data folder every "
                          "worker shares (runs, checkpoints, trajectory shards) before launching (and before "
                          "`prefect deploy`, which stores it in the deployments)")
    base = load_experiment(plan.sweep.base, plan.sweep.overrides)
    if base.tracking.backend != "none":
        uri = tracking_uri(base)
        if not uri.startswith(("http://", "https://")):
            raise ConfigError(f"dispatch: deployment runs the trials on other machines, which cannot reach the "
                              f"tracking store {uri}: export MLFLOW_TRACKING_URI=http://<host>:<port> (the "
                              "MLflow server the workers report to) before launching")
        try:
            with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=probe_s):
                pass
        except (urllib.error.URLError, OSError) as e:
            raise ConfigError(f"dispatch: deployment: the MLflow server {uri} (MLFLOW_TRACKING_URI) does not answer "
                              f"({getattr(e, 'reason', e)}); start it, or point MLFLOW_TRACKING_URI at one the "
                              "workers reach") from None


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
    if lost and base.tracking.backend != "none":
        fail_running_runs(tracking_uri(base), lost)


def trial_histories(plan: SweepPlan, trials: list[optuna.trial.FrozenTrial]) -> list[RunHistory]:
    """The MLflow histories of the trials that trained (a study's curves and the monitor's signals), each
    run's tags completed with its trial's parameters (so ``group_by`` may name a parameter or a tag)."""
    base = load_experiment(plan.sweep.base, plan.sweep.overrides)
    ran = [t for t in sorted(trials, key=lambda t: t.number)
           if t.state.name in ("COMPLETE", "PRUNED") and t.user_attrs.get("mlflow_run_id")]
    if not ran or base.tracking.backend == "none":
        return []
    fetched = fetch_runs(tracking_uri(base), [t.user_attrs["mlflow_run_id"] for t in ran], study_metrics(),
                         STUDY_PREFIXES)
    return [dataclasses.replace(f.history, tags={**f.history.tags, **{k: str(v) for k, v in t.params.items()}},
                                histories=with_shard_metrics(f.history.histories, t.user_attrs.get("run_dir")))
            for f, t in zip(fetched, ran, strict=True)]
