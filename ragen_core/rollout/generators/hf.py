"""The ``hf`` generation backend (the default): batched, left-padded, KV-cached sampling with a transformers model.

Our own sampling loop (not ``model.generate``) so that we control exactly what RL needs: the log-probability
of every sampled id under ``log_softmax(logits / T)`` (base.py), stopping per row at the end-of-turn token,
per-row random streams (a row's samples do not depend on its batch neighbours), the KV cache, and a value
head's value of each sampled id's state (``value_head``).

A call prefills, then decodes:

- the prefill runs each row's new prompt tokens, on top of its reused cache, through
  ``decode_step.LlamaDecodeStep.prefill`` where the fast step covers the model (below): the decode step's fused,
  packed weights with LoRA merged, T tokens a row; else through ``model.forward`` (on CPU with attention.py's
  grouped-query SDPA). Rows with the same prompt and nothing reused (the N responses of a prompt on their first
  turn) are prefilled once, and different first-turn prompts that open alike (one env's instructions) have their
  common prefix prefilled once and reused as a kept cache; rows go in groups of at most ``prefill_chunk_tokens``
  padded tokens, sorted by length (a group's rows take consecutive slots of the decode batch). The keys and
  values land in preallocated buffers with room for the replies (kv.py), which decoding fills in place; with the
  fast step each group builds its cache straight in the decode batch's buffers;
- each decode step feeds one token per unfinished row through ``decode_step.LlamaDecodeStep`` where
  ``fast_decode`` is on (the default) and the model is covered (Llama, Qwen2): fused weight matmuls on
  oneDNN-packed weights, the fused CPU attention kernel of cpu_attention.py, and cascade attention over a prompt
  group's shared prompt (decode_step.py says when each applies). Otherwise the step is ``model.forward``.
  Finished rows leave the batch once the unfinished ones are fewer than ``shrink_below`` of it.

``compute_dtype`` bf16 over fp32 weights (the trainer's resolved ``trainer.precision``: bf16, or ``auto`` on a
CPU with bf16 matmul instructions) samples as the trainer's bf16 autocast computes: the fast step's prefill and
decode run their weight matmuls in bf16, keep the residual stream in fp32 and the keys and values in bf16 (its
cache and the kept caches; decode_step.py); ``model.forward`` prefills and steps run under ``torch.autocast``, and
the cache they fill is converted back to the weights' dtype. The sampled log-probabilities stay fp32.

Cross-turn cache reuse: with ``session_ids`` each episode keeps the keys/values of the
tokens it has seen (previous prompt + generated ids, minus the last sampled id, which was never fed
back). On its next turn only the new suffix of the prompt (the end-of-turn token and the new user
text) is prefilled, on top of the kept cache. The kept tokens must be a prefix of the new prompt;
otherwise the longest common prefix is reused (e.g. after the context guard dropped old turns, the
system prompt still matches), down to a full prefill. Positions come from the attention mask
(cumsum - 1), so rows with different cached lengths batch together with masked holes, and the
result equals a full re-prefill up to float rounding (tests check 1e-4 on log-probabilities).
Caches are dropped when the model's weights change (tracked with the parameters' version counters,
so an in-place optimizer step on a shared model is noticed too), on ``end_sessions``, and oldest
first when they exceed ``max_cached_bytes``; a call with ``SamplingParams.last_turn`` keeps none.

Run: ``python -m pytest tests/unit/rollout/test_generators.py -q``; speed: ``python bench/rollout.py``.
"""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import cast

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from ragen_core.rollout.generators.attention import gqa_attention
from ragen_core.rollout.generators.base import (
    FINISH_LENGTH,
    FINISH_STOP,
    STAT_KEYS,
    Generation,
    SamplingParams,
)
from ragen_core.rollout.generators.decode_step import LlamaDecodeStep, SharedPrefix, cascade_pays, decode_step_for
from ragen_core.rollout.generators.kv import (
    LayerKV,
    adopted_cache,
    cache_layers,
    growing_cache,
    kv_nbytes,
    stacked_cache,
    take_row,
)
from ragen_core.rollout.generators.sampling import draw_uniforms, row_generators, sample_from_logits

COMMON_PREFIX_MIN = 32
"""Fewest tokens of a common prefix of different first-turn prompts that is prefilled once for them
(``HFGenerator._on_common_prefix``)."""

SHRINK_BELOW = 0.5
"""The default ``shrink_below``. Measured (SmolLM2, one thread, 32 rows, 600 tokens): a step 0.27 s, dropping half
the rows 0.13 s (their whole caches are copied), a step with 16 rows 0.17 s, so it pays back in ~2 steps."""

