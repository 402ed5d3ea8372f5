"""The steps of one training iteration as Prefect tasks: ``STEPS``, which flows/train.py hands to the one loop
(``ragen_core.session.run_to_end``).

Each task calls exactly one ``ragen_core.session`` function. Task runs are named after the step and the
iteration (``rollout-it0042``: the iteration the policy has reached), so the Prefect UI reads as a log.
``NO_CACHE``: the inputs are live models, so caching by inputs is neither possible nor wanted. No retries: the steps
are not idempotent (they advance weights and seed counters).
"""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from ragen_core import session
from ragen_core.types import RolloutBatch, Selection, UpdateStats


@task(name="rollout", task_run_name="rollout-it{sess.iteration:04d}", cache_policy=NO_CACHE)
def rollout(sess: session.Session) -> RolloutBatch:
    return session.collect_rollouts(sess)


@task(name="diagnose", task_run_name="diagnose-it{sess.iteration:04d}", cache_policy=NO_CACHE)
def diagnose(sess: session.Session, rollouts: RolloutBatch) -> dict[str, float]:
    return session.diagnose(sess, rollouts)


@task(name="filter", task_run_name="filter-it{sess.iteration:04d}", cache_policy=NO_CACHE)
def filter_groups(sess: session.Session, rollouts: RolloutBatch) -> Selection:
    return session.tokenize_and_filter(sess, rollouts)


@task(name="update", task_run_name="update-it{sess.iteration:04d}", cache_policy=NO_CACHE)
def update(sess: session.Session, selection: Selection) -> UpdateStats:
    return session.update_policy(sess, selection)


@task(name="evaluate", task_run_name="evaluate-it{sess.iteration:04d}", cache_policy=NO_CACHE)
def evaluate(sess: session.Session) -> dict[str, float]:
    return session.evaluate_policy(sess)


@task(name="record", task_run_name="record-it{sess.iteration:04d}", cache_policy=NO_CACHE)
def record(sess: session.Session, rollouts: RolloutBatch, selection: Selection, stats: UpdateStats,
           val: dict[str, float] | None, diagnostics: dict[str, float] | None = None) -> dict[str, float]:
    return session.record_iteration(sess, rollouts, selection, stats, val, diagnostics)


@task(name="checkpoint", task_run_name="checkpoint-it{sess.iteration:04d}", cache_policy=NO_CACHE)
def checkpoint(sess: session.Session) -> Path:
    return session.save_run_checkpoint(sess)


STEPS = session.Steps(evaluate=evaluate, rollout=rollout, diagnose=diagnose, filter=filter_groups, update=update,
                      record=record, checkpoint=checkpoint)
"""The steps as tasks, in the shape ``session.run_to_end`` takes."""
