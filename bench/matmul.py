"""The matmul rate the benchmarks divide by (their roofline fractions), measured in the benchmark's own process
so it runs with the same threads as what it is compared with."""

from __future__ import annotations

import time

import torch


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