SHARED_SHRINK_BELOW = 0.9
"""``shrink_below`` when the batch decodes under cascade attention (``_Batch.prefix``): dropping rows then copies
only their own decoded columns, not the prompt. Measured on the demo's rollouts (64 rows in 8 prompt groups, the
same sampled ids each time, alternating): 5.08 s at 0.9 (1.0: 5.11) against 5.57 s at 0.5, which left up to
half of the rows finished but still in every step's matmuls."""


@dataclass
class _Session:
    """What one episode keeps between turns: its tokens and their per-layer keys/values ([H, L, D])."""

    token_ids: tuple[int, ...]
    layers: list[LayerKV]
    nbytes: int


@dataclass(frozen=True)
class _Row:
    """The prefill plan of one prompt row."""

    prompt: tuple[int, ...]
    reused: int
    """Leading prompt tokens whose keys/values come from the session cache."""
    cached: list[LayerKV] | None
    """The session's cache cut to ``reused`` tokens (None when nothing is reused)."""
    limit: int
    """Most new tokens this row may sample."""

    @property
    def suffix(self) -> tuple[int, ...]:
        return self.prompt[self.reused :]


class HFGenerator:
    """Generator protocol over a transformers causal LM (CPU or GPU); see the module docstring."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: object | None = None,
        *,
        max_length: int | None = None,
        cache_reuse: bool = True,
        prefill_chunk_tokens: int = 8192,
        shrink_below: float | None = None,
        max_cached_bytes: int = 8 << 30,
        fast_decode: bool = True,
        value_head: torch.nn.Module | None = None,
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        """
        model: a causal LM whose forward accepts ``past_key_values``, ``position_ids`` and ``logits_to_keep``.
        tokenizer: only used for its pad id (any id works: padded slots are masked).
        max_length: context length cap (default: ``model.config.max_position_embeddings``).
        cache_reuse: keep per-session caches between calls (off = always a full prefill).
        prefill_chunk_tokens: rows are prefilled in groups of at most this many (padded) tokens,
            which bounds the attention scores' memory.
        shrink_below: finished rows are dropped from the decode batch once the unfinished ones are
            fewer than this fraction of it (0: never; 1: as soon as one finishes). None: 0.5
            (:data:`SHRINK_BELOW`), or :data:`SHARED_SHRINK_BELOW` under cascade attention, where a drop
            copies only the rows' own columns.
        max_cached_bytes: session caches beyond this are evicted, least recently used first.
        fast_decode: decode steps through ``decode_step.LlamaDecodeStep`` (same arithmetic, without
            ``model.forward``'s per-step machinery, on oneDNN-packed weights) where the architecture is
            covered; off = ``model.forward`` (``RolloutConfig.fast_decode``).
        value_head: a module mapping the model's last hidden state [..., H] to a value [..., 1] (the trainer's
            ``critic: head``): each ``Generation`` then carries the head's value of every sampled id's state
            (``Generation.values``), so the update needs no forward for its old values. It is read at each
            call, so an optimizer step on it is seen. Ignored (values None) for a model without a final norm
            module to read the hidden state from (``_final_norm``).
        compute_dtype: bf16 over fp32 weights samples as the trainer's bf16 autocast computes (the session
            passes its resolved ``trainer.precision``): the fast step's weight matmuls in bf16 and its cache
            bf16 (``LlamaDecodeStep``), or ``model.forward`` under ``torch.autocast`` with an fp32 cache; the
            sampled log-probabilities stay fp32. None: the weights' dtype throughout.
        """
        self.model = model
        self.device = next(model.parameters()).device
        config = getattr(model, "config", None)
        self.max_length = int(max_length or getattr(config, "max_position_embeddings", 0) or 1 << 30)
        pad = getattr(tokenizer, "pad_token_id", None)
        if pad is None:
            pad = getattr(tokenizer, "eos_token_id", None)
        self.pad_token_id = int(pad) if pad is not None else 0
        self.cache_reuse = cache_reuse
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.shrink_below = shrink_below
        self.max_cached_bytes = max_cached_bytes
        _check_plain_attention(model)
        weights = next(model.parameters()).dtype
        self.compute_dtype = compute_dtype if compute_dtype not in (None, weights) else None
        self._step = decode_step_for(model, self.compute_dtype) if fast_decode else None
        self.value_head = value_head
        self._norm = _final_norm(model)
        self._hidden: torch.Tensor | None = None  # [B, H] last position's hidden state, from the norm's hook
        self._sessions: OrderedDict[Hashable, _Session] = OrderedDict()
        self._cached_bytes = 0
        self._weights_version = self._current_weights_version()
        self._stats = dict.fromkeys(
            (*STAT_KEYS, "reused_tokens", "shared_prompt_tokens", "common_prefix_tokens", "calls"), 0.0
        )

    # ------------------------------------------------------------------ protocol

    @property
    def stats(self) -> dict[str, float]:
        """Cumulative counters: ``STAT_KEYS``, ``reused_tokens`` (prompt tokens taken from session caches),
        ``shared_prompt_tokens`` (prompt tokens of rows whose identical prompt was prefilled once),
        ``common_prefix_tokens`` (first-turn prompt tokens not prefilled because different prompts' common
        prefix was prefilled once for them, ``_on_common_prefix``)."""
        return dict(self._stats)

    def end_sessions(self, session_ids: Iterable[Hashable]) -> None:
        for sid in session_ids:
            self._drop_session(sid)

    def update_weights(self, model: torch.nn.Module) -> None:
        """Copy ``model``'s weights in (nothing to copy when it is our own model) and drop all caches."""
        if model is not self.model:
            with torch.no_grad():
                self.model.load_state_dict(model.state_dict(), strict=True)
        self._clear_sessions()
        self._weights_version = self._current_weights_version()
        if self._step is not None:
            self._step.invalidate()

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        session_ids: Sequence[Hashable] | None = None,
    ) -> list[Generation]:
        if session_ids is not None and len(session_ids) != len(prompts):
            raise ValueError(f"got {len(session_ids)} session ids for {len(prompts)} prompts")
        if session_ids is not None and len(set(session_ids)) != len(session_ids):
            raise ValueError("session ids must be distinct within one generate call")
        if not prompts:
            return []
        for i, prompt in enumerate(prompts):  # before any session cache is touched
            if not 0 < len(prompt) < self.max_length:
                raise ValueError(
                    f"prompt {i} has {len(prompt)} tokens; the model's context is {self.max_length} "
                    "(an empty prompt or a too long dialogue: see RolloutConfig.window_turns / max_context_tokens)"
                )
        was_training = self.model.training
        # eval mode: no dropout, and gradient checkpointing (training only) would switch the cache off
        self.model.eval()
        hook = None
        if self._records_values():  # only during this call: a training forward must not feed it
            hook = cast(torch.nn.Module, self._norm).register_forward_hook(self._keep_hidden)
        try:
            with torch.inference_mode(), gqa_attention(self.model):
                version = self._current_weights_version()
                if version != self._weights_version:
                    self._clear_sessions()  # weights changed in place: every kept cache is stale
                    self._weights_version = version
                    if self._step is not None:
                        self._step.invalidate()  # and so are the decode step's fused weights
                rows = [self._plan(i, p, params, session_ids) for i, p in enumerate(prompts)]
                return self._run(rows, params, session_ids)
        finally:
            self.model.train(was_training)
            self._hidden = None
            if hook is not None:
                hook.remove()

    # ------------------------------------------------------------------ values

    def _records_values(self) -> bool:
        return self.value_head is not None and self._norm is not None

    def _keep_hidden(self, module: torch.nn.Module, args: object, output: torch.Tensor) -> None:
        self._hidden = output[:, -1, :]  # [B, H]: rows are left-padded, so the last column is every row's last

    def _values(self, hidden: torch.Tensor | None = None) -> torch.Tensor | None:
        """[B] the value head on ``hidden`` ([B, H], the fast step's) or on the hook's last capture; None when
        values are not recorded."""
        if not self._records_values():
            return None
        hidden = self._hidden if hidden is None else hidden
        assert hidden is not None, "a forward of the model ran without the final norm's hook"
        head = cast(torch.nn.Module, self.value_head)
        weight = next(head.parameters())
        return head(hidden.to(weight.dtype)).squeeze(-1).float()

    # ------------------------------------------------------------------ planning

    def _plan(
        self,
        index: int,
        prompt: Sequence[int],
        params: SamplingParams,
        session_ids: Sequence[Hashable] | None,
    ) -> _Row:
        ids = tuple(int(t) for t in prompt)
        limit = min(params.max_new_tokens, self.max_length - len(ids))
        session = None
        if session_ids is not None:
            # the row's old cache is consumed here; the row gets a new one after this call
            session = self._pop_session(session_ids[index])
        if session is None or not self.cache_reuse:
            return _Row(ids, 0, None, limit)
        # at least one prompt token must be prefilled: its logits give the first sample
        reused = min(_common_prefix(session.token_ids, ids), len(ids) - 1)
        if reused == 0:
            return _Row(ids, 0, None, limit)
        cached = (
            session.layers
            if reused == len(session.token_ids)
            else [(k[:, :reused], v[:, :reused]) for k, v in session.layers]
        )
        return _Row(ids, reused, cached, limit)

    # ------------------------------------------------------------------ prefill + decode

    def _run(
        self, rows: list[_Row], params: SamplingParams, session_ids: Sequence[Hashable] | None
    ) -> list[Generation]:
        t0 = time.perf_counter()
        batch = self._prefill(rows)
        t1 = time.perf_counter()
        self._stats["prefill_seconds"] += t1 - t0
        self._stats["reused_tokens"] += sum(r.reused for r in rows)
        self._stats["calls"] += 1
        keep = None  # no session has a next turn after a last one: nothing to keep for it
        if session_ids is not None and self.cache_reuse and not params.last_turn:
            keep = self._keeper(rows, session_ids)
        values = self._values if self._records_values() else None
        with self._autocast() if self._step is None else contextlib.nullcontext():  # the step casts on its own
            out = _decode(self.model, batch, rows, params, self.pad_token_id, self.shrink_below, keep, self._step,
                          values)
        self._stats["decode_seconds"] += time.perf_counter() - t1
        self._stats["decode_tokens"] += batch.fed
        self._stats["generated_tokens"] += sum(len(g.token_ids) for g in out)
        return out

    def _prefill(self, rows: list[_Row]) -> _Batch:
        """Prefill every row's suffix on top of its reused cache; the decode batch after it.

        Rows with the same prompt and no reused cache (the N members of a prompt group on their first
        turn) are prefilled once and copied; different first-turn prompts go on their common prefix, prefilled
        once (:meth:`_on_common_prefix`). Row b is laid out as [pad | reused cache | pad | suffix],
        right-aligned in a common width W.
        """
        firsts: dict[tuple[int, ...], int] = {}
        unique: list[_Row] = []
        source: list[int] = []  # row -> its position in ``unique``
        for r in rows:
            key = r.prompt if r.reused == 0 else None
            if key is None or key not in firsts:
                if key is not None:
                    firsts[key] = len(unique)
                unique.append(r)
            source.append(len(unique) - 1 if key is None else firsts[key])
        self._stats["shared_prompt_tokens"] += sum(len(r.suffix) for r in rows) - sum(
            len(r.suffix) for r in unique
        )
        unique = self._on_common_prefix(unique)
        self._stats["prefill_tokens"] += sum(len(r.suffix) for r in unique)
        room = max(r.limit for r in rows)
        shared = len(unique) < len(rows)  # then the rows come out of the prefill's cache below
        layers, mask, logits, cache, values, order = self._prefill_unique(unique, 0 if shared else room)
        if not shared:  # the prefill's cache already has the room (one group's, or the groups' written into it)
            return _Batch(cache, mask, logits, torch.tensor(order, device=self.device), values=values)
        slot_of = [0] * len(order)  # a unique row's slot in the prefill's tensors
        for slot, u in enumerate(order):
            slot_of[u] = slot
        slots = torch.arange(len(rows), device=self.device)
        index = torch.tensor([slot_of[u] for u in source], device=self.device)
        values = None if values is None else values.index_select(0, index)
        if self._step is not None and self.device.type == "cpu" and cascade_pays(len(unique), len(rows)):
            # the fast step reads the prompts once per group (cascade attention); the rows' cache holds only
            # the tokens each row decodes, so the prompts are never copied per row and dropping rows is cheap
            prefix = SharedPrefix(layers, mask, index)
            own = growing_cache([(k[:, :, :0].index_select(0, index), v[:, :, :0].index_select(0, index))
                                 for k, v in layers], room)
            return _Batch(own, mask.index_select(0, index), logits.index_select(0, index), slots, prefix=prefix,
                          values=values)
        layers = [(k.index_select(0, index), v.index_select(0, index)) for k, v in layers]
        return _Batch(growing_cache(layers, room), mask.index_select(0, index), logits.index_select(0, index), slots,
                      values=values)

    def _on_common_prefix(self, unique: list[_Row]) -> list[_Row]:
        """``unique`` with its first-turn rows (nothing reused) put on their common prefix. First-turn rows whose
        prompts agree on their first :data:`COMMON_PREFIX_MIN` tokens form a set; a set of two or more rows has
        its longest common prefix prefilled here once, and each of its rows reuses that as a kept cache and
        prefills only the rest of its prompt (at least one token, whose logits give its first sample). The
        prompts of one env's episodes open with the same instructions: FrozenLake's first prompts of different
        seeds share 123 of about 196 tokens. Rows with a reused cache stay as they are."""
        sets: dict[tuple[int, ...], list[int]] = {}
        for i, r in enumerate(unique):
            if r.reused == 0 and len(r.prompt) > COMMON_PREFIX_MIN:
                sets.setdefault(r.prompt[:COMMON_PREFIX_MIN], []).append(i)
        out = list(unique)
        for members in sets.values():
            if len(members) < 2:
                continue
            first = unique[members[0]].prompt
            n = min(len(unique[i].prompt) for i in members) - 1
            for i in members[1:]:
                n = _common_prefix(first[:n], unique[i].prompt)
            cache, _, _ = self._prefill_group([_Row(first[:n], 0, None, 0)], 0)
            layers = [(k[0, :, -n:], v[0, :, -n:]) for k, v in cache_layers(cache)]  # [H, n, D] each
            self._stats["prefill_tokens"] += n
            self._stats["common_prefix_tokens"] += n * (len(members) - 1)
            for i in members:
                out[i] = _Row(unique[i].prompt, n, layers, unique[i].limit)
        return out

    def _prefill_unique(
        self, rows: list[_Row], room: int
    ) -> tuple[list[LayerKV], torch.Tensor, torch.Tensor, DynamicCache, torch.Tensor | None, list[int]]:
        """Per-layer keys/values [B, H, W, D], mask [B, W] (long) and last logits [B, V] of ``rows``; the
        cache they live in, with ``room`` free slots for decoding; the last position's values [B] or None; the
        order of the rows in all of them (slot i holds ``rows[order[i]]``: the prefill groups one after another)."""
        groups = _chunks(list(range(len(rows))), rows, self.prefill_chunk_tokens)
        if len(groups) == 1:
            cache, mask, logits = self._prefill_group(rows, room)
            return cache_layers(cache), mask, logits, cache, self._values(), list(range(len(rows)))
        order = [i for group in groups for i in group]
        width = max(_width([rows[i] for i in g]) for g in groups)
        mask = torch.zeros(len(rows), width, dtype=torch.long, device=self.device)
        values = torch.empty(len(rows), device=self.device) if self._records_values() else None
        # Buffers [B, H, width + room, D], a group's rows in consecutive slots, its columns right-aligned at width.
        # With the fast step they exist before the first group, which builds its cache in them: its kept caches
        # are copied once and its prefill appends there, and only the columns left of the group's are zeroed. A
        # first turn under ``model.forward`` gets transformers' cache, copied in afterwards.
        buffers = self._empty_buffers(len(rows), width + room) if self._step is not None else []
        logits = torch.empty(0)
        start = 0
        for group in groups:
            g_rows = [rows[i] for i in group]
            end, w = start + len(group), _width(g_rows)
            out = ([(k[start:end, :, width - w :], v[start:end, :, width - w :]) for k, v in buffers]
                   if self._step is not None else None)
            g_cache, g_mask, g_logits = self._prefill_group(g_rows, 0, out)
            if not buffers:  # allocate once the first group tells us shapes and dtypes
                buffers = [
                    (
                        k.new_empty(len(rows), k.shape[1], width + room, k.shape[3]),
                        v.new_empty(len(rows), v.shape[1], width + room, v.shape[3]),
                    )
                    for k, v in cache_layers(g_cache)
                ]
            if out is None:
                for (k, v), (gk, gv) in zip(buffers, cache_layers(g_cache), strict=True):
                    k[start:end, :, width - w : width] = gk
                    v[start:end, :, width - w : width] = gv
            for k, v in buffers:  # left padding holds zeros, not garbage (masked terms stay finite)
                k[start:end, :, : width - w].zero_()
                v[start:end, :, : width - w].zero_()
            mask[start:end, width - w :] = g_mask
            if not len(logits):
                logits = g_logits.new_empty(len(rows), g_logits.shape[-1])
            logits[start:end] = g_logits
            if values is not None:
                values[start:end] = cast(torch.Tensor, self._values())
            start = end
        layers = [(k[:, :, :width], v[:, :, :width]) for k, v in buffers]
        return layers, mask, logits, adopted_cache(buffers, width), values, order

    def _prefill_group(
        self, group: list[_Row], room: int, out: list[LayerKV] | None = None
    ) -> tuple[DynamicCache, torch.Tensor, torch.Tensor]:
        """Prefill one group; (its cache, with ``room`` free slots after the prompt, mask [G, W], logits [G, V]).
        ``out`` (fast step only): per layer, buffers [G, H, >= W + room, D] the cache is built in."""
        reused = max(r.reused for r in group)
        new = max(len(r.suffix) for r in group)
        mask = torch.zeros(len(group), reused + new, dtype=torch.long)
        input_ids = torch.full((len(group), new), self.pad_token_id, dtype=torch.long)
        for b, r in enumerate(group):
            mask[b, reused - r.reused : reused] = 1
            mask[b, reused + new - len(r.suffix) :] = 1
            input_ids[b, new - len(r.suffix) :] = torch.tensor(r.suffix)
        mask, input_ids = mask.to(self.device), input_ids.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp_(min=0)[:, reused:]  # [G, new]; pads get any valid id
        cache = DynamicCache()
        if reused > 0:  # the kept caches stacked once, straight into buffers with room for the suffix and replies
            like = next(r.cached for r in group if r.cached is not None)
            cache = stacked_cache([r.cached for r in group], reused, like, room=new + room, out=out)
        if self._step is not None:  # the fast step's weights and arithmetic, T tokens a row (decode_step.py)
            if reused == 0:  # the step writes every new column, padding included (finite), so nothing is zeroed
                cache = adopted_cache(out, 0) if out is not None else self._empty_cache(len(group), new + room)
            logits = self._step.prefill(input_ids, positions, mask, cache).float()
            self._hidden = self._step.last_hidden
            return cache, mask, logits
        assert out is None, "buffers to build a cache in are for the fast step"
        with self._autocast():
            result = self.model(
                input_ids=input_ids,
                attention_mask=mask,
                position_ids=positions,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
        logits = result.logits[:, -1, :].float()
        if self.compute_dtype is not None:
            _cache_to(result.past_key_values, next(self.model.parameters()).dtype)
        if reused == 0 and room > 0:  # transformers' own cache: into growing buffers (one copy) to decode in
            return growing_cache(cache_layers(result.past_key_values), room), mask, logits
        return result.past_key_values, mask, logits

    def _empty_buffers(self, rows: int, capacity: int) -> list[LayerKV]:
        """Per-layer key/value buffers [rows, H, capacity, D] of the fast step's model, uninitialised, in the
        step's cache dtype (as a kept cache is)."""
        step = cast(LlamaDecodeStep, self._step)
        weight = next(self.model.parameters())
        shape = (rows, step.n_kv, capacity, step.head_dim)
        return [(weight.new_empty(shape, dtype=step.cache_dtype), weight.new_empty(shape, dtype=step.cache_dtype))
                for _ in range(step.n_layers)]

    def _empty_cache(self, rows: int, room: int) -> DynamicCache:
        """A growing cache with no columns filled and ``room`` free, in the step's cache dtype (as a kept cache
        is)."""
        return adopted_cache(self._empty_buffers(rows, room), 0)

    def _autocast(self) -> contextlib.AbstractContextManager[object]:
        """``torch.autocast`` to ``compute_dtype``, or nothing."""
        if self.compute_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def _keeper(
        self, rows: list[_Row], session_ids: Sequence[Hashable]
    ) -> Callable[[_Batch, list[int], list[list[int]]], None]:
        """A callback that stores the caches of finished batch slots for their sessions."""

        def keep(batch: _Batch, slots: list[int], tokens: list[list[int]]) -> None:
            layers = cache_layers(batch.cache)
            shared = batch.prefix
            for slot in slots:
                r = int(batch.rows[slot])
                # the last sampled id was never fed back, so it has no keys/values yet
                kept = rows[r].prompt + tuple(tokens[r][:-1])
                positions = batch.mask[slot].nonzero().squeeze(1)
                assert len(positions) == len(kept), (len(positions), len(kept))
                if shared is None:
                    row_layers = take_row(layers, slot, positions)
                else:  # the prompt's columns from its group, then the row's own
                    w, group = shared.width, int(shared.source[slot])
                    head = take_row(shared.layers, group, positions[positions < w])
                    tail = take_row(layers, slot, positions[positions >= w] - w)
                    row_layers = [(torch.cat([hk, tk], dim=1), torch.cat([hv, tv], dim=1))
                                  for (hk, hv), (tk, tv) in zip(head, tail, strict=True)]
                self._put_session(session_ids[r], _Session(kept, row_layers, kv_nbytes(row_layers)))

        return keep

    # ------------------------------------------------------------------ sessions

    def _put_session(self, sid: Hashable, session: _Session) -> None:
        self._drop_session(sid)
        self._sessions[sid] = session
        self._cached_bytes += session.nbytes
        while self._cached_bytes > self.max_cached_bytes and self._sessions:
            self._drop_session(next(iter(self._sessions)))

    def _pop_session(self, sid: Hashable) -> _Session | None:
        session = self._sessions.pop(sid, None)
        if session is not None:
            self._cached_bytes -= session.nbytes
        return session

    def _drop_session(self, sid: Hashable) -> None:
        self._pop_session(sid)

    def _clear_sessions(self) -> None:
        self._sessions.clear()
        self._cached_bytes = 0

    @property
    def cached_sessions(self) -> int:
        """Number of sessions holding a cache (for tests and diagnostics)."""
        return len(self._sessions)

    def _current_weights_version(self) -> tuple[int, ...]:
        # every in-place write (optimizer step, load_state_dict) bumps a tensor's version counter
        return tuple(p._version for p in self.model.parameters())


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two id sequences."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _width(rows: list[_Row]) -> int:
    """Width of a prefill group: the longest reused cache plus the longest suffix."""
    return max(r.reused for r in rows) + max(len(r.suffix) for r in rows)


def _chunks(order: list[int], rows: list[_Row], max_tokens: int) -> list[list[int]]:
    """Group row positions (by length) so each group's padded size rows x width stays under max_tokens."""
    if len(order) * _width(rows) <= max_tokens:
        return [order]
    groups: list[list[int]] = []
    current: list[int] = []
    for i in sorted(order, key=lambda i: (rows[i].reused + len(rows[i].suffix), rows[i].reused)):
        if current and (len(current) + 1) * _width([rows[j] for j in [*current, i]]) > max_tokens:
            groups.append(current)
            current = []
        current.append(i)
    groups.append(current)
    return groups


@dataclass
class _Batch:
    """Decode state of the rows still in the batch (private, mutated by ``_decode`` only)."""

    cache: DynamicCache
    mask: torch.Tensor  # [B, W] long, 1 on real tokens
    logits: torch.Tensor  # [B, V] next-token logits of each slot
    rows: torch.Tensor  # [B] the call's row index of each slot
    fed: int = 0
    """Real tokens fed through decode forwards so far."""
    prefix: SharedPrefix | None = None
    """The prompt columns shared by prompt groups (cascade attention in the fast step), or None."""
    values: torch.Tensor | None = None
    """[B] the value head's value of each slot's current state (the hidden state ``logits`` came from), or None."""

    def select(self, keep: torch.Tensor) -> None:
        """Keep only the slots ``keep`` ([K] long) in every batch tensor."""
        self.cache.batch_select_indices(keep)
        self.mask, self.logits, self.rows = self.mask[keep], self.logits[keep], self.rows[keep]
        if self.values is not None:
            self.values = self.values[keep]
        if self.prefix is not None:
            self.prefix.select(keep)


def _decode(
    model: torch.nn.Module,
    batch: _Batch,
    rows: list[_Row],
    params: SamplingParams,
    pad_token_id: int,
    shrink_below: float | None,
    keep: Callable[[_Batch, list[int], list[list[int]]], None] | None,
    step: LlamaDecodeStep | None = None,
    values_of: Callable[[torch.Tensor | None], torch.Tensor | None] | None = None,
) -> list[Generation]:
    """Sample until every row stopped or reached its limit; ``keep`` gets each slot's cache at the end.
    ``step``: the fast decode step (decode_step.py), else ``model.forward``. ``values_of``: the slots' values
    [B] after a forward, from the fast step's hidden state (or None: the hook's); None records no values."""
    n = len(rows)
    streams = row_generators(params.seed, n, params.streams)
    stop_ids = torch.tensor(params.stop_token_ids or [-1], device=batch.mask.device)  # -1 is never sampled
    limits = [r.limit for r in rows]
    tokens: list[list[int]] = [[] for _ in range(n)]
    logps: list[list[float]] = [[] for _ in range(n)]
    vals: list[list[float]] = [[] for _ in range(n)]
    finish = [FINISH_LENGTH] * n
    alive = list(range(n))  # slots still sampling
    while True:
        slots = torch.tensor(alive, device=batch.mask.device)
        live_rows = batch.rows[slots].tolist()
        u = draw_uniforms(streams, live_rows, batch.mask.device)
        ids, lps = sample_from_logits(batch.logits[slots], params.temperature, params.top_p, u)  # [A], [A]
        stopped = torch.isin(ids, stop_ids).tolist()
        if batch.values is not None:
            for r, v in zip(live_rows, batch.values[slots].tolist(), strict=True):
                vals[r].append(v)
        still = []
        for slot, r, tok, lp, stop in zip(alive, live_rows, ids.tolist(), lps.tolist(), stopped, strict=True):
            tokens[r].append(tok)
            logps[r].append(lp)
            if stop:
                finish[r] = FINISH_STOP
            elif len(tokens[r]) < limits[r]:
                still.append(slot)
        if not still:
            break
        width = len(batch.rows)
        next_ids = torch.full((width,), pad_token_id, dtype=torch.long, device=batch.mask.device)
        next_ids[slots] = ids
        if len(still) < _shrink_threshold(shrink_below, batch) * width:
            # drop finished slots: keep their caches first, then shrink every batch tensor
            if keep is not None:
                keep(batch, sorted(set(range(width)) - set(still)), tokens)
            index = torch.tensor(still, device=batch.mask.device)
            next_ids = next_ids[index]
            batch.select(index)
            still = list(range(len(still)))
        live = torch.zeros(len(batch.rows), dtype=torch.long, device=batch.mask.device)
        live[still] = 1
        positions = batch.mask.sum(-1, keepdim=True)  # [B, 1] next position of each slot
        batch.mask = torch.cat([batch.mask, live[:, None]], dim=1)
        _feed(model, batch, next_ids, positions, step, values_of)
        batch.fed += len(still)
        alive = still
    if keep is not None:
        keep(batch, list(range(len(batch.rows))), tokens)
    recorded = batch.values is not None
    return [Generation(tuple(t), tuple(lp), f, tuple(v) if recorded else None)
            for t, lp, f, v in zip(tokens, logps, finish, vals, strict=True)]


def _shrink_threshold(shrink_below: float | None, batch: _Batch) -> float:
    """The fraction of alive rows below which finished rows leave the batch (``HFGenerator``'s shrink_below)."""
    if shrink_below is not None:
        return shrink_below
    return SHARED_SHRINK_BELOW if batch.prefix is not None else SHRINK_BELOW


def _feed(
    model: torch.nn.Module,
    batch: _Batch,
    next_ids: torch.Tensor,
    positions: torch.Tensor,
    step: LlamaDecodeStep | None,
    values_of: Callable[[torch.Tensor | None], torch.Tensor | None] | None,
) -> None:
    """One decode forward of ``next_ids`` ([B]) at ``positions`` ([B, 1]): the batch's next logits (and values)."""
    if step is not None:
        batch.logits = step.step(next_ids, positions[:, 0], batch.mask, batch.cache, batch.prefix)
    else:
        out = model(
            input_ids=next_ids[:, None],
            attention_mask=batch.mask,
            position_ids=positions,
            past_key_values=batch.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        batch.logits = out.logits[:, -1, :].float()  # bf16 under autocast
    if values_of is not None:
        batch.values = values_of(step.last_hidden if step is not None else None)


def _cache_to(cache: DynamicCache, dtype: torch.dtype) -> None:
    """Keys and values of ``dtype`` in every layer of a cache a prefill under autocast filled (its value
    projections came out in the autocast dtype; the kept caches, the decode step and its kernel hold ``dtype``)."""
    for layer in cache.layers:  # a growing layer's buffers already have the kept caches' dtype (kv.stacked_cache)
        if type(layer) is DynamicLayer and layer.keys is not None and layer.values is not None:
            if layer.keys.dtype != dtype or layer.values.dtype != dtype:
                layer.keys, layer.values = layer.keys.to(dtype), layer.values.to(dtype)
                layer.dtype = dtype


def _final_norm(model: torch.nn.Module) -> torch.nn.Module | None:
    """The decoder's final norm (its output is the last hidden state the output layer reads), or None.

    transformers' decoder-only models keep it as ``norm`` on the inner model (``model.model.norm`` for
    Llama, Qwen, Mistral; a peft wrapper adds a level, ``get_base_model`` removes it)."""
    get_base = getattr(model, "get_base_model", None)
    base = get_base() if callable(get_base) else model
    inner = getattr(base, "model", None)
    norm = getattr(inner, "norm", None)
    return norm if isinstance(norm, torch.nn.Module) else None


def _check_plain_attention(model: torch.nn.Module) -> None:
    """Refuse models whose cache is not plain full attention (sliding windows break the layout)."""
    config = getattr(model, "config", None)
    if config is None:
        return
    cache = DynamicCache(config=config)
    if any(type(layer) is not DynamicLayer for layer in cache.layers):
        raise ValueError(
            f"the hf generator supports full-attention models only; {type(model).__name__} uses "
            f"{sorted({type(layer).__name__ for layer in cache.layers})}"
        )
