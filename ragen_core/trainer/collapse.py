"""Template collapse, model side (SPEC §8): the teacher-forced matrix log p(z_i | x_j) and the MI diagnostics.

    from ragen_core.trainer.collapse import first_turn_pairs, cross_logprobs, measure_collapse
    pairs = first_turn_pairs(trajectories, tokenizer)         # distinct first-turn prompts X, reasonings Z
    cross = cross_logprobs(model, pairs.prompts, pairs.reasonings)   # [M, N] sequence log-probs
    m = measure_collapse(model, tokenizer, trajectories)      # collapse_metrics(...) + counts + seconds

X is everything the model saw before its reasoning content: the first turn's prompt ids, which end
with the ``<think>`` prefill (``rollout.prefill``; when the prefill is off, the ids of ``<think>`` are
appended, the reference's definition). Z is the reasoning content between the tags, tags excluded,
re-tokenised from its text (RAGEN-2 scores it the same way, ``first_turn_reasoning_ids``). Replies
without a closed think block, and empty ones, are left out (an empty Z scores 0 under every prompt
and says nothing). Prompts are keyed by their ids, so groups that share an initial state share a column.

:func:`cross_logprobs` runs ONE forward per distinct prompt and reuses its KV cache for every
candidate reasoning (the cache is repeated over a batch of reasonings, which then run only their own
tokens): N prompt passes of P tokens plus N·M reasoning rows of L tokens, instead of N·M rows of
P + L (the prompt is ~5x longer than a reasoning on Sokoban). Models whose layers are not all full
attention (a sliding-window cache would crop the repeated prompt, see ``forward.can_share``) run
whole [x_j ; z_i] rows instead, still batched. The pure math is ``ragen_core/algos/collapse.py``.

Tests: ``.venv/bin/python -m pytest tests/unit/trainer/test_trainer_collapse.py -q`` (against a naive
pair-at-a-time computation on the tiny model).
"""

from __future__ import annotations

import copy
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from ragen_core.algos import losses
from ragen_core.algos.collapse import collapse_metrics
from ragen_core.trainer.forward import (
    ONE_PIECE_LOGITS_BYTES,
    can_pack,
    can_share,
    decoder_and_head,
    pack_pays,
    packed_tail,
    vocab_size,
)

if TYPE_CHECKING:
    from transformers import DynamicCache, PreTrainedTokenizerBase

    from ragen_core.types import Trajectory

__all__ = ["THINK_OPEN", "ReasoningPairs", "cross_logprobs", "first_turn_pairs", "later_turn_pairs", "measure_collapse",
           "measure_later_turns"]

THINK_OPEN = "<think>"
_THINK_BLOCK = re.compile(r"<think>(.*?)</think>", re.DOTALL)


@dataclass(frozen=True)
class ReasoningPairs:
    """First-turn (prompt, reasoning) pairs of a batch: N distinct prompts, M reasonings."""

    prompts: tuple[tuple[int, ...], ...]
    """The N distinct prompts X (ids up to and including ``<think>``), in order of first appearance."""
    reasonings: tuple[tuple[int, ...], ...]
    """The M reasoning contents Z as ids (non-empty)."""
    texts: tuple[str, ...]
    """The M reasoning contents as text."""
    prompt_col: tuple[int, ...]
    """For each reasoning, the index of its own prompt in ``prompts``."""
    n_first_turns: int
    """First turns looked at, including those left out (no closed think block, or empty)."""


def first_turn_pairs(trajectories: Sequence[Trajectory], tokenizer: PreTrainedTokenizerBase) -> ReasoningPairs:
    """The (X, Z) pairs of the trajectories' first turns (module docstring says what X and Z are)."""
    return _pairs([(t, 0, tuple(t.turns[0].prompt_ids)) for t in trajectories if t.turns], tokenizer)


def later_turn_pairs(trajectories: Sequence[Trajectory], tokenizer: PreTrainedTokenizerBase, n: int,
                     rng: np.random.Generator) -> ReasoningPairs:
    """(X, Z) pairs of later turns, trajectory-uniform (RAGEN-2): up to ``n`` multi-turn trajectories drawn
    without replacement, one turn t >= 1 drawn uniformly in each. X is the whole context the model saw
    before turn t's reasoning (first prompt, the replies and prompt deltas up to turn t's, which ends with
    the prefill); trajectories whose context was cut by the guard (``dropped_turns``) are left out.
    Almost every later-turn context is its own prompt, so N is close to M."""
    multi = [t for t in trajectories if len(t.turns) > 1 and t.dropped_turns == 0]
    items = []
    for i in sorted(rng.permutation(len(multi))[:n].tolist()):
        traj = multi[i]
        turn = int(rng.integers(1, len(traj.turns)))
        x: list[int] = []
        for k in range(turn):
            x += [*traj.turns[k].prompt_ids, *traj.turns[k].response_ids]
        items.append((traj, turn, (*x, *traj.turns[turn].prompt_ids)))
    return _pairs(items, tokenizer)


