"""The steps of ``ragen eval`` (flows/evaluate.py) as Prefect tasks; ``ragen compare``'s are in compare_steps.py.

Each calls one ``ragen_core`` function. ``NO_CACHE``: an evaluation depends on weights on disk, which
the inputs do not describe. No retries: a failed evaluation is minutes of rollouts, and logging twice
would duplicate metric points.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from ragen_core import evaluation
from ragen_core.config import EnvConfig, ExperimentConfig
from ragen_core.tracking import history

log = logging.getLogger("ragen")


@task(name="evaluate-weights", cache_policy=NO_CACHE)
def evaluate_weights(cfg: ExperimentConfig, target: evaluation.EvalTarget, envs: tuple[EnvConfig, ...],
                     seeds: int | None, progress: Callable[[int, int], None] | None = None) -> evaluation.EvalReport:
    return evaluation.evaluate_target(cfg, target, envs, seeds, progress)


@task(name="log-evaluation", cache_policy=NO_CACHE)
def log_evaluation(uri: str | None, run_id: str | None, report: evaluation.EvalReport, files: list[Path],
                   step: int) -> str:
    """Metrics and files onto the run's own MLflow run; returns one line saying where they went."""
    if uri is None or run_id is None:
        return "not logged to MLflow: this run has no MLflow run (tracking.backend none, or never created)"
    try:
        history.log_onto_run(uri, run_id, report.metrics, step, files, artifact_path="eval")
    except Exception as e:  # noqa: BLE001 -- the results are on disk already; say so instead of failing
        log.warning("could not log the evaluation to MLflow run %s at %s: %s", run_id, uri, e)
        return f"not logged to MLflow ({type(e).__name__}: {e}); the results are in {files[0].parent}"
    return f"logged to MLflow run {run_id} at {uri} (metrics val/final/..., artifacts eval/)"
