"""Training attention on CPU in bf16: the segment kernel, forward and backward, for every mask the update makes.

The update's attention calls have few mask shapes: a plain causal row, a right-padded one, a row that continues a
shared prompt's cache, and a prompt group packed into one row (the prompt causally, then each reply over the prompt
and causally over itself: :func:`ragen_core.trainer.forward.packed_group`). In each, query i may attend to the keys
[0, a_i) and [b_i, c_i]. The segment kernel of cpu_attention's build takes those three bounds per query instead of
a mask, runs only the blocks of 64 keys a block of queries needs, and computes its products with AVX512-BF16's
vdpbf16ps into fp32, the softmax online in fp32 (FlashAttention-2's forward and backward). Torch's CPU flash
kernel runs about 100 GFLOP/s whatever the mask, masked pairs included; on 2 AVX512-BF16 cores the segment
kernel took 3.0 ms forward and backward for a Bandit group's packed row (8 replies of 26 tokens on a 187-token
prompt) against 10.9 ms, and 16.8 ms for four FrozenLake rows on a 196-token prompt against 42.7 ms for their split
calls (``bench/attention.py``, docs/benchmarks.md).

:func:`segment_attention` is a transformers attention function. Inside :func:`use_segment_attention` (which
:func:`ragen_core.trainer.forward.hidden_states` enters), a CPU decoder that runs ``sdpa`` runs it instead:
where the kernel applies (built, the CPU has AVX512-BF16, bf16 compute, head size 64, no dropout, a mask of that
form) it runs the kernel, and everywhere else :func:`ragen_core.trainer.forward.split_attention` (torch's sdpa
kernels). ``RAGEN_SEGMENT_ATTENTION=0`` turns it off. Where the CPU has AMX, the kernel's products run on its
tiles (``cpu_attention.segment_amx``; ``RAGEN_SEGMENT_AMX=0`` keeps them on AVX512-BF16's vector products).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ragen_core.rollout.generators import cpu_attention
from ragen_core.rollout.generators.attention import implementation

NAME = "ragen_segment_sdpa"
"""The attention implementation name registered with transformers (attention and mask functions)."""

HEAD_SIZE = 64
"""The head size the kernel is built for."""


class SegmentAttention(torch.autograd.Function):
    """``softmax(q kᵀ · scale)`` over each query's keys ``[0, a) ∪ [b, c]``, times v, by the segment kernel.

    q [B, Hq, Lq, 64], k and v [B, Hkv, Lk, 64], all bf16 with a contiguous last dimension; bounds [B, Lq, 3] int32.
    Returns [B, Lq, Hq, 64] bf16 (the layout transformers' attention functions return)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: torch.Tensor,
                scale: float) -> torch.Tensor:
        out, lse = torch.ops.ragen_cpu_attention.segment_attention_fwd(q, k, v, bounds, scale)
        ctx.save_for_backward(q, k, v, out, lse, bounds)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse, bounds = ctx.saved_tensors
        grad = grad.to(torch.bfloat16)
        if grad.stride(-1) != 1:
            grad = grad.contiguous()
        dq, dk, dv = torch.ops.ragen_cpu_attention.segment_attention_bwd(q, k, v, out, lse, grad, bounds, ctx.scale)
        return dq, dk, dv, None, None


def causal_bounds(batch: int, length: int) -> torch.Tensor:
    """Bounds [batch, length, 3] of plain causal attention: query i sees [0, i]."""
    i = torch.arange(length, dtype=torch.int32)
    zero = torch.zeros_like(i)
    return torch.stack([zero, zero, i], dim=-1).expand(batch, -1, -1).contiguous()


def packed_bounds(prefix: int, tails: Sequence[int]) -> torch.Tensor:
    """Bounds [1, prefix + sum(tails), 3] of a packed row as :func:`ragen_core.trainer.forward.packed_group` lays it
    out: the prefix causally, then each row's ``tails`` tokens over the prefix and causally over themselves."""
    rows = [(0, 0, i) for i in range(prefix)]
    start = prefix
    for tail in tails:
        rows += [(prefix, start, start + j) for j in range(tail)]
        start += tail
    return torch.tensor(rows, dtype=torch.int32).reshape(1, -1, 3)


_last: list[Any] = [None, None]  # [weakref to the last mask analysed, its bounds]: a forward's layers share one mask


