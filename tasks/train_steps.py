"""The steps of one training iteration as Prefect tasks (flows/train.py chains them).

Each task calls exactly one ``ragen_core.session`` function. ``NO_CACHE``: the inputs are
live models, so caching by inputs is neither possible nor wanted. No retries: the steps
are not idempotent (they advance weights and seed counters).
"""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from ragen_core import session as s
from ragen_core.types import UpdateStats


@task(name="rollout", cache_policy=NO_CACHE)
def rollout(sess: s.Session) -> s.RolloutBatch:
    return s.collect_rollouts(sess)


@task(name="diagnose", cache_policy=NO_CACHE)
def diagnose(sess: s.Session, rollouts: s.RolloutBatch) -> dict[str, float]:
    return s.diagnose(sess, rollouts)


@task(name="filter", cache_policy=NO_CACHE)
def filter_groups(sess: s.Session, rollouts: s.RolloutBatch) -> s.Selection:
    return s.select_groups(sess, rollouts)


@task(name="update", cache_policy=NO_CACHE)
def update(sess: s.Session, selection: s.Selection) -> UpdateStats:
    return s.update_policy(sess, selection)


@task(name="evaluate", cache_policy=NO_CACHE)
def evaluate(sess: s.Session) -> dict[str, float]:
    return s.evaluate_policy(sess)


@task(name="record", cache_policy=NO_CACHE)
def record(sess: s.Session, rollouts: s.RolloutBatch, selection: s.Selection, stats: UpdateStats,
           val: dict[str, float] | None, diagnostics: dict[str, float] | None = None) -> dict[str, float]:
    return s.record_iteration(sess, rollouts, selection, stats, val, diagnostics)


@task(name="checkpoint", cache_policy=NO_CACHE)
def checkpoint(sess: s.Session) -> Path:
    return s.save_run_checkpoint(sess)
