"""The ``hf`` generation backend: batched, left-padded, KV-cached sampling with a transformers model.

Our own decode loop over ``model.forward`` (not ``model.generate``) so that we control exactly what
RL needs: the log-probability of every sampled id under ``log_softmax(logits / T)`` (base.py),
stopping per row at the end-of-turn token, per-row random streams (a row's samples do not depend on
its batch neighbours), and the KV cache.

Cross-turn cache reuse (issue 4): with ``session_ids`` each episode keeps the keys/values of the
tokens it has seen (previous prompt + generated ids, minus the last sampled id, which was never fed
back). On its next turn only the new suffix of the prompt (the end-of-turn token and the new user
text) is prefilled, on top of the kept cache. The kept tokens must be a prefix of the new prompt;
otherwise the longest common prefix is reused (e.g. after the context guard dropped old turns, the
system prompt still matches), down to a full prefill. Positions come from the attention mask
(cumsum - 1), so rows with different cached lengths batch together with masked holes, and the
result equals a full re-prefill up to float rounding (tests check 1e-4 on log-probabilities).
Caches are dropped when the model's weights change (tracked with the parameters' version counters,
so an in-place optimizer step on a shared model is noticed too), on ``end_sessions``, and oldest
first when they exceed ``max_cached_bytes``.

Run: ``python -m pytest tests/unit/rollout/test_generators.py -q``; speed: ``python bench/rollout.py``.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from ragen_core.rollout.generators.base import (
    FINISH_LENGTH,
    FINISH_STOP,
    STAT_KEYS,
    Generation,
    SamplingParams,
)
from ragen_core.rollout.generators.kv import (
    LayerKV,
    cache_layers,
    growing_cache,
    kv_nbytes,
    stack_left_padded,
    take_row,
)
from ragen_core.rollout.generators.sampling import draw_uniforms, row_generators, sample_from_logits


@dataclass
class _Session:
    """What one episode keeps between turns: its tokens and their per-layer keys/values ([H, L, D])."""

    token_ids: tuple[int, ...]
    layers: list[LayerKV]
    nbytes: int


@dataclass(frozen=True)
class _Row:
    """The prefill plan of one prompt row."""

    index: int
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
        shrink_below: float = 0.5,
        max_cached_bytes: int = 8 << 30,
    ) -> None:
        """
        model: a causal LM whose forward accepts ``past_key_values``, ``position_ids`` and ``logits_to_keep``.
        tokenizer: only used for its pad id (any id works: padded slots are masked).
        max_length: context length cap (default: ``model.config.max_position_embeddings``).
        cache_reuse: keep per-session caches between calls (off = always a full prefill).
        prefill_chunk_tokens: rows are prefilled in groups of at most this many (padded) tokens,
            which bounds the attention scores' memory.
        shrink_below: finished rows are dropped from the decode batch once the unfinished ones are
            fewer than this fraction of it (copying the cache costs about one decode step).
        max_cached_bytes: session caches beyond this are evicted, least recently used first.
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
        self._sessions: OrderedDict[Hashable, _Session] = OrderedDict()
        self._cached_bytes = 0
        self._weights_version = self._current_weights_version()
        self._stats = dict.fromkeys((*STAT_KEYS, "reused_tokens", "calls"), 0.0)

    # ------------------------------------------------------------------ protocol

    @property
    def stats(self) -> dict[str, float]:
        """Cumulative counters (``STAT_KEYS`` plus ``reused_tokens``: prompt tokens taken from caches)."""
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
        was_training = self.model.training
        # eval mode: no dropout, and gradient checkpointing (training only) would switch the cache off
        self.model.eval()
        try:
            with torch.inference_mode():
                if self._current_weights_version() != self._weights_version:
                    self._clear_sessions()  # weights changed in place: every kept cache is stale
                    self._weights_version = self._current_weights_version()
                rows = [self._plan(i, p, params, session_ids) for i, p in enumerate(prompts)]
                return self._run(rows, params, session_ids)
        finally:
            self.model.train(was_training)

    # ------------------------------------------------------------------ planning

    def _plan(
        self,
        index: int,
        prompt: Sequence[int],
        params: SamplingParams,
        session_ids: Sequence[Hashable] | None,
    ) -> _Row:
        ids = tuple(int(t) for t in prompt)
        if not ids:
            raise ValueError(f"prompt {index} is empty")
        if len(ids) >= self.max_length:
            raise ValueError(
                f"prompt {index} has {len(ids)} tokens but the model's context is {self.max_length}; "
                "shorten the dialogue (RolloutConfig.window_turns / max_context_tokens)"
            )
        limit = min(params.max_new_tokens, self.max_length - len(ids))
        session = None
        if session_ids is not None:
            # the row's old cache is consumed here; the row gets a new one after this call
            session = self._pop_session(session_ids[index])
        if session is None or not self.cache_reuse:
            return _Row(index, ids, 0, None, limit)
        # at least one prompt token must be prefilled: its logits give the first sample
        reused = min(_common_prefix(session.token_ids, ids), len(ids) - 1)
        if reused == 0:
            return _Row(index, ids, 0, None, limit)
        cached = (
            session.layers
            if reused == len(session.token_ids)
            else [(k[:, :reused], v[:, :reused]) for k, v in session.layers]
        )
        return _Row(index, ids, reused, cached, limit)

    # ------------------------------------------------------------------ prefill + decode

    def _run(
        self, rows: list[_Row], params: SamplingParams, session_ids: Sequence[Hashable] | None
    ) -> list[Generation]:
        n = len(rows)
        t0 = time.perf_counter()
        layers, mask, logits = self._prefill(rows)
        t1 = time.perf_counter()
        self._stats["prefill_seconds"] += t1 - t0
        self._stats["prefill_tokens"] += sum(len(r.suffix) for r in rows)
        self._stats["reused_tokens"] += sum(r.reused for r in rows)
        self._stats["calls"] += 1

        generators = row_generators(params.seed, n)
        stop_ids = torch.tensor(params.stop_token_ids or [-1], device=self.device)
        limits = torch.tensor([r.limit for r in rows], device=self.device)
        tokens: list[list[int]] = [[] for _ in range(n)]
        logps: list[list[float]] = [[] for _ in range(n)]
        finish = [FINISH_LENGTH] * n
        batch_rows = torch.arange(n, device=self.device)  # original row of each batch slot
        alive = torch.ones(n, dtype=torch.bool, device=self.device)  # per batch slot
        positions = mask.sum(-1)  # [B] position id of the next token of each slot
        cache = growing_cache(layers, room=int(limits.max()))
        del layers
        step = 0
        while True:
            slots = alive.nonzero().squeeze(1)  # [A] batch slots still sampling
            u = draw_uniforms(generators, batch_rows[slots].tolist(), self.device)
            ids, lps = sample_from_logits(logits[slots], params.temperature, params.top_p, u)  # [A], [A]
            step += 1
            for slot_row, tok, lp in zip(batch_rows[slots].tolist(), ids.tolist(), lps.tolist(), strict=True):
                tokens[slot_row].append(tok)
                logps[slot_row].append(lp)
            stopped = torch.isin(ids, stop_ids)  # [A]; stop_ids is [-1] (never sampled) when empty
            done = stopped | (step >= limits[batch_rows[slots]])
            for r in batch_rows[slots][stopped].tolist():
                finish[r] = FINISH_STOP
            alive[slots[done]] = False
            if not bool(alive.any()):
                break
            if int(alive.sum()) < self.shrink_below * len(alive):
                # drop finished slots: keep their caches first, then shrink every batch tensor
                self._save_sessions(cache, mask, batch_rows, ~alive, rows, tokens, session_ids)
                keep = alive.nonzero().squeeze(1)
                cache.batch_select_indices(keep)
                mask, positions, batch_rows = mask[keep], positions[keep], batch_rows[keep]
                alive, logits = alive[keep], logits[keep]
                slots, ids, done = _reindex(slots, ids, done, keep)
            next_ids = torch.full((len(alive),), self.pad_token_id, dtype=torch.long, device=self.device)
            next_ids[slots] = ids
            mask = torch.cat([mask, alive[:, None].to(mask.dtype)], dim=1)
            out = self.model(
                input_ids=next_ids[:, None],
                attention_mask=mask,
                position_ids=positions[:, None],
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            logits = out.logits[:, -1, :]  # [B, V]
            positions = positions + alive.long()
            self._stats["decode_tokens"] += int(alive.sum())
        self._save_sessions(cache, mask, batch_rows, torch.ones_like(alive), rows, tokens, session_ids)
        self._stats["decode_seconds"] += time.perf_counter() - t1
        self._stats["generated_tokens"] += sum(len(t) for t in tokens)
        return [Generation(tuple(t), tuple(lp), f) for t, lp, f in zip(tokens, logps, finish, strict=True)]

    def _prefill(self, rows: list[_Row]) -> tuple[list[LayerKV], torch.Tensor, torch.Tensor]:
        """Prefill every row's suffix on top of its reused cache.

        Returns per-layer batch keys/values ([B, H, W, D]), the mask [B, W] (long) and the last
        position's logits [B, V]. Row b is laid out as [pad | reused cache | pad | suffix], right-aligned.
        """
        groups = _chunks(rows, self.prefill_chunk_tokens)
        width = max(_chunk_width(g) for g in groups)
        mask = torch.zeros(len(rows), width, dtype=torch.long, device=self.device)
        logits: torch.Tensor | None = None
        layers: list[LayerKV] | None = None
        for group in groups:
            g_layers, g_mask, g_logits = self._prefill_group(group)
            index = torch.tensor([r.index for r in group], device=self.device)
            if len(groups) == 1 and g_mask.shape[1] == width:
                layers, mask, logits = g_layers, g_mask, g_logits
                break
            if layers is None:
                shape = g_layers[0][0].shape
                layers = [
                    (
                        k.new_zeros(len(rows), shape[1], width, shape[3]),
                        v.new_zeros(len(rows), shape[1], width, v.shape[3]),
                    )
                    for k, v in g_layers
                ]
                logits = g_logits.new_empty(len(rows), g_logits.shape[-1])
            w = g_mask.shape[1]
            for (k, v), (gk, gv) in zip(layers, g_layers, strict=True):
                k[index, :, width - w :] = gk
                v[index, :, width - w :] = gv
            mask[index, width - w :] = g_mask
            logits[index] = g_logits
        assert layers is not None and logits is not None
        return layers, mask, logits

    def _prefill_group(self, group: list[_Row]) -> tuple[list[LayerKV], torch.Tensor, torch.Tensor]:
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
        if reused > 0:
            like = next(r.cached for r in group if r.cached is not None)
            cache = growing_cache(stack_left_padded([r.cached for r in group], reused, like), room=new)
        out = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return cache_layers(out.past_key_values), mask, out.logits[:, -1, :]

    # ------------------------------------------------------------------ sessions

    def _save_sessions(
        self,
        cache: DynamicCache,
        mask: torch.Tensor,
        batch_rows: torch.Tensor,
        which: torch.Tensor,
        rows: list[_Row],
        tokens: list[list[int]],
        session_ids: Sequence[Hashable] | None,
    ) -> None:
        """Keep the cache of the batch slots in ``which`` ([B] bool) for their sessions."""
        if session_ids is None or not self.cache_reuse:
            return
        layers = cache_layers(cache)
        for slot in which.nonzero().squeeze(1).tolist():
            r = int(batch_rows[slot])
            if session_ids[r] in self._sessions:
                continue  # saved when the batch shrank
            # the last sampled id was never fed back, so it has no keys/values yet
            kept = rows[r].prompt + tuple(tokens[r][:-1])
            positions = mask[slot].nonzero().squeeze(1)
            assert len(positions) == len(kept), (len(positions), len(kept))
            row_layers = take_row(layers, slot, positions)
            self._put_session(session_ids[r], _Session(kept, row_layers, kv_nbytes(row_layers)))

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


def _chunk_width(rows: list[_Row]) -> int:
    return max(r.reused for r in rows) + max(len(r.suffix) for r in rows)


def _chunks(rows: list[_Row], max_tokens: int) -> list[list[_Row]]:
    """Group rows (sorted by length) so each group's padded size rows x width stays under max_tokens."""
    if len(rows) * _chunk_width(rows) <= max_tokens:
        return [rows]
    groups: list[list[_Row]] = []
    current: list[_Row] = []
    for r in sorted(rows, key=lambda r: (r.reused + len(r.suffix), r.reused)):
        if current and (len(current) + 1) * _chunk_width([*current, r]) > max_tokens:
            groups.append(current)
            current = []
        current.append(r)
    groups.append(current)
    return groups


def _reindex(
    slots: torch.Tensor, ids: torch.Tensor, done: torch.Tensor, keep: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Map the still-alive sampled slots onto the shrunk batch (``keep`` = old slots kept, in order)."""
    live = ~done
    new_slot = torch.full((int(keep.max()) + 1,), -1, dtype=torch.long, device=keep.device)
    new_slot[keep] = torch.arange(len(keep), device=keep.device)
    return new_slot[slots[live]], ids[live], done[live]


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
