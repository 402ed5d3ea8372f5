"""The multi-turn loop (loop.py) with a scripted generator: groups, lock-step generation, SPEC §3 rules.

The scripted generator (ragen_core.rollout.scripted) replies with chosen text, so these tests pin the
loop's logic; tests/unit/rollout/test_rollout_hf.py runs the same loop with the real HF generator.
Expected rewards come from replaying the same actions on a fresh env, independently of the loop.

Run: .venv/bin/python -m pytest tests/unit/rollout/test_rollout_loop.py -q
"""

from __future__ import annotations

import dataclasses

import pytest
from transformers import PreTrainedTokenizerBase

from ragen_core.config import EnvConfig, RolloutConfig
from ragen_core.envs import make
from ragen_core.models import load_tokenizer
from ragen_core.rollout.chat import ChatRenderer
from ragen_core.rollout.loop import context_limit, run_rollouts
from ragen_core.rollout.scripted import ScriptedGenerator

SOKOBAN = EnvConfig(name="Sokoban")
BANDIT = EnvConfig(name="Bandit", tag="bandit")


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerBase:
    return load_tokenizer("tiny-random")


def _answer(*actions: str) -> str:
    return "<think>plan</think><answer>" + " || ".join(actions) + "</answer>"


def _replay(env_cfg: EnvConfig, seed: int, member: int, actions: list[str]) -> list[float]:
    env = make(env_cfg.name, **env_cfg.params)
    env.reset(seed=seed, options={"dynamics_seed": member})
    return [env.step(a)[1] for a in actions]


def test_group_shares_initial_state_and_luck_by_default(tok: PreTrainedTokenizerBase) -> None:
    # SPEC §2: the reference resets all N members with the same seed, so they share
    # the env's random draws: 16 pulls of Dragon in one group all pay the same.
    gen = ScriptedGenerator(tok, _answer("Dragon"))
    trajs = run_rollouts(BANDIT, gen, tok, RolloutConfig(), seeds=[6, 1], n_per_group=16)
    assert [t.group_id for t in trajs] == [0] * 16 + [1] * 16
    assert [t.seed for t in trajs] == [6] * 16 + [1] * 16
    for g in (trajs[:16], trajs[16:]):
        assert len({t.turns[0].observation for t in g}) == 1  # same initial state within a group
        assert len({t.env_return for t in g}) == 1  # same luck within a group
    assert {t.meta["dynamics_seed"] for t in trajs} == {0}
    assert trajs[0].env_return == _replay(BANDIT, 6, 0, ["Dragon"])[0]
    # over many groups both payouts occur (the luck is per group, not fixed)
    many = run_rollouts(BANDIT, ScriptedGenerator(tok, _answer("Dragon")), tok, RolloutConfig(), seeds=range(40),
                        n_per_group=2)
    assert {t.env_return for t in many} == {0.0, 1.0}
    t = trajs[0]
    assert (t.terminated, t.truncated, t.success, len(t.turns), t.env_tag) == (True, False, True, 1, "bandit")


def test_independent_group_dynamics_draw_own_luck(tok: PreTrainedTokenizerBase) -> None:
    cfg = RolloutConfig(group_dynamics="independent")
    gen = ScriptedGenerator(tok, _answer("Dragon"))
    trajs = run_rollouts(BANDIT, gen, tok, cfg, seeds=[6, 1], n_per_group=16)
    assert len({t.turns[0].observation for t in trajs[:16]}) == 1  # still one initial state per group
    # Dragon pays 1.0 with p=0.25: 16 members with their own dynamics stream do not all agree
    rewards = [t.env_return for t in trajs[:16]]
    assert set(rewards) == {0.0, 1.0}
    assert rewards == [_replay(BANDIT, 6, m, ["Dragon"])[0] for m in range(16)]
    # deterministic: the same call again gives the same luck; group_offset shifts ids
    again = run_rollouts(BANDIT, ScriptedGenerator(tok, _answer("Dragon")), tok, cfg, seeds=[6],
                         n_per_group=16, group_offset=7)
    assert [t.env_return for t in again] == rewards and {t.group_id for t in again} == {7}


@pytest.mark.parametrize(("dynamics", "same"), [("shared", True), ("independent", False)])
def test_frozen_lake_slips_are_shared_within_a_group(tok: PreTrainedTokenizerBase, dynamics: str, same: bool) -> None:
    # The same actions on slippery ice: with shared dynamics every member slips the same way, so the
    # whole episodes agree; with independent dynamics they drift apart.
    lake = EnvConfig(name="FrozenLake")
    cfg = RolloutConfig(group_dynamics=dynamics, max_turns=3)
    trajs = run_rollouts(lake, ScriptedGenerator(tok, _answer("Down", "Right")), tok, cfg, seeds=[11],
                         n_per_group=8)
    episodes = {tuple(turn.observation for turn in t.turns) + (t.env_return,) for t in trajs}
    assert (len(episodes) == 1) is same


