"""The Prefect tasks of a sweep (flows/sweep.py): worker processes, the results table, the study report.

They are tasks for visibility: each shows in the UI with its timing, and each is one call. Trials themselves are
train flows, not tasks; the trials' life is ragen_core/sweeps/trials.py, what is published ragen_core/sweeps/report.py.
``NO_CACHE``: each depends on a live study.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable

from optuna import Study
from prefect import task
from prefect.cache_policies import NO_CACHE

from ragen_core.sweeps import SweepPlan
from ragen_core.sweeps.report import results_report, study_report
from ragen_core.sweeps.trials import stop_workers, wait_workers
from ragen_core.tracking import MetricLogger
from ragen_core.tracking.run_history import RunHistory


@task(name="workers", cache_policy=NO_CACHE)
def spawn_workers(cmd: list[str], env: dict[str, str], n: int, study: Study,
                  on_alive: Callable[[int], None] | None = None) -> list[int]:
    """Start ``n`` worker processes (``cmd``) on the study's storage and wait for all (:func:`wait_workers`: a hung
    one is killed, ``on_alive`` hears how many still run when some ended); returns their exit codes. Stopped while
    waiting (SIGTERM, Ctrl-C), it stops them and waits for them (:func:`stop_workers`)."""
    procs = [subprocess.Popen(cmd, env=env) for _ in range(n)]
    try:
        return wait_workers(procs, study, on_alive=on_alive)
    except BaseException:
        stop_workers(procs)
        raise


@task(name="study-report", cache_policy=NO_CACHE)
def publish_study(plan: SweepPlan, runs: list[RunHistory], parent: MetricLogger) -> str:
    return study_report(plan, runs, parent)


@task(name="results", cache_policy=NO_CACHE)
def publish_results(plan: SweepPlan, study: Study, parent: MetricLogger, url: str) -> str:
    return results_report(plan, study, parent, url)
