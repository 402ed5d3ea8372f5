"""Golden and edge-case tests for ragen_core.algos.masked. Run: python -m pytest tests/unit/algos -q"""

from __future__ import annotations

import math

import pytest
import torch

from ragen_core.algos.masked import masked_count, masked_mean, masked_sum, masked_var, masked_whiten

NAN = float("nan")
# x holds junk (100, NaN) where the mask is False; it must never show up in a result.
X = torch.tensor([[1.0, 2.0, 100.0], [3.0, NAN, 5.0]], dtype=torch.float64)
M = torch.tensor([[True, True, False], [True, False, True]])


def test_masked_sum_mean_golden() -> None:
    # selected: 1, 2, 3, 5 -> sum 11, mean 11/4
    assert masked_sum(X, M).item() == 11.0
    assert masked_count(X, M).item() == 4.0
    assert masked_mean(X, M).item() == 2.75
    # per row: [1+2, 3+5] = [3, 8]; means [1.5, 4]
    assert masked_sum(X, M, dim=1).tolist() == [3.0, 8.0]
    assert masked_mean(X, M, dim=1).tolist() == [1.5, 4.0]
    assert masked_mean(X, M, dim=1, keepdim=True).shape == (2, 1)


def test_masked_var_golden() -> None:
    # deviations from 2.75: -1.75, -0.75, 0.25, 2.25; squares sum 3.0625+0.5625+0.0625+5.0625 = 8.75
    assert masked_var(X, M).item() == pytest.approx(8.75 / 3)
    assert masked_var(X, M, unbiased=False).item() == pytest.approx(8.75 / 4)
    # row 0: {1, 2} -> (0.25+0.25)/1 = 0.5; row 1: {3, 5} -> (1+1)/1 = 2
    assert masked_var(X, M, dim=1).tolist() == pytest.approx([0.5, 2.0])
    # matches torch.var on the selected entries
    assert masked_var(X, M).item() == pytest.approx(torch.tensor([1.0, 2.0, 3.0, 5.0]).var().item())


def test_empty_and_single_selections_give_zero_not_nan() -> None:
    none = torch.zeros_like(M)
    assert masked_mean(X, none).item() == 0.0
    assert masked_var(X, none).item() == 0.0
    one = torch.tensor([[True, False, False], [False, False, False]])
    assert masked_var(X, one).item() == 0.0  # n - 1 = 0: undefined, reported as 0
    assert masked_var(X, one, unbiased=False).item() == 0.0
    assert masked_whiten(X, one).tolist() == [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]


def test_masked_whiten_golden() -> None:
    w = masked_whiten(X, M)
    sd = math.sqrt(8.75 / 3 + 1e-8)
    expected = [[(1 - 2.75) / sd, (2 - 2.75) / sd, 0.0], [(3 - 2.75) / sd, 0.0, (5 - 2.75) / sd]]
    torch.testing.assert_close(w, torch.tensor(expected, dtype=torch.float64))
    assert masked_mean(w, M).item() == pytest.approx(0.0, abs=1e-12)
    assert masked_var(w, M).item() == pytest.approx(1.0, abs=1e-6)
    # shift_mean=False scales only: the mean is added back
    w2 = masked_whiten(X, M, shift_mean=False)
    assert masked_mean(w2, M).item() == pytest.approx(2.75)
    assert w2[0, 2].item() == 0.0 and w2[1, 1].item() == 0.0


def test_arguments_not_mutated() -> None:
    x, m = X.clone(), M.clone()
    for fn in (masked_sum, masked_mean, masked_var, masked_whiten):
        fn(x, m)
        assert torch.equal(m, M)
        assert torch.allclose(x, X, equal_nan=True)