def test_episode_budget_follows_the_config(tok: PreTrainedTokenizerBase) -> None:
    # SPEC §5: Table 3's k = 6 gives 5 turns x 6 actions = 30 actions, and the env's
    # own step limit (Sokoban: 10 by default) must follow, not cut the episode at 10.
    from ragen_core.rollout.loop import episode_env

    cfg = RolloutConfig(max_actions_per_turn=6, max_actions_per_episode=30)
    assert episode_env(SOKOBAN, cfg).max_steps == 30
    assert episode_env(EnvConfig(name="FrozenLake"), cfg).max_steps == 30
    assert episode_env(EnvConfig(name="Sokoban", params={"max_steps": 12}), cfg).max_steps == 12  # explicit wins
    assert episode_env(BANDIT, cfg).max_steps == 1  # one pull is a rule of the game
    # bumping into walls spends actions without solving: the episode uses all 30
    wall = "<think>x</think><answer>" + "Up || Up || Up || Left || Left || Left" + "</answer>"
    (t,) = run_rollouts(SOKOBAN, ScriptedGenerator(tok, wall), tok, cfg, seeds=[5], n_per_group=1)
    assert "You have 30 actions left" in t.meta["user_texts"][0]
    assert not t.success and len(t.turns) == 5 and sum(len(turn.actions) for turn in t.turns) == 30


def test_penalty_rules_and_turn_rewards(tok: PreTrainedTokenizerBase) -> None:
    script = ["no tags at all", _answer("Up", "Jump"), "<think>x</think><answer>up</answer>",
              "<think>x</think><answer> </answer>"]
    gen = ScriptedGenerator(tok, lambda call, row, prompt: script[call])
    cfg = RolloutConfig(max_turns=4, format_reward=0.05)
    (t,) = run_rollouts(SOKOBAN, gen, tok, cfg, seeds=[3], n_per_group=1)
    assert [turn.actions for turn in t.turns] == [(), ("Up",), ("Up",), ()]  # unknown 'Jump' skipped
    assert [turn.parse_ok for turn in t.turns] == [False, False, True, False]
    # -0.1 for: no parse, an unknown action, an empty answer; the clean turn gets format_reward 0.05
    assert [turn.penalty for turn in t.turns] == [-0.1, -0.1, 0.05, -0.1]
    up, up2 = _replay(SOKOBAN, 3, 0, ["Up", "Up"])
    assert [turn.reward for turn in t.turns] == [0.0, up, up2, 0.0]
    assert t.total_return == pytest.approx(up + up2 - 0.3 + 0.05)
    assert t.env_return == pytest.approx(up + up2)
    assert t.meta["named_actions"] == [0, 2, 1, 0] and t.meta["unknown_actions"] == [0, 1, 0, 0]
    assert (t.truncated, t.terminated) == (True, False)  # max_turns reached
    assert t.turns[1].think_tokens == len(tok("plan", add_special_tokens=False)["input_ids"])


def test_reward_goes_back_in_the_next_user_message(tok: PreTrainedTokenizerBase) -> None:
    gen = ScriptedGenerator(tok, lambda call, row, prompt: "bad" if call == 0 else _answer("Up"))
    (t,) = run_rollouts(SOKOBAN, gen, tok, RolloutConfig(max_turns=3), seeds=[3], n_per_group=1)
    second = tok.decode(list(t.turns[1].prompt_ids))
    assert "Reward:\n0\nFormat penalty" in second and "\n-0.1\n\nTurn 2:\nState:\n" in second
    third = tok.decode(list(t.turns[2].prompt_ids))
    assert f"Reward:\n{t.turns[1].reward:g}\n\nTurn 3:" in third and "Format penalty" not in third


def test_action_budget_ends_the_episode(tok: PreTrainedTokenizerBase) -> None:
    gen = ScriptedGenerator(tok, _answer("Up", "Left", "Down", "Right", "Up"))
    cfg = RolloutConfig(max_actions_per_turn=5, max_actions_per_episode=7)
    (t,) = run_rollouts(SOKOBAN, gen, tok, cfg, seeds=[3], n_per_group=1)
    # turn 1 runs 5 actions, turn 2 only the 2 left in the budget, then the episode is truncated
    assert [len(turn.actions) for turn in t.turns] == [5, 2]
    assert t.turns[1].actions == ("Up", "Left")
    assert (t.truncated, t.terminated, t.n_actions) == (True, False, 7)
    assert "You have 2 actions left." in tok.decode(list(t.turns[1].prompt_ids))


