"""Trajectories → TokenBatch: one right-padded row per trajectory, loss on exactly the sampled ids (SPEC §3, §4).

    from ragen_core.rollout.batch import build_token_batch
    batch = build_token_batch(trajectories, tokenizer, cfg.rollout, max_length=2048)

A row is the dialogue as the model last saw it plus its last reply (``context.render_dialogue``):
the first prompt (system, instruction, first state), then per turn the sampled reply ids and the
next prompt delta. ``input_ids`` hold exactly the sampled ids, never a re-tokenisation;
``loss_mask`` is True exactly on them (each reply's end-of-turn token included, the template's
text after it excluded), ``old_logprobs`` carries the sampler's log-probs at those positions
(``types.py`` alignment: position t holds log p(input_ids[t] | input_ids[:t])).

Rewards (SPEC §4), on the [B, T] ``rewards`` tensor:

* ``"last"``: the trajectory's ``total_return`` (env rewards + format penalties) on its last
  generated token;
* ``"turn"``: each turn's reward + penalty on that turn's last generated token. Rewards of turns
  the context guard dropped (or of a turn with an empty reply) are carried to the next turn
  end, so every row's rewards always sum to ``total_return``.

Turn boundaries are data: ``turn_ids`` (index into ``Trajectory.turns``, -1 on padding) and
``turn_ends`` (True on each turn's last generated token). Per turn (GiGPO's input, [B, K] with K the most
turns of a trajectory): ``turn_rewards`` (reward + penalty) and ``turn_states`` (``Turn.state_key`` as an
id, :func:`turn_state_ids`).

Per-turn rows (``rollout.context_window`` K, RAGEN-2's ``limited_multi_turn``; :func:`build_turn_batch`): each
turn with a reply is a row of its own, the context the model generated it from plus that reply: the system
message and instruction block (re-rendered in front of the first kept turn when older turns are dropped), the
previous turns of its window of K (their prompts and replies, K counting its own turn) and its own prompt. Only its
reply is under the loss mask (with its sampled ``old_logprobs``); its ``rewards`` hold the trajectory's
``total_return`` on the reply's last token (every row of a trajectory the same, as the reference gives them), and
``episode_ids`` says which trajectory a row came from. A row keeps its trajectory's ``group_id`` and ``returns``;
``old_values`` and the per-turn tensors are left out (the update computes values per row).

Context guard: ``max_length`` caps a row; the oldest turns go first (``context.py``), starting
from the turns the rollout already dropped (``Trajectory.dropped_turns``). A row that does not fit
even with only its last turn is cut from the left (mask alignment kept); nothing raises.

Run its tests: ``.venv/bin/python -m pytest tests/unit/rollout/test_rollout_batch.py -q``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from ragen_core.rollout.chat import ChatRenderer, RenderedSequence, Span
from ragen_core.rollout.context import render_dialogue
from ragen_core.rollout.prompts import make_renderer
from ragen_core.types import TokenBatch, Trajectory

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from ragen_core.config import RolloutConfig

__all__ = ["build_token_batch", "build_turn_batch", "mask_problems", "trajectory_row", "turn_row", "turn_state_ids"]


def trajectory_row(traj: Trajectory, renderer: ChatRenderer, window_turns: int | None = None,
                   max_length: int | None = None) -> RenderedSequence:
    """The guarded training row of one trajectory (spans with their generated/prompt roles)."""
    if not traj.turns:
        raise ValueError(f"trajectory (env {traj.env_tag}, seed {traj.seed}) has no turns; nothing to train on")
    return _dialogue_row(traj, len(traj.turns), renderer, window_turns, max_length, traj.dropped_turns)


def turn_row(traj: Trajectory, turn: int, renderer: ChatRenderer, window_turns: int,
             max_length: int | None = None) -> RenderedSequence:
    """Turn ``turn``'s own training row (module docstring, "Per-turn rows"): its guarded context (at most
    ``window_turns`` turns, its own included) and its reply, the only generated span."""
    # Trajectory.dropped_turns is where the LAST context started; an earlier turn's context started at or before
    # it, so its row starts where the window and the budget put it (exact unless the rollout overflowed its budget).
    row = _dialogue_row(traj, turn + 1, renderer, window_turns, max_length, 0)
    spans = tuple(s if s.turn == turn or not s.generated else Span(s.ids, False, s.turn) for s in row.spans)
    return RenderedSequence(spans=spans, start_turn=row.start_turn)


def _dialogue_row(traj: Trajectory, n: int, renderer: ChatRenderer, window_turns: int | None,
                  max_length: int | None, min_start: int) -> RenderedSequence:
    """The guarded row of the first ``n`` turns of ``traj`` starting no earlier than ``min_start``, every reply
    generated."""
    turns = traj.turns[:n]
    prompts = [t.prompt_ids for t in turns]
    responses = [t.response_ids for t in turns]
    logprobs = [t.logprobs for t in turns]
    texts = traj.meta.get("user_texts")
    texts = list(texts)[:n] if texts is not None and len(texts) == len(traj.turns) else None
    block = traj.meta.get("instruction")
    last = n - 1
    row = render_dialogue(renderer, prompts, responses, logprobs, block=block, user_texts=texts,
                          budget=max_length, window_turns=window_turns, min_start=min(min_start, last))
    if row is not None:
        return row
    # Not even the last turn fits: keep its last max_length tokens (never a crash; SPEC §3).
    only_last = render_dialogue(renderer, prompts, responses, logprobs, block=block, user_texts=texts,
                                budget=None, min_start=last)
    if only_last is None or max_length is None:  # unreachable: without a budget a start always exists
        raise AssertionError("render_dialogue without a budget returned nothing")
    return _cut_left(only_last, max_length)


def _cut_left(seq: RenderedSequence, max_length: int) -> RenderedSequence:
    """The last ``max_length`` tokens of ``seq``, spans trimmed at the cut."""
    drop = len(seq) - max_length
    spans = []
    for s in seq.spans:
        k = min(drop, len(s.ids))
        drop -= k
        if k < len(s.ids):
            spans.append(Span(s.ids[k:], s.generated, s.turn, s.logprobs[k:] if s.generated else ()))
    return RenderedSequence(spans=tuple(spans), start_turn=seq.start_turn)


def _rewards(row: RenderedSequence, traj: Trajectory, placement: str) -> list[float]:
    """Per-token rewards of one row (module docstring, "Rewards")."""
    ends = row.turn_ends
    out = [0.0] * len(ends)
    end_pos = [t for t, e in enumerate(ends) if e]
    if not end_pos:  # no generated token survived: nowhere to put a reward
        return out
    if placement == "last":
        out[end_pos[-1]] = traj.total_return
        return out
    if placement != "turn":
        raise ValueError(f"reward_placement must be 'last' or 'turn', got {placement!r}")
    turn_ids = row.turn_ids
    end_of_turn = {turn_ids[p]: p for p in end_pos}
    pending = 0.0
    for i, turn in enumerate(traj.turns):
        pending += turn.reward + turn.penalty
        if i in end_of_turn:
            out[end_of_turn[i]] += pending
            pending = 0.0
    out[end_pos[-1]] += pending  # a trailing turn with no generated token left in the row
    return out


def turn_state_ids(trajectories: Sequence[Trajectory]) -> list[list[int]]:
    """Each turn's ``state_key`` as an int, per trajectory: equal ids exactly for equal keys. A turn without a key
    ('') gets an id of its own, so an unknown state never joins a step group."""
    ids: dict[str, int] = {}
    fresh = itertools.count()  # every id is drawn once, so an unknown turn's id is nobody else's
    return [[ids.setdefault(turn.state_key, next(fresh)) if turn.state_key else next(fresh) for turn in t.turns]
            for t in trajectories]


def _per_turn(trajectories: Sequence[Trajectory]) -> tuple[torch.Tensor, torch.Tensor]:
    """(turn_rewards [B, K] float, turn_states [B, K] long) of the module docstring."""
    k_max = max(len(t.turns) for t in trajectories)
    rewards = torch.zeros((len(trajectories), k_max), dtype=torch.float32)
    states = torch.full((len(trajectories), k_max), -1, dtype=torch.long)
    for b, (t, ids) in enumerate(zip(trajectories, turn_state_ids(trajectories), strict=True)):
        rewards[b, : len(ids)] = torch.tensor([x.reward + x.penalty for x in t.turns], dtype=torch.float32)
        states[b, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    return rewards, states


def build_token_batch(
    trajectories: Sequence[Trajectory],
    tokenizer: PreTrainedTokenizerBase,
    rollout_cfg: RolloutConfig,
    max_length: int | None = None,
    *,
    renderer: ChatRenderer | None = None,
    reward_placement: str | None = None,
) -> TokenBatch:
    """One row per trajectory, right-padded to the longest row (module docstring).

    ``reward_placement`` (last | turn) overrides ``rollout_cfg.reward_placement``; pass
    ``ExperimentConfig.reward_placement``, which resolves "auto" by the estimator (auto alone means last).
    """
    placement = reward_placement or rollout_cfg.reward_placement
    placement = "last" if placement == "auto" else placement
    if not trajectories:
        raise ValueError("build_token_batch needs at least one trajectory")
    renderer_for = _renderers(tokenizer, rollout_cfg, renderer)
    rows = [trajectory_row(t, renderer_for(t), rollout_cfg.window_turns, max_length) for t in trajectories]
    columns = _columns(rows, trajectories, tokenizer, placement)
    turn_rewards, turn_states = _per_turn(trajectories)
    return TokenBatch(
        **columns, group_ids=torch.tensor([t.group_id for t in trajectories], dtype=torch.long),
        returns=torch.tensor([t.total_return for t in trajectories], dtype=torch.float32),
        old_values=_sampled_values(rows, trajectories, columns["loss_mask"]), turn_rewards=turn_rewards,
        turn_states=turn_states,
    )


def build_turn_batch(
    trajectories: Sequence[Trajectory],
    tokenizer: PreTrainedTokenizerBase,
    rollout_cfg: RolloutConfig,
    max_length: int | None = None,
    *,
    renderer: ChatRenderer | None = None,
) -> TokenBatch:
    """One row per turn with a reply (``rollout_cfg.context_window`` K turns of context; module docstring,
    "Per-turn rows"), right-padded to the longest row, trajectory by trajectory in turn order."""
    window = rollout_cfg.context_window
    if not isinstance(window, int):
        raise ValueError(f"build_turn_batch needs rollout.context_window K (an integer), got {window!r}")
    if not trajectories:
        raise ValueError("build_turn_batch needs at least one trajectory")
    renderer_for = _renderers(tokenizer, rollout_cfg, renderer)
    picked = [(e, t) for e, traj in enumerate(trajectories) for t, turn in enumerate(traj.turns) if turn.response_ids]
    if not picked:
        raise ValueError("build_turn_batch: no turn of these trajectories has a reply; nothing to train on")
    rows = [turn_row(trajectories[e], t, renderer_for(trajectories[e]), window, max_length) for e, t in picked]
    owners = [trajectories[e] for e, _ in picked]
    return TokenBatch(
        **_columns(rows, owners, tokenizer, "last"),
        group_ids=torch.tensor([t.group_id for t in owners], dtype=torch.long),
        returns=torch.tensor([t.total_return for t in owners], dtype=torch.float32),
        episode_ids=torch.tensor([e for e, _ in picked], dtype=torch.long),
    )


def _renderers(tokenizer: PreTrainedTokenizerBase, rollout_cfg: RolloutConfig,
               renderer: ChatRenderer | None) -> Callable[[Trajectory], ChatRenderer]:
    """Trajectory -> the renderer of the system prompt and prefill its rollout used (one per pair, made once)."""
    first = renderer or make_renderer(tokenizer, rollout_cfg)
    renderers = {(first.system_prompt, first.prefill): first}

    def renderer_for(t: Trajectory) -> ChatRenderer:
        # a re-rendered head must carry the system prompt and prefill the rollout used (no "prefill"
        # in meta: a trajectory from before prefilling existed, so none)
        key = (t.meta.get("system_prompt", rollout_cfg.system_prompt), t.meta.get("prefill", ""))
        if key not in renderers:
            renderers[key] = make_renderer(tokenizer, rollout_cfg, *key)
        return renderers[key]

    return renderer_for


def _columns(rows: Sequence[RenderedSequence], trajectories: Sequence[Trajectory],
             tokenizer: PreTrainedTokenizerBase, placement: str) -> dict[str, torch.Tensor]:
    """The [B, T] token columns of ``rows`` (row b from ``trajectories[b]``), right-padded to the longest."""
    width = max(len(r) for r in rows)
    pad = _pad_id(tokenizer)
    B = len(rows)
    input_ids = torch.full((B, width), pad, dtype=torch.long)
    attention_mask = torch.zeros((B, width), dtype=torch.bool)
    loss_mask = torch.zeros((B, width), dtype=torch.bool)
    old_logprobs = torch.zeros((B, width), dtype=torch.float32)
    rewards = torch.zeros((B, width), dtype=torch.float32)
    turn_ids = torch.full((B, width), -1, dtype=torch.long)
    turn_ends = torch.zeros((B, width), dtype=torch.bool)
    for b, (row, traj) in enumerate(zip(rows, trajectories, strict=True)):
        n = len(row)
        input_ids[b, :n] = torch.tensor(row.input_ids, dtype=torch.long)
        attention_mask[b, :n] = True
        loss_mask[b, :n] = torch.tensor(row.loss_mask, dtype=torch.bool)
        old_logprobs[b, :n] = torch.tensor(row.old_logprobs, dtype=torch.float32)
        rewards[b, :n] = torch.tensor(_rewards(row, traj, placement), dtype=torch.float32)
        turn_ids[b, :n] = torch.tensor(row.turn_ids, dtype=torch.long)
        turn_ends[b, :n] = torch.tensor(row.turn_ends, dtype=torch.bool)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask,
            "old_logprobs": old_logprobs, "rewards": rewards, "turn_ids": turn_ids, "turn_ends": turn_ends}


def _sampled_values(rows: Sequence[RenderedSequence], trajectories: Sequence[Trajectory],
                    loss_mask: torch.Tensor) -> torch.Tensor | None:
    """[B, T] the values the generator recorded (``Turn.values``) on the loss positions, 0 elsewhere; or None
    unless every row holds all its turns (none dropped, nothing cut) and every turn carries its values.

    Only then was each reply sampled in a context that is a prefix of its row (context.py), so a recorded value
    is the critic head's value at exactly that row position, what the update's forward would compute.
    """
    out = torch.zeros(loss_mask.shape, dtype=torch.float32)
    for b, (row, traj) in enumerate(zip(rows, trajectories, strict=True)):
        if row.start_turn != 0 or any(len(t.values) != len(t.response_ids) for t in traj.turns):
            return None
        values = [v for t in traj.turns for v in t.values]
        if int(loss_mask[b].sum()) != len(values):  # cut from the left (_cut_left)
            return None
        out[b, loss_mask[b]] = torch.tensor(values, dtype=torch.float32)
    return out


def _pad_id(tokenizer: PreTrainedTokenizerBase) -> int:
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            return value
    return 0



def mask_problems(batch: TokenBatch, trajectories: Sequence[Trajectory],
                  tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """What is wrong with ``batch``'s masks for ``trajectories`` (empty when nothing is).

    Independent of how the rows were built: it only uses the trajectories and the tokenizer.
    A row cut from the left (``_cut_left``) is reported, since its first kept reply is partial.
    A reply that quotes an observation is not counted as env text under the mask.
    """
    problems: list[str] = []
    for b, t in enumerate(trajectories):
        ids, mask, tids = batch.input_ids[b], batch.loss_mask[b], batch.turn_ids[b]
        kept = range(t.dropped_turns, len(t.turns))
        where = f"row {b} (env {t.env_tag}, seed {t.seed})"
        if ids[mask].tolist() != [i for k in kept for i in t.turns[k].response_ids]:
            problems.append(f"{where}: masked ids are not the sampled ids of turns {list(kept)}")
        if batch.old_logprobs[b][mask].tolist() != [x for k in kept for x in t.turns[k].logprobs]:
            problems.append(f"{where}: old_logprobs are not the sampled log-probs")
        if batch.old_logprobs[b][~mask].any():
            problems.append(f"{where}: old_logprobs non-zero outside the loss mask")
        for k in kept:
            turn = t.turns[k]
            text = tokenizer.decode(ids[mask & (tids == k)].tolist())
            if text != tokenizer.decode(list(turn.response_ids)):
                problems.append(f"{where}: turn {k} masked text {text!r} is not the reply")
        unmasked = tokenizer.decode(ids[~mask & batch.attention_mask[b]].tolist())
        masked = tokenizer.decode(ids[mask].tolist())
        for k in kept:
            obs = t.turns[k].observation.strip()
            if obs not in unmasked or (obs and obs in masked and obs not in t.turns[k].response_text):
                problems.append(f"{where}: observation of turn {k} is missing from the prompt or masked")
        n = int(batch.attention_mask[b].sum())
        if not batch.attention_mask[b, :n].all() or mask[n:].any() or (tids[n:] != -1).any() or (tids[:n] < 0).any():
            problems.append(f"{where}: padding is not right-aligned, or is trained or has a turn id")
        if int(batch.turn_ends[b].sum()) != sum(1 for k in kept if t.turns[k].response_ids):
            problems.append(f"{where}: turn_ends does not mark one token per kept turn")
    return problems
