"""CPU attention for padded batches: SDPA with native grouped-query attention, even with a mask.

transformers' ``sdpa`` attention expands the key/value heads to the query heads (``repeat_kv``, a
copy of the whole cache per layer per step) whenever an attention mask is present, because CUDA's
fused kernels refuse masked GQA. A padded batch (left padding, or the holes of cache reuse) always
has a mask, so on CPU every decode step copied the cache three times over for SmolLM2 (9 query, 3
key/value heads). ``torch.nn.functional.scaled_dot_product_attention(..., enable_gqa=True)`` takes
the mask directly on CPU: same result (bit-identical in our check), 4-5x less attention time at an
800-token context. ``gqa_attention(model)`` switches a model to it for the duration of a block and
back, on CPU only; elsewhere it does nothing.

Nothing to run here; ``tests/unit/rollout/test_generators.py`` checks the outputs are unchanged.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch

NAME = "ragen_sdpa_gqa"
"""The attention implementation name registered with transformers."""


def _sdpa_gqa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,  # transformers' attention kwargs (position_bias, cache, ...), passed through as they come
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature; query [B, H, Q, D], key/value [B, KV, K, D]."""
    if attention_mask is None:  # nothing padded: transformers' own path already uses native GQA
        # lazily: transformers takes seconds to import and only model code paths need it
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **kwargs,
        )
    out = torch.nn.functional.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None  # [B, Q, H, D] as the attention modules expect


@functools.cache
def _register() -> None:
    # lazily: transformers takes seconds to import and only model code paths need it
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, _sdpa_gqa_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)


@contextlib.contextmanager
def implementation(config: Any, name: str) -> Iterator[None]:
    """``config._attn_implementation`` set to ``name`` inside the block, and back to what it was after it."""
    before = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = before


@contextlib.contextmanager
def gqa_attention(model: torch.nn.Module) -> Iterator[None]:
    """Use masked native-GQA SDPA inside the block when ``model`` runs SDPA on CPU (module docstring)."""
    config = getattr(model, "config", None)
    device = next(model.parameters()).device
    if config is None or device.type != "cpu" or getattr(config, "_attn_implementation", None) != "sdpa":
        yield
        return
    _register()
    with implementation(config, NAME):
        yield