def test_lock_step_generation_and_sessions(tok: PreTrainedTokenizerBase) -> None:
    # Row 0 of the first two calls is member 0, which spends its 10-action budget in two turns;
    # everyone else makes one action per turn and plays all 5 turns.
    five = _answer("Up", "Down", "Up", "Down", "Up")
    gen = ScriptedGenerator(tok, lambda call, row, prompt: five if row == 0 and call < 2 else _answer("Left"))
    trajs = run_rollouts(SOKOBAN, gen, tok, RolloutConfig(), seeds=[3], n_per_group=3, temperature=0.7,
                         sampling_seed=11)
    assert [len(c.prompts) for c in gen.calls] == [3, 3, 2, 2, 2]  # one call per turn, live rows only
    assert [len(t.turns) for t in trajs] == [2, 5, 5]
    sessions = [c.session_ids for c in gen.calls]
    assert sessions[0] is not None and len(set(sessions[0])) == 3 and sessions[1] == sessions[0]
    assert sessions[2] == sessions[0][1:]
    assert gen.ended[:1] == [sessions[0][0]] and sorted(map(str, gen.ended)) == sorted(map(str, sessions[0]))
    params = [c.params for c in gen.calls]
    assert {p.temperature for p in params} == {0.7}
    assert all(p.stop_token_ids == ChatRenderer(tok, RolloutConfig().system_prompt).stop_token_ids for p in params)
    assert len({p.seed for p in params}) == 5 and all(p.seed is not None for p in params)
    assert [p.last_turn for p in params] == [False] * 4 + [True]  # max_turns 5: no session outlives the fifth
    # each context is the previous context + the sampled ids + the new prompt delta (prefix growth)
    t = trajs[1]
    for k in range(1, 5):
        expected = ([i for turn in t.turns[:k] for i in turn.prompt_ids + turn.response_ids]
                    + list(t.turns[k].prompt_ids))
        assert list(gen.calls[k].prompts[1 if k < 2 else 0]) == expected


def test_nothink_mode(tok: PreTrainedTokenizerBase) -> None:
    gen = ScriptedGenerator(tok, "<answer>Up</answer>")
    (t,) = run_rollouts(SOKOBAN, gen, tok, RolloutConfig(think=False, max_turns=1), seeds=[3], n_per_group=1)
    assert t.turns[0].parse_ok and t.turns[0].think_tokens == 0
    head = tok.decode(list(t.turns[0].prompt_ids))
    assert "Always output: <answer> [your answer] </answer>" in head and "<think>" not in head


def test_sampled_ids_and_logprobs_are_stored_verbatim(tok: PreTrainedTokenizerBase) -> None:
    gen = ScriptedGenerator(tok, _answer("Up"))
    trajs = run_rollouts(SOKOBAN, gen, tok, RolloutConfig(max_turns=2), seeds=[3], n_per_group=2)
    outs = [gen._reply(c, r, p, gen.calls[c].params) for c in range(2) for r, p in enumerate(gen.calls[c].prompts)]
    stored = [(trajs[r].turns[c].response_ids, trajs[r].turns[c].logprobs, trajs[r].turns[c].finish_reason)
              for c in range(2) for r in range(2)]
    assert stored == [(o.token_ids, o.logprobs, o.finish_reason) for o in outs]


def test_reply_cut_at_max_new_tokens(tok: PreTrainedTokenizerBase) -> None:
    gen = ScriptedGenerator(tok, _answer("Up") + " and a very long tail " * 20)
    (t,) = run_rollouts(SOKOBAN, gen, tok, RolloutConfig(max_new_tokens=16, max_turns=2), seeds=[3], n_per_group=1)
    assert [turn.finish_reason for turn in t.turns] == ["length", "length"]
    assert len(t.turns[0].response_ids) == 16
    # the next prompt closes the unfinished assistant message with the template's end-of-turn text
    assert tok.decode(list(t.turns[1].prompt_ids)).startswith("<|im_end|>\n<|im_start|>user\n")


