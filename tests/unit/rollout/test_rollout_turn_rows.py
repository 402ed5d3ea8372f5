"""Per-turn training rows (rollout.context_window K, batch.build_turn_batch) on a hand-made 5-turn FrozenLake episode.

K counts the row's own turn, as RAGEN-2's max_context_window does: row t holds the system message and instruction,
turns max(0, t-K+1)..t-1 (their prompts and replies) and turn t's prompt, then turn t's reply, the only trained span.

Run: .venv/bin/python -m pytest tests/unit/rollout/test_rollout_turn_rows.py -q
"""

from __future__ import annotations

import pytest
import torch
from transformers import PreTrainedTokenizerBase

from ragen_core.config import EnvConfig, RolloutConfig
from ragen_core.models import load_tokenizer
from ragen_core.rollout.batch import build_token_batch, build_turn_batch
from ragen_core.rollout.chat import ChatRenderer
from ragen_core.rollout.loop import run_rollouts
from ragen_core.rollout.prompts import first_user_text
from ragen_core.rollout.scripted import ScriptedGenerator
from ragen_core.types import Trajectory, Turn

INSTRUCTION = "You are walking on a frozen lake. Reach G, avoid holes O."
TEXTS = [f"Turn {t + 1}:\nState:\nP_F_\nF_OG" for t in range(5)]
N = 5


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerBase:
    return load_tokenizer("tiny-random")


@pytest.fixture(scope="module")
def renderer(tok: PreTrainedTokenizerBase) -> ChatRenderer:
    return ChatRenderer(tok, RolloutConfig().system_prompt)


def _head(renderer: ChatRenderer, s: int) -> list[int]:
    """System message + instruction + turn s's user message: the first ids of a row whose first kept turn is s."""
    return list(renderer.head_ids(first_user_text(INSTRUCTION, TEXTS[s])))


def _lake(renderer: ChatRenderer, group_id: int = 7, rewards: tuple[float, ...] = (0, 0, 0, 0, 1.0)) -> Trajectory:
    """5 turns with known ids: turn 0's prompt is the rendered head, turn t>0's prompt delta [100+t, 101+t, 102+t],
    turn t's reply [200+10t, 201+10t, 2] (2 = the tiny model's <|im_end|>), log-probs -(t+1)/10, -(t+1)/20, -0.01."""
    turns = tuple(
        Turn(TEXTS[t], tuple(_head(renderer, 0)) if t == 0 else (100 + t, 101 + t, 102 + t),
             (200 + 10 * t, 201 + 10 * t, 2), (-(t + 1) / 10, -(t + 1) / 20, -0.01), f"r{t}", ("Down",),
             rewards[t], -0.1 if t == 1 else 0.0, t != 1)
        for t in range(N))
    meta = {"instruction": INSTRUCTION, "user_texts": list(TEXTS)}
    return Trajectory("FrozenLake", 11, group_id, turns, success=True, terminated=True, truncated=False,
                      meta=meta)  # type: ignore[arg-type]


def _expected_ids(traj: Trajectory, renderer: ChatRenderer, t: int, k: int) -> list[int]:
    """Plain loop: head of the first kept turn, then each kept turn's prompt delta (not the first's) and reply."""
    s = max(0, t - k + 1)
    ids = _head(renderer, s)
    for i in range(s, t + 1):
        if i > s:
            ids += list(traj.turns[i].prompt_ids)
        ids += list(traj.turns[i].response_ids)
    return ids


@pytest.mark.parametrize("k", [1, 2, 3, 5, 9])
def test_each_turn_is_a_row_of_its_window_with_only_its_reply_trained(tok, renderer, k: int) -> None:
    traj = _lake(renderer)
    batch = build_turn_batch([traj], tok, RolloutConfig(context_window=k))
    assert batch.batch_size == N
    for t in range(N):
        n = int(batch.attention_mask[t].sum())
        ids = batch.input_ids[t, :n].tolist()
        assert ids == _expected_ids(traj, renderer, t, k)
        reply = list(traj.turns[t].response_ids)
        assert batch.loss_mask[t, :n].tolist() == [False] * (n - len(reply)) + [True] * len(reply)
        assert not batch.loss_mask[t, n:].any()
        assert batch.old_logprobs[t][batch.loss_mask[t]].tolist() == pytest.approx(list(traj.turns[t].logprobs))
        assert not batch.old_logprobs[t][~batch.loss_mask[t]].any()
        assert batch.turn_ends[t].nonzero().flatten().tolist() == [n - 1]
        assert set(batch.turn_ids[t][batch.loss_mask[t]].tolist()) == {t}
    assert batch.group_ids.tolist() == [7] * N and batch.episode_ids is not None
    assert batch.episode_ids.tolist() == [0] * N


