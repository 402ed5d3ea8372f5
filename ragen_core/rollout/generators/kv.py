"""Key/value-cache plumbing for the hf backend: batching per-row caches and taking rows back out.

A row's cache is a list over layers of ``(keys, values)``, each ``[H, L, D]`` (H key/value heads,
L tokens, D head size), with no padding. A batch cache is the same list with ``[B, H, W, D]`` tensors
and a ``[B, W]`` attention mask (1 = a real token). Rows are right-aligned (left padding) and may
contain masked holes: positions come from the mask (cumsum - 1), so a hole changes nothing but the
amount of memory used. ``growing_cache`` wraps batch tensors into a transformers ``DynamicCache``
that appends in place into preallocated room instead of concatenating the whole cache every step.

Nothing to run here; ``tests/unit/rollout/test_generators.py`` exercises it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.cache_utils import CacheLayerMixin, DynamicCache, DynamicLayer

LayerKV = tuple[torch.Tensor, torch.Tensor]
"""(keys, values) of one layer: [H, L, D] for a row, [B, H, W, D] for a batch."""


def kv_nbytes(layers: Sequence[LayerKV]) -> int:
    """Bytes held by a cache (row or batch)."""
    return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in layers)


def stacked_cache(
    rows: Sequence[Sequence[LayerKV] | None], width: int, like: Sequence[LayerKV], room: int,
    out: Sequence[LayerKV] | None = None,
) -> DynamicCache:
    """Batch per-row caches, each right-aligned in ``width`` slots, into a growing cache with ``room`` free
    slots per layer after them (written straight into the cache's own buffers: one copy of the rows' caches).

    rows: per row, a list over layers of ([H, L_r, D], [H, L_r, D]) or None for an empty cache;
    like: any cache of the same model (gives H, D, dtype, device). The caller's mask must be 0 on the
    left-padding slots, which hold zeros (not garbage) so masked attention terms stay finite.
    out: per layer, buffers [B, H, >= width + room, D] (views of a larger batch's, say) to write into instead of
    new ones; the cache then lives in them.
    """
    layers = []
    for layer, (k_like, v_like) in enumerate(like):
        h, d = k_like.shape[-3], k_like.shape[-1]
        if out is not None:
            keys, values = out[layer]
        else:
            keys = k_like.new_empty(len(rows), h, width + room, d)  # [B, H, W + room, D]
            values = v_like.new_empty(len(rows), h, width + room, v_like.shape[-1])
        for b, row in enumerate(rows):
            n = 0 if row is None else row[layer][0].shape[-2]
            if n < width:  # left padding: zeros, not garbage, keep masked attention terms finite
                keys[b, :, : width - n].zero_()
                values[b, :, : width - n].zero_()
            if n > 0:
                keys[b, :, width - n : width] = row[layer][0]  # type: ignore[index]
                values[b, :, width - n : width] = row[layer][1]  # type: ignore[index]
        layers.append((keys, values))
    return adopted_cache(layers, width)


def adopted_cache(buffers: Sequence[LayerKV], length: int) -> DynamicCache:
    """A growing cache over preallocated buffers ([B, H, capacity, D] per layer) whose first ``length`` slots
    are filled; decoding appends into the rest (no copy)."""
    cache = DynamicCache()
    cache.layers = [_GrowingLayer.adopt(k, v, length) for k, v in buffers]
    return cache


def take_row(layers: Sequence[LayerKV], row: int, positions: torch.Tensor) -> list[LayerKV]:
    """Copy one row's cache out of a batch cache, keeping only ``positions`` ([L] long, in order).

    Returns a list over layers of contiguous ([H, L, D], [H, L, D]) tensors that own their memory, so
    the batch cache can be freed.
    """
    return [(k[row].index_select(1, positions), v[row].index_select(1, positions)) for k, v in layers]


class _GrowingLayer(DynamicLayer):
    """A DynamicLayer that appends into preallocated room (amortised O(new tokens) per step).

    transformers' DynamicLayer concatenates the whole cache with every new token, copying
    B*H*W*D floats per layer per decoded token; here room grows by doubling and ``keys``/``values``
    are views of the filled part.
    """

    # Always tensors here (set by _refresh in __init__), where DynamicLayer allows None before its first update.
    keys: torch.Tensor
    values: torch.Tensor

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, room: int) -> None:
        super().__init__()
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True
        self._length = keys.shape[-2]
        self._k = _with_room(keys, self._length + room)
        self._v = _with_room(values, self._length + room)
        self._refresh()

    @classmethod
    def adopt(cls, keys: torch.Tensor, values: torch.Tensor, length: int) -> _GrowingLayer:
        """A layer over preallocated buffers [..., capacity, D] whose first ``length`` slots are filled (no copy)."""
        layer = cls.__new__(cls)
        DynamicLayer.__init__(layer)
        layer.dtype, layer.device = keys.dtype, keys.device
        layer.is_initialized = True
        layer._length = length
        layer._k, layer._v = keys, values
        layer._refresh()
        return layer

    def _refresh(self) -> None:
        self.keys = self._k[..., : self._length, :]
        self.values = self._v[..., : self._length, :]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object) -> LayerKV:
        n = key_states.shape[-2]
        k, v, start = self.grow(n)
        k[..., start : start + n, :] = key_states
        v[..., start : start + n, :] = value_states
        return self.keys, self.values

    def grow(self, n: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Make room for ``n`` more columns and count them in: (keys buffer, values buffer [..., capacity, D],
        the first new column). The caller writes the new columns into the buffers before reading ``keys``."""
        if self._length + n > self._k.shape[-2]:
            grown = max(2 * self._k.shape[-2], self._length + n)
            self._k, self._v = _with_room(self.keys, grown), _with_room(self.values, grown)
        start = self._length
        self._length += n
        self._refresh()
        return self._k, self._v, start

    def get_seq_length(self) -> int:
        return self._length

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._k, self._v = self._k[indices], self._v[indices]
        self._refresh()

    def crop(self, tokens_to_remove: int) -> None:  # pragma: no cover - not used by the hf backend
        raise NotImplementedError("_GrowingLayer does not support crop")


def _with_room(t: torch.Tensor, capacity: int) -> torch.Tensor:
    """[..., L, D] -> [..., capacity, D] with ``t`` in the first L slots (the rest uninitialised)."""
    out = t.new_empty(*t.shape[:-2], capacity, t.shape[-1])
    out[..., : t.shape[-2], :] = t
    return out


def growing_cache(layers: Sequence[LayerKV], room: int) -> DynamicCache:
    """A DynamicCache over batch tensors ([B, H, W, D] per layer) with ``room`` free slots per layer."""
    cache = DynamicCache()
    cache.layers = [_GrowingLayer(k, v, room) for k, v in layers]
    return cache


def cache_layers(cache: DynamicCache) -> list[LayerKV]:
    """The (keys, values) tensors of every layer of a transformers cache ([B, H, W, D] each)."""
    out: list[LayerKV] = []
    for layer in cache.layers:
        # A cache the model has just run on: every layer is a key/value layer holding tensors.
        assert isinstance(layer, CacheLayerMixin) and layer.keys is not None and layer.values is not None
        out.append((layer.keys, layer.values))
    return out
