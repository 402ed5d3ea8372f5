"""State keys (``env.state_key``, ``info["state_key"]``): equal exactly when two states are equal, whatever path or
episode reached them; GiGPO's step groups rest on them.

Run: .venv/bin/python -m pytest tests/unit/envs/test_state_keys.py -q
"""

from __future__ import annotations

import numpy as np
import pytest

from ragen_core.envs import list_envs, make

ENVS = list_envs()
OBS_IS_STATE = [n for n in ENVS if n != "WebShop"]
"""Envs whose observation and action names show the whole state (a WebShop page shows 10 of its results and not
the goal's attributes), so there equal observations must mean equal keys too."""


def _random_episodes(name: str, seeds: range, rng: np.random.Generator,
                     steps: int = 8) -> list[tuple[str, tuple[str, ...]]]:
    """(state key, (observation, *action names)) after every reset and step of random episodes."""
    env = make(name)
    seen = []
    for seed in seeds:
        obs, info = env.reset(seed=seed)
        assert info["state_key"] == env.state_key
        seen.append((info["state_key"], (obs, *env.action_names)))
        for _ in range(steps):
            obs, _, terminated, truncated, info = env.step(env.sample_action(rng))
            assert info["state_key"] == env.state_key
            seen.append((info["state_key"], (obs, *env.action_names)))
            if terminated or truncated:
                break
    return seen


@pytest.mark.parametrize("name", ENVS)
def test_every_env_reports_a_hashable_key_that_follows_its_state(name: str) -> None:
    seen = _random_episodes(name, range(6), np.random.default_rng(0))
    assert all(isinstance(key, str) and key for key, _ in seen)
    hash(seen[0][0])
    by_key: dict[str, tuple[str, ...]] = {}
    for key, obs in seen:
        assert by_key.setdefault(key, obs) == obs  # equal keys: equal states, so equal observations
    if name in OBS_IS_STATE:
        by_obs: dict[tuple[str, ...], str] = {}
        for key, obs in seen:
            assert by_obs.setdefault(obs, key) == key  # equal (whole-state) observations: equal keys
    assert len({key for key, _ in seen}) > 1


@pytest.mark.parametrize("name", ENVS)
def test_the_same_seed_gives_the_same_key_in_a_fresh_env_and_after_play(name: str) -> None:
    first = make(name).reset(seed=7)[1]["state_key"]
    env = make(name)
    env.reset(seed=3)
    env.step(env.sample_action(np.random.default_rng(1)))
    assert env.reset(seed=7)[1]["state_key"] == first
    assert env.reset(seed=7, options={"dynamics_seed": 5})[1]["state_key"] == first  # luck is not state


def test_an_action_that_changes_nothing_keeps_the_key() -> None:
    for name in ("Sokoban", "FrozenLake", "Countdown", "Bandit"):
        env = make(name)
        _, info = env.reset(seed=0)
        _, _, _, _, after = env.step("no such action")
        assert after["invalid_action"] and after["state_key"] == info["state_key"]


# ---------------------------------------------------------------- per env


def test_sokoban_same_position_by_two_paths_and_per_level() -> None:
    level = "######\n#_P__#\n#_XO_#\n#____#\n######"
    env = make("Sokoban", max_steps=None)
    start = env.reset(seed=0, options={"level": level})[1]["state_key"]
    left = env.step("Left")[4]["state_key"]
    assert left != start
    assert env.step("Right")[4]["state_key"] == start  # back where it began, boxes untouched: the same state
    assert env.step("Up")[4]["state_key"] == start  # into a wall: nothing moved
    pushed = env.step("Down")[4]["state_key"]  # pushes the box down
    assert pushed not in (start, left)
    # player at the same cell, box elsewhere: another state; another level with the same player and box: too
    env.reset(seed=0, options={"level": "######\n#_P__#\n#__XO#\n#____#\n######"})
    assert env.state_key != start
    env.reset(seed=0, options={"level": "######\n#_P__#\n#_XO_#\n#___##\n######"})
    assert env.state_key != start
    # Sokoban and SokobanNewVocab draw one level in other symbols: each env names its own keys
    other = make("SokobanNewVocab", max_steps=None)
    other.reset(seed=0, options={"level": level.translate(str.maketrans("#_OXP", "W.GBA"))})
    assert other.state_key != start and other.state_key.replace("SokobanNewVocab", "Sokoban", 1) == start