def test_golden_rows_of_a_window_of_two(tok, renderer) -> None:
    traj = _lake(renderer)
    batch = build_turn_batch([traj], tok, RolloutConfig(context_window=2))
    head0, head2 = _head(renderer, 0), _head(renderer, 2)
    rows = [batch.input_ids[t][batch.attention_mask[t]].tolist() for t in range(N)]
    assert rows[0] == head0 + [200, 201, 2]
    assert rows[1] == head0 + [200, 201, 2] + [101, 102, 103] + [210, 211, 2]
    # turn 3 with K=2: turn 2 re-rendered as the first user message (instruction in front), then turn 3
    assert rows[3] == head2 + [220, 221, 2] + [103, 104, 105] + [230, 231, 2]
    text = tok.decode(head2)
    assert RolloutConfig().system_prompt in text and INSTRUCTION in text and TEXTS[2] in text
    assert TEXTS[1] not in tok.decode(rows[3])


def test_every_row_carries_its_trajectorys_return_on_its_last_token(tok, renderer) -> None:
    lake = _lake(renderer)  # total_return = 1.0 + (-0.1) = 0.9
    batch = build_turn_batch([lake], tok, RolloutConfig(context_window=2))
    for t in range(N):
        n = int(batch.attention_mask[t].sum())
        pad = batch.rewards.shape[1] - n
        assert batch.rewards[t].tolist() == pytest.approx([0.0] * (n - 1) + [0.9] + [0.0] * pad)
    assert batch.returns.tolist() == pytest.approx([0.9] * N)
    assert batch.old_values is None and batch.turn_rewards is None


def test_rows_of_several_trajectories_keep_groups_and_select(tok, renderer) -> None:
    a, b = _lake(renderer, 3), _lake(renderer, 4, rewards=(0, 0, 0, 0, 0))
    short = Trajectory("FrozenLake", 11, 4, a.turns[:2], success=False, terminated=True, truncated=False,
                       meta={"instruction": INSTRUCTION, "user_texts": TEXTS[:2]})  # type: ignore[typeddict-item]
    batch = build_turn_batch([a, b, short], tok, RolloutConfig(context_window=2))
    assert batch.group_ids.tolist() == [3] * 5 + [4] * 5 + [4] * 2
    assert batch.episode_ids is not None and batch.episode_ids.tolist() == [0] * 5 + [1] * 5 + [2] * 2
    sub = batch.select([5, 10, 11])
    assert sub.episode_ids is not None and sub.episode_ids.tolist() == [1, 2, 2]
    assert sub.group_ids.tolist() == [4, 4, 4]


def test_a_turn_without_a_reply_makes_no_row(tok, renderer) -> None:
    lake = _lake(renderer)
    turns = list(lake.turns)
    turns[2] = Turn(TEXTS[2], turns[2].prompt_ids, (), (), "", (), 0.0, -0.1, False)
    gap = Trajectory("FrozenLake", 11, 0, tuple(turns), success=False, terminated=True, truncated=False,
                     meta=lake.meta)
    batch = build_turn_batch([gap], tok, RolloutConfig(context_window=2))
    assert batch.batch_size == N - 1
    assert [int(batch.turn_ids[b][batch.loss_mask[b]][0]) for b in range(N - 1)] == [0, 1, 3, 4]


def test_a_row_over_the_cap_loses_its_oldest_turns_first(tok, renderer) -> None:
    lake = _lake(renderer)
    full = build_turn_batch([lake], tok, RolloutConfig(context_window=3))
    n = int(full.attention_mask[4].sum())
    capped = build_turn_batch([lake], tok, RolloutConfig(context_window=3), max_length=n - 1)
    row = capped.input_ids[4][capped.attention_mask[4]].tolist()
    assert len(row) <= n - 1 and row == _expected_ids(lake, renderer, 4, 2)  # turn 2 dropped, turns 3-4 kept


def test_generation_sees_the_same_window_as_the_row(tok) -> None:
    # each per-turn row is exactly the prompt the generator saw for that turn, plus the reply it sampled
    moves = ["Right", "Down", "Left", "Up"]
    gen = ScriptedGenerator(tok, lambda c, r, p: f"<think>go</think><answer>{moves[c % 4]}</answer>")
    cfg = RolloutConfig(max_turns=5, context_window=2, max_actions_per_turn=1, max_actions_per_episode=5)
    params = {"size": 4, "p_frozen": 1.0, "slippery": False}  # no holes, no slips: all five turns happen
    (traj,) = run_rollouts(EnvConfig(name="FrozenLake", params=params), gen, tok, cfg, seeds=[3], n_per_group=1)
    assert len(traj.turns) == N
    batch = build_turn_batch([traj], tok, cfg)
    for t in range(N):
        row = batch.input_ids[t][batch.attention_mask[t]].tolist()
        assert row == list(gen.calls[t].prompts[0]) + list(traj.turns[t].response_ids)
    first = tok.decode(batch.input_ids[4][batch.attention_mask[4]].tolist())
    assert traj.meta["instruction"] in first and traj.turns[2].observation not in first


def test_context_window_full_keeps_todays_rows(tok, renderer) -> None:
    lake = _lake(renderer)
    today = build_token_batch([lake], tok, RolloutConfig())
    full = build_token_batch([lake], tok, RolloutConfig(context_window="full"))
    for name, value in vars(today).items():
        other = getattr(full, name)
        assert (value is None and other is None) or torch.equal(value, other), name
    assert full.episode_ids is None and full.batch_size == 1
    with pytest.raises(ValueError, match="context_window K"):
        build_turn_batch([lake], tok, RolloutConfig())