def _pairs(items: Sequence[tuple[Trajectory, int, tuple[int, ...]]],
           tokenizer: PreTrainedTokenizerBase) -> ReasoningPairs:
    """ReasoningPairs of (trajectory, turn index, context ids before the reply) items."""
    think_ids = tuple(int(i) for i in tokenizer(THINK_OPEN, add_special_tokens=False)["input_ids"])
    prompts: dict[tuple[int, ...], int] = {}
    reasonings, texts, cols = [], [], []
    for traj, k, context in items:
        found = _THINK_BLOCK.search(traj.turns[k].response_text)
        if found is None:
            continue
        ids = tuple(int(i) for i in tokenizer(found.group(1), add_special_tokens=False)["input_ids"])
        if not ids:
            continue
        prefilled = str(traj.meta.get("prefill", "")).endswith(THINK_OPEN)
        x = context if prefilled else context + think_ids
        cols.append(prompts.setdefault(x, len(prompts)))
        reasonings.append(ids)
        texts.append(found.group(1))
    return ReasoningPairs(tuple(prompts), tuple(reasonings), tuple(texts), tuple(cols), len(items))


def _padded(reasonings: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and their mask. -> ([M, L] long, [M, L] bool)."""
    width = max(len(z) for z in reasonings)
    ids = torch.zeros(len(reasonings), width, dtype=torch.long)
    mask = torch.zeros(len(reasonings), width, dtype=torch.bool)
    for i, z in enumerate(reasonings):
        ids[i, :len(z)] = torch.tensor(list(z), dtype=torch.long)
        mask[i, :len(z)] = True
    return ids.to(device), mask.to(device)


def _score(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Summed log-probs of ``targets`` where ``mask``; hidden[:, t] predicts targets[:, t].

    hidden: [b, L, H], targets, mask: [b, L] -> [b]. The output layer runs only on the masked states.
    """
    logp = losses.logprobs_from_logits(head(hidden[mask]).float(), targets[mask])  # [n]
    rows = mask.nonzero()[:, 0]  # [n] the row of each scored token
    return torch.zeros(mask.shape[0], device=hidden.device).index_add(0, rows, logp)  # [b]


def cross_logprobs(model: torch.nn.Module, prompts: Sequence[Sequence[int]], reasonings: Sequence[Sequence[int]],
                   *, logits_bytes: int = ONE_PIECE_LOGITS_BYTES) -> torch.Tensor:
    """Teacher-forced sequence log-probs: out[i, j] = sum_t log p(z_i,t | x_j, z_i,<t). -> [M, N] float32.

    ``prompts``: N id sequences (each non-empty); ``reasonings``: M non-empty id sequences. Each prompt
    runs once; its KV cache is repeated over batches of reasonings (taken in length order, each cut to
    its longest) sized so that their fp32 logits stay under ``logits_bytes``. Temperature 1 (the policy
    itself). The model's train/eval mode is restored.
    """
    if not prompts or not reasonings or any(len(x) == 0 for x in prompts) or any(len(z) == 0 for z in reasonings):
        raise ValueError("cross_logprobs needs at least one prompt and one reasoning, none of them empty")
    decoder, head = decoder_and_head(model)
    device = next(model.parameters()).device
    z, z_mask = _padded(reasonings, device)  # [M, L]
    m, width = z.shape
    lengths = z_mask.sum(dim=1)  # [M]
    order = torch.argsort(lengths, stable=True)  # [M] batches of reasonings of similar length
    vocab = vocab_size(head)
    rows_per_pass = max(1, logits_bytes // (width * vocab * 4))
    share = can_share(decoder)
    out = torch.empty(m, len(prompts), dtype=torch.float32, device=device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for j, prompt in enumerate(prompts):
                x = torch.tensor([list(prompt)], dtype=torch.long, device=device)  # [1, P]
                prefilled = _prefill(decoder, x) if share else None  # (cache, last hidden state)
                for start in range(0, m, rows_per_pass):
                    rows = order[start:start + rows_per_pass]  # [b] similar lengths: little padding
                    cut = int(lengths[rows].max())
                    ids, mask = z[rows, :cut], z_mask[rows, :cut]  # [b, L_b]
                    hidden = (_continue(decoder, *prefilled, ids, mask) if prefilled is not None
                              else _whole_rows(decoder, x, ids, mask))  # [b, L_b, H]
                    out[rows, j] = _score(head, hidden, ids, mask)
    finally:
        model.train(was_training)
    return out


def _prefill(decoder: torch.nn.Module, x: torch.Tensor) -> tuple[DynamicCache, torch.Tensor]:
    """One prompt pass: its KV cache and its last hidden state (which predicts z's first token). x: [1, P]."""
    # lazily: transformers takes seconds to import and only model code paths need it
    from transformers import DynamicCache

    cache = DynamicCache()
    hidden = decoder(input_ids=x, past_key_values=cache, use_cache=True).last_hidden_state  # [1, P, H]
    return cache, hidden[:, -1:]  # [1, 1, H]


def _continue(decoder: torch.nn.Module, cache: DynamicCache, last: torch.Tensor, z: torch.Tensor,
              z_mask: torch.Tensor) -> torch.Tensor:
    """Hidden states predicting each token of z after the cached prompt. z, z_mask: [b, L] -> [b, L, H].

    State 0 is the prompt's last (shared); states 1..L-1 come from running z[:, :-1] on a copy of the
    prompt's cache repeated b times (right padding: real tokens never attend to the pads after them), or, when
    :func:`~ragen_core.trainer.forward.pack_pays` (short, uneven reasonings), packed into one row on the one-row
    cache (``forward.packed_tail``): on the demo's first turns, 28 reasonings of 11.4 tokens on average
    would run as 28 × 26 padded positions per prompt.
    """
    b, width = z.shape
    first = last.expand(b, -1, -1)  # [b, 1, H]
    if width == 1:
        return first
    p = cache.get_seq_length()
    tails = (z_mask.sum(dim=1) - 1).clamp(min=0)  # [b] real tokens of z[:, :-1]
    if can_pack(decoder) and pack_pays(tails.tolist(), p):
        rest = packed_tail(decoder, z[:, :-1], tails, p, copy.deepcopy(cache))  # [b, L - 1, H], 0 on padding
        return torch.cat([first, rest], dim=1)  # [b, L, H]
    rows_cache = copy.deepcopy(cache)
    rows_cache.batch_repeat_interleave(b)  # [1, heads, P, d] -> [b, heads, P, d] per layer
    mask = torch.cat([z_mask.new_ones(b, p), z_mask[:, :-1]], dim=1).long()  # [b, P + L - 1]
    positions = torch.arange(p, p + width - 1, device=z.device).expand(b, -1)  # [b, L - 1]
    rest = decoder(input_ids=z[:, :-1], attention_mask=mask, position_ids=positions, past_key_values=rows_cache,
                   use_cache=True).last_hidden_state  # [b, L - 1, H]
    return torch.cat([first, rest], dim=1)  # [b, L, H]


def _whole_rows(decoder: torch.nn.Module, x: torch.Tensor, z: torch.Tensor, z_mask: torch.Tensor) -> torch.Tensor:
    """The same hidden states from whole [x ; z] rows (no cache reuse). x: [1, P], z, z_mask: [b, L] -> [b, L, H]."""
    b, p = z.shape[0], x.shape[1]
    ids = torch.cat([x.expand(b, -1), z], dim=1)  # [b, P + L]
    mask = torch.cat([z_mask.new_ones(b, p), z_mask], dim=1).long()
    hidden = decoder(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state  # [b, P + L, H]
    return hidden[:, p - 1 : -1]  # [b, L, H] states P-1 .. P+L-2 predict z_0 .. z_{L-1}


def measure_collapse(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase,
                     trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """:func:`~ragen_core.algos.collapse.collapse_metrics` of the trajectories' first-turn reasonings.

    Sequence-level metrics (``mi``, ``cond_entropy``, ``retrieval_acc``, ... in nats), plus ``mi_per_token``
    (the same MI from length-normalised log-probs, the reference's headline ``mi_estimate``),
    ``n_first_turns``, ``valid_share`` (turns with a closed, non-empty think block), ``distinct_reasonings``
    (distinct texts), ``reasoning_tokens`` (mean length of Z) and ``seconds`` (wall time of the matrix).
    With no usable reasoning only the counts are returned.
    """
    return _measure(model, first_turn_pairs(trajectories, tokenizer))


def measure_later_turns(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase,
                        trajectories: Sequence[Trajectory], n: int, rng: np.random.Generator) -> dict[str, float]:
    """:func:`measure_collapse` on :func:`later_turn_pairs` (``n_first_turns`` then counts the drawn turns)."""
    return _measure(model, later_turn_pairs(trajectories, tokenizer, n, rng))


def _measure(model: torch.nn.Module, pairs: ReasoningPairs) -> dict[str, float]:
    counts = {"n_first_turns": float(pairs.n_first_turns), "n_reasonings": float(len(pairs.reasonings)),
              "valid_share": len(pairs.reasonings) / max(pairs.n_first_turns, 1),
              "distinct_reasonings": float(len(set(pairs.texts)))}
    if not pairs.reasonings:
        return counts
    started = time.perf_counter()
    cross = cross_logprobs(model, pairs.prompts, pairs.reasonings).cpu()  # [M, N]
    seconds = time.perf_counter() - started
    col = torch.tensor(pairs.prompt_col)
    lengths = torch.tensor([float(len(z)) for z in pairs.reasonings])  # [M]
    out = collapse_metrics(cross, col)
    out["mi_per_token"] = collapse_metrics(cross / lengths.unsqueeze(1), col)["mi"]
    return {**out, **counts, "reasoning_tokens": float(lengths.mean()), "seconds": seconds}
