"""Run-level rules of ragen_core.session that no flow test would notice going wrong."""

from __future__ import annotations

import pytest

from ragen_core.config import ConfigError, EvalConfig, ExperimentConfig
from ragen_core.rollout.evaluate import heldout_seeds
from ragen_core.session import TRAIN_SEED_OFFSET, train_seeds


def test_training_seeds_never_meet_heldout_seeds() -> None:
    # 200 iterations x P=8 x Online-k 10: far more than any run uses
    used = set(train_seeds(0, 200 * 8 * 10))
    assert used.isdisjoint(heldout_seeds(256, 123))
    assert min(used) == TRAIN_SEED_OFFSET
    # consecutive iterations continue where the last stopped, without overlap
    assert train_seeds(0, 8)[-1] + 1 == train_seeds(8, 8)[0]


def test_heldout_range_reaching_training_seeds_is_refused() -> None:
    with pytest.raises(ConfigError, match="eval.seed_start"):
        ExperimentConfig(eval=EvalConfig(seed_start=TRAIN_SEED_OFFSET - 10, seeds=256))
