"""The steps of ``ragen compare`` (flows/compare.py) as Prefect tasks: read runs from MLflow, log the comparison.

Each calls one ``ragen_core.tracking.history`` function. ``NO_CACHE``: a comparison reads a live
tracking store, which the inputs do not describe. No retries: logging twice would make two records.
"""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from ragen_core.tracking import history


@task(name="fetch-runs", cache_policy=NO_CACHE)
def fetch_runs(uri: str, refs: list[str], extra: tuple[str, ...] = (),
               prefixes: tuple[str, ...] = ()) -> list[history.FetchedRun]:
    return history.fetch_runs(uri, refs, extra, prefixes)


@task(name="log-comparison", cache_policy=NO_CACHE)
def log_comparison(uri: str, experiment_id: str, run_name: str, tags: dict[str, str], files: list[Path]) -> str:
    return history.log_compare_run(uri, experiment_id, run_name, tags, files, artifact_path="compare")
