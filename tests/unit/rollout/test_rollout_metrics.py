"""Rollout diagnostics (metrics.py) and held-out evaluation (evaluate.py): hand-computed golden values.

Run: .venv/bin/python -m pytest tests/unit/rollout/test_rollout_metrics.py -q
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest

from ragen_core.config import EnvConfig, RolloutConfig
from ragen_core.envs import make
from ragen_core.models import load_tokenizer
from ragen_core.rollout.evaluate import evaluate, heldout_seeds
from ragen_core.rollout.metrics import first_turn_metrics, plugin_mi, rollout_metrics
from ragen_core.rollout.scripted import ScriptedGenerator
from ragen_core.types import Trajectory, Turn


def _turn(actions: tuple[str, ...], reward: float, penalty: float, ok: bool, n_resp: int, think: int, eff: int,
          finish: str = "stop") -> Turn:
    return Turn("obs", (1,), (5,) * n_resp, (-1.0,) * n_resp, "r", actions, reward, penalty, ok, finish, think, eff)


def _traj(tag: str, group: int, turns: list[Turn], success: bool, named: list[int], unknown: list[int],
          truncated: bool = False) -> Trajectory:
    return Trajectory(tag, group, group, tuple(turns), success=success, terminated=not truncated, truncated=truncated,
                      meta={"named_actions": named, "unknown_actions": unknown})


TRAJS = [
    _traj("A", 0, [_turn(("Up", "Up"), 1.0, 0.0, True, 4, 2, 2)], True, [2], [0]),
    _traj("A", 0, [_turn((), 0.0, -0.1, False, 6, 0, 0, "length")], False, [0], [0], truncated=True),
    _traj("A", 1, [_turn(("Up",), 0.0, -0.1, False, 2, 1, 0)], False, [2], [1]),
    _traj("A", 1, [_turn(("Up",), 0.0, 0.0, True, 4, 3, 1), _turn(("Down",), 0.0, 0.0, True, 4, 3, 0)], False,
          [1, 1], [0, 0]),
    _traj("B", 0, [_turn(("x",), 0.5, 0.0, True, 8, 0, 1)], True, [1], [0]),
]


def test_rollout_metrics_golden() -> None:
    m = rollout_metrics(TRAJS)
    expected = {
        "env/A/success": 1 / 4, "env/A/return": 1.0 / 4, "env/A/total_return": (1.0 - 0.1 - 0.1 + 0.0) / 4,
        "env/B/success": 1.0, "env/B/return": 0.5, "env/B/total_return": 0.5,
        # groups (A,0) pass, (A,1) fail, (B,0) pass; N = largest group = 2
        "rollout/pass_at_2": 2 / 3,
        # unbiased std of [1, 0] = sqrt(0.5) = 0.70711, of [0, 0] = 0; the singleton group (B,0) is skipped
        "rollout/reward_std_groups_mean": (0.5**0.5 + 0.0) / 2,
        "rollout/return_mean": (1.0 - 0.1 - 0.1 + 0.0 + 0.5) / 5,
        "rollout/success": 2 / 5,
        "rollout/actions_per_episode": (2 + 0 + 1 + 2 + 1) / 5,
        "rollout/turns_per_episode": (1 + 1 + 1 + 2 + 1) / 5,
        # named 2+0+2+2+1 = 7, one unknown -> 6/7; effective 2+0+0+1+0+1 = 4 of 6 executed
        "rollout/valid_action_ratio": 6 / 7, "rollout/effective_action_ratio": 4 / 6,
        "rollout/format_ok_ratio": 4 / 6, "rollout/truncated_ratio": 1 / 5, "rollout/dropped_turns_mean": 0.0,
        "response/length_mean": (4 + 6 + 2 + 4 + 4 + 8) / 6, "response/think_length_mean": (2 + 0 + 1 + 3 + 3 + 0) / 6,
        "response/clip_ratio": 1 / 6,
        # first turns: think 2, 0, 1, 3, 0; every text "r"; first actions Up, (unparsed), (unparsed: the reply
        # named an unknown action), Up, x in groups A0, A0, A1, A1, B0. I = 4 x 1/5 ln(1 x 5 / (2 x 2)) for the
        # four cells of A0, A1 x Up, (unparsed), plus 1/5 ln(1 x 5 / (1 x 1)) for B0 x x
        "rollout/first_empty_think": 2 / 5, "rollout/first_distinct": 1 / 5, "rollout/first_top_share": 1.0,
        "rollout/first_action_mi": 0.8 * math.log(1.25) + 0.2 * math.log(5),
    }
    shuffled = m.pop("rollout/first_action_mi_shuffled")
    assert 0.0 <= shuffled <= math.log(3) and shuffled == rollout_metrics(TRAJS)["rollout/first_action_mi_shuffled"]
    assert m.keys() == expected.keys()
    for key, value in expected.items():
        assert m[key] == pytest.approx(value), key
    assert rollout_metrics([]) == {}


def test_first_turn_metrics_tell_a_board_dependent_first_move_from_a_template() -> None:
    """8 groups of 8, as the FrozenLake study: when each group's members all make their group's own move, the MI is
    log 4 (4 moves, 2 groups each) and the shuffled level far under it; one template move for every board gives 0
    for both; moves drawn regardless of the group leave the MI near its shuffled level."""
    import random

    def batch(move: Callable[[int, int], str], text: Callable[[int, int], str] = lambda g, m: "r") -> list[Trajectory]:
        return [Trajectory("F", g, g, (Turn("obs", (1,), (5,), (-1.0,), text(g, m), (move(g, m),), 0.0, 0.0, True,
                                            "stop", 0 if m < 2 else 3, 1),), success=False, terminated=True,
                           truncated=False) for g in range(8) for m in range(8)]

    moves = ["Up", "Down", "Left", "Right"]
    own = first_turn_metrics(batch(lambda g, m: moves[g % 4]))
    assert own["rollout/first_action_mi"] == pytest.approx(math.log(4))
    assert own["rollout/first_action_mi_shuffled"] < 0.5 * math.log(4)
    assert own["rollout/first_empty_think"] == pytest.approx(2 / 8)  # members 0 and 1 of each group
    template = first_turn_metrics(batch(lambda g, m: "Up", lambda g, m: "<answer>Up</answer>"))
    assert template["rollout/first_action_mi"] == 0.0 and template["rollout/first_action_mi_shuffled"] == 0.0
    assert template["rollout/first_distinct"] == 1 / 64 and template["rollout/first_top_share"] == 1.0
    draw = random.Random(0)
    noise = first_turn_metrics(batch(lambda g, m: draw.choice(moves), lambda g, m: f"{g}-{m}"))
    assert abs(noise["rollout/first_action_mi"] - noise["rollout/first_action_mi_shuffled"]) < 0.15
    assert noise["rollout/first_distinct"] == 1.0
    assert first_turn_metrics([]) == {}
    with pytest.raises(ValueError, match="paired"):
        plugin_mi([1, 2], [1])


def test_evaluate_fixed_seeds_temperature_and_pass_at_n() -> None:
    tok = load_tokenizer("tiny-random")
    gen = ScriptedGenerator(tok, "<think>dragons are risky but rich</think><answer>Dragon</answer>")
    seeds = heldout_seeds(4, 123)
    assert seeds == (123, 124, 125, 126)
    envs = [EnvConfig(name="Bandit"), EnvConfig(name="BanditRev", tag="rev")]
    result = evaluate(envs, gen, tok, RolloutConfig(), seeds, n_per_seed=3)
    assert {c.params.temperature for c in gen.calls} == {0.5}
    assert all(c.params.seed is not None for c in gen.calls)
    # Bandit: Dragon is the high-risk arm with the higher expected value (0.25 > 0.15): always a success
    # BanditRev: Dragon is the safe arm paying 0.15: never a success (success means the higher-EV arm)
    payouts = []  # the 3 samples of a seed share the env's luck (rollout.group_dynamics: shared)
    for seed in seeds:
        for _ in range(3):
            env = make("Bandit")
            env.reset(seed=seed, options={"dynamics_seed": 0})
            payouts.append(env.step("Dragon")[1])
    m = result.metrics
    assert m["val/Bandit/success"] == 1.0 and m["val/Bandit/pass_at_3"] == 1.0
    assert m["val/Bandit/return"] == pytest.approx(sum(payouts) / 12)
    assert m["val/rev/success"] == 0.0 and m["val/rev/pass_at_3"] == 0.0
    assert m["val/rev/return"] == pytest.approx(0.15)
    assert m["val/success"] == pytest.approx(0.5)
    assert len(result.trajectories) == 24 and {t.seed for t in result.trajectories} == set(seeds)
    # deterministic: the same weights evaluated again give the same numbers
    again = evaluate(envs, ScriptedGenerator(tok, gen.script), tok, RolloutConfig(), seeds, n_per_seed=3)
    assert again.metrics == m
    with pytest.raises(ValueError):
        heldout_seeds(0)


def test_package_exports_resolve_to_the_same_objects_in_any_import_order() -> None:
    # `ragen_core.rollout.evaluate` is the submodule (Python binds it on the package on first import),
    # so the package exports the module's other names, never a function called `evaluate`.
    import subprocess
    import sys

    code = ("import ragen_core.rollout as rollout, ragen_core.rollout.evaluate as evaluate_module; "
            "assert rollout.evaluate is evaluate_module and rollout.heldout_seeds is evaluate_module.heldout_seeds "
            "and rollout.EvalResult is evaluate_module.EvalResult; "
            "assert 'evaluate' not in rollout.__all__")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_a_study_fills_in_the_reply_and_state_metrics_from_a_runs_shards(tmp_path, monkeypatch) -> None:
    """Runs from before the first-turn and step-group metrics were logged get them from their Parquet shards
    (sweeps/shards.py with_shard_metrics); a value tracking has wins; a run whose folder is not here keeps what
    tracking has."""
    from dataclasses import replace

    from ragen_core.store.parquet import write_shard
    from ragen_core.sweeps.shards import local_run_dir, with_shard_metrics

    run = tmp_path / "run"
    write_shard(run, 0, TRAJS)
    # iteration 1: group (A, 1) of two trajectories with state keys: turns ['s', 't'] and ['s'] -> s shared (2 of
    # 3 turns); the one later turn, t, alone (0 of 1)
    keyed = [replace(TRAJS[3], turns=(replace(TRAJS[3].turns[0], state_key="s"),
                                      replace(TRAJS[3].turns[1], state_key="t"))),
             replace(TRAJS[2], turns=(replace(TRAJS[2].turns[0], state_key="s"),))]
    write_shard(run, 1, keyed)
    logged = {"rollout/first_empty_think": ((1, 0.9),), "val/success": ((0, 0.5),)}
    got = with_shard_metrics(logged, str(run))
    assert got["rollout/first_empty_think"] == ((0, pytest.approx(2 / 5)), (1, 0.9))
    assert got["rollout/first_action_mi"] == ((0, pytest.approx(0.8 * math.log(1.25) + 0.2 * math.log(5))),
                                              (1, 0.0))  # one group at iteration 1: no dependence to measure
    # iteration 0 has no state keys (an env without them): nothing is filled in there
    assert got["rollout/step_group_share"] == ((1, pytest.approx(2 / 3)),)
    assert got["rollout/step_group_share_later"] == ((1, 0.0),)
    assert got["val/success"] == ((0, 0.5),)
    assert with_shard_metrics(logged, str(tmp_path / "elsewhere")) == logged
    assert with_shard_metrics(logged, None) == logged
    # a run is found by its folder or by its name under $RAGEN_DATA_DIR/runs (ragen compare fills in from it)
    monkeypatch.setenv("RAGEN_DATA_DIR", str(tmp_path / "data"))
    named = tmp_path / "data" / "runs" / "lake-20260101-000000"
    named.mkdir(parents=True)
    (named / "config.yaml").write_text("{}\n")
    assert local_run_dir("lake-20260101-000000") == str(named)
    assert local_run_dir(str(named)) == str(named)
    assert local_run_dir("elsewhere-20260101-000000") is None