def mask_bounds(mask: torch.Tensor | None, batch: int, lq: int, lk: int) -> torch.Tensor | None:
    """Bounds [batch, Lq, 3] int32 (a, b, c: query i may attend to the keys [0, a) and [b, c]) of a boolean mask
    [batch or 1, 1, Lq, Lk] (True: may attend), or None where some row is not of that form or attends to nothing.
    ``mask`` None is causal attention (Lq == Lk; else None). The last mask's answer is kept for its next call."""
    if mask is None:
        return causal_bounds(batch, lq) if lq == lk else None
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1 or tuple(mask.shape[2:]) != (lq, lk) \
            or mask.shape[0] not in (1, batch):
        return None
    ref, bounds = _last
    if ref is not None and ref() is mask and bounds is not None and bounds.shape[0] == batch:
        return bounds
    m = mask[:, 0]  # [b, Lq, Lk]
    j = torch.arange(lk, device=mask.device)
    if not bool(m.any(dim=-1).all()):
        return None
    a = torch.where(m.all(dim=-1), lk, (~m).to(torch.uint8).argmax(dim=-1))  # the leading run of Trues: [0, a)
    after = m & (j >= a[..., None])
    second = after.any(dim=-1)
    b = torch.where(second, after.to(torch.uint8).argmax(dim=-1), lk)
    c = torch.where(second, lk - 1 - m.flip(-1).to(torch.uint8).argmax(dim=-1), -1)
    if not torch.equal((j < a[..., None]) | ((j >= b[..., None]) & (j <= c[..., None])), m):
        return None
    out = torch.stack([a, b, c], dim=-1).to(torch.int32).expand(batch, -1, -1).contiguous()
    _last[0], _last[1] = weakref.ref(mask), out
    return out


@functools.cache
def _kernel() -> bool:
    """Whether the segment kernel runs here: cpu_attention's build loads and the CPU has AVX512-BF16."""
    return cpu_attention.segment_ops() is not None


def runs_segment_kernel(decoder: torch.nn.Module) -> bool:
    """Whether the decoder's attention calls run the segment kernel now, as far as the decoder tells: inside
    :func:`use_segment_attention` (a CPU, the kernel built and applying to this CPU), bf16 compute (autocast or
    bf16 weights), head size 64 and no attention dropout. :func:`segment_attention` still checks each call."""
    config = getattr(decoder, "config", None)
    if getattr(config, "_attn_implementation", None) != NAME:
        return False
    bf16 = (torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu")
            else next(decoder.parameters()).dtype) == torch.bfloat16
    heads = getattr(config, "num_attention_heads", 0)
    size = getattr(config, "head_dim", None) or (getattr(config, "hidden_size", 0) // heads if heads else 0)
    dropout = float(getattr(config, "attention_dropout", 0.0) or 0.0) if decoder.training else 0.0
    return bf16 and size == HEAD_SIZE and dropout == 0.0


def segment_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    """A transformers attention function: the segment kernel where it applies (module docstring), else
    :func:`ragen_core.trainer.forward.split_attention` (torch's sdpa, in parts for a packed row that pays)."""
    from ragen_core.trainer.forward import split_attention

    device = query.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else query.dtype
    bounds = None
    if (device == "cpu" and dtype == torch.bfloat16 and dropout == 0.0 and query.shape[-1] == HEAD_SIZE
            and key.shape[1] > 0 and query.shape[1] % key.shape[1] == 0 and getattr(module, "is_causal", True)
            and _kernel()):
        bounds = mask_bounds(attention_mask, query.shape[0], query.shape[2], key.shape[2])
    if bounds is None:
        return split_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    q, k, v = (t.to(torch.bfloat16) for t in (query, key, value))
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    scale = float(scaling) if scaling is not None else HEAD_SIZE ** -0.5
    return SegmentAttention.apply(q, k, v, bounds, scale), None


@functools.cache
def _register() -> None:
    # lazily: transformers takes seconds to import and only model code paths need it
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, segment_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)  # the masks sdpa gets: boolean, None where plainly causal


@contextlib.contextmanager
def use_segment_attention(decoder: torch.nn.Module) -> Iterator[None]:
    """Inside the block, a decoder that runs ``sdpa`` on CPU runs :func:`segment_attention` (where the kernel runs
    here); anywhere else nothing changes. Not under gradient checkpointing: its recomputation in the backward runs
    after the block, on ``sdpa``, and must save what the forward saved."""
    config = getattr(decoder, "config", None)
    checkpointed = decoder.training and getattr(decoder, "gradient_checkpointing", False)
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa" or checkpointed or not _kernel():
        yield
        return
    if next(decoder.parameters()).device.type != "cpu":
        yield
        return
    _register()
    with implementation(config, NAME):
        yield
