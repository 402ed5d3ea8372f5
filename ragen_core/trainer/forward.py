"""Chunked forward passes: token log-probs, entropy and values without a full [B, T, V] logits tensor.

The output layer dominates memory for small models with big vocabularies: one
fp32 logits copy of 16×384 tokens over SmolLM2's 49k vocabulary is 1.2 GB, and
autograd keeps several. So the backbone runs once to give hidden states
[B, T, H], and the output layer is applied chunk by chunk over T
(``trainer.logprob_chunk``). When there is more than one chunk and gradients
are on, each chunk is recomputed in backward (activation checkpointing), so only
one chunk's logits ever exist, in forward or backward. Logits that fit in
``ONE_PIECE_LOGITS_BYTES`` are made in one piece instead (no recompute).

Alignment follows ``ragen_core.types``: ``logprobs[b, t]`` scores
``input_ids[b, t]`` from the hidden state at t − 1, and ``values[b, t]`` is the
critic's value of the state before token t is generated (hidden state at
t − 1), as veRL aligns them. Position 0 is never trained and holds 0.

Logits are divided by the rollout temperature so that, before any update, the
ratio to the sampling log-probs is 1 (as veRL does).

Run the tests with ``python -m pytest tests/unit/trainer -q``.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ragen_core.algos import losses
from ragen_core.models.causal_lm import causal_lm, unwrap_lora
from ragen_core.rollout.generators import cpu_attention
from ragen_core.rollout.generators.attention import implementation
from ragen_core.trainer import attention

__all__ = [
    "GROUP_BATCH_PADDING",
    "MIN_SHARED_PREFIX",
    "ONE_PIECE_LOGITS_BYTES",
    "SPLIT_ATTENTION",
    "SPLIT_CALL_PAIRS",
    "PackedRows",
    "PolicyOutput",
    "backbone_tokens",
    "can_pack",
    "can_share",
    "chunked_logprobs",
    "decoder_and_head",
    "first_scored",
    "group_batches",
    "hidden_states",
    "logits_gradient_in_place",
    "pack_pays",
    "packed_group",
    "packed_groups",
    "packed_tail",
    "policy_forward",
    "shared_prefix_groups",
    "shift_values",
    "split_attention",
    "split_pays",
    "vocab_size",
]


class PolicyOutput(NamedTuple):
    """What one actor forward gives, all [B, T] aligned with input_ids (0 at position 0)."""

    logprobs: torch.Tensor
    entropy: torch.Tensor
    hidden: torch.Tensor  # [B, T, H] last hidden states (for a value head on the actor)


def decoder_and_head(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(decoder backbone, output layer) of a causal LM, looking through a peft wrapper.

    Works for any transformers ``*ForCausalLM`` (``get_decoder`` / ``get_output_embeddings``).
    With LoRA the decoder's linear layers already carry the adapters, so calling
    it trains them; ``with model.disable_adapter():`` turns them off for a reference pass.
    """
    base = causal_lm(unwrap_lora(model))
    head = base.get_output_embeddings()
    if head is None:
        raise TypeError(f"{type(base).__name__} has no output layer; the actor must be a causal LM")
    return base.get_decoder(), head


def vocab_size(head: nn.Module) -> int:
    """Output size of a causal LM's output layer: its ``out_features``, else its weight's rows ([V, H])."""
    out_features = getattr(head, "out_features", 0)
    if out_features:
        return int(out_features)
    weight = head.weight
    assert isinstance(weight, torch.Tensor), "an output layer's weight is a parameter, not a submodule"
    return int(weight.shape[0])


ONE_PIECE_LOGITS_BYTES = 256 * 2**20
"""Scored logits up to this size (4 rows × 340 positions of a 49k vocabulary) skip chunking."""

MIN_SHARED_PREFIX = 16
"""Rows sharing at least this many leading tokens have that prefix run once (see :func:`hidden_states`)."""


def shared_prefix_groups(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, min_shared: int = MIN_SHARED_PREFIX
) -> list[tuple[list[int], int]]:
    """Rows of a right-padded batch that share a leading prefix, as [(rows, prefix length)].

    input_ids, attention_mask: [B, T]. A row joins the group whose first row shares the
    longest prefix with it, if that is at least ``min_shared`` tokens and joining saves work; a
    group's prefix is the shortest such share among its rows, and always leaves each row at least
    one token of its own (a query with nothing to attend to but padding would be undefined).
    Joining a group of n rows with prefix p at a shorter share s makes its n rows run p − s more
    tokens each and saves the new row s: a row joins only when s > n·(p − s). So two prompt groups
    whose prompts part after a few tokens (Bandit's seeds share a 38-token system prompt, then a
    190-token prompt within a group) stay two groups with their whole prompts, not one on the 38.
    Rows sharing nothing form groups of one with prefix 0. Every row is in exactly one group.
    """
    ids = input_ids.tolist()
    lengths = attention_mask.sum(dim=1).tolist()
    groups: list[tuple[list[int], int]] = []
    for r, row in enumerate(ids):
        best, best_len = -1, 0
        for g, (rows, prefix) in enumerate(groups):
            head = rows[0]
            cap = min(int(lengths[r]), int(lengths[head])) - 1
            n = 0
            while n < cap and row[n] == ids[head][n]:
                n += 1
            saves = len(rows) == 1 or n >= prefix or n > len(rows) * (prefix - n)
            if n >= min_shared and n > best_len and saves:
                best, best_len = g, n
        if best < 0:
            groups.append(([r], 0))
        else:
            rows, prefix = groups[best]
            groups[best] = ([*rows, r], best_len if len(rows) == 1 else min(prefix, best_len))
    return groups


