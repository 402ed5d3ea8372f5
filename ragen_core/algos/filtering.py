"""StarPO-S uncertainty filter (SPEC §4; RAGEN paper §4, "uncertainty-based filtering").

Keep only the prompt groups whose trajectories disagree most: per group, the
std of raw returns (env rewards, penalties excluded) measures how uncertain
the policy still is on that initial state. Whole groups are kept or dropped.
Pure tensor functions (STYLE rule 1); arguments are never modified.

Run the tests with ``python -m pytest tests/unit/algos -q``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

import torch

FilterMode = Literal["std", "std_rev", "none"]

# Guards floor(keep_ratio × P) against binary rounding: 0.29 × 100 is 28.999999999999996 in floats.
_ROUNDING_SLACK = 1e-9


# Stds are compared after rounding to this many decimals, so that groups whose stds differ only by
# float error tie: 4 and 12 successes out of 16 have the same std, yet float64 gives two values 1 ulp apart.
_STD_DECIMALS = 9


def group_std(returns_by_group: torch.Tensor) -> torch.Tensor:
    """Unbiased (n − 1, as ``torch.std``) std of each group's returns, in float64. [P, N] -> [P].

    Each row is sorted first so groups holding the same returns in another
    order get bit-identical stds.
    """
    return returns_by_group.sort(dim=1).values.to(torch.float64).std(dim=1)


def _highest_std_first(std: torch.Tensor) -> torch.Tensor:
    return torch.sort(std, descending=True, stable=True).indices  # stable: ties keep the lower index first


def _lowest_std_first(std: torch.Tensor) -> torch.Tensor:
    return torch.sort(std, stable=True).indices


_ORDERS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "std": _highest_std_first,
    "std_rev": _lowest_std_first,
}


def n_kept(n_groups: int, keep_ratio: float) -> int:
    """How many groups the filter keeps: max(1, floor(keep_ratio × P))."""
    return max(1, math.floor(keep_ratio * n_groups + _ROUNDING_SLACK))


def uncertainty_filter(
    returns_by_group: torch.Tensor, keep_ratio: float, mode: FilterMode = "std"
) -> torch.Tensor:
    """Indices of the prompt groups to train on. returns_by_group: [P, N] float -> [K] long, ascending.

    mode "std" keeps the K = max(1, floor(keep_ratio × P)) groups with the
    highest in-group std (StarPO-S), "std_rev" the K lowest (ablation), "none"
    all P groups. Ties (stds equal to 9 decimals) go to the lower group
    index. The std is unbiased, as
    ``torch.std`` in the reference; it needs N ≥ 2 responses per group, so the
    std modes refuse N < 2.
    """
    if returns_by_group.dim() != 2:
        raise ValueError(f"returns_by_group must be [P, N]; got shape {tuple(returns_by_group.shape)}")
    if not 0.0 < keep_ratio <= 1.0:
        raise ValueError(f"keep_ratio must be in (0, 1]; got {keep_ratio}")
    n_groups, group_size = returns_by_group.shape
    if mode == "none":
        return torch.arange(n_groups, dtype=torch.long)
    if mode not in _ORDERS:
        raise ValueError(f"unknown filter mode {mode!r}; choose one of 'std', 'std_rev', 'none'")
    if group_size < 2:
        raise ValueError(
            f"group size {group_size} makes in-group std undefined; "
            "set rollout.responses_per_prompt >= 2 or filter mode none"
        )
    std = torch.round(group_std(returns_by_group), decimals=_STD_DECIMALS)  # [P]
    order = _ORDERS[mode](std)  # [P] group indices, preferred first
    return order[: n_kept(n_groups, keep_ratio)].sort().values.to(torch.long)  # [K] ascending


def group_matrix(
    values: torch.Tensor, group_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Arrange per-trajectory values into groups. values: [B], group_ids: [B] -> ([P, N], [P], [P, N]).

    Returns (values_by_group, group_keys, rows): group p is ``group_keys[p]``
    (ascending ids), ``rows[p]`` are its trajectory indices in batch order and
    ``values_by_group[p] = values[rows[p]]``. Use ``rows[keep].flatten()`` to
    turn kept group indices back into batch rows. All groups must have the
    same size N.
    """
    if values.dim() != 1 or values.shape != group_ids.shape:
        raise ValueError(
            f"values and group_ids must both be [B]; got {tuple(values.shape)}, {tuple(group_ids.shape)}"
        )
    if values.numel() == 0:
        raise ValueError("cannot group an empty batch")
    keys, counts = torch.unique(group_ids, return_counts=True)  # [P], [P]
    if not bool((counts == counts[0]).all()):
        raise ValueError(f"groups must all have the same size; sizes are {counts.tolist()}")
    rows = torch.sort(group_ids, stable=True).indices.reshape(len(keys), -1)  # [P, N]
    return values[rows], keys, rows


def group_std_stats(returns_by_group: torch.Tensor, keep: torch.Tensor | None = None) -> dict[str, float]:
    """Diagnostics of in-group return std (SPEC §6), as plain floats for logging.

    returns_by_group: [P, N] with N ≥ 2, keep: [K] kept group indices or None.
    Keys: std_mean (all groups), std_max, zero_std_frac (share of groups with
    std < 1e-6, which carry no learning signal), and kept_std_mean when ``keep`` is given.
    """
    std = group_std(returns_by_group)  # [P]
    stats = {
        "std_mean": float(std.mean()),
        "std_max": float(std.max()),
        "zero_std_frac": float((std < 1e-6).double().mean()),
    }
    if keep is not None:
        stats["kept_std_mean"] = float(std[keep].mean())
    return stats
