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
    logp = torch.log_softmax(logits / temperature, dim=-1)  # [B, V]
    # float64 cumulative sums keep the inverse-CDF lookup exact enough over ~50k-token vocabularies
    probs = logp.exp().double()  # [B, V]
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)  # [B, V]
        # keep an id while the mass before it is < top_p: the most likely id is always kept
        keep = (sorted_p.cumsum(dim=-1) - sorted_p) < top_p
        cdf = (sorted_p * keep).cumsum(dim=-1)  # [B, V]
    else:
        order, cdf = None, probs.cumsum(dim=-1)  # [B, V]
    target = (uniforms.double() * cdf[:, -1])[:, None]  # [B, 1], strictly below the total mass
    # first index whose CDF exceeds the target: never an id of probability 0
    pos = torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[-1] - 1)  # [B, 1]
    ids = (pos if order is None else order.gather(1, pos)).squeeze(1)  # [B]
    return ids, logp.gather(1, ids[:, None]).squeeze(1)
