"""The matmul rate the benchmarks divide by (their roofline fractions), measured in the benchmark's own process
so it runs with the same threads as what it is compared with."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode


def matmul_rate(dtype: torch.dtype = torch.float32, n: int = 2048, repeats: int = 5,
                device: torch.device | None = None) -> float:
    """FLOP/s of an n x n x n product in ``dtype``: the best of ``repeats`` timed products after one warm-up.
    On CUDA each product is synchronised, and fp32 runs as TF32 (what the trainer allows there)."""
    device = device or torch.device("cpu")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    best = float("inf")
    for i in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        (a @ b).sum().item()
        if i:  # the first product is the warm-up
            best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


class ProductRecorder(TorchDispatchMode):
    """Inside the block, records every matrix product torch dispatches (mm, addmm, addmm_, bmm, baddbmm, backward
    passes included) as (op, arguments, keyword arguments), each tensor argument kept as its layout only (shape,
    strides, dtype), so that :meth:`replay_seconds` can time the products without the work around them; and the
    seconds the products took where they ran (``seconds``)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = []
        self.seconds = 0.0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func not in PRODUCTS:
            return func(*args, **kwargs)
        # beta and alpha are the only keyword arguments (numbers)
        self.calls.append((func, tuple(_Layout.of(a) if isinstance(a, torch.Tensor) else a for a in args),
                           dict(kwargs)))
        start = time.perf_counter()
        out = func(*args, **kwargs)
        self.seconds += time.perf_counter() - start
        return out

    def flops(self) -> int:
        """The recorded products' FLOPs by torch's FlopCounterMode formulas (2 x m x k x n each, x the batch for bmm
        and baddbmm), addmm_'s too, which the counter itself does not count."""
        return sum(PRODUCTS[func](*(a.shape for a in args if isinstance(a, _Layout))) for func, args, _ in self.calls)

    def replay_seconds(self, repeats: int = 3) -> float:
        """The recorded products run again alone, in their order and on inputs of their layouts: the best of
        ``repeats`` wall times of the whole sequence (after one warm-up run). Inputs of one layout are made once and
        shared by every call with that layout (so a replay of a large run does not hold all its operands at once);
        the values are random, which a product's speed does not depend on."""
        tensors: dict[_Layout, torch.Tensor] = {}

        def make(layout: _Layout) -> torch.Tensor:
            if layout not in tensors:
                span = zip(layout.shape, layout.stride, strict=True)
                size = 1 + sum((n - 1) * s for n, s in span) if all(layout.shape) else 0
                tensors[layout] = torch.randn(max(size, 1)).to(layout.dtype).as_strided(layout.shape, layout.stride)
            return tensors[layout]

        calls = [(func, tuple(make(a) if isinstance(a, _Layout) else a for a in args), kwargs)
                 for func, args, kwargs in self.calls]
        best = float("inf")
        for i in range(repeats + 1):
            start = time.perf_counter()
            for func, args, kwargs in calls:
                func(*args, **kwargs)
            if i:  # the first run is the warm-up
                best = min(best, time.perf_counter() - start)
        return best


class _Layout(NamedTuple):
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, t: torch.Tensor) -> _Layout:
        return cls(tuple(t.shape), tuple(t.stride()), t.dtype)


aten = torch.ops.aten
PRODUCTS: dict[Any, Callable[..., int]] = {
    aten.mm.default: flop_counter.mm_flop, aten.bmm.default: flop_counter.bmm_flop,
    aten.addmm.default: flop_counter.addmm_flop, aten.addmm_.default: flop_counter.addmm_flop,
    aten.baddbmm.default: flop_counter.baddbmm_flop,
}
"""The products recorded, each with its FLOP formula over its tensor arguments' shapes."""


