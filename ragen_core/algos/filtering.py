"""Group filters: StarPO-S's uncertainty filter (SPEC §4; RAGEN §4) and RAGEN-2's SNR-aware selection (SPEC §8).

Keep only the prompt groups whose trajectories disagree most: per group, the
std of raw returns (env rewards, penalties excluded) measures how uncertain
the policy still is on that initial state. Whole groups are kept or dropped.
:func:`select_groups` generalises the choice to any per-group score with the
strategies of RAGEN-2 (top-k as a fraction or a count, top-p linear or
softmax, min-p), picked from :data:`STRATEGIES` (STYLE rule 2).
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
    if mode not in ("std", "std_rev"):
        raise ValueError(f"unknown filter mode {mode!r}; choose one of 'std', 'std_rev', 'none'")
    if group_size < 2:
        raise ValueError(
            f"group size {group_size} makes in-group std undefined; "
            "set rollout.responses_per_prompt >= 2 or filter mode none"
        )
    return select_groups(group_std(returns_by_group), "top_k", keep_ratio, largest=mode == "std")  # [K]


# --------------------------------------------------------------------------- SNR-aware selection (RAGEN-2)

_ZERO = 1e-10
"""A group score at most this far from 0 counts as zero (include_zero=False drops it)."""


def _preferred_first(scores: torch.Tensor, largest: bool) -> torch.Tensor:
    """Indices into ``scores`` [n], best first; ties (9 decimals) keep the lower index first."""
    rounded = torch.round(scores.to(torch.float64), decimals=_STD_DECIMALS)
    return torch.sort(rounded, descending=largest, stable=True).indices


def _top_k(scores: torch.Tensor, value: float, largest: bool, n_groups: int, **_: object) -> torch.Tensor:
    """The best max(1, floor(value × P)) groups; P counts every group, also those include_zero dropped."""
    k = min(n_kept(n_groups, value), scores.numel())
    return _preferred_first(scores, largest)[:k]


def _top_k_abs(scores: torch.Tensor, value: float, largest: bool, **_: object) -> torch.Tensor:
    """The best max(1, int(value)) groups."""
    return _preferred_first(scores, largest)[: min(max(1, int(value)), scores.numel())]


def _top_p(scores: torch.Tensor, value: float, largest: bool, top_p_mode: str, eps: float,
           **_: object) -> torch.Tensor:
    """Nucleus over groups; value >= 1 keeps all. linear: the best groups until their running sum
    reaches value × total − eps (the group that reaches it included; a score <= 0 ends the walk; if
    the sum never reaches it, none). softmax: the smallest best-first set whose softmax mass reaches value."""
    if value >= 1.0:
        return torch.arange(scores.numel())
    order = _preferred_first(scores, largest)
    x = scores.to(torch.float64)[order]  # [n] best first
    if top_p_mode == "softmax":
        mass = torch.softmax(x if largest else -x, dim=0).cumsum(0)  # [n]
        k = int(torch.searchsorted(mass, torch.tensor([value], dtype=torch.float64))[0]) + 1
        return order[: min(k, scores.numel())]
    if top_p_mode != "linear":
        raise ValueError(f"unknown top_p_mode {top_p_mode!r}; choose 'linear' or 'softmax'")
    threshold = value * float(x.sum()) - eps
    total, k = 0.0, 0
    for score in x.tolist():
        if total >= threshold or score <= 0.0:
            break
        total, k = total + score, k + 1
    return order[:k] if total >= threshold else order[:0]


def _min_p(scores: torch.Tensor, value: float, largest: bool, **_: object) -> torch.Tensor:
    """largest: scores >= value × max; smallest: scores <= min / value."""
    x = scores.to(torch.float64)
    keep = x >= x.max() * value - _ZERO if largest else x <= x.min() / (value + _ZERO) + _ZERO
    return keep.nonzero().flatten()


def _none(scores: torch.Tensor, **_: object) -> torch.Tensor:
    return torch.arange(scores.numel())


STRATEGIES: dict[str, Callable[..., torch.Tensor]] = {
    "top_k": _top_k, "top_k_abs": _top_k_abs, "top_p": _top_p, "min_p": _min_p, "none": _none,
}
"""select_groups strategies (SPEC §8): (scores [n], value, largest, ...) -> indices into scores."""


def select_groups(
    scores: torch.Tensor,
    strategy: str,
    value: float,
    *,
    largest: bool = True,
    include_zero: bool = True,
    top_p_mode: str = "linear",
    eps: float = 0.01,
) -> torch.Tensor:
    """Kept group indices, ascending. scores: [P] float (one score per group, e.g. in-group reward std) -> [K] long.

    Strategies (:data:`STRATEGIES`): ``top_k`` keeps max(1, floor(value × P)) groups (StarPO-S:
    0.25), ``top_k_abs`` max(1, int(value)) groups, ``top_p`` a nucleus (``top_p_mode`` linear or
    softmax; value 1.0 keeps all), ``min_p`` those within a factor ``value`` of the best, ``none``
    all. ``largest=False`` prefers the lowest scores (the std_rev ablation). ``include_zero=False``
    first drops groups whose score is 0 (no signal); K may then be 0, and the caller skips the update.
    Ties go to the lower group index. Follows RAGEN-2's rollout filter (mll-lab-nu/RAGEN).
    """
    if scores.dim() != 1:
        raise ValueError(f"scores must be [P]; got shape {tuple(scores.shape)}")
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown filter strategy {strategy!r}; choose one of {sorted(STRATEGIES)}")
    if strategy != "none" and not value > 0.0:
        raise ValueError(f"filter value must be > 0 for strategy {strategy!r}; got {value}")
    candidates = torch.arange(scores.numel())
    if not include_zero:
        candidates = candidates[scores.abs() > _ZERO]
    if candidates.numel() == 0:
        return candidates
    picked = STRATEGIES[strategy](scores[candidates], value=value, largest=largest, n_groups=scores.numel(),
                                  top_p_mode=top_p_mode, eps=eps)
    return candidates[picked].sort().values.to(torch.long)


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
