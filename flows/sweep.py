"""The sweep flow: an Optuna study whose trials are runs of the train flow (RAGEN §5 ablations).

    ragen sweep sweeps/smoke.yaml                      # one process, trials as sub-flows
    ragen sweep sweeps/table2-responses-per-prompt.yaml --workers 4
    ragen study studies/echo-trap-bandit.yaml          # a sweep with group_by: the study report too
    python -c "from flows.sweep import sweep; print(sweep('sweeps/smoke.yaml'))"
    optuna-dashboard sqlite:///data/optuna.db          # watch the study

One MLflow parent run per study and a nested run per trial (tags study, trial and the Prefect flow-run
id); each trial runs ``flows.train.train_trial`` (no second copy of the training code), reports validation
success per evaluation and may be pruned. ``--workers N`` starts N processes (the hidden command
``ragen sweep-worker``, flows/cli.py) on the same storage, each on a GPU of its own where the machine
offers GPUs (ragen_core/gpus.py), else on its share of the cores (:func:`worker_threads`); ``ragen study``
without ``--workers`` picks the number (:func:`study_workers`). With ``dispatch: deployment`` each trial is a run of the
``ragen-train-trial`` deployment on the work pool instead, and this flow holds no GPU: it waits for the
pool's workers, and stops with a line saying so when none takes a trial up within the sweep's
``pickup_timeout_s``. The trials' life (ask, train, tell) is ragen_core/sweeps/trials.py; this module
supplies how a trial runs and how worker processes start. Interrupted? Run the same command again: the
study resumes. At the end the results table (CSV, Markdown, PNG) and the best params go on the parent run.
Tests: tests/flows/test_sweep_flow.py, test_sweep_workers.py, test_study_flow.py.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import prefect.deployments
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.runtime import flow_run
from prefect.settings import get_current_settings

from flows._ui import publish_markdown
from ragen_core import cpu_share, gpus
from ragen_core.config import ConfigError
from ragen_core.sweeps import SweepPlan, dashboard_command, open_study, plan_sweep, redact, storage_url
from ragen_core.sweeps.carry import carry_in, carry_out
from ragen_core.sweeps.trials import (
    NoWorker,
    check_pool_launch,
    close_lost_runs,
    open_parent_run,
    run_memory,
    run_trials,
    run_worker,
    trial_histories,
)
from tasks import sweep_steps as steps

if TYPE_CHECKING:
    import optuna


@flow(name="ragen-sweep")
def sweep(sweep_file: str, workers: int = 1, overrides: list[str] | None = None) -> str:
    """Run (or resume) the study of ``sweep_file``; returns a summary with the results table."""
    overrides = list(overrides or [])
    plan = plan_sweep(sweep_file, overrides)
    check_pool_launch(plan)  # a pool sweep without a reachable tracking server or a shared data folder: refused
    workers = local_workers(plan, workers)
    url = storage_url(plan.sweep)
    study = open_study(plan.sweep, plan.grid, url)
    parent = open_parent_run(plan, study, url, flow_run.id)
    carry_in(plan, study, parent.run_id)  # finished trials carried from another machine (sweep's carry file)
    print(f"[sweep] study {plan.sweep.name} in {redact(url)}: {plan.target} trials; watch it with "
          f"{dashboard_command(url)}")
    status = "FAILED"
    try:
        run_trials(plan, study, url, parent.run_id, workers, run_trial=lambda params: run_trial(plan, params),
                   spawn=spawner(plan, overrides, parent.run_id, study))
        close_lost_runs(plan, study.get_trials(deepcopy=False))
        carry_out(plan, study)
        summary = steps.publish_results(plan, study, parent, url)
        if plan.sweep.group_by:
            summary += "\n\n" + steps.publish_study(plan, trial_histories(plan, study.get_trials(deepcopy=False)),
                                                    parent)
        status = "FINISHED"
    finally:
        parent.close(status)
    publish_markdown(f"sweep-{plan.sweep.name}", summary, f"results of the study {plan.sweep.name}")
    return summary


STUDY_RUN_BYTES = 6 * 2**30
"""Memory a CPU run of a study is given when sizing how many run at a time, where the study neither sets
``run_memory_gib`` nor has runs that measured their peak: a run of the default model (the Bandit study's vanilla,
a 32-row PPO mini-batch in one forward/backward, experiments/demo.yaml) peaked at 5.0-5.6 GiB resident (a
benchmark's 5 iterations; a study's worker). Multi-turn runs take more (studies/echo-trap-frozenlake.yaml: 7.6 and
10.9 GiB), which those studies set."""


def study_workers(plan: SweepPlan, say: Callable[[str], None] = print) -> int:
    """Runs at a time for ``ragen study`` without ``--workers``: two on a machine that offers no GPU, has two cores
    or more and memory for two runs (:func:`~ragen_core.sweeps.trials.run_memory`: ``run_memory_gib``, the largest
    peak the study's runs measured, else :data:`STUDY_RUN_BYTES`), each worker on half the cores
    (:func:`worker_threads`; a round with one trial left gives its one worker all of them, :func:`spawner`); else
    one. Two runs of one thread each make more iterations than one run of two threads (vanilla StarPO on
    studies/echo-trap-bandit.yaml on two cores: an iteration each every 37.6 s against one every 26.4 s, 1.40x the
    throughput): small matmuls and the decode loop's Python leave one process short of both cores."""
    import psutil  # lazily: only this decision needs it

    if plan.sweep.dispatch != "local" or gpus.offered() or cpu_share.cores() < 2:
        return 1
    need, source = run_memory(plan, storage_url(plan.sweep), STUDY_RUN_BYTES)
    available = psutil.virtual_memory().available
    workers = 2 if available >= 2 * need else 1
    say(f"[sweep] {workers} run(s) at a time: {available / 2**30:.1f} GiB available, a run needs "
        f"{need / 2**30:.1f} GiB ({source}); --workers N to choose")
    return workers


def worker_threads(plan: SweepPlan, workers: int) -> int | None:
    """torch CPU threads per local worker process: the cores shared out among ``workers`` on a machine that offers
    no GPU; None (torch's default) with one worker, GPUs or a pool."""
    if workers < 2 or plan.sweep.dispatch != "local" or gpus.offered():
        return None
    return max(1, cpu_share.cores() // workers)


def spawner(plan: SweepPlan, overrides: list[str], parent_run_id: str, study: optuna.Study
            ) -> Callable[[int], list[int]]:
    """What starts a round's ``n`` worker processes, the cores shared out among those ``n``: a round with one
    trial left (a study's last run, a resumed study's one unfinished run) starts one worker on all the cores. When
    a worker of a round ends (nothing left for it to start, or it failed) while others still run trials, those
    take up its cores from their next iteration (ragen_core/cpu_share.py); where the user set ``OMP_NUM_THREADS``, that
    count stays."""

    def spawn(n: int) -> list[int]:
        threads = worker_threads(plan, n)
        own = "OMP_NUM_THREADS" in os.environ  # the user's count, which worker_env keeps
        env = worker_env(threads=threads)
        cmd = worker_command(plan, overrides, parent_run_id)
        if threads is None or own:
            return steps.spawn_workers(cmd, env, n, study)
        with tempfile.TemporaryDirectory(prefix="ragen-cpu-share-") as folder:
            share = Path(folder) / "threads"
            cpu_share.publish(share, threads)
            env[cpu_share.SHARE_ENV] = str(share)

            def on_alive(alive: int) -> None:
                more = max(1, cpu_share.cores() // alive)
                print(f"[sweep] a worker ended, {alive} still running: {more} threads each from their next "
                      "iteration")
                cpu_share.publish(share, more)

            return steps.spawn_workers(cmd, env, n, study, on_alive)

    return spawn


def local_workers(plan: SweepPlan, workers: int) -> int:
    """How many worker processes run the trials here: as asked, but no more than this machine's GPUs when it
    offers some (each worker holds one); trials on a pool need none here."""
    offered = gpus.offered() if plan.sweep.dispatch == "local" else []
    if offered and workers > len(offered):
        print(f"[sweep] {workers} workers asked for, this machine offers {len(offered)} GPUs "
              f"({','.join(offered)}): starting {len(offered)}")
        return len(offered)
    return workers


def run_trial(plan: SweepPlan, parameters: dict[str, Any]) -> Any:
    """The trial flow (flows/train.py ``train_trial``) in this process (a sub-flow), or a run of its
    deployment on the work pool."""
    if plan.sweep.dispatch == "deployment":
        return run_on_pool(plan, parameters)
    # imported here: the train flow loads torch, which the sweep's own loop does not need
    from flows.train import train_trial as trial_flow

    return trial_flow(**parameters)


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
    run = prefect.deployments.run_deployment(plan.sweep.deployment, parameters=parameters, timeout=0)
    state = wait_for_run(run, plan.sweep.deployment, plan.sweep.pickup_timeout_s)
    if state is None or not state.is_completed():
        raise RuntimeError(f"deployment run {run.name} ({run.id}) of {plan.sweep.deployment} ended "
                           f"{state.name if state else 'without a state'}")


def wait_for_run(run: Any, deployment: str, pickup_timeout_s: float, poll_s: float = 2.0) -> Any:
    """The final state of a deployment run. While it waits for a worker and no run of the same deployment is
    running anywhere (a busy pool is a queue, not a stall) for ``pickup_timeout_s``, it is cancelled and
    :class:`NoWorker` raised."""
    from prefect.client.schemas.filters import (
        DeploymentFilter,
        DeploymentFilterId,
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.states import Cancelled

    idle_since = time.monotonic()
    with get_client(sync_client=True) as client:
        while True:
            current = client.read_flow_run(run.id)
            state = current.state
            if state is not None and state.is_final():
                return state
            if state is None or state.type in (StateType.SCHEDULED, StateType.PENDING):
                busy = client.read_flow_runs(
                    flow_run_filter=FlowRunFilter(state=FlowRunFilterState(
                        type=FlowRunFilterStateType(any_=[StateType.RUNNING]))),
                    deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[current.deployment_id])),
                    limit=1) if current.deployment_id else []
                if busy:
                    idle_since = time.monotonic()
                elif time.monotonic() - idle_since > pickup_timeout_s:
                    client.set_flow_run_state(run.id, Cancelled(message="no worker took it up"), force=True)
                    raise NoWorker(f"no worker took up {run.name} of {deployment} within {pickup_timeout_s:g} s "
                                   "while none of its runs was running: start a worker on the pool "
                                   "(ragen worker --pool <pool>); the study resumes with the same command")
            else:
                idle_since = time.monotonic()
            time.sleep(poll_s)


@flow(name="ragen-sweep-worker")
def worker(sweep_file: str, overrides: list[str], parent_run_id: str | None) -> None:
    """One worker process of ``--workers N`` (``ragen sweep-worker``): trials until none is left to start, on a
    GPU of its own where the machine offers GPUs. A flow, so that its trials are sub-flows: SIGTERM then reaches
    the trial's Optuna objective, which marks the trial interrupted (continued on resume), before Prefect's
    outermost flow ends the process (as it does for the flow that got the signal)."""
    plan = plan_sweep(sweep_file, overrides)
    held = gpus.hold(1)
    if held:
        print(f"[sweep] worker {os.getpid()} holds GPU {','.join(held)}")
    run_worker(plan, storage_url(plan.sweep), parent_run_id, lambda params: run_trial(plan, params))


def worker_command(plan: SweepPlan, overrides: list[str], parent_run_id: str | None) -> list[str]:
    """The command line of one worker process: the hidden ``sweep-worker`` command of flows/cli.py."""
    cmd = [sys.executable, "-m", "flows.cli", "sweep-worker", plan.path]
    cmd += ["--parent-run-id", parent_run_id] if parent_run_id else []
    for item in overrides:
        cmd += ["--set", item]
    return cmd


def worker_env(threads: int | None = None) -> dict[str, str]:
    """The environment of worker processes: this one, pointed at the same Prefect API, and with ``threads``,
    ``OMP_NUM_THREADS`` (torch's CPU threads) unless this environment sets it.

    In Prefect's ephemeral mode the API is a temporary server inside this process; workers
    that report there show their train runs beside the sweep's (and start no server of their own).
    """
    env = dict(os.environ)
    if threads is not None:
        env.setdefault("OMP_NUM_THREADS", str(threads))
    if not env.get("PREFECT_API_URL"):
        with get_client(sync_client=True) as client:
            env["PREFECT_API_URL"] = str(client.api_url).rstrip("/")
    return env