def can_share(decoder: nn.Module) -> bool:
    """Prefix sharing needs the KV cache (off under gradient checkpointing in training) and plain
    full attention in every layer (a sliding-window cache would crop the repeated prefix)."""
    if decoder.training and getattr(decoder, "gradient_checkpointing", False):
        return False
    config = getattr(decoder, "config", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return all(t == "full_attention" for t in layer_types)
    return getattr(config, "sliding_window", None) is None


PACKED_ATTENTION = ("sdpa", "eager", attention.NAME)
"""Attention implementations that take the packed row's block-diagonal 4D mask as it is (flash-attention
kernels read only padding from a mask)."""


def can_pack(decoder: nn.Module) -> bool:
    return getattr(getattr(decoder, "config", None), "_attn_implementation", None) in PACKED_ATTENTION


def hidden_states(decoder: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Last hidden states of a decoder. input_ids, attention_mask: [B, T] -> [B, T, H].

    Rows are right-padded, so default positions 0..T−1 are right for every row.

    Rows that share a leading prefix (the N responses of one prompt group share its whole
    first prompt, SPEC §3) have the prefix run once: its keys and values are repeated for the
    rows, which then run only their own tokens. Causal attention makes the prefix's hidden
    states independent of what follows, so this is the same computation (equal within float
    rounding), and autograd sums the rows' gradients through the repeated prefix. When
    :func:`pack_pays` (short, uneven tails), the prefix and the rows' own tokens packed after it
    run as one row (:func:`packed_group`) instead of the tails padded to the longest on a
    repeated prefix cache. For a single-turn Bandit group of 8 (187-token prompt, replies of ~26
    tokens capped at 48) it runs about 400 tokens instead of 8 × 235 = 1,880 (padded tails: 571).
    Not used under gradient checkpointing, which switches the cache off, nor with sliding-window
    layers.
    """
    with attention.use_segment_attention(decoder):
        return _hidden_states(decoder, input_ids, attention_mask)


def _hidden_states(decoder: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    mask = attention_mask.long()
    groups = [g for g in shared_prefix_groups(input_ids, attention_mask) if g[1] > 0] if can_share(decoder) else []
    if not groups:
        return decoder(input_ids=input_ids, attention_mask=mask, use_cache=False).last_hidden_state
    # lazily: transformers takes seconds to import and only model code paths need it
    from transformers import DynamicCache

    parts: list[torch.Tensor] = []
    order: list[int] = []
    packed: list[tuple[list[int], torch.Tensor, torch.Tensor, int]] = []  # groups that run packed
    for rows, prefix in groups:
        index = torch.tensor(rows, device=input_ids.device)
        ids, m = input_ids[index], mask[index]  # [n, T]
        tails = m[:, prefix:].sum(dim=1)  # [n] each row's own tokens (right-padded, at least 1)
        if can_pack(decoder) and pack_pays(tails.tolist(), prefix):
            packed.append((list(rows), ids, tails, prefix))  # run below, together where that pays
            continue
        cache = DynamicCache()
        head = decoder(input_ids=ids[:1, :prefix], attention_mask=m[:1, :prefix], past_key_values=cache,
                       use_cache=True)
        cache.batch_repeat_interleave(len(rows))  # [1, heads, prefix, d] -> [n, heads, prefix, d]
        tail = decoder(input_ids=ids[:, prefix:], attention_mask=m, past_key_values=cache,
                       use_cache=True).last_hidden_state
        shared = head.last_hidden_state.expand(len(rows), -1, -1)  # [n, prefix, H]
        parts.append(torch.cat([shared, tail], dim=1))  # [n, T, H]
        order.extend(rows)
    if packed:
        together = attention.runs_segment_kernel(decoder)
        lengths = [prefix + int(tails.sum()) for _, _, tails, prefix in packed]
        for batch in group_batches(lengths) if together else [[i] for i in range(len(packed))]:
            jobs = [packed[i] for i in batch]
            parts.extend(packed_groups(decoder, [(ids, tails, prefix) for _, ids, tails, prefix in jobs]))
            for rows, *_ in jobs:
                order.extend(rows)
    rest = sorted(set(range(input_ids.shape[0])) - set(order))
    if rest:
        index = torch.tensor(rest, device=input_ids.device)
        parts.append(decoder(input_ids=input_ids[index], attention_mask=mask[index], use_cache=False).last_hidden_state)
        order.extend(rest)
    inverse = torch.empty(len(order), dtype=torch.long, device=input_ids.device)
    inverse[torch.tensor(order, device=input_ids.device)] = torch.arange(len(order), device=input_ids.device)
    return torch.cat(parts, dim=0)[inverse]


ATTENTION_PAIR_COST = 1 / 3000
"""Cost of one (query, key) attention pair relative to one token's linear layers. Per layer, a token's
projections and MLP cost 2 × (2·H² + 2·H·K + 3·H·I) ≈ 7.1 M FLOPs for SmolLM2-135M (H 576, keys and values
K 192, MLP I 1536), a pair 4·H ≈ 2.3 k (scores and weighted values): about 1/3000. The ratio falls as 1/H
in larger models, so there the estimate errs towards padding."""


def pack_pays(tails: list[int], prefix: int) -> bool:
    """Whether a shared-prefix group's own tokens run faster packed into one row than padded to the longest.

    tails: each row's own-token count; prefix: the shared prefix length. Padded, the rows run
    n × max(tails) tokens, each attending to prefix + max(tails) keys. Packed, they run sum(tails)
    tokens in one row: no padding, and attention either over the whole packed row (one call on the block
    mask, where the mask skips nothing) or, where :func:`split_pays`, each row's tokens over the prefix and
    their own row, plus :data:`SPLIT_CALL_PAIRS` a row. Costs are in token linear-layer units
    (:data:`ATTENTION_PAIR_COST`); packing must come out under 0.9 times padding. Short, uneven replies (a
    single-turn group) pack; long multi-turn rows pack when they are uneven enough for the padding saved
    to outweigh the extra calls, and rows of nearly one length stay padded.
    """
    n, longest, total = len(tails), max(tails), sum(tails)
    padded = n * longest * (1 + (prefix + longest) * ATTENTION_PAIR_COST)
    if split_pays(tails, prefix):
        pairs = sum(t * (prefix + t) for t in tails) + n * SPLIT_CALL_PAIRS
    else:
        pairs = total * (prefix + total)
    packed = total + pairs * ATTENTION_PAIR_COST
    return n > 1 and packed < 0.9 * padded


def backbone_tokens(lengths: Sequence[int], groups: Sequence[tuple[Sequence[int], int]], pack: bool) -> int:
    """Token positions :func:`hidden_states` runs for one micro-batch, padding included (its compute and
    activation memory both grow with this); an upper bound where packed groups run one at a time.

    lengths: each row's real length; groups: [(rows, shared prefix)] as :func:`shared_prefix_groups`
    gives them, or [] where the decoder cannot share (:func:`can_share`); pack: :func:`can_pack`.
    The micro-batch is padded to W = max(lengths). A group of n > 1 rows with a prefix runs the prefix
    once, then its rows' own tokens packed (sum of the tails, when :func:`pack_pays`) or padded
    (n × (W − prefix)); every other row runs whole, padded to W. Packed groups count as
    :func:`group_batches` pads them to run together (as they run on the segment kernel: :func:`packed_groups`).
    """
    if not lengths:
        return 0
    width = max(lengths)
    total, alone, packed = 0, len(lengths), []
    for rows, prefix in groups:
        if prefix <= 0 or len(rows) < 2:
            continue
        tails = [lengths[r] - prefix for r in rows]
        if pack and pack_pays(tails, prefix):
            packed.append(prefix + sum(tails))
        else:
            total += prefix + len(rows) * (width - prefix)
        alone -= len(rows)
    total += sum(len(batch) * packed[batch[0]] for batch in group_batches(packed))
    return total + alone * width


def _packed_layout(ids: torch.Tensor, tails: torch.Tensor,
                   prefix: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows' own tokens laid out as one packed row after a shared prefix.

    ids: [n, W] the rows after the prefix (right-padded), tails: [n] their real lengths. Returns
    real [n, W] (which positions are tokens), packed [S] (those tokens in row order), positions [S]
    (each token's position in its own row, prefix + offset) and own [S, S] (token i may attend to
    token j: same row, j not after i).
    """
    n, width = ids.shape
    offsets = torch.arange(width, device=ids.device)
    real = offsets[None, :] < tails[:, None]  # [n, W]
    positions = (prefix + offsets).expand(n, -1)[real]  # [S]
    segment = torch.arange(n, device=ids.device)[:, None].expand(-1, width)[real]  # [S] source row
    own = (segment[:, None] == segment[None, :]) & (positions[:, None] >= positions[None, :])  # [S, S]
    return real, ids[real], positions, own


def packed_tail(decoder: nn.Module, ids: torch.Tensor, tails: torch.Tensor, prefix: int,
                 cache: object) -> torch.Tensor:
    """Hidden states of rows' own tokens run as one packed row on a one-row prefix cache.

    ids: [n, W] the rows after the shared prefix (right-padded), tails: [n] their real lengths,
    cache: the prefix's keys and values (batch 1). Each token attends to the whole prefix and
    causally to its own row's earlier tokens, at its own position (prefix + offset), so it is the
    padded computation without the padding. Returns [n, W, H], zeros at padded positions.
    """
    n, width = ids.shape
    real, packed, positions, own = _packed_layout(ids, tails, prefix)
    mask = torch.cat([own.new_ones(own.shape[0], prefix), own], dim=1)[None, None]  # [1, 1, S, prefix + S]
    out = decoder(input_ids=packed[None], attention_mask=mask, position_ids=positions[None], past_key_values=cache,
                  use_cache=True).last_hidden_state  # [1, S, H]
    return out.new_zeros(n, width, out.shape[-1]).masked_scatter(real[..., None], out[0])  # [n, W, H]


SPLIT_ATTENTION = "ragen_packed_sdpa"
"""The attention implementation an sdpa decoder runs :func:`packed_group`'s row with (registered in transformers'
``AttentionInterface`` on first use, switched to for that one call): :func:`split_attention`."""


@dataclass(frozen=True)
class PackedRows:
    """A packed row's parts, for :func:`split_attention`: the shared prefix's length, each row's own-token count
    (the rows follow the prefix in this order) and each row's mask [length, prefix + length] (True: may attend)
    over the prefix and its own tokens."""

    prefix: int
    lengths: tuple[int, ...]
    masks: tuple[torch.Tensor, ...]

    @classmethod
    def of(cls, tails: Sequence[int], prefix: int, device: torch.device) -> PackedRows:
        masks = []
        for length in tails:
            own = torch.ones(length, length, dtype=torch.bool, device=device).tril()
            masks.append(torch.cat([own.new_ones(length, prefix), own], dim=1))
        return cls(prefix, tuple(int(t) for t in tails), tuple(masks))


def split_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                    packed_rows: PackedRows | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """A transformers attention function: a packed row's attention in parts, each on the pairs it needs.

    query [1, heads, P + S, d], key and value [1, kv heads, P + S, d] of a row laid out as :func:`packed_group`
    lays it out (``packed_rows``). The prefix attends causally to itself (one causal call, which skips the
    blocks above the diagonal); each row's own tokens attend to the prefix and causally to each other (one
    masked call a row, over P + its length keys). One call over the whole block mask computes every
    (P + S)² pair, most of them masked out: for 4 FrozenLake rows of 46-505 tokens on a 196-token prompt 2.5
    times the pairs needed (for short replies the extra calls cost more than the pairs saved: :func:`split_pays`
    decides). The softmax of each query is over the same
    keys, so the result is the block-mask call's up to float rounding, forward and backward. Returns
    [1, P + S, heads, d], as transformers' sdpa function does. Without ``packed_rows`` it is that function.
    """
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    if packed_rows is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    device = query.device.type
    if torch.is_autocast_enabled(device):  # cast once here, not the prefix's keys again in every row's call
        dtype = torch.get_autocast_dtype(device)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    groups = int(getattr(module, "num_key_value_groups", 1))
    if groups > 1:
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    # split, not sliced: the backward of a slice writes its gradient into a zeroed full-size tensor, the
    # backward of one split concatenates the parts' gradients
    sizes = [packed_rows.prefix, *packed_rows.lengths]
    queries, keys, values = query.split(sizes, dim=2), key.split(sizes, dim=2), value.split(sizes, dim=2)
    parts = [F.scaled_dot_product_attention(queries[0], keys[0], values[0], dropout_p=dropout, is_causal=True,
                                            scale=scaling)]
    for i, mask in enumerate(packed_rows.masks, start=1):  # [1, heads, length, d] over P + length keys
        parts.append(F.scaled_dot_product_attention(queries[i], torch.cat([keys[0], keys[i]], dim=2),
                                                    torch.cat([values[0], values[i]], dim=2), attn_mask=mask,
                                                    dropout_p=dropout, scale=scaling))
    return torch.cat(parts, dim=2).transpose(1, 2).contiguous(), None


SPLIT_CALL_PAIRS = 15_000
"""The cost of one more attention call (forward and backward, with its key copies) in (query, key) pairs.
Measured on a 2-core AVX512 CPU for SmolLM2-135M's 9 heads of 64, in fp32 (bf16 and bf16 autocast alike): a
Bandit group (8 replies of 15-48 tokens on a 187-token prompt) took 15.7 ms a layer in one block-mask call over
its 163k pairs and 16.5 ms split into 9 calls over 62k; a FrozenLake group (4 rows of 46-505 tokens on 196) 173
ms over 1.93M pairs against 73 ms split over 762k. Both fit about 0.09 µs a pair and 1.3 ms (14k pairs) a call."""


def split_pays(tails: Sequence[int], prefix: int) -> bool:
    """Whether :func:`split_attention` beats one call on the block mask for a packed row of ``prefix`` then rows
    of ``tails`` own tokens: the pairs it computes (the prefix's causal half, each row's tokens over the prefix and
    its own tokens), plus :data:`SPLIT_CALL_PAIRS` for each row's call, under 0.9 times the block mask's
    (prefix + S)². Long rows split (a few multi-turn rows), short replies on a long prompt (Bandit) do not."""
    total = prefix + sum(tails)
    split = prefix * prefix // 2 + sum(t * (prefix + t) for t in tails) + len(tails) * SPLIT_CALL_PAIRS
    return split < 0.9 * total * total


@contextlib.contextmanager
def _attention_implementation(config: object, name: str) -> Iterator[None]:
    """``config._attn_implementation`` set to ``name`` inside the block (registered with transformers first)."""
    from transformers import AttentionInterface

    if name not in AttentionInterface().valid_keys():
        AttentionInterface.register(name, split_attention)
    with implementation(config, name):
        yield


def packed_group(decoder: nn.Module, ids: torch.Tensor, tails: torch.Tensor, prefix: int) -> torch.Tensor:
    """Hidden states of a prompt group run as ONE row: its shared prefix, then its rows' own tokens packed.

    ids: [n, T] the group's rows (right-padded; the first ``prefix`` tokens the same in every row), tails:
    [n] each row's own-token count. The prefix attends causally to itself; each own token to the whole
    prefix and causally to its own row's earlier tokens, at its own position: the padded computation
    without the padding and with the prefix run once, as :func:`packed_tail` on a prefix cache, but in one
    decoder call of prefix + S tokens instead of two of prefix and S. The weight matmuls then run twice the
    rows at once, which a CPU runs at a higher FLOP rate (at SmolLM2's sizes about 90 against 115 GFLOP/s
    on 2 AVX2 cores, 190 rows against 380). One attention call on the block mask computes all (prefix + S)²
    pairs; where that is most of the work (long rows: :func:`split_pays`), an sdpa decoder computes it in parts
    instead (:func:`split_attention`: the prefix causally, each row on the prefix and itself).
    Returns [n, T, H], zeros at padded positions.
    """
    seq, at, mask, real = _packed_row(ids, tails, prefix)
    seq, at = seq[None], at[None]  # [1, prefix + S]
    config = decoder.config
    lengths = [int(t) for t in tails.tolist()]
    implementation = getattr(config, "_attn_implementation", None)
    split = implementation in ("sdpa", attention.NAME) and split_pays(lengths, prefix)
    extra = {"packed_rows": PackedRows.of(lengths, prefix, ids.device)} if split else {}
    # the segment attention function splits by itself where its kernel does not run
    switch = split and implementation == "sdpa"
    with _attention_implementation(config, SPLIT_ATTENTION) if switch else contextlib.nullcontext():
        out = decoder(input_ids=seq, attention_mask=mask[None, None], position_ids=at, use_cache=False,
                      **extra).last_hidden_state[0]  # [prefix + S, H]
    return _unpack_row(out, real, prefix)


def _packed_row(ids: torch.Tensor, tails: torch.Tensor,
                prefix: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A prompt group laid out as :func:`packed_group` runs it. ids: [n, T], tails: [n] -> (tokens [L], positions
    [L], mask [L, L] (True: may attend), real [n, T - prefix] (which of the rows' own positions are tokens)), with L
    = prefix + sum(tails)."""
    real, packed, positions, own = _packed_layout(ids[:, prefix:], tails, prefix)
    s = own.shape[0]
    causal = torch.ones(prefix, prefix, dtype=torch.bool, device=ids.device).tril()
    mask = torch.cat([torch.cat([causal, own.new_zeros(prefix, s)], dim=1),
                      torch.cat([own.new_ones(s, prefix), own], dim=1)], dim=0)  # [prefix + S, prefix + S]
    seq = torch.cat([ids[0, :prefix], packed])  # [prefix + S]
    at = torch.cat([torch.arange(prefix, device=ids.device), positions])  # [prefix + S]
    return seq, at, mask, real


def _unpack_row(out: torch.Tensor, real: torch.Tensor, prefix: int) -> torch.Tensor:
    """A packed row's hidden states [prefix + S, H] back as the group's rows [n, prefix + W, H], zeros at padding."""
    n, width = real.shape
    shared = out[:prefix].expand(n, -1, -1)  # [n, prefix, H]
    tail = out.new_zeros(n, width, out.shape[-1]).masked_scatter(real[..., None], out[prefix:])  # [n, W, H]
    return torch.cat([shared, tail], dim=1)


GROUP_BATCH_PADDING = 1 / 8
"""The most padding (a fraction of the real positions) :func:`group_batches` adds to run packed groups together."""


def group_batches(lengths: Sequence[int], padding: float = GROUP_BATCH_PADDING) -> list[list[int]]:
    """Packed prompt groups (their rows' lengths, prefix and own tokens) in batches that run as one decoder call
    (:func:`packed_groups`): longest first, each batch as many as fit with its rows padded to its longest within
    ``padding`` of its real positions. Indices into ``lengths``; every index once."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        if batches:
            batch = batches[-1]
            longest, real = lengths[batch[0]], sum(lengths[j] for j in batch) + lengths[i]
            if longest * (len(batch) + 1) <= (1 + padding) * real:
                batch.append(i)
                continue
        batches.append([i])
    return batches


def packed_groups(decoder: nn.Module, groups: Sequence[tuple[torch.Tensor, torch.Tensor, int]]) -> list[torch.Tensor]:
    """Several prompt groups' packed rows (:func:`packed_group`, each (ids [n, T], tails [n], prefix)) run as ONE
    decoder call, each row of the batch a group, right-padded to the longest; a padding position attends to its
    row's first key only, and is dropped. The weight matmuls then run on all the groups' positions at once: on 2
    AMX cores oneDNN ran two of a layer's bf16 products at about half their rate at 600-800 rows (a group's) and at
    full rate at 1,400-1,550 (docs/benchmarks.md). Meant for the segment attention kernel, which skips the masked pairs
    (:func:`ragen_core.trainer.attention.runs_segment_kernel`); elsewhere the padded rows' attention runs on the
    dense mask. Returns each group's [n, T, H], as :func:`packed_group` does."""
    if len(groups) == 1:
        return [packed_group(decoder, *groups[0])]
    rows = [_packed_row(ids, tails, prefix) for ids, tails, prefix in groups]
    width = max(seq.shape[0] for seq, *_ in rows)
    device = rows[0][0].device
    seqs = torch.zeros(len(rows), width, dtype=rows[0][0].dtype, device=device)
    at = torch.zeros(len(rows), width, dtype=rows[0][1].dtype, device=device)
    mask = torch.zeros(len(rows), 1, width, width, dtype=torch.bool, device=device)
    mask[:, 0, :, 0] = True  # padding attends to the first key (its output is dropped)
    for i, (seq, positions, block, _) in enumerate(rows):
        n = seq.shape[0]
        seqs[i, :n], at[i, :n] = seq, positions
        mask[i, 0, :n, :n] = block
    out = decoder(input_ids=seqs, attention_mask=mask, position_ids=at, use_cache=False).last_hidden_state
    return [_unpack_row(out[i, :seq.shape[0]], real, prefix)
            for i, ((seq, _, _, real), (_, _, prefix)) in enumerate(zip(rows, groups, strict=True))]


def _chunk_logprobs_entropy(
    hidden: torch.Tensor, labels: torch.Tensor, head: nn.Module, inv_temperature: float, entropy_grad: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of labels and entropy for one chunk. hidden: [B, C, H], labels: [B, C] -> ([B, C], [B, C])."""
    b, c, width = hidden.shape
    # as one [B·C, H] matrix: a [B, C, H] slice of the hidden states is not contiguous, and a linear layer on
    # such a 3-D input that requires grad runs as a batched matmul against the expanded weight, forward and
    # backward (measured at the demo's 8 × 40 positions: 178 + 200 ms against 135 + 125 as one matmul)
    flat = head(hidden.reshape(b * c, width))  # [B·C, V], the only logits tensor alive
    ops = cpu_attention.loss_ops() if flat.device.type == "cpu" and flat.stride(-1) == 1 else None
    if ops is not None and flat.dtype in (torch.float32, torch.bfloat16):
        # flat is this call's own: inside logits_gradient_in_place the backward writes the gradient over it
        lp, ent = _FusedLogprobsEntropy.apply(flat, labels.reshape(-1), inv_temperature, ops, _IN_PLACE.get())
        lp, ent = lp.view(b, c), ent.view(b, c)
        return lp, ent if entropy_grad else ent.detach()
    logits = flat.view(b, c, -1)  # [B, C, V]
    if inv_temperature != 1.0:  # at 1 (training rollouts' default) not another vocabulary-sized tensor
        logits = logits.float() * inv_temperature
    if entropy_grad:  # one exp pass over the vocabulary for both, in float32 (bf16 logits kept as they are)
        return losses.logprobs_and_entropy(logits, labels)
    logits = logits.float()
    logprobs = losses.logprobs_from_logits(logits, labels)  # [B, C]
    return logprobs, losses.entropy_from_logits(logits.detach())  # [B, C], a diagnostic only


_IN_PLACE: contextvars.ContextVar[bool] = contextvars.ContextVar("ragen_logits_gradient_in_place", default=False)


@contextlib.contextmanager
def logits_gradient_in_place() -> Iterator[None]:
    """The output layer's fused losses (:class:`_FusedLogprobsEntropy`) made inside the block write the logits'
    gradient over the logits in their backward, instead of into a fresh vocabulary-sized tensor. Only for graphs
    run backward once: a second backward through a retained graph (the gradient-bucket analysis' one per loss term)
    would need the logits again, and autograd refuses it (the logits' version is bumped)."""
    token = _IN_PLACE.set(True)
    try:
        yield
    finally:
        _IN_PLACE.reset(token)


class _FusedLogprobsEntropy(torch.autograd.Function):
    """(log-prob, entropy) of softmax(scale · logits) at labels on the CPU kernel (``cpu_attention.loss_ops``):
    losses.logprobs_and_entropy's values and gradient, computed a row at a time in a float32 copy that stays in
    the cache, where torch's ops make vocabulary-sized float32 tensors (the softmax, the casts), whose first touch
    costs more than the arithmetic. logits [N, V], labels [N] -> ([N], [N]) float32. Saves the logits (in their
    dtype) and two floats a row; the backward recomputes the softmax. ``in_place`` (:func:`logits_gradient_in_place`):
    the caller's logits are needed by nothing else and the graph runs backward once, and the backward writes their
    gradient over them (their version bumped, so a use that saved them too fails loudly): a fresh vocabulary-sized
    tensor's first touch cost more than the backward's arithmetic (on 2 AMX cores, 900 Bandit positions: 124 ms a
    call in the update against 21 ms for the kernel alone)."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, labels: torch.Tensor, scale: float, ops: Any,
                in_place: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        labels = labels.to(torch.long).contiguous()
        lp, ent, lse, expected = ops.logprobs_entropy_fwd(logits, labels, scale)
        ctx.save_for_backward(logits, labels, lse, expected)
        ctx.scale, ctx.ops, ctx.in_place = scale, ops, in_place
        return lp, ent

    @staticmethod
    def backward(ctx: Any, g_logprob: torch.Tensor, g_entropy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        logits, labels, lse, expected = ctx.saved_tensors
        grad = ctx.ops.logprobs_entropy_bwd(logits, labels, lse, expected, g_logprob.float().contiguous(),
                                            g_entropy.float().contiguous(), ctx.scale, ctx.in_place)
        if ctx.in_place:
            torch.autograd.graph.increment_version(logits)
        return grad, None, None, None, None


def chunked_logprobs(
    hidden: torch.Tensor,
    input_ids: torch.Tensor,
    head: nn.Module,
    temperature: float = 1.0,
    chunk: int = 128,
    entropy_grad: bool = True,
    start: int = 1,
    one_piece_bytes: int = ONE_PIECE_LOGITS_BYTES,
    scored: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token log-probs and entropy, the output layer applied ``chunk`` positions at a time.

    hidden: [B, T, H], input_ids: [B, T] -> (logprobs [B, T], entropy [B, T]);
    logprobs[:, t] = log softmax(head(hidden[:, t−1]) / temperature)[input_ids[:, t]],
    entropy[:, t] the entropy of that same distribution; both 0 at t = 0.
    ``entropy_grad`` False detaches the entropy (it is then a diagnostic only).
    With gradients on and more than one chunk, each chunk is checkpointed so the
    backward pass recomputes its logits instead of keeping them.
    ``start`` (>= 1): positions before it are not scored and hold 0, so a caller that needs
    only the replies (the loss mask begins after the first prompt) skips the output layer
    on the prompt: a 49k-vocabulary layer costs about a third of SmolLM2's per-token compute.
    ``one_piece_bytes``: when the fp32 logits of all scored positions fit in this many bytes
    they are made in one piece and kept for backward (recomputing them costs ~10% of an
    update); only larger ones are chunked and recomputed.
    ``scored`` ([B, T] bool, e.g. the loss mask): only these positions are scored, every other one holds 0
    (``start`` is then not used). The output layer runs on exactly those positions, gathered into one row:
    no padding after short replies and no env text between turns (in the demo's update: 384 and
    360 scored positions per micro-batch, 216 and 200 of them replies). The values are those of the
    positions' own rows, equal within float rounding.
    """
    if scored is not None:
        return _scored_logprobs(hidden, input_ids, head, temperature, chunk, entropy_grad, scored, one_piece_bytes)
    start = max(1, min(int(start), input_ids.shape[1]))
    h = hidden[:, start - 1 : -1]  # [B, T-start, H] states that predict tokens start..T-1
    labels = input_ids[:, start:]  # [B, T-start]
    n = h.shape[1]
    vocab = vocab_size(head)
    if h.shape[0] * n * vocab * 4 <= one_piece_bytes:
        chunk = max(n, 1)  # small enough: one piece, nothing recomputed in backward
    starts = list(range(0, n, chunk))
    recompute = torch.is_grad_enabled() and len(starts) > 1
    parts_lp, parts_ent = [], []
    for s in starts:
        args = (h[:, s : s + chunk], labels[:, s : s + chunk], head, 1.0 / temperature, entropy_grad)
        if recompute:
            lp, ent = checkpoint(_chunk_logprobs_entropy, *args, use_reentrant=False)
        else:
            lp, ent = _chunk_logprobs_entropy(*args)
        parts_lp.append(lp)
        parts_ent.append(ent)
    zero = hidden.new_zeros(hidden.shape[0], start, dtype=torch.float32)  # [B, start] positions not scored
    logprobs = torch.cat([zero, *parts_lp], dim=1)  # [B, T]
    entropy = torch.cat([zero, *parts_ent], dim=1)  # [B, T]
    return logprobs, entropy


def _scored_logprobs(
    hidden: torch.Tensor,
    input_ids: torch.Tensor,
    head: nn.Module,
    temperature: float,
    chunk: int,
    entropy_grad: bool,
    scored: torch.Tensor,
    one_piece_bytes: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`chunked_logprobs` on the ``scored`` positions only ([B, T] bool; position 0 never)."""
    b, t = input_ids.shape
    keep = scored.bool().clone()
    keep[:, 0] = False
    rows, cols = keep.nonzero(as_tuple=True)  # [S] each, row-major
    h = hidden[rows, cols - 1][None]  # [1, S, H] the states that predict them
    labels = input_ids[rows, cols][None]  # [1, S]
    n = h.shape[1]
    if n == 0:  # still through the head (one position, times 0): a backward must reach every parameter
        lp, ent = chunked_logprobs(hidden, input_ids, head, temperature, chunk, entropy_grad, t - 1, one_piece_bytes)
        return lp * 0.0, ent * 0.0
    zeros = hidden.new_zeros(b, t, dtype=torch.float32)
    piece = n if n * vocab_size(head) * 4 <= one_piece_bytes else max(1, chunk * b)  # positions a chunk
    starts = list(range(0, n, piece))
    recompute = torch.is_grad_enabled() and len(starts) > 1
    parts_lp, parts_ent = [], []
    for s in starts:
        args = (h[:, s : s + piece], labels[:, s : s + piece], head, 1.0 / temperature, entropy_grad)
        lp, ent = checkpoint(_chunk_logprobs_entropy, *args, use_reentrant=False) if recompute else \
            _chunk_logprobs_entropy(*args)
        parts_lp.append(lp[0])
        parts_ent.append(ent[0])
    return (zeros.index_put((rows, cols), torch.cat(parts_lp)),  # [B, T], 0 where not scored
            zeros.index_put((rows, cols), torch.cat(parts_ent)))


def policy_forward(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float = 1.0,
    chunk: int = 128,
    entropy_grad: bool = True,
    start: int = 1,
    one_piece_bytes: int = ONE_PIECE_LOGITS_BYTES,
    scored: torch.Tensor | None = None,
) -> PolicyOutput:
    """One actor forward: backbone once, then chunked log-probs and entropy. [B, T] inputs -> PolicyOutput.

    ``start``: the first position whose log-prob is needed; ``scored``: or exactly the positions that are
    (see :func:`chunked_logprobs`).
    """
    decoder, head = decoder_and_head(model)
    hidden = hidden_states(decoder, input_ids, attention_mask)  # [B, T, H]
    logprobs, entropy = chunked_logprobs(hidden, input_ids, head, temperature, chunk, entropy_grad, start,
                                         one_piece_bytes, scored)
    return PolicyOutput(logprobs, entropy, hidden)


def first_scored(loss_mask: torch.Tensor) -> int:
    """The first position any row trains on (loss_mask: [B, T] bool -> int, at least 1; 1 if none)."""
    cols = loss_mask.any(dim=0).nonzero()
    return max(1, int(cols[0])) if cols.numel() else 1


def shift_values(per_state: torch.Tensor) -> torch.Tensor:
    """Align per-position critic outputs with tokens: values[:, t] = per_state[:, t−1], 0 at t = 0.

    per_state: [B, T] (value of the prefix ending at each position) -> [B, T].
    """
    return torch.cat([per_state.new_zeros(per_state.shape[0], 1), per_state[:, :-1]], dim=1)