def test_window_keeps_instruction_and_last_turns(tok: PreTrainedTokenizerBase) -> None:
    gen = ScriptedGenerator(tok, _answer("Left"))
    cfg = RolloutConfig(max_turns=4, window_turns=2)
    (t,) = run_rollouts(SOKOBAN, gen, tok, cfg, seeds=[3], n_per_group=1)
    assert t.dropped_turns == 2  # at turn 4 (index 3) the window keeps turns 3 and 4
    last_context = tok.decode(list(gen.calls[3].prompts[0]))
    assert "You are solving a Sokoban puzzle" in last_context  # the instruction block stays
    assert "Turn 3:" in last_context and "Turn 4:" in last_context and "Turn 2:" not in last_context
    assert last_context.count("<|im_start|>system") == 1 and last_context.count("<|im_start|>assistant") == 2


def test_hard_cap_drops_oldest_turns_and_overflow_ends_episode(tok: PreTrainedTokenizerBase) -> None:
    gen = ScriptedGenerator(tok, _answer("Left"))
    base = run_rollouts(SOKOBAN, gen, tok, RolloutConfig(max_turns=3), seeds=[3], n_per_group=1)[0]
    second_context = len(base.turns[0].prompt_ids) + len(base.turns[0].response_ids) + len(base.turns[1].prompt_ids)
    cfg = RolloutConfig(max_turns=3, max_new_tokens=128, max_context_tokens=second_context + 128)
    capped = ScriptedGenerator(tok, _answer("Left"))
    (t,) = run_rollouts(SOKOBAN, capped, tok, cfg, seeds=[3], n_per_group=1)
    assert len(t.turns) == 3 and t.dropped_turns >= 1 and not t.meta["context_overflow"]
    assert all(len(p) <= second_context for c in capped.calls for p in c.prompts)
    # a cap that fits the first prompt but no later one: the episode ends (truncated), no crash
    first = len(base.turns[0].prompt_ids)
    tight = RolloutConfig(max_turns=3, max_new_tokens=128, max_context_tokens=first + 128)
    (o,) = run_rollouts(SOKOBAN, ScriptedGenerator(tok, _answer("Left")), tok, tight, seeds=[3], n_per_group=1)
    assert (len(o.turns), o.truncated, o.meta["context_overflow"]) == (1, True, True)
    # not even the first prompt fits: a clear error before anything is generated
    with pytest.raises(ValueError, match="first prompt"):
        run_rollouts(SOKOBAN, ScriptedGenerator(tok, "x"), tok,
                     dataclasses.replace(tight, max_context_tokens=first + 127), seeds=[3], n_per_group=1)


def test_context_limit_resolution(tok: PreTrainedTokenizerBase) -> None:
    assert context_limit(RolloutConfig(max_context_tokens=512), 4096, tok) == 512
    assert context_limit(RolloutConfig(), 4096, tok) == 4096
    assert context_limit(RolloutConfig(), None, tok) == tok.model_max_length == 2048


def test_free_form_env_countdown(tok: PreTrainedTokenizerBase) -> None:
    gen = ScriptedGenerator(tok, "<think>try</think><answer>(1 + 2) * 3</answer>")
    (t,) = run_rollouts(EnvConfig(name="Countdown"), gen, tok, RolloutConfig(), seeds=[1], n_per_group=1)
    assert t.turns[0].actions == ("(1 + 2) * 3",) and t.terminated and len(t.turns) == 1
    assert "Available actions" not in tok.decode(list(t.turns[0].prompt_ids))


def test_free_form_action_rejected_by_the_env_is_penalised(tok: PreTrainedTokenizerBase) -> None:
    gen = ScriptedGenerator(tok, "<think>no idea</think><answer>hello there</answer>")
    (t,) = run_rollouts(EnvConfig(name="Countdown"), gen, tok, RolloutConfig(), seeds=[1], n_per_group=1)
    first = t.turns[0]
    assert (first.actions, first.parse_ok, first.penalty, first.reward) == ((), False, -0.1, 0.0)
    assert t.meta["named_actions"][0] == 1 and t.meta["unknown_actions"][0] == 1


def test_generator_failure_frees_every_live_session(tok: PreTrainedTokenizerBase) -> None:
    def script(call: int, row: int, prompt: object) -> str:
        if call == 1:
            raise RuntimeError("out of memory")
        return _answer("Left")

    gen = ScriptedGenerator(tok, script)
    with pytest.raises(RuntimeError, match="out of memory"):
        run_rollouts(SOKOBAN, gen, tok, RolloutConfig(), seeds=[3], n_per_group=2)
    assert sorted(map(str, gen.ended)) == sorted(map(str, gen.calls[0].session_ids or ()))
