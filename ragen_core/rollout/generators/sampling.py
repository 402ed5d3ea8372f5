"""Token sampling as pure tensor functions (temperature, top-p, greedy) with per-row random streams.

Sampling is by inverse CDF: each row draws one uniform number per step from its own stream, so a
row's samples do not depend on which other rows share the batch (the left-padding invariance the
tests check) and a seeded call is reproducible. Log-probabilities follow base.py's convention:
``log_softmax(logits / temperature)`` at the sampled id, not renormalised over the top-p nucleus.

Nothing to run here; ``tests/unit/rollout/test_generators.py`` exercises it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def row_seed(seed: int, row: int) -> int:
    """A 63-bit seed for row ``row`` of a call seeded with ``seed`` (well mixed, stable across runs)."""
    state = np.random.SeedSequence([int(seed) & 0xFFFFFFFFFFFFFFFF, int(row)]).generate_state(2, np.uint32)
    return int((int(state[0]) << 31) ^ int(state[1])) & 0x7FFFFFFFFFFFFFFF


def row_generators(seed: int | None, n_rows: int, streams: Sequence[int] | None = None
                   ) -> list[torch.Generator] | None:
    """One CPU ``torch.Generator`` per row when ``seed`` is set, else None (use the global RNG).

    Row ``i`` gets stream ``streams[i]`` (default ``i``): see ``SamplingParams.streams``.
    """
    if seed is None:
        return None
    keys = range(n_rows) if streams is None else streams
    if len(keys) != n_rows:
        raise ValueError(f"got {len(keys)} sampling streams for {n_rows} rows")
    return [torch.Generator().manual_seed(row_seed(seed, k)) for k in keys]


def draw_uniforms(
    generators: list[torch.Generator] | None, rows: list[int], device: torch.device
) -> torch.Tensor:
    """One U[0, 1) number for each of ``rows`` ([R] float64), from each row's own stream when given.

    Only the listed rows consume randomness, so a row's stream advances once per token it samples.
    """
    if generators is None:
        u = torch.rand(len(rows), dtype=torch.float64)
    else:
        u = torch.cat([torch.rand(1, dtype=torch.float64, generator=generators[r]) for r in rows])
    return u.to(device)


def sample_from_logits(
    logits: torch.Tensor, temperature: float, top_p: float, uniforms: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one id per row and return ``(ids [B] long, logprobs [B] float32)``.

    logits: [B, V] raw next-token logits; uniforms: [B] in [0, 1).
    ``temperature == 0`` is greedy (uniforms unused) with ``logprobs = log_softmax(logits)[id]``.
    Otherwise ``p = softmax(logits / T)``; with ``top_p < 1`` ids outside the smallest set of most likely
    ids whose mass reaches ``top_p`` get probability 0 (the set is renormalised for sampling only).
    """
    logits = logits.float()
    if temperature == 0.0:
        logp = torch.log_softmax(logits, dim=-1)  # [B, V]
        ids = logp.argmax(dim=-1)  # [B]
        return ids, logp.gather(1, ids[:, None]).squeeze(1)
    if top_p >= 1.0:  # one vocabulary-sized tensor: exp(z - max z), sampled from unnormalised
        z = logits if temperature == 1.0 else logits / temperature  # [B, V]
        top = z.amax(dim=-1, keepdim=True)  # [B, 1]
        weights = (z - top).exp_()  # [B, V]
        ids, total = _inverse_cdf_by_blocks(weights, uniforms)
        # log_softmax(z)[id] = z[id] - max z - log Σ exp(z - max z)
        return ids, (z.gather(1, ids[:, None]) - top).squeeze(1) - total.log().float()
    logp = torch.log_softmax(logits / temperature, dim=-1)  # [B, V]
    # float64 cumulative sums keep the inverse-CDF lookup exact enough over ~50k-token vocabularies
    probs = logp.exp().double()  # [B, V]
    sorted_p, order = probs.sort(dim=-1, descending=True)  # [B, V]; top_p < 1 here (1 returned above)
    # keep an id while the mass before it is < top_p: the most likely id is always kept
    keep = (sorted_p.cumsum(dim=-1) - sorted_p) < top_p
    cdf = (sorted_p * keep).cumsum(dim=-1)  # [B, V]
    target = (uniforms.double() * cdf[:, -1])[:, None]  # [B, 1], strictly below the total mass
    # first index whose CDF exceeds the target: never an id of probability 0
    pos = torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[-1] - 1)  # [B, 1]
    ids = order.gather(1, pos).squeeze(1)  # [B]
    return ids, logp.gather(1, ids[:, None]).squeeze(1)


CDF_BLOCK = 1024
"""Ids per block of :func:`_inverse_cdf_by_blocks`."""


def _inverse_cdf_by_blocks(probs: torch.Tensor, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The id whose float64 CDF first exceeds ``u`` × total, per row, and the total: probs [B, V] float32
    (unnormalised weights will do), uniforms [B] -> (ids [B], totals [B] float64).

    The same lookup as a float64 cumulative sum over the whole vocabulary, found in two levels: float64
    sums of blocks of :data:`CDF_BLOCK` ids and their cumulative sum pick the block, one block's cumulative
    sum the id. A full float64 copy and cumulative sum of [B, V] cost 21 ms of a 180 ms decode step at 64
    rows over 49k ids (profiled: fresh pages for each new [B, V] tensor); this reads the weights once. An
    id of probability 0 is never returned (a rounding difference between the two levels falls back to the
    block's last likely id).
    """
    b, v = probs.shape
    n_blocks = -(-v // CDF_BLOCK)
    if v % CDF_BLOCK:
        probs = torch.nn.functional.pad(probs, (0, n_blocks * CDF_BLOCK - v))
    padded = probs.view(b, n_blocks, CDF_BLOCK)
    block_cdf = padded.sum(dim=-1, dtype=torch.float64).cumsum(dim=-1)  # [B, nb]
    target = (uniforms.double() * block_cdf[:, -1])[:, None]  # [B, 1], strictly below the total mass
    block = torch.searchsorted(block_cdf, target, right=True).clamp_(max=n_blocks - 1)  # [B, 1]
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)), 0.0)  # [B, 1]
    inner = padded.gather(1, block[:, :, None].expand(b, 1, CDF_BLOCK)).squeeze(1)  # [B, K]
    pos = torch.searchsorted(before + inner.double().cumsum(dim=-1), target, right=True)  # [B, 1]
    last_likely = CDF_BLOCK - 1 - (inner > 0).flip(-1).int().argmax(dim=-1, keepdim=True)  # [B, 1]
    return (block * CDF_BLOCK + torch.minimum(pos, last_likely)).squeeze(1), block_cdf[:, -1]
