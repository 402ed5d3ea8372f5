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
