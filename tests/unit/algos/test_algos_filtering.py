"""Tests for the StarPO-S uncertainty filter: golden picks, ties, rounding of keep_ratio × P, errors,
and equivalence with a plain-Python reference. Run: python -m pytest tests/unit/algos -q
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ragen_core.algos import filtering

# unbiased stds: g0 {0, 1} 0.7071, g1 {1, 0} 0.7071 (tie with g0), g2 {0, 0} 0, g3 {2, 0} 1.4142
GROUPS = torch.tensor([[0.0, 1.0], [1.0, 0.0], [0.0, 0.0], [2.0, 0.0]])


def test_golden_picks_and_ties_to_lower_index() -> None:
    # K = floor(0.5 · 4) = 2. std: highest g3, then the g0/g1 tie goes to g0 -> [0, 3] (ascending)
    keep = filtering.uncertainty_filter(GROUPS, keep_ratio=0.5, mode="std")
    assert keep.tolist() == [0, 3] and keep.dtype == torch.long
    # std_rev: lowest g2, then the tie again goes to g0 -> [0, 2]
    assert filtering.uncertainty_filter(GROUPS, 0.5, "std_rev").tolist() == [0, 2]
    # K = 3: g3, g0, g1 -> [0, 1, 3]
    assert filtering.uncertainty_filter(GROUPS, 0.75, "std").tolist() == [0, 1, 3]
    assert filtering.uncertainty_filter(GROUPS, 0.25, "none").tolist() == [0, 1, 2, 3]


def test_binary_reward_groups_with_mirrored_success_counts_tie() -> None:
    # 4 and 12 successes out of 16 have the same std (float64 gives two values 1 ulp apart): a tie,
    # so the lower index wins whichever group comes first.
    four = torch.tensor([1.0] * 4 + [0.0] * 12)
    twelve = torch.tensor([1.0] * 12 + [0.0] * 4)
    flat = torch.zeros(16)
    assert filtering.uncertainty_filter(torch.stack([flat, twelve, four]), 0.34, "std").tolist() == [1]
    assert filtering.uncertainty_filter(torch.stack([flat, four, twelve]), 0.34, "std").tolist() == [1]


@pytest.mark.parametrize(
    ("n_groups", "ratio", "kept"),
    [
        (8, 0.25, 2),  # the reference setting P = 8: two groups
        (10, 0.25, 2),  # floor(2.5)
        (3, 0.25, 1),  # floor(0.75) = 0 -> at least one group
        (100, 0.29, 29),  # 0.29 · 100 = 28.999999999999996 in floats; still 29
        (10, 0.7, 7),  # 7.000000000000001 in floats; 7
        (5, 1.0, 5),
    ],
)
def test_keep_count_rounding(n_groups: int, ratio: float, kept: int) -> None:
    assert filtering.n_kept(n_groups, ratio) == kept
    returns = torch.arange(n_groups * 2, dtype=torch.float32).reshape(n_groups, 2) ** 2  # distinct stds
    assert len(filtering.uncertainty_filter(returns, ratio, "std")) == kept


def test_group_size_one_is_refused_with_a_clear_error() -> None:
    with pytest.raises(ValueError, match="responses_per_prompt >= 2 or filter mode none"):
        filtering.uncertainty_filter(torch.zeros(4, 1), 0.25, "std")
    with pytest.raises(ValueError, match="group size 1"):
        filtering.uncertainty_filter(torch.zeros(4, 1), 0.25, "std_rev")
    assert filtering.uncertainty_filter(torch.zeros(4, 1), 0.25, "none").tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("ratio", [0.0, -0.1, 1.01])
def test_bad_keep_ratio_is_refused(ratio: float) -> None:
    with pytest.raises(ValueError, match="keep_ratio"):
        filtering.uncertainty_filter(GROUPS, ratio, "std")


def test_bad_mode_and_shape_are_refused() -> None:
    with pytest.raises(ValueError, match="mode"):
        filtering.uncertainty_filter(GROUPS, 0.5, "variance")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"\[P, N\]"):
        filtering.uncertainty_filter(torch.zeros(8), 0.5, "std")


def reference_filter(rows: list[list[int]], ratio: float, mode: str) -> list[int]:
    """Plain Python: exact std (statistics works in fractions), sort by (±std, index), take K, sort."""
    k = max(1, math.floor(round(ratio * len(rows), 9)))
    std = [statistics.stdev(r) for r in rows]
    sign = -1 if mode == "std" else 1
    return sorted(sorted(range(len(rows)), key=lambda p: (sign * std[p], p))[:k])


@settings(max_examples=80, deadline=None)
@given(
    st.integers(2, 6).flatmap(
        lambda n: st.lists(st.lists(st.integers(0, 3), min_size=n, max_size=n), min_size=1, max_size=12)
    ),
    st.sampled_from([0.1, 0.25, 0.3, 0.5, 0.75, 1.0]),
    st.sampled_from(["std", "std_rev"]),
)
def test_matches_plain_reference(rows: list[list[int]], ratio: float, mode: str) -> None:
    keep = filtering.uncertainty_filter(torch.tensor(rows, dtype=torch.float32), ratio, mode)
    assert keep.tolist() == reference_filter(rows, ratio, mode)


def test_group_matrix_and_back_to_rows() -> None:
    # batch order: ids 7, 3, 7, 3, 5, 5 -> groups (ascending ids) 3: rows [1, 3]; 5: [4, 5]; 7: [0, 2]
    values = torch.tensor([0.0, 1.0, 1.0, 1.0, 0.0, 2.0])
    ids = torch.tensor([7, 3, 7, 3, 5, 5])
    by_group, keys, rows = filtering.group_matrix(values, ids)
    assert keys.tolist() == [3, 5, 7]
    assert rows.tolist() == [[1, 3], [4, 5], [0, 2]]
    assert by_group.tolist() == [[1.0, 1.0], [0.0, 2.0], [0.0, 1.0]]
    keep = filtering.uncertainty_filter(by_group, 0.5, "std")  # std 0, 1.414, 0.707; K = 1 -> group 1
    assert keep.tolist() == [1] and rows[keep].flatten().tolist() == [4, 5]
    with pytest.raises(ValueError, match="same size"):
        filtering.group_matrix(values[:5], ids[:5])


def test_group_std_stats() -> None:
    stats = filtering.group_std_stats(GROUPS, keep=torch.tensor([0, 3]))
    s = math.sqrt(0.5)  # std of {0, 1}
    assert stats["std_mean"] == pytest.approx((s + s + 0 + 2 * s) / 4)
    assert stats["std_max"] == pytest.approx(2 * s)
    assert stats["zero_std_frac"] == 0.25
    assert stats["kept_std_mean"] == pytest.approx((s + 2 * s) / 2)


def test_no_argument_mutated() -> None:
    groups = GROUPS.clone()
    for mode in ("std", "std_rev", "none"):
        filtering.uncertainty_filter(groups, 0.5, mode)
    filtering.group_std_stats(groups)
    assert torch.equal(groups, GROUPS)
    values, ids = torch.tensor([2.0, 1.0]), torch.tensor([1, 1])
    filtering.group_matrix(values, ids)
    assert values.tolist() == [2.0, 1.0] and ids.tolist() == [1, 1]


# --------------------------------------------------------------------------- select_groups (RAGEN-2, SPEC §8)
# Golden values by hand. SCORES = (0.5, 0.0, 2.0, 1.0, 0.5): P = 5, sum 4.0; best-first order 2, 3, 0, 4, 1
# (the tie at 0.5 goes to the lower index, 0 before 4).
SCORES = torch.tensor([0.5, 0.0, 2.0, 1.0, 0.5])


def _sel(strategy: str, value: float, scores: torch.Tensor = SCORES, **kw: object) -> list[int]:
    return filtering.select_groups(scores, strategy, value, **kw).tolist()


def test_select_top_k_fraction_and_count() -> None:
    assert _sel("top_k", 0.4) == [2, 3]  # floor(0.4 x 5) = 2
    assert _sel("top_k", 0.6) == [0, 2, 3]  # 3: the tie at 0.5 keeps group 0, not 4
    assert _sel("top_k", 0.1) == [2]  # floor(0.5) = 0 -> at least 1
    assert _sel("top_k", 0.4, largest=False) == [0, 1]  # lowest: 0.0 (group 1), then 0.5 (group 0)
    assert _sel("top_k_abs", 1) == [2] and _sel("top_k_abs", 10) == [0, 1, 2, 3, 4]


def test_select_top_p_linear() -> None:
    # value 0.5: threshold 0.5 x 4 - 0.01 = 1.99; 2.0 reaches it -> group 2 alone
    assert _sel("top_p", 0.5) == [2]
    # value 0.8: threshold 3.19; 2.0, 3.0, 3.5 (group 0) reaches it -> 2, 3, 0
    assert _sel("top_p", 0.8) == [0, 2, 3]
    # value 0.9: threshold 3.59; 2.0, 3.0, 3.5, 4.0 (group 4) -> all but the zero group
    assert _sel("top_p", 0.9) == [0, 2, 3, 4]
    assert _sel("top_p", 0.9, include_zero=False) == [0, 2, 3, 4]
    assert _sel("top_p", 1.0) == [0, 1, 2, 3, 4]  # 1.0 keeps every group, as in the reference


def test_select_top_p_softmax() -> None:
    # exp(0.5, 0, 2, 1, 0.5) = 1.6487, 1, 7.3891, 2.7183, 1.6487; sum 14.4048
    # best-first masses 0.51297, then +0.18871 = 0.70168
    assert _sel("top_p", 0.5, top_p_mode="softmax") == [2]  # 0.513 >= 0.5 at once
    assert _sel("top_p", 0.7, top_p_mode="softmax") == [2, 3]  # 0.70168 >= 0.7 at the second


def test_select_min_p() -> None:
    assert _sel("min_p", 0.5) == [2, 3]  # >= 0.5 x max 2.0 = 1.0
    assert _sel("min_p", 0.5, largest=False) == [1]  # <= min 0.0 / 0.5 = 0


def test_select_all_zero_scores_and_one_prompt() -> None:
    zero = torch.zeros(4)
    # linear top-p: threshold 0.9 x 0 - 0.01 < 0 is met before any group: nothing kept (the reference's rule)
    assert _sel("top_p", 0.9, zero) == []
    assert _sel("top_p", 0.9, zero, include_zero=False) == []  # every group dropped first
    assert _sel("top_k", 0.25, zero) == [0]  # a tie of four: the lowest index
    assert _sel("none", 1.0, zero) == [0, 1, 2, 3]
    one = torch.tensor([0.3])  # N = 1 prompt: threshold 0.9 x 0.3 - 0.01 = 0.26, reached by 0.3
    assert _sel("top_p", 0.9, one) == [0] and _sel("top_k", 0.25, one) == [0] and _sel("min_p", 0.5, one) == [0]


def test_select_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match="strategy"):
        _sel("top_q", 0.5)
    with pytest.raises(ValueError, match=r"\[P\]"):
        filtering.select_groups(torch.zeros(2, 2), "top_k", 0.5)
    with pytest.raises(ValueError, match="> 0"):
        _sel("top_k", 0.0)
