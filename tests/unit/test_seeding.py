"""Every test starts from the same global random streams (tests/conftest.py: ``reseed_global_rngs``), whatever ran
before it in its process."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from tests.conftest import TEST_SEED


def _draws() -> tuple[float, float, list[float]]:
    return random.random(), float(np.random.random()), torch.rand(3).tolist()


def _seeded() -> tuple[float, float, list[float]]:
    return (random.Random(TEST_SEED).random(), float(np.random.RandomState(TEST_SEED).random_sample()),
            torch.rand(3, generator=torch.Generator().manual_seed(TEST_SEED)).tolist())


def test_a_test_body_starts_from_the_seeded_streams() -> None:
    assert _draws() == _seeded()


def test_so_does_the_next_whatever_the_last_one_drew() -> None:
    _draws()  # what the test before this one (in any order) also drew
    torch.randn(1000)
    random.random()
    assert _draws() != _seeded()  # the streams moved on within a test ...


def test_the_streams_are_reseeded_for_every_test() -> None:
    assert _draws() == _seeded()  # ... and start again at the next


@pytest.fixture
def fixture_draws() -> tuple[float, float, list[float]]:
    return _draws()  # at setup, from the seeded streams


def test_a_fixture_and_the_body_both_start_seeded(fixture_draws: tuple[float, float, list[float]]) -> None:
    assert fixture_draws == _seeded()
    assert _draws() == _seeded()  # the fixture's draws do not move the body's start