def test_frozen_lake_map_and_position() -> None:
    env = make("FrozenLake", slippery=False, max_steps=None)
    lake = ["FFFF", "FSFF", "FFHF", "FFFG"]
    start = env.reset(seed=0, options={"map": lake})[1]["state_key"]
    assert env.step("Left")[4]["state_key"] != start
    assert env.step("Right")[4]["state_key"] == start  # Left then Right: the start again
    down_right = [env.step(a)[4]["state_key"] for a in ("Down", "Right")][-1]
    env.reset(seed=0, options={"map": lake})
    right_down = [env.step(a)[4]["state_key"] for a in ("Right", "Down")][-1]
    assert down_right == right_down  # the hole at (2, 2) reached by two paths
    env.reset(seed=0, options={"map": ["FFFF", "FSFF", "FFFF", "FFHG"]})  # same start, other map
    assert env.state_key != start
    # two seeds with one map share their keys (the seed is not state); layouts of other seeds differ
    keys = {s: make("FrozenLake").reset(seed=s)[1]["state_key"] for s in range(30)}
    maps = {s: make("FrozenLake").reset(seed=s)[0] for s in range(30)}
    assert all((keys[a] == keys[b]) == (maps[a] == maps[b]) for a in keys for b in keys)
    assert len(set(keys.values())) > 1


def test_bandit_arms_payoffs_and_the_pull() -> None:
    keys, orders = {}, {}
    for seed in range(8):
        env = make("Bandit")
        _, info = env.reset(seed=seed)
        keys[seed], orders[seed] = info["state_key"], tuple(info["arms"])
    assert len(set(orders.values())) == 2  # both arm orders occur
    assert all((keys[a] == keys[b]) == (orders[a] == orders[b]) for a in keys for b in keys)
    env = make("Bandit")
    before = env.reset(seed=0)[1]["state_key"]
    after = env.step("Phoenix")[4]["state_key"]
    assert after != before
    rev = make("Bandit", low_risk_reward=0.2)  # another payoff setting: another state
    assert rev.reset(seed=0)[1]["state_key"] != before


def test_countdown_problem_and_answer() -> None:
    env = make("Countdown")
    _, info = env.reset(seed=0)
    start = info["state_key"]
    assert make("Countdown").reset(seed=1)[1]["state_key"] != start
    solved = env.step(env.solution)[4]["state_key"]
    assert solved != start
    answers = [" + ".join(map(str, env.numbers)), " * ".join(map(str, env.numbers))]
    graded = []
    for answer in answers:
        env.reset(seed=0)
        graded.append(env.step(answer)[4]["state_key"])
    assert len({start, solved, *graded}) == 4 - (env.solution in answers)  # each graded answer is its own state


def test_webshop_pages_and_returning_to_a_page() -> None:
    env = make("WebShop", max_steps=None)
    start = env.reset(seed=1)[1]["state_key"]
    assert make("WebShop", max_steps=None).reset(seed=2)[1]["state_key"] != start  # another goal
    results = env.step("search[black]")[4]["state_key"]
    assert results != start
    page2 = env.step("click[next >]")[4]["state_key"]
    assert page2 != results
    assert env.step("click[< prev]")[4]["state_key"] == results
    env.step("click[next >]")
    assert env.step("click[back to search]")[4]["state_key"] == start  # the page number left behind is not state
    assert env.step("search[black]")[4]["state_key"] == results
    item = env.step(env.action_names[-1])[4]["state_key"]
    option = next(a for a in env.action_names if a not in ("click[back to search]", "click[< prev]", "click[buy now]"))
    chosen = env.step(option)[4]["state_key"]
    assert len({results, item, chosen}) == 3
    assert env.step(option)[4]["state_key"] == chosen  # the same option again changes nothing
    assert env.step("click[< prev]")[4]["state_key"] == results
