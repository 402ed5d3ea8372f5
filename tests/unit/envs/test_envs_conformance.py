"""Conformance suite run on every registered env: the TextEnv contract of ragen_core/envs/base.py.

Checks: reset/step shapes and types, the info keys, rewards within the declared per-step
range, episodes that end, determinism (same seed and actions give identical observations,
rewards and infos, also in another process with another hash seed), the defined outcome of
unknown/empty actions, and render() == observation.

Run: .venv/bin/python -m pytest tests/unit/envs/test_envs_conformance.py -q
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

from ragen_core.envs import TextEnv, list_envs, make

ENVS = list_envs()
INFO_KEYS = {"success", "action_is_effective", "invalid_action", "action", "steps", "state_key"}
JSON_TYPES = (bool, int, float, str, type(None), list, dict)

# The same code computes a trajectory digest in this process and in a child process.
TRAJECTORY_SRC = r'''
import hashlib, json
import numpy as np
from ragen_core.envs import make

def trajectory_digest(name, seed, action_seed, n_steps=12):
    env = make(name)
    rng = np.random.default_rng(action_seed)
    obs, info = env.reset(seed=seed)
    record = [[obs, info]]
    for _ in range(n_steps):
        action = env.sample_action(rng)
        obs, reward, terminated, truncated, info = env.step(action)
        record.append([action, obs, reward, terminated, truncated, info])
        if terminated or truncated:
            obs, info = env.reset(seed=seed + 1)
            record.append([obs, info])
    blob = json.dumps(record, sort_keys=True, ensure_ascii=True)
    return hashlib.sha256(blob.encode()).hexdigest()
'''


def _digest_fn():
    namespace: dict = {}
    exec(TRAJECTORY_SRC, namespace)  # test-owned source text, run identically in a child process
    return namespace["trajectory_digest"]


def _check_info(env: TextEnv, info: dict) -> None:
    assert INFO_KEYS <= set(info), f"missing {INFO_KEYS - set(info)}"
    assert isinstance(info["success"], bool)
    assert isinstance(info["action_is_effective"], bool)
    assert isinstance(info["invalid_action"], bool)
    assert isinstance(info["steps"], int)
    assert isinstance(info["state_key"], str) and info["state_key"] == env.state_key
    json.dumps(info)  # plain JSON values only
    for v in info.values():
        assert isinstance(v, JSON_TYPES)


def _run_random_episode(env: TextEnv, seed: int, rng: np.random.Generator, limit: int = 200) -> int:
    obs, info = env.reset(seed=seed)
    assert isinstance(obs, str) and isinstance(info, dict)
    assert info["success"] is False
    assert env.render() == obs
    lo, hi = env.reward_range
    for n in range(1, limit + 1):
        result = env.step(env.sample_action(rng))
        assert len(result) == 5
        obs, reward, terminated, truncated, info = result
        assert isinstance(obs, str) and isinstance(reward, float)
        assert isinstance(terminated, bool) and isinstance(truncated, bool)
        assert not (terminated and truncated)
        assert lo - 1e-9 <= reward <= hi + 1e-9, (reward, env.reward_range)
        assert env.render() == obs
        _check_info(env, info)
        assert info["steps"] == n
        if info["success"]:
            assert terminated
        if terminated or truncated:
            return n
    raise AssertionError(f"{env.name}: episode did not end within {limit} random actions")


@pytest.mark.parametrize("name", ENVS)
def test_static_interface(name: str) -> None:
    env = make(name)
    assert env.name == name
    _obs, _ = env.reset(seed=0)
    assert isinstance(env.instruction, str) and env.instruction
    assert isinstance(env.legend, dict)
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in env.legend.items())
    names = env.action_names
    assert isinstance(names, list) and names and all(isinstance(a, str) and a for a in names)
    lo, hi = env.reward_range
    assert lo <= 0.0 <= hi  # the invalid-action reward 0.0 is inside the declared range
    assert isinstance(env.free_form_actions, bool)
    assert env.max_episode_actions is None or env.max_episode_actions >= 1
    assert "<" not in "".join(names) or env.free_form_actions  # placeholders only for free-form envs
    # instruction carries no answer-format text: that is the rollout layer's job
    assert "<answer>" not in env.instruction and "<think>" not in env.instruction


@pytest.mark.parametrize("name", ENVS)
def test_random_episodes_follow_the_contract_and_end(name: str) -> None:
    env = make(name)
    rng = np.random.default_rng(123)
    lengths = [_run_random_episode(env, seed, rng) for seed in range(25)]
    if env.max_steps is not None:
        assert max(lengths) <= env.max_steps


@pytest.mark.parametrize("name", ENVS)
def test_stepping_after_the_end_is_a_defined_noop(name: str) -> None:
    env = make(name)
    rng = np.random.default_rng(5)
    _run_random_episode(env, 3, rng)
    final = env.render()
    obs, reward, terminated, truncated, info = env.step(env.sample_action(rng))
    assert obs == final and reward == 0.0 and (terminated or truncated)
    assert info["episode_over"] is True and info["invalid_action"] is True


@pytest.mark.parametrize("name", ENVS)
@pytest.mark.parametrize("bad", ["", "   ", "xyzzy", "Up Up", "\x00", "🙂🙂", "search[", "click[]", None, 17, ["Up"]])
def test_unknown_or_empty_action_is_a_defined_noop(name: str, bad: object) -> None:
    env = make(name)
    obs0, _ = env.reset(seed=11)
    obs, reward, terminated, truncated, info = env.step(bad)  # type: ignore[arg-type]
    assert obs == obs0 == env.render()
    assert reward == 0.0 and terminated is False
    assert truncated == (env.max_steps == 1)  # the call still counts towards max_steps
    assert info["invalid_action"] is True and info["action_is_effective"] is False and info["action"] is None
    assert info["success"] is False


@pytest.mark.parametrize("name", ENVS)
def test_same_seed_and_actions_give_identical_trajectories(name: str) -> None:
    digest = _digest_fn()
    assert digest(name, 42, 7) == digest(name, 42, 7)
    # and the seed matters: some other seed gives another trajectory
    assert any(digest(name, s, 7) != digest(name, 42, 7) for s in range(43, 48))


def test_determinism_across_processes() -> None:
    digest = _digest_fn()
    here = {name: digest(name, 42, 7) for name in ENVS}
    child = TRAJECTORY_SRC + (
        "\nfrom ragen_core.envs import list_envs\n"
        "print(json.dumps({n: trajectory_digest(n, 42, 7) for n in list_envs()}))\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "2718"}  # a different str-hash order must not matter
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, env=env, timeout=120,
                         check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == here


@pytest.mark.parametrize("name", ENVS)
def test_unseeded_reset_is_reproducible(name: str) -> None:
    # Documented rule: a fresh env's reset() uses seed 0, later unseeded resets seed + 1.
    a, b = make(name), make(name)
    assert a.reset()[0] == b.reset(seed=0)[0]
    assert a.reset()[0] == b.reset(seed=1)[0]
    assert a.episode_seed == 1


@pytest.mark.parametrize("name", ENVS)
def test_step_before_reset_raises(name: str) -> None:
    with pytest.raises(RuntimeError, match="reset"):
        make(name).step("Up")


@pytest.mark.parametrize("name", [n for n in ENVS if not make(n).free_form_actions])
def test_match_action_is_case_insensitive(name: str) -> None:
    env = make(name)
    env.reset(seed=0)
    for a in env.action_names:
        assert env.match_action(f"  {a.upper()} ") == a
        assert env.match_action(a.lower()) == a
    assert env.match_action("no such action") is None


@pytest.mark.parametrize("name", ENVS)
def test_max_steps_truncates(name: str) -> None:
    env = make(name, max_steps=2)
    rng = np.random.default_rng(0)
    for seed in range(10):
        env.reset(seed=seed)
        for n in (1, 2):
            _, _, terminated, truncated, _ = env.step(env.sample_action(rng))
            if terminated:
                break
            # truncated exactly when the budget is used up and the game has not ended
            assert truncated == (n == 2)


def test_dynamics_seed_keeps_layout_and_changes_luck() -> None:
    # Bandit: the arm order comes from the seed; payouts of the high-risk arm from the dynamics stream.
    env = make("Bandit")
    payouts = set()
    for k in range(40):
        _obs, info = env.reset(seed=9, options={"dynamics_seed": k})
        assert info["arms"] == make("Bandit").reset(seed=9)[1]["arms"]
        payouts.add(env.step("Dragon")[1])
    assert payouts == {0.0, 1.0}


@pytest.mark.parametrize("name", ENVS)
def test_gymnasium_env_checker(name: str) -> None:
    # gymnasium's own API checker (reset/step signatures, seeding, spaces). max_steps=None because
    # its random Text actions are invalid here, and a 1-step budget trips its "truncates after
    # 1 step" heuristic for the single-answer envs.
    from gymnasium.utils.env_checker import check_env

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # render_fps / spec notices do not apply to text envs
        check_env(make(name, max_steps=None), skip_render_check=True)