def _segment_pairs(bounds: torch.Tensor, valid: torch.Tensor | None = None) -> int:
    """Query-key pairs the segment kernel's bounds allow: query i of row r sees the keys j < a (of them only the
    flagged ones, with ``valid`` [B, Lk]) and b <= j <= c, once each (bounds [B, Lq, 3] of (a, b, c))."""
    a, lo, hi = (bounds[..., j].to(torch.int64) for j in range(3))
    if a.numel() == 0:
        return 0
    width = valid.shape[1] if valid is not None else int(max(int(a.max()), int(hi.max()) + 1, 0))
    flags = valid.to(torch.int64) if valid is not None else torch.ones(a.shape[0], width, dtype=torch.int64)
    csum = torch.nn.functional.pad(flags.cumsum(-1), (1, 0))  # [B, Lk + 1]: flagged keys before each index

    def flagged(start: torch.Tensor, end: torch.Tensor) -> torch.Tensor:  # flagged keys in [start, end)
        start, end = start.clamp(0, width), end.clamp(0, width)
        return (csum.gather(1, torch.maximum(start, end)) - csum.gather(1, start))

    second = (hi - lo + 1).clamp(min=0)
    return int((flagged(torch.zeros_like(a), a) + second - flagged(lo, torch.minimum(a, hi + 1))).sum())


def _sdpa_pairs(query: torch.Tensor, key: torch.Tensor, is_causal: bool, attn_mask: torch.Tensor | None) -> int:
    """Query-key pairs, summed over batch and query heads, that torch's CPU attention lets through."""
    b, h, lq, _ = query.shape
    lk = key.shape[2]
    if attn_mask is not None:
        allowed = attn_mask if attn_mask.dtype == torch.bool else attn_mask > torch.finfo(attn_mask.dtype).min / 2
        return int(allowed.expand(b, h, lq, lk).sum())
    if is_causal:  # torch's causal mask is aligned top-left: query i sees keys 0..i
        return b * h * int(torch.arange(1, lq + 1).clamp(max=lk).sum())
    return b * h * lq * lk


def _in_place_product(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *args: Any, out_val: Any = None,
                      **kwargs: Any) -> int:
    """``addmm_``'s FLOPs: 2 m k n (its accumulation into ``out`` is not a product)."""
    return flop_counter.mm_flop(a.shape, b.shape)


_in_place_product._get_raw = True  # type: ignore[attr-defined]


def _attention_formula(products: int, segment: bool, backward: bool) -> Callable[..., int]:
    """A raw-argument FlopCounterMode formula: ``products`` products of 2 x head size FLOPs per allowed pair."""

    def formula(*args: Any, out_val: Any = None, **kwargs: Any) -> int:
        # sdpa's backward takes the output's gradient first; the segment kernel's takes q, k, v first
        query, key = (args[1], args[2]) if backward and not segment else (args[0], args[1])
        d = query.shape[-1]
        if segment:
            bounds = args[6] if backward else args[3]
            valid = None if backward else (args[5] if len(args) > 5 else kwargs.get("valid"))
            return products * 2 * d * query.shape[1] * _segment_pairs(bounds, valid)
        is_causal = bool(args[7] if backward else (args[4] if len(args) > 4 else kwargs.get("is_causal", False)))
        return products * 2 * d * _sdpa_pairs(query, key, is_causal, kwargs.get("attn_mask"))

    formula._get_raw = True  # type: ignore[attr-defined]  # FlopCounterMode hands it the tensors, not shapes
    return formula


def model_flop_mapping() -> dict[Any, Callable[..., int]]:
    """FlopCounterMode's ``custom_mapping`` for what its own registry leaves out on a CPU: the in-place product
    (``addmm_``, the fused LoRA's), torch's CPU flash attention, and the segment kernel of
    ``ragen_core/rollout/generators/cpu_attention.py`` where it is built. Attention counts model FLOPs: the pairs the
    mask lets through (not the masked ones a kernel may compute anyway), q kᵀ and p v forward, their four gradient
    products backward (the scores recomputed there are not the model's)."""
    mapping: dict[Any, Callable[..., int]] = {
        aten.addmm_: _in_place_product,
        aten._scaled_dot_product_flash_attention_for_cpu: _attention_formula(2, segment=False, backward=False),
        aten._scaled_dot_product_flash_attention_for_cpu_backward: _attention_formula(4, segment=False, backward=True),
    }
    ops = getattr(torch.ops, "ragen_cpu_attention", None)
    if ops is not None and hasattr(ops, "segment_attention_fwd"):
        mapping[ops.segment_attention_fwd] = _attention_formula(2, segment=True, backward=False)
        mapping[ops.segment_attention_bwd] = _attention_formula(4, segment=True, backward=True)
    return mapping


ATTENTION_OPS = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward",
                 "segment_attention_fwd", "segment_attention_bwd")
"""Names (FlopCounterMode's per-op keys end with them) of the attention ops :func:`model_flop_mapping` counts."""
