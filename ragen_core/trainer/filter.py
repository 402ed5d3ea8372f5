"""Apply the group filter to a token batch: keep whole prompt groups (StarPO-S, SPEC §4; RAGEN-2, SPEC §8).

    kept = filter_batch(batch, trajectories, cfg.algorithm)
    stats = update(state, kept.batch, cfg, advantage_scale=kept.advantage_scale)
    metrics.update(kept.metrics)        # rollout/reward_std_all, rollout/reward_std_kept, ...

One score per group (``algorithm.filter_metric``, :data:`GROUP_SCORES`) from per-trajectory
values arranged as [P groups, N responses]; the choice is
``ragen_core.algos.filtering.select_groups`` (``filter_strategy`` / ``filter_value`` /
``filter_largest`` / ``filter_include_zero`` / ``filter_top_p_mode``); this module computes the
scores and maps kept groups back to batch rows. Reward scores are taken of ``algorithm.filter_on``:
``return`` ranks the raw env returns (penalties excluded; ours, the default); ``total`` ranks env
return + format penalties, group-normalised first ((R − mean) / (std + 1e-6), as
``advantages.grpo``) under the grpo and gigpo estimators: what the reference's filter ranks (its
``original_rm_scores`` alias the normalised, penalised scores). Entropy scores use each
trajectory's mean −log p of its sampled tokens (a Monte-Carlo estimate of its token entropy, free
from the rollout's log-probs). The ``rollout/reward_std_*`` metrics always describe raw env
returns, whatever is ranked. The flow calls it between rollout and update (it is not inside
``update`` so that a benchmark can time the update on the same rollout batch with different
filters). It may keep nothing (``filter_include_zero: false`` on a batch with no signal): the
caller then skips the update.

Run the tests with ``python -m pytest tests/unit/trainer -q``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from ragen_core.algos import advantages, filtering
from ragen_core.config import AlgorithmConfig
from ragen_core.types import TokenBatch, Trajectory

__all__ = ["GROUP_SCORES", "FilterResult", "filter_batch"]


class FilterResult(NamedTuple):
    batch: TokenBatch
    """The kept rows, group by group (groups in ascending id, rows in batch order within a group)."""
    kept_groups: torch.Tensor
    """[K] indices of kept groups, in ascending group-id order of the input batch."""
    rows: torch.Tensor
    """[K·N] the input rows that were kept, in the order of ``batch``."""
    metrics: dict[str, float]
    """rollout/reward_std_all, rollout/reward_std_kept, rollout/zero_std_frac, rollout/kept_groups,
    rollout/kept_ratio."""
    advantage_scale: float = 1.0
    """What ``algorithm.filter_adv_scale`` multiplies the advantages by (1.0 unless scaling is on)."""


def _std(x: torch.Tensor) -> torch.Tensor:
    return filtering.group_std(x) if x.shape[1] > 1 else torch.zeros(x.shape[0], dtype=torch.float64)


GROUP_SCORES: dict[str, tuple[str, Callable[[torch.Tensor], torch.Tensor]]] = {
    "reward_std": ("reward", _std),
    "reward_mean": ("reward", lambda x: x.to(torch.float64).mean(dim=1)),
    "entropy": ("entropy", lambda x: x.to(torch.float64).mean(dim=1)),
    "entropy_std": ("entropy", _std),
    "length": ("length", lambda x: x.to(torch.float64).mean(dim=1)),
}
"""filter_metric -> (per-trajectory value, reduction of a [P, N] matrix to [P] group scores)."""

_ADV_SCALES: dict[str, Callable[[float], float]] = {"none": lambda f: 1.0, "linear": lambda f: f, "sqrt": math.sqrt}


def _row_values(kind: str, batch: TokenBatch, rewards: torch.Tensor) -> torch.Tensor:
    """Per batch row [B]: the reward scores, entropy (mean −old_logprob over the loss mask) or length."""
    if kind == "reward":
        return rewards
    mask = batch.loss_mask
    length = mask.sum(dim=1).to(torch.float64)  # [B]
    if kind == "length":
        return length
    nll = -(batch.old_logprobs.to(torch.float64) * mask).sum(dim=1)  # [B]
    return nll / length.clamp(min=1.0)


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
            raise ValueError(f"returns_by_group has shape {tuple(values.shape)}, "
                             f"the batch's groups are {tuple(rows.shape)}")
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
    """Keep the prompt groups chosen by ``algo``'s filter settings (module docstring).

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
        if algo.estimator in ("grpo", "gigpo"):  # the critic-free estimators normalise returns in their group
            scores = advantages.grpo(scores, batch.group_ids)  # [B]
    by_group, _, rows = filtering.group_matrix(returns, batch.group_ids)  # [P, N], [P], [P, N]
    kind, reduce = GROUP_SCORES[algo.filter_metric]
    values, _, _ = filtering.group_matrix(_row_values(kind, batch, scores), batch.group_ids)  # [P, N]
    group_scores = reduce(values)  # [P]
    keep = filtering.select_groups(group_scores, algo.filter_strategy, algo.filter_value,
                                   largest=algo.filter_largest, include_zero=algo.filter_include_zero,
                                   top_p_mode=algo.filter_top_p_mode, eps=algo.filter_eps)  # [K]
    kept_rows = rows[keep].flatten()  # [K·N]
    n_groups, group_size = by_group.shape
    fraction = len(keep) / n_groups
    metrics = {"rollout/kept_groups": float(len(keep)), "rollout/kept_ratio": fraction,
               "rollout/filter_score_mean": float(group_scores.mean()),
               "rollout/filter_score_kept": float(group_scores[keep].mean()) if len(keep) else 0.0}
    if group_size >= 2:  # in-group std needs two responses
        s = filtering.group_std_stats(by_group, keep if len(keep) else None)
        metrics.update({"rollout/reward_std_all": s["std_mean"], "rollout/reward_std_kept": s.get("kept_std_mean", 0.0),
                        "rollout/zero_std_frac": s["zero_std_frac"]})
    return FilterResult(batch.select(kept_rows), keep, kept_rows, metrics, _ADV_SCALES[algo.filter_adv_scale](fraction))
