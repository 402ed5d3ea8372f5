"""Token batches (batch.py) on the tiny model's ChatML template: exact masks, sampled ids, rewards, guard.

The same mask checks run on the default model's template in
tests/integration/test_masks_default_model.py (slow).

Run: .venv/bin/python -m pytest tests/unit/rollout/test_rollout_batch.py -q
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import PreTrainedTokenizerBase

from ragen_core.config import EnvConfig, RolloutConfig
from ragen_core.models import load_tokenizer
from ragen_core.rollout.batch import build_token_batch, mask_problems
from ragen_core.rollout.chat import ChatRenderer
from ragen_core.rollout.loop import run_rollouts
from ragen_core.rollout.prompts import first_user_text
from ragen_core.rollout.scripted import ScriptedGenerator
from ragen_core.types import TokenBatch, Trajectory, Turn

SOKOBAN = EnvConfig(name="Sokoban")
REPLIES = ["<think>push</think><answer>Left || Up</answer>", "<think>hmm √ déjà</think><answer>Right</answer>",
           "no format at all", "<think>long " + "word " * 40 + "</think><answer>Down</answer>"]


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerBase:
    return load_tokenizer("tiny-random")


def _script(call: int, row: int, prompt: object) -> str:
    return REPLIES[(call + row) % len(REPLIES)]


def check_masks(batch: TokenBatch, trajs: list[Trajectory], tok: PreTrainedTokenizerBase) -> None:
    """The mask properties every batch must have (also used by the default-model integration test)."""
    assert mask_problems(batch, trajs, tok) == []
    # scripted replies are real text, so more can be said: the masked text of a turn is the reply
    # text plus the template's end-of-turn token when it was sampled, and no env text is masked
    # (the prefilled tag that starts response_text is prompt context: it stands unmasked just before the reply)
    eot = ChatRenderer(tok, RolloutConfig().system_prompt).end_of_turn_text
    for b, t in enumerate(trajs):
        mask, tids = batch.loss_mask[b], batch.turn_ids[b]
        prefill = t.meta["prefill"]
        for k in range(t.dropped_turns, len(t.turns)):
            turn = t.turns[k]
            assert turn.response_text.startswith(prefill)
            sampled = turn.response_text[len(prefill):]
            text = tok.decode(batch.input_ids[b][mask & (tids == k)].tolist())
            assert text == (sampled + eot if turn.finish_reason == "stop" else sampled)
            first = int((mask & (tids == k)).nonzero()[0]) if sampled or turn.finish_reason == "stop" else None
            if first is not None and prefill:
                before = tok.decode(batch.input_ids[b][:first].tolist())
                assert before.endswith(prefill) and not mask[first - 1]
        masked = tok.decode(batch.input_ids[b][mask].tolist())
        assert "State:" not in masked and "Reward:" not in masked and "<|im_start|>" not in masked


def test_masks_ids_and_env_text(tok: PreTrainedTokenizerBase) -> None:
    cfg = RolloutConfig(max_new_tokens=40)  # the long reply is cut: finish_reason 'length'
    trajs = run_rollouts(SOKOBAN, ScriptedGenerator(tok, _script), tok, cfg, seeds=[3, 4], n_per_group=2)
    assert {turn.finish_reason for t in trajs for turn in t.turns} == {"stop", "length"}
    batch = build_token_batch(trajs, tok, cfg)
    check_masks(batch, trajs, tok)


@pytest.mark.parametrize("think", [True, False])
def test_prefilled_tag_is_context_not_trained(tok: PreTrainedTokenizerBase, think: bool) -> None:
    # SPEC §3: every generation prompt ends with <think> (<answer> in NoThink), the
    # reply continues from it, the parser sees tag + reply, and the loss mask leaves the tag out.
    tag = "<think>" if think else "<answer>"
    reply = "<think>push</think><answer>Up</answer>" if think else "<answer>Up</answer>"
    cfg = RolloutConfig(think=think, max_turns=2)
    gen = ScriptedGenerator(tok, reply)
    trajs = run_rollouts(SOKOBAN, gen, tok, cfg, seeds=[3], n_per_group=1)
    for call in gen.calls:  # every context the model saw ends with the tag
        assert tok.decode(list(call.prompts[0])).endswith(tag)
    (t,) = trajs
    assert t.meta["prefill"] == tag and all(turn.parse_ok for turn in t.turns)
    assert all(not tok.decode(list(turn.response_ids)).startswith(tag) for turn in t.turns)
    batch = build_token_batch(trajs, tok, cfg)
    check_masks(batch, trajs, tok)
    # off: the model opens the tag itself, and it is trained
    off = run_rollouts(SOKOBAN, ScriptedGenerator(tok, reply), tok, dataclasses.replace(cfg, prefill=False),
                       seeds=[3], n_per_group=1)
    assert off[0].meta["prefill"] == "" and tok.decode(list(off[0].turns[0].response_ids)).startswith(tag)


def test_row_is_the_templates_rendering_of_the_dialogue(tok: PreTrainedTokenizerBase) -> None:
    cfg = RolloutConfig()
    gen = ScriptedGenerator(tok, _script)
    trajs = run_rollouts(SOKOBAN, gen, tok, cfg, seeds=[3], n_per_group=2)
    batch = build_token_batch(trajs, tok, cfg)
    renderer = ChatRenderer(tok, cfg.system_prompt)
    for b, t in enumerate(trajs):
        texts = t.meta["user_texts"]
        messages = renderer.messages(first_user_text(t.meta["instruction"], texts[0]),
                                     [turn.response_text for turn in t.turns], texts[1:])
        template = tok.apply_chat_template(messages, tokenize=False)
        row = batch.input_ids[b][batch.attention_mask[b]].tolist()
        assert template.startswith(tok.decode(row))  # the template adds only "\n" after the last <|im_end|>
        assert tok(template, add_special_tokens=False)["input_ids"][: len(row)] == row
        # the row is also exactly the last context the generator saw + the last sampled reply
        assert row == list(gen.calls[len(t.turns) - 1].prompts[b]) + list(t.turns[-1].response_ids)


def _hand_trajectory(group_id: int = 0) -> Trajectory:
    # head [5 6 7], reply0 [10 11 2], delta1 [8 9], reply1 [12 2]  (2 = the tiny model's <|im_end|>)
    turns = (
        Turn("s0", (5, 6, 7), (10, 11, 2), (-0.5, -0.25, -0.125), "r0", ("Up",), -0.1, -0.1, False),
        Turn("s1", (8, 9), (12, 2), (-1.0, -0.75), "r1", ("Up",), 1.0, 0.0, True),
    )
    return Trajectory("Sokoban", 3, group_id, turns, success=True, terminated=True, truncated=False)


def test_reward_placement_golden(tok: PreTrainedTokenizerBase) -> None:
    traj = _hand_trajectory()
    last = build_token_batch([traj], tok, RolloutConfig(reward_placement="last"))
    # row: 5 6 7 | 10 11 2 | 8 9 | 12 2 -> positions 0..9; last generated token at position 9.
    assert last.input_ids[0].tolist() == [5, 6, 7, 10, 11, 2, 8, 9, 12, 2]
    assert last.loss_mask[0].tolist() == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]
    # total_return = (-0.1 - 0.1) + (1.0 + 0.0) = 0.8, all of it on position 9
    assert last.rewards[0].tolist() == pytest.approx([0] * 9 + [0.8])
    turn = build_token_batch([traj], tok, RolloutConfig(reward_placement="turn"))
    # turn 0's reward + penalty (-0.2) on its last generated token (position 5), turn 1's (1.0) on 9
    assert turn.rewards[0].tolist() == pytest.approx([0, 0, 0, 0, 0, -0.2, 0, 0, 0, 1.0])
    assert turn.turn_ends[0].tolist() == [0, 0, 0, 0, 0, 1, 0, 0, 0, 1]
    assert turn.turn_ids[0].tolist() == [0, 0, 0, 0, 0, 0, 1, 1, 1, 1]
    assert turn.old_logprobs[0].tolist() == [0, 0, 0, -0.5, -0.25, -0.125, 0, 0, -1.0, -0.75]
    assert turn.returns.tolist() == pytest.approx([0.8]) and turn.group_ids.tolist() == [0]


def test_padding_group_ids_and_select(tok: PreTrainedTokenizerBase) -> None:
    short = Trajectory("Bandit", 1, 4, (_hand_trajectory().turns[0],), success=False, terminated=True, truncated=False)
    batch = build_token_batch([_hand_trajectory(3), short], tok, RolloutConfig())
    assert batch.input_ids.shape == (2, 10)
    assert batch.attention_mask[1].tolist() == [1] * 6 + [0] * 4
    assert batch.input_ids[1, 6:].tolist() == [tok.pad_token_id] * 4
    assert batch.group_ids.tolist() == [3, 4]
    assert batch.rewards[1].tolist() == pytest.approx([0, 0, 0, 0, 0, -0.2, 0, 0, 0, 0])
    sub = batch.select([1])
    assert sub.input_ids.shape == (1, 6)


def test_hard_cap_in_batch_drops_oldest_turns_and_keeps_rewards(tok: PreTrainedTokenizerBase) -> None:
    cfg = RolloutConfig(reward_placement="turn")
    trajs = run_rollouts(SOKOBAN, ScriptedGenerator(tok, _script), tok, cfg, seeds=[3], n_per_group=1)
    full = build_token_batch(trajs, tok, cfg)
    width = int(full.attention_mask.sum())
    capped = build_token_batch(trajs, tok, cfg, max_length=width - 1)
    n = int(capped.attention_mask.sum())
    assert n <= width - 1
    kept = sorted(set(capped.turn_ids[0, :n].tolist()))
    assert kept[0] >= 1 and kept[-1] == len(trajs[0].turns) - 1
    row_text = tok.decode(capped.input_ids[0, :n].tolist())
    assert row_text.count("<|im_start|>system") == 1 and "You are solving a Sokoban puzzle" in row_text
    # dropped turns' rewards move to the first kept turn end: the row still sums to total_return
    assert float(capped.rewards.sum()) == pytest.approx(trajs[0].total_return, abs=1e-5)
    # masked ids are still exactly the kept turns' sampled ids
    assert capped.input_ids[0][capped.loss_mask[0]].tolist() == [
        i for k in kept for i in trajs[0].turns[k].response_ids]
    # a cap below even the last turn: cut from the left, never a crash
    tiny = build_token_batch(trajs, tok, cfg, max_length=8)
    assert tiny.input_ids.shape == (1, 8)
    assert tiny.input_ids[0].tolist() == full.input_ids[0, width - 8:width].tolist()
    assert tiny.loss_mask[0].tolist() == full.loss_mask[0, width - 8:width].tolist()


def test_window_rows_are_the_last_context(tok: PreTrainedTokenizerBase) -> None:
    cfg = RolloutConfig(window_turns=2, max_turns=4)
    gen = ScriptedGenerator(tok, _script)
    trajs = run_rollouts(SOKOBAN, gen, tok, cfg, seeds=[3], n_per_group=2)
    batch = build_token_batch(trajs, tok, cfg)
    check_masks(batch, trajs, tok)
    # the re-rendered head uses the rollout's system prompt (in meta), whatever the builder's config says
    other = build_token_batch(trajs, tok, dataclasses.replace(cfg, system_prompt="another system prompt"))
    assert torch.equal(other.input_ids, batch.input_ids)
    for b, t in enumerate(trajs):
        assert t.dropped_turns == len(t.turns) - 2
        row = batch.input_ids[b][batch.attention_mask[b]].tolist()
        assert row == list(gen.calls[len(t.turns) - 1].prompts[b]) + list(t.turns[-1].response_ids)


def test_empty_input_is_an_error(tok: PreTrainedTokenizerBase) -> None:
    with pytest.raises(ValueError, match="at least one"):
        build_token_batch([], tok, RolloutConfig())
    empty = Trajectory("Sokoban", 1, 0, (), success=False, terminated=False, truncated=True)
    with pytest.raises(ValueError, match="no turns"):
        build_token_batch([empty], tok, RolloutConfig())


_PIECES = list("abc <>/|√é\n") + ["<think>", "</think>", "<answer>", "</answer>", "Up", "left", " || ", "🙂"]
_REPLY = st.lists(st.sampled_from(_PIECES), max_size=30).map("".join)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(replies=st.lists(_REPLY, min_size=1, max_size=4), max_new=st.integers(4, 40),
       placement=st.sampled_from(["last", "turn"]), window=st.sampled_from([None, 1, 2]))
def test_mask_properties_hold_for_any_replies(tok: PreTrainedTokenizerBase, replies: list[str], max_new: int,
                                              placement: str, window: int | None) -> None:
    cfg = RolloutConfig(max_new_tokens=max_new, max_turns=3, reward_placement=placement, window_turns=window)
    gen = ScriptedGenerator(tok, lambda c, r, p: replies[(c + r) % len(replies)])
    trajs = run_rollouts(SOKOBAN, gen, tok, cfg, seeds=[3], n_per_group=2)
    batch = build_token_batch(trajs, tok, cfg)
    check_masks(batch, trajs, tok)
    assert torch.allclose(batch.rewards.sum(1), torch.tensor([t.total_return for t in trajs]), atol=1e-5)


def test_mask_problems_catches_a_shifted_or_widened_mask(tok: PreTrainedTokenizerBase) -> None:
    cfg = RolloutConfig(max_turns=2)
    trajs = run_rollouts(SOKOBAN, ScriptedGenerator(tok, _script), tok, cfg, seeds=[3], n_per_group=1)
    batch = build_token_batch(trajs, tok, cfg)
    assert mask_problems(batch, trajs, tok) == []
    shifted = dataclasses.replace(batch, loss_mask=torch.roll(batch.loss_mask, 1, dims=1))
    assert mask_problems(shifted, trajs, tok)
    # train on the template's "\n" after each <|im_end|> too: the classic off-by-one of re-rendered masks
    wider = batch.loss_mask | torch.roll(batch.loss_mask, 1, dims=1) & batch.attention_mask
    assert mask_problems(dataclasses.replace(batch, loss_mask=wider), trajs, tok)
    env_masked = batch.loss_mask.clone()
    env_masked[0, :5] = True
    assert mask_problems(dataclasses.replace(batch, loss_mask=env_masked), trajs, tok)


def _with_values(traj: Trajectory, values: list[tuple[float, ...]]) -> Trajectory:
    turns = tuple(dataclasses.replace(t, values=v) for t, v in zip(traj.turns, values, strict=True))
    return dataclasses.replace(traj, turns=turns)


def test_recorded_values_land_on_the_loss_positions(tok: PreTrainedTokenizerBase) -> None:
    """Golden: Turn.values (the generator's value head at sampling) go where old_logprobs go; select keeps them."""
    traj = _with_values(_hand_trajectory(), [(0.5, 0.25, 2.0), (-1.0, 3.0)])
    batch = build_token_batch([traj], tok, RolloutConfig())
    assert batch.old_values is not None
    assert batch.old_values[0].tolist() == [0, 0, 0, 0.5, 0.25, 2.0, 0, 0, -1.0, 3.0]
    short = Trajectory("Bandit", 1, 4, (_hand_trajectory().turns[0],), success=False, terminated=True,
                       truncated=False)
    two = build_token_batch([traj, _with_values(short, [(1.5, 1.0, 0.5)])], tok, RolloutConfig())
    assert two.old_values is not None and two.old_values[1].tolist() == [0, 0, 0, 1.5, 1.0, 0.5, 0, 0, 0, 0]
    sub = two.select([1])
    assert sub.old_values is not None and sub.old_values.tolist() == [[0, 0, 0, 1.5, 1.0, 0.5]]


def test_no_recorded_values_unless_every_row_is_its_whole_dialogue(tok: PreTrainedTokenizerBase) -> None:
    """None (the update then runs its critic forward) when a turn has no values, or a row lost turns or tokens:
    a value recorded in another context is not the value at that row position."""
    full = _with_values(_hand_trajectory(), [(0.5, 0.25, 2.0), (-1.0, 3.0)])
    assert build_token_batch([_hand_trajectory()], tok, RolloutConfig()).old_values is None
    half = _with_values(_hand_trajectory(), [(0.5, 0.25, 2.0), ()])
    assert build_token_batch([full, half], tok, RolloutConfig()).old_values is None
    assert build_token_batch([full], tok, RolloutConfig(), max_length=9).old_values is None  # a turn dropped
    assert build_token_batch([full], tok, RolloutConfig(window_turns=1)).old_values is None
    assert build_token_batch([full], tok, RolloutConfig(), max_length=10).old_values is not None
