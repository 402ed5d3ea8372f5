"""GiGPO (algorithm.estimator: gigpo) from rollout to update: each turn records the key of the state it acted on,
the token batch carries per-turn rewards and state ids, the trainer gives each turn's advantage to that turn's
reply tokens only, and a smoke run trains with finite losses.

Run with ``python -m pytest tests/unit/trainer/test_trainer_gigpo.py -q``.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from conftest import make_cfg

from ragen_core.config import EnvConfig, RolloutConfig, load_experiment
from ragen_core.envs import make
from ragen_core.models import load_tokenizer
from ragen_core.rollout.batch import build_token_batch
from ragen_core.rollout.loop import run_rollouts
from ragen_core.rollout.metrics import step_group_metrics, step_group_share
from ragen_core.rollout.scripted import ScriptedGenerator
from ragen_core.trainer.update import compute_advantages
from ragen_core.types import TokenBatch

SMOKE = Path(__file__).resolve().parents[3] / "experiments" / "smoke.yaml"
LAKE = EnvConfig(name="FrozenLake", params={"slippery": False})


def _answer(action: str) -> str:
    return f"<think>plan</think><answer>{action}</answer>"


@pytest.fixture(scope="module")
def lake_rollouts():
    # replies alternate Left and Right (by turn and row) on ice that does not slip: both members of a group act
    # on its initial state in turn 0, and a move undone by the next one comes back to an earlier state
    tok = load_tokenizer("tiny-random")
    cfg = RolloutConfig(max_turns=3, max_actions_per_turn=1, max_actions_per_episode=3, max_new_tokens=24)
    gen = ScriptedGenerator(tok, lambda call, row, prompt: _answer(["Left", "Right"][(call + row) % 2]))
    return run_rollouts(LAKE, gen, tok, cfg, seeds=[5, 6], n_per_group=2), cfg, tok


def test_each_turn_records_the_key_of_the_state_it_acted_on(lake_rollouts) -> None:
    trajs, _, _ = lake_rollouts
    for t in trajs:
        env = make(LAKE.name, **LAKE.params)
        _, info = env.reset(seed=t.seed)
        for turn in t.turns:
            assert turn.state_key == info["state_key"]  # the state before the turn's actions
            for action in turn.actions:
                info = env.step(action)[4]


def test_the_token_batch_carries_turn_rewards_and_state_ids(lake_rollouts) -> None:
    trajs, cfg, tok = lake_rollouts
    batch = build_token_batch(trajs, tok, cfg)
    assert batch.turn_rewards is not None and batch.turn_states is not None
    k = max(len(t.turns) for t in trajs)
    assert batch.turn_rewards.shape == batch.turn_states.shape == (len(trajs), k)
    keys = {}
    for b, t in enumerate(trajs):
        n = len(t.turns)
        assert batch.turn_rewards[b, :n].tolist() == pytest.approx([x.reward + x.penalty for x in t.turns])
        assert (batch.turn_states[b, n:] == -1).all() and (batch.turn_rewards[b, n:] == 0).all()
        for turn, state in zip(t.turns, batch.turn_states[b, :n].tolist(), strict=True):
            assert keys.setdefault(turn.state_key, state) == state  # one id per key
    assert len(set(keys.values())) == len(keys)
    # both members of a group start at one state; a lake turn with Left, Right comes back to it
    assert all(batch.turn_states[b, 0] == batch.turn_states[b ^ 1, 0] for b in range(len(trajs)))
    assert 0.0 < step_group_share(trajs) <= 1.0
    sub = batch.select([2, 0])
    assert sub.turn_states is not None and sub.turn_rewards is not None
    assert torch.equal(sub.turn_states, batch.turn_states[[2, 0]])
    assert torch.equal(sub.turn_rewards, batch.turn_rewards[[2, 0]])


def test_step_group_share_counts_turns_in_groups_of_two_or_more(lake_rollouts) -> None:
    from dataclasses import replace

    trajs, _, _ = lake_rollouts
    # hand-set keys: group g's turns ['a', 'b'] and ['a', ''] -> a twice (shared), b once, '' alone: 2 of 4 turns
    def keyed(t, keys):
        return replace(t, turns=tuple(replace(x, state_key=k) for x, k in zip(t.turns[:2], keys, strict=True)))

    two = [keyed(trajs[0], ["a", "b"]), keyed(trajs[1], ["a", ""])]
    assert step_group_share(two) == 0.5
    assert step_group_share(two, first_turn=1) == 0.0  # later turns b and '': both alone
    assert step_group_share([keyed(trajs[0], ["", ""]), keyed(trajs[1], ["", ""])]) == 0.0  # unknown: never grouped
    assert step_group_share([]) == 0.0
    # a later turn meets an earlier one: turns ['a', 'b'] and ['b', 'a'] -> every turn shared; later turns 2 of 2
    crossed = [keyed(trajs[0], ["a", "b"]), keyed(trajs[1], ["b", "a"])]
    assert step_group_share(crossed) == 1.0 and step_group_share(crossed, first_turn=1) == 1.0
    # ['a', 'b'], ['a', 'c'] and a third member ['a', 'b'] -> later turns b, c, b: 2 of 3 shared; all turns 5 of 6
    three = [keyed(trajs[0], ["a", "b"]), keyed(trajs[1], ["a", "c"]), keyed(trajs[0], ["a", "b"])]
    assert step_group_share(three) == pytest.approx(5 / 6)
    assert step_group_share(three, first_turn=1) == pytest.approx(2 / 3)
    assert step_group_metrics(three) == {"rollout/step_group_share": pytest.approx(5 / 6),
                                         "rollout/step_group_share_later": pytest.approx(2 / 3)}
    assert step_group_metrics([keyed(trajs[0], ["", ""])]) == {}  # no keys: an env without state_key
    one_turn = [replace(t, turns=t.turns[:1]) for t in three]  # single-turn episodes: no later turns to count
    assert step_group_metrics(one_turn) == {"rollout/step_group_share": 1.0}
    # another prompt group never joins a step group: the same keys in group 1 are alone there
    other = [keyed(trajs[0], ["a", "b"]), replace(keyed(trajs[1], ["a", "b"]), group_id=trajs[0].group_id + 1)]
    assert step_group_share(other) == 0.0


def _two_turn_batch() -> TokenBatch:
    # One prompt group of two trajectories, two turns each. Positions:
    #   row 0: 0-1 prompt | 2-4 reply of turn 0 | 5 env text | 6-7 reply of turn 1 | 8 padding
    #   row 1: 0-1 prompt | 2-3 reply of turn 0 | 4-5 env text | 6-8 reply of turn 1
    gen = [[0, 0, 1, 1, 1, 0, 1, 1, 0], [0, 0, 1, 1, 0, 0, 1, 1, 1]]
    turn = [[0, 0, 0, 0, 0, 1, 1, 1, -1], [0, 0, 0, 0, 1, 1, 1, 1, 1]]
    ends = [[0, 0, 0, 0, 1, 0, 0, 1, 0], [0, 0, 0, 1, 0, 0, 0, 0, 1]]
    loss_mask = torch.tensor(gen, dtype=torch.bool)
    rewards = torch.zeros(2, 9)
    rewards[0, 7] = 1.0  # row 0's return on its last generated token
    return TokenBatch(
        input_ids=torch.arange(18).reshape(2, 9), attention_mask=torch.tensor(turn) >= 0, loss_mask=loss_mask,
        old_logprobs=torch.where(loss_mask, -1.0, 0.0), rewards=rewards, turn_ids=torch.tensor(turn),
        turn_ends=torch.tensor(ends, dtype=torch.bool), group_ids=torch.tensor([0, 0]),
        returns=torch.tensor([1.0, 0.0]),
        turn_rewards=torch.tensor([[0.0, 1.0], [0.0, 0.0]]),  # row 0 earns its 1 in turn 1
        turn_states=torch.tensor([[0, 1], [0, 2]]),  # both turn 0s act on state 0; turn 1s on states of their own
    )


def test_the_trainer_gives_each_turn_its_advantage_on_its_reply_tokens_only() -> None:
    # Episode (grpo of returns [1, 0]): mean 0.5, std sqrt(0.5) -> ±0.5/(0.70711 + 1e-6) ≈ ±0.70711.
    # Step, γ = 0.95: state 0 holds row 0's turn 0 (R = 0 + 0.95·1 = 0.95) and row 1's (R = 0): mean 0.475,
    #   std sqrt(2·0.475²) = 0.67175 -> ±0.475/(0.67175 + 1e-6) ≈ ±0.70711; states 1 and 2 have one turn -> 0.
    # Turn advantages: row 0 [0.70711 + 0.70711, 0.70711] = [1.41421, 0.70711], row 1 [-1.41421, -0.70711].
    cfg = make_cfg("grpo", "algorithm.estimator=gigpo")
    assert (cfg.algorithm.gigpo_gamma, cfg.algorithm.gigpo_omega, cfg.algorithm.gigpo_step_norm) == (0.95, 1.0, "std")
    batch = _two_turn_batch()
    adv, ret = compute_advantages(batch, batch.rewards, None, cfg.algorithm)
    assert ret is None
    e = 0.5 / (math.sqrt(0.5) + 1e-6)
    s = 0.475 / (math.sqrt(2 * 0.475**2) + 1e-6)
    expected = torch.tensor([[0, 0, e + s, e + s, e + s, 0, e, e, 0],
                             [0, 0, -e - s, -e - s, 0, 0, -e, -e, -e]])
    torch.testing.assert_close(adv, expected)
    assert adv[0, 2].item() == pytest.approx(1.41421, abs=1e-5)
    # omega 0: every generated token gets exactly what grpo gives it
    grpo_cfg = make_cfg("grpo")
    zero = make_cfg("grpo", "algorithm.estimator=gigpo", "algorithm.gigpo_omega=0")
    torch.testing.assert_close(compute_advantages(batch, batch.rewards, None, zero.algorithm)[0],
                               compute_advantages(batch, batch.rewards, None, grpo_cfg.algorithm)[0], rtol=0, atol=0)


def test_a_kl_in_the_reward_counts_in_the_turn_it_sits_in() -> None:
    # -0.5 on every generated token: row 0 loses 1.5 in turn 0 and 1 in turn 1, row 1 1 and 1.5. With gamma 0 a
    # turn's return-to-go is its own reward: state 0 holds -1.5 (row 0) and -1 (row 1).
    cfg = make_cfg("grpo", "algorithm.estimator=gigpo", "algorithm.gigpo_gamma=0", "algorithm.gigpo_step_norm=mean")
    batch = _two_turn_batch()
    rewards = batch.rewards - 0.5 * batch.loss_mask.float()
    adv, _ = compute_advantages(batch, rewards, None, cfg.algorithm)
    # returns: row 0 1 - 2.5 = -1.5, row 1 -2.5: mean -2, std sqrt(0.5) -> ±0.5/(0.70711 + 1e-6)
    e = 0.5 / (math.sqrt(0.5) + 1e-6)
    assert adv[0, 2].item() == pytest.approx(e - 0.25) and adv[1, 2].item() == pytest.approx(-e + 0.25)
    assert adv[0, 6].item() == pytest.approx(e) and adv[1, 6].item() == pytest.approx(-e)


def test_gigpo_needs_the_per_turn_fields() -> None:
    from dataclasses import replace

    cfg = make_cfg("grpo", "algorithm.estimator=gigpo")
    batch = replace(_two_turn_batch(), turn_states=None)
    with pytest.raises(ValueError, match="turn_rewards and turn_states"):
        compute_advantages(batch, batch.rewards, None, cfg.algorithm)


def test_gigpo_config_allows_no_critic_and_needs_a_group() -> None:
    from ragen_core.config import ConfigError

    cfg = load_experiment(SMOKE, ["algorithm.estimator=gigpo", "algorithm.critic=none"])
    assert cfg.algo_tag == "gigpo" and cfg.reward_placement == "last"
    with pytest.raises(ConfigError, match="gigpo normalises within a group"):
        load_experiment(SMOKE, ["algorithm.estimator=gigpo", "algorithm.critic=none", "rollout.responses_per_prompt=1",
                                "algorithm.filter_strategy=none"])
    with pytest.raises(ConfigError, match="gigpo_step_norm"):
        load_experiment(SMOKE, ["algorithm.estimator=gigpo", "algorithm.gigpo_step_norm=max"])


def test_a_smoke_run_trains_with_gigpo_and_logs_the_step_group_share(tmp_path, monkeypatch) -> None:
    from ragen_core.session import finish, open_session, run_iteration
    from ragen_core.tracking import NullLogger
    from ragen_core.tracking.metrics import describe

    monkeypatch.setenv("RAGEN_DATA_DIR", str(tmp_path))
    cfg = load_experiment(SMOKE, ["algorithm.estimator=gigpo", "algorithm.critic=none", "env.name=FrozenLake",
                                  "rollout.max_turns=3", "rollout.max_actions_per_episode=3", "eval.every=0",
                                  "trainer.checkpoint_every=0", "rollout.max_new_tokens=24"])
    log = NullLogger()
    sess = open_session(cfg, log, say=lambda line: None)
    assert sess.state.models.critic is None and sess.state.models.value_head is None
    # scripted replies with valid moves, so episodes last several turns (the random tiny model names no action)
    sess.generator = ScriptedGenerator(sess.tokenizer, lambda c, r, p: _answer(["Left", "Down", "Right", "Up"][r % 4]))
    rows = [run_iteration(sess) for _ in range(cfg.trainer.iterations)]
    finish(sess)
    for row in rows:
        assert row["rollout/update_skipped"] == 0.0
        assert math.isfinite(row["actor/pg_loss"]) and math.isfinite(row["actor/grad_norm"])
        assert 0.0 < row["rollout/step_group_share"] <= 1.0  # each group's first turns share the initial state
        assert 0.0 <= row["rollout/step_group_share_later"] <= row["rollout/step_group_share"]
    names = {name for _, metrics in log.metrics for name in metrics}
    assert {"rollout/step_group_share", "rollout/step_group_share_later"} <= names
    assert sorted(n for n in names if describe(n) is None) == []
