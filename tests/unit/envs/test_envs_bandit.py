"""Bandit: payouts and success per SPEC §2, arm names of each variant, arm order shuffled per seed,
and payout frequencies over many seeds.

Run: .venv/bin/python -m pytest tests/unit/envs/test_envs_bandit.py -q
"""

from __future__ import annotations

import math

import pytest

from ragen_core.envs import TextEnv, make


def _pull(env: TextEnv, seed: int, arm: str) -> float:
    env.reset(seed=seed)
    return env.step(arm)[1]


@pytest.mark.parametrize(("name", "low", "high"), [
    ("Bandit", "Phoenix", "Dragon"),
    ("BanditRev", "Dragon", "Phoenix"),     # roles swapped: names now conflict with payouts
    ("BanditTest", "Trader", "Librarian"),  # held-out names, roles as in the reference config
])
def test_variants_name_their_arms(name: str, low: str, high: str) -> None:
    env = make(name)
    env.reset(seed=0)
    assert sorted(env.action_names) == sorted([low, high])
    assert env.high_risk_name == high and env.low_risk_name == low
    _, reward, terminated, _, info = env.step(low)
    assert reward == 0.15 and terminated and info["high_risk"] is False
    # Defaults: EV(low) = 0.15 < EV(high) = 0.25 * 1.0 = 0.25, so only the high-risk arm is a success.
    assert info["success"] is False
    env.reset(seed=0)
    _, reward, _, _, info = env.step(high.lower())
    assert reward in (0.0, 1.0) and info["success"] is True and info["high_risk"] is True


def test_success_follows_expected_values_from_parameters() -> None:
    # low arm 0.3 > EV(high) = 0.25: now the low-risk arm is the right choice
    env = make("Bandit", low_risk_reward=0.3)
    env.reset(seed=1)
    assert env.step("Phoenix")[4]["success"] is True
    env.reset(seed=1)
    assert env.step("Dragon")[4]["success"] is False
    # equal EVs (0.25 vs 0.25): both count as the higher-EV arm
    env = make("Bandit", low_risk_reward=0.25)
    for arm in ("Phoenix", "Dragon"):
        env.reset(seed=2)
        assert env.step(arm)[4]["success"] is True


def test_teacher_engineer_pair_and_reward_range() -> None:
    env = make("Bandit", low_risk_name="Teacher", high_risk_name="Engineer")
    env.reset(seed=0)
    assert sorted(env.action_names) == ["Engineer", "Teacher"]
    assert "Teacher" in env.instruction and "Engineer" in env.instruction
    assert env.reward_range == (0.0, 1.0)
    with pytest.raises(ValueError):
        make("Bandit", low_risk_name="Dragon", high_risk_name="dragon")


def test_arm_order_is_shuffled_per_seed() -> None:
    env = make("Bandit")
    firsts = [env.reset(seed=s)[1]["arms"][0] for s in range(400)]
    share = firsts.count("Dragon") / len(firsts)
    # Fair coin over 400 seeds: standard error 0.025; 5 SE tolerance.
    assert abs(share - 0.5) < 5 * 0.025
    # and the observation, action list and instruction all show that order
    obs, info = env.reset(seed=3)
    a, b = info["arms"]
    assert env.action_names == [a, b] and obs.index(a) < obs.index(b)
    assert env.instruction.index(a) < env.instruction.index(b)


def test_payout_frequencies_match_spec() -> None:
    env = make("Bandit")
    n = 4000
    high = [_pull(env, s, "Dragon") for s in range(n)]
    assert set(high) == {0.0, 1.0}
    p = high.count(1.0) / n
    # P(1.0) = 0.25; standard error sqrt(0.25 * 0.75 / 4000) = 0.00685; tolerance 5 SE = 0.034.
    assert abs(p - 0.25) < 5 * math.sqrt(0.25 * 0.75 / n)
    low = {_pull(env, s, "Phoenix") for s in range(200)}
    assert low == {0.15}  # the low-risk arm is a fixed payout


def test_same_seed_same_payout() -> None:
    env = make("Bandit")
    outcomes = []
    for _ in range(2):
        env.reset(seed=77)
        outcomes.append(env.step("Dragon"))
    assert outcomes[0] == outcomes[1]
