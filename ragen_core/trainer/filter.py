"""Apply the StarPO-S uncertainty filter to a token batch: keep whole prompt groups (SPEC §4).

    kept = filter_batch(batch, trajectories, cfg.algorithm)
    stats = update(state, kept.batch, cfg)
    metrics.update(kept.metrics)        # rollout/reward_std_all, rollout/reward_std_kept, ...

The ranking itself is ``ragen_core.algos.filtering.uncertainty_filter`` on
per-trajectory scores arranged as [P groups, N responses]; this module picks the
scores and maps kept groups back to batch rows. ``algorithm.filter_on``:
``return`` ranks the raw env returns (penalties excluded; ours, the default);
``total`` ranks env return + format penalties, group-normalised first
((R − mean) / (std + 1e-6), as ``advantages.grpo``) under the grpo estimator:
what the reference's filter ranks (its ``original_rm_scores`` alias the
normalised, penalised scores). The ``rollout/reward_std_*`` metrics always
describe raw env returns, whatever is ranked. The flow calls it between
rollout and update (it is not inside ``update`` so that a benchmark can time
the update on the same rollout batch with different keep ratios).

Run the tests with ``python -m pytest tests/unit/trainer -q``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from ragen_core.algos import advantages, filtering
from ragen_core.config import AlgorithmConfig
from ragen_core.types import TokenBatch, Trajectory

__all__ = ["FilterResult", "filter_batch"]


class FilterResult(NamedTuple):
    batch: TokenBatch
    """The kept rows, group by group (groups in ascending id, rows in batch order within a group)."""
    kept_groups: torch.Tensor
    """[K] indices of kept groups, in ascending group-id order of the input batch."""
    rows: torch.Tensor
    """[K·N] the input rows that were kept, in the order of ``batch``."""
    metrics: dict[str, float]
    """rollout/reward_std_all, rollout/reward_std_kept, rollout/zero_std_frac, rollout/kept_groups, rollout/kept_ratio."""


def _row_returns(env_returns: Sequence[Trajectory] | Sequence[float] | torch.Tensor, batch: TokenBatch,
                 field: str = "env_return") -> torch.Tensor:
    """Per batch row: the trajectories' ``field`` (env_return or total_return), or the given values; [B] float64."""
    if isinstance(env_returns, torch.Tensor):
        values = env_returns.to(torch.float64)
    else:
        values = torch.tensor([float(getattr(t, field)) if isinstance(t, Trajectory) else float(t)
                               for t in env_returns], dtype=torch.float64)
    if values.dim() == 2:  # [P, N] already grouped (ascending group id, batch order within a group)
        _, _, rows = filtering.group_matrix(torch.zeros(batch.batch_size), batch.group_ids)
        flat = torch.empty(batch.batch_size, dtype=torch.float64)
        if values.shape != rows.shape:
            raise ValueError(f"returns_by_group has shape {tuple(values.shape)}, the batch's groups are {tuple(rows.shape)}")
        flat[rows.flatten()] = values.flatten()
        values = flat
    if values.shape != (batch.batch_size,):
        raise ValueError(f"need one env return per batch row ({batch.batch_size}); got shape {tuple(values.shape)}")
    return values


def filter_batch(
    batch: TokenBatch,
    env_returns: Sequence[Trajectory] | Sequence[float] | torch.Tensor,
    algo: AlgorithmConfig,
) -> FilterResult:
    """Keep the prompt groups chosen by ``algo.filter_mode`` / ``algo.keep_ratio`` / ``algo.filter_on``.

    env_returns: the trajectories of the batch rows (their ``env_return``, or
    ``total_return`` under filter_on total, is used), or the per-row values to
    rank [B], or already grouped [P, N] in
    :func:`ragen_core.algos.filtering.group_matrix` order. All groups must have
    the same size N (N ≥ 2 for the std modes).
    """
    returns = _row_returns(env_returns, batch)  # [B]
    scores = returns
    if algo.filter_on == "total":
        scores = _row_returns(env_returns, batch, "total_return")  # [B]
        if algo.estimator == "grpo":
            scores = advantages.grpo(scores, batch.group_ids)  # [B]
    by_group, _, rows = filtering.group_matrix(returns, batch.group_ids)  # [P, N], [P], [P, N]
    ranked, _, _ = filtering.group_matrix(scores, batch.group_ids)  # [P, N]
    keep = filtering.uncertainty_filter(ranked, algo.keep_ratio, algo.filter_mode)  # [K]
    kept_rows = rows[keep].flatten()  # [K·N]
    n_groups, group_size = by_group.shape
    metrics = {"rollout/kept_groups": float(len(keep)), "rollout/kept_ratio": len(keep) / n_groups}
    if group_size >= 2:  # in-group std needs two responses
        s = filtering.group_std_stats(by_group, keep)
        metrics.update({"rollout/reward_std_all": s["std_mean"], "rollout/reward_std_kept": s["kept_std_mean"],
                        "rollout/zero_std_frac": s["zero_std_frac"]})
    return FilterResult(batch.select(kept_rows), keep, kept_rows, metrics)
