"""Benchmark: the update's bf16 attention, cpu_attention's segment kernel against torch's, forward and backward.

At the studies' packed-row shapes (SmolLM2's 9 query heads over 3 key/value heads of 64): a Bandit prompt group
(8 replies of 26 tokens on a 187-token prompt), four FrozenLake rows on a 196-token prompt, one long FrozenLake
row, and a plain causal row. Each shape runs, alternated, as the update runs it (trainer/attention.py: the segment
kernel), as one torch SDPA call on the packed row's block mask, and as forward.split_attention's calls (the prefix
causally, each row over the prefix and itself), all in bf16 with the key heads repeated as transformers repeats
them. Prints milliseconds (the faster half of the repeats, averaged), the useful GFLOP/s (4·d·heads per attended
pair forward, 10 more backward) and the ratio torch ÷ segment for each. Where the segment kernel's products run on
AMX tiles (cpu_attention.segment_amx), it also runs with them on vdpbf16ps, and prints that ratio too (``amx_speedup``).
Needs a CPU with AVX512-BF16.

Run:  .venv/bin/python bench/attention.py [--repeats 10]

The last line printed is one JSON object: {"<shape>": {"segment_ms": ..., "block_mask_ms": ..., "split_ms": ...,
"speedup_vs_block_mask": ..., "speedup_vs_split": ..., ["segment_vdpbf16ps_ms": ..., "amx_speedup": ...]}, ...}
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ragen_core.rollout.generators import cpu_attention
from ragen_core.trainer.attention import SegmentAttention, packed_bounds

SHAPES = {  # name: (prompt, reply lengths)
    "bandit-group": (187, [26] * 8),
    "frozenlake-4-rows": (196, [46, 120, 300, 505]),
    "frozenlake-long-row": (196, [505]),
    "causal-400": (0, [400]),
}
HEADS, KV_HEADS, D, SCALE = 9, 3, 64, 0.125


def timed(fn: Callable[[], None], repeats: int) -> float:
    """Milliseconds: the faster half of ``repeats`` calls (after 2 warm-ups), averaged."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    times.sort()
    half = times[: max(1, repeats // 2)]
    return sum(half) / len(half) * 1e3


def measure(prefix: int, tails: list[int], repeats: int, amx: bool) -> dict[str, float]:
    """One packed row's attention, forward and backward, three ways (four with ``amx``: module docstring),
    alternated twice."""
    length = prefix + sum(tails)
    bounds = packed_bounds(prefix, tails)
    j = torch.arange(length)
    mask = (j < bounds[0, :, :1]) | ((j >= bounds[0, :, 1:2]) & (j <= bounds[0, :, 2:3]))
    pairs = int(mask.sum())
    q = torch.randn(1, length, HEADS, D).bfloat16().transpose(1, 2).requires_grad_()
    k = torch.randn(1, KV_HEADS, length, D).bfloat16().requires_grad_()
    v = torch.randn(1, KV_HEADS, length, D).bfloat16().requires_grad_()
    grad = torch.randn(1, length, HEADS, D).bfloat16()
    g = HEADS // KV_HEADS

    def segment() -> None:
        SegmentAttention.apply(q, k, v, bounds, SCALE).backward(grad)

    def block_mask() -> None:
        out = F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1),
                                             attn_mask=mask, scale=SCALE)
        out.transpose(1, 2).backward(grad)

    def split() -> None:
        keys, values = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        sizes = [prefix, *tails]
        qs, ks, vs = q.split(sizes, 2), keys.split(sizes, 2), values.split(sizes, 2)
        parts = [F.scaled_dot_product_attention(qs[0], ks[0], vs[0], is_causal=True, scale=SCALE)] if prefix else []
        for i, t in enumerate(tails, start=1):
            own = torch.ones(t, t, dtype=torch.bool).tril()
            row = torch.cat([torch.ones(t, prefix, dtype=torch.bool), own], dim=1)
            parts.append(F.scaled_dot_product_attention(qs[i], torch.cat([ks[0], ks[i]], 2),
                                                        torch.cat([vs[0], vs[i]], 2), attn_mask=row, scale=SCALE))
        torch.cat(parts, 2).transpose(1, 2).backward(grad)

    def segment_vdpbf16ps() -> None:
        cpu_attention.segment_amx(False)
        try:
            segment()
        finally:
            cpu_attention.segment_amx(True)

    sides = [("segment", segment), ("block_mask", block_mask), ("split", split)]
    if amx:
        sides.append(("segment_vdpbf16ps", segment_vdpbf16ps))
    times = dict.fromkeys((key for key, _ in sides), 0.0)
    for _ in range(2):  # alternated, so that the machine's drift falls on all of them
        for key, fn in sides:
            times[key] += timed(fn, repeats) / 2
    row: dict[str, float] = {f"{key}_ms": round(ms, 2) for key, ms in times.items()}
    row.update(pairs=pairs, segment_gflop_per_s=round(14 * D * HEADS * pairs / times["segment"] / 1e6, 1),
               speedup_vs_block_mask=round(times["block_mask"] / times["segment"], 2),
               speedup_vs_split=round(times["split"] / times["segment"], 2))
    if amx:
        row.update(amx_speedup=round(times["segment_vdpbf16ps"] / times["segment"], 2))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    if cpu_attention.segment_ops() is None:
        sys.exit("the segment kernel does not run here (no compiler, or a CPU without AVX512-BF16)")
    torch.manual_seed(0)
    amx = cpu_attention.segment_amx()
    print(f"segment kernel's products: {'AMX tiles (oneDNN)' if amx else 'vdpbf16ps'}", flush=True)
    result = {}
    for name, (prefix, tails) in SHAPES.items():
        row = result[name] = measure(prefix, tails, args.repeats, amx)
        vdp = (f", on vdpbf16ps {row['segment_vdpbf16ps_ms']:7.2f} ms ({row['amx_speedup']:.2f}x)"
               if amx else "")
        print(f"{name:20s} {row['pairs'] / 1e3:6.0f}k pairs: segment {row['segment_ms']:7.2f} ms "
              f"({row['segment_gflop_per_s']:.0f} GFLOP/s), block mask {row['block_mask_ms']:7.2f} ms "
              f"({row['speedup_vs_block_mask']:.2f}x), split {row['split_ms']:7.2f} ms "
              f"({row['speedup_vs_split']:.2f}x){vdp}", flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
