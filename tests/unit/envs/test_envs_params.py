"""Env parameters are checked when the env is built: a bad one is a ValueError naming it, never a
ZeroDivisionError at the first search, a reset that never returns, or a value silently replaced.

Each constructor's signature is its schema (envs/base.py ``checked_params``); config loading builds every env
once, so the same checks refuse a bad experiment file before anything is written (tests/unit/test_config_corpus.py).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from ragen_core.envs import countdown as countdown_mod
from ragen_core.envs import list_envs, make
from ragen_core.envs.countdown import CountdownEnv, generate_problem
from ragen_core.envs.webshop.env import WebShopEnv

BAD = [
    # the cases the checks were written for
    ("WebShop", {"results_per_page": 0}, "results_per_page"),  # was ZeroDivisionError at the first search
    ("WebShop", {"num_products": 0}, "num_products"),  # was silently 1200
    ("Countdown", {"min_numbers": 50, "max_numbers": 60}, "min_numbers"),  # reset never returned
    ("Countdown", {"min_numbers": 5}, "min_numbers"),  # above max_numbers (4)
    ("Sokoban", {"height": -5}, "height"),
    # types are exact: a YAML true is no count, "3" no number
    ("Sokoban", {"width": True}, "width"),
    ("Sokoban", {"n_boxes": "2"}, "n_boxes"),
    ("FrozenLake", {"slippery": 1}, "slippery"),
    # floats are finite
    ("Bandit", {"high_risk_reward": math.inf}, "high_risk_reward"),
    ("Bandit", {"high_risk_prob": math.nan}, "high_risk_prob"),
    ("Sokoban", {"step_reward": -math.inf}, "step_reward"),
    # sizes that would not finish a reset
    ("FrozenLake", {"size": 10_000}, "size"),
    ("Sokoban", {"height": 1000, "width": 1000}, "height"),
    ("Sokoban", {"n_boxes": 4, "height": 4, "width": 4}, "n_boxes"),  # 2x2 inside: no room for 4 boxes
    ("Sokoban", {"generator": "uniform", "min_moves": 20}, "min_moves"),  # above the uniform default max 10
    ("WebShop", {"num_products": 10**9}, "num_products"),
    ("Countdown", {"max_number": 10**7}, "max_number"),
    # the rest
    ("Bandit", {"low_risk_name": ""}, "low_risk_name"),
    ("Bandit", {"max_steps": 0}, "max_steps"),
    ("WebShop", {"goal_split": [3, 1]}, "goal_split"),
    ("WebShop", {"goal_split": [-1, 4]}, "goal_split"),
    ("WebShop", {"products_path": "/no/such/items.json"}, "products_path"),
    ("Sokoban", {"generator": "magic"}, "generator"),
]


@pytest.mark.timeout(20)
@pytest.mark.parametrize(("name", "params", "key"), BAD, ids=[f"{n}-{k}" for n, _, k in BAD])
def test_a_bad_parameter_is_refused_at_construction_naming_it(name: str, params: dict, key: str) -> None:
    with pytest.raises(ValueError, match=key):
        make(name, **params)


@pytest.mark.parametrize("name", list_envs())
def test_an_unknown_parameter_is_refused_naming_it(name: str) -> None:
    with pytest.raises(ValueError, match="no_such_knob"):
        make(name, no_such_knob=1)


def test_the_classes_check_their_parameters_when_built_directly() -> None:
    with pytest.raises(ValueError, match="results_per_page"):
        WebShopEnv(results_per_page=0)
    with pytest.raises(ValueError, match="min_numbers"):
        CountdownEnv(min_numbers=50)


def test_good_parameters_still_build_and_play() -> None:
    shop = make("WebShop", results_per_page=3, num_products=50, goal_split=None)
    obs, _ = shop.reset(seed=0)
    obs, *_ = shop.step("search[shoes]")
    items = [a for a in shop.action_names if a not in ("click[back to search]", "click[next >]", "click[< prev]")]
    assert "(page 1 of " in obs and len(items) == 3
    lake = make("FrozenLake", size=3, p_frozen=1.0, symbols=["a", "b", "c", "d", "e", "f"], max_steps=None)
    assert lake.reset(seed=1)[0]
    box = make("Sokoban", generator="uniform", min_moves=3, max_moves=4, step_reward=-1)  # an int for a float is fine
    assert box.reset(seed=2)[1]["min_moves"] in (3, 4)


@pytest.mark.timeout(20)
def test_generating_a_countdown_problem_gives_up_instead_of_looping(monkeypatch) -> None:
    monkeypatch.setattr(countdown_mod, "MAX_DRAWS", 200)
    with pytest.raises(RuntimeError, match="max_target"):  # a target of 1 from numbers up to a million: ~never
        generate_problem(np.random.default_rng(0), 3, 4, max_number=10**6, max_target=1)
