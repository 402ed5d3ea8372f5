"""Masked reductions over per-token tensors: sum, mean, variance, whitening.

Pure tensor functions (STYLE rule 1). ``mask`` is a bool tensor broadcastable to
``x``; True marks the entries that take part (in the trainer: ``loss_mask``,
the tokens the model generated). Entries where the mask is False never
influence a result, whatever value they hold (NaN included), because they are
selected away with ``torch.where`` rather than multiplied by zero. (That holds
for forward values; keep padding finite if you differentiate through them.)

Run the tests with ``python -m pytest tests/unit/algos -q``.
"""

from __future__ import annotations

import torch

Dim = int | tuple[int, ...] | None


def _select(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x`` where ``mask`` else 0 (where, not multiply, so NaN/inf outside the mask cannot leak)."""
    return torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: Dim = None, keepdim: bool = False) -> torch.Tensor:
    """Sum of ``x`` over the True entries of ``mask``.

    x: [...], mask: broadcastable to x (bool). dim None reduces everything
    (0-dim result unless keepdim); otherwise the given dim(s) are reduced.
    """
    return _select(x, mask).sum(dim=dim, keepdim=keepdim)


def masked_count(x: torch.Tensor, mask: torch.Tensor, dim: Dim = None, keepdim: bool = False) -> torch.Tensor:
    """Number of True mask entries, broadcast like ``x`` and reduced like :func:`masked_sum` (float)."""
    ones = torch.ones((), dtype=x.dtype, device=x.device).expand_as(x)
    return masked_sum(ones, mask, dim, keepdim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: Dim = None, keepdim: bool = False) -> torch.Tensor:
    """Mean of ``x`` over the True entries of ``mask``; 0 where nothing is selected.

    x: [...], mask: broadcastable to x. An empty selection gives 0 rather than
    NaN (the count is clamped to 1) so that an all-masked row cannot poison a batch.
    """
    return masked_sum(x, mask, dim, keepdim) / masked_count(x, mask, dim, keepdim).clamp(min=1.0)


def masked_var(x: torch.Tensor, mask: torch.Tensor, dim: Dim = None, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``x`` over the True entries of ``mask``.

    x: [...], mask: broadcastable to x. ``unbiased`` divides by n − 1 (Bessel,
    like ``torch.var``), otherwise by n. With too few entries (n ≤ 1 unbiased,
    n = 0 biased) the variance is undefined; we return 0 there, so whitening a
    single token gives 0 instead of NaN.
    """
    mean = masked_mean(x, mask, dim, keepdim=True)  # broadcasts back over x
    sq = masked_sum((x - mean) ** 2, mask, dim)
    n = masked_count(x, mask, dim)
    denom = n - 1.0 if unbiased else n
    return torch.where(denom > 0, sq / denom.clamp(min=1.0), torch.zeros_like(sq))


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """Whiten ``x`` with the mean and unbiased variance of its masked entries (whole tensor).

    x: [B, T] (any shape), mask: same shape (bool) -> [B, T].
    Returns (x − mean) / sqrt(var + eps), plus the mean back when
    ``shift_mean`` is False (scale only, the sign of x is kept). Entries outside
    the mask are 0 in the result. SPEC §4: PPO advantages are whitened over
    the loss mask; this is done by the caller, never inside ``gae``.
    """
    mean = masked_mean(x, mask)
    var = masked_var(x, mask, unbiased=True)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return _select(whitened, mask)
