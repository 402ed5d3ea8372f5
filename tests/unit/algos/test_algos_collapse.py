"""Golden and edge-case tests for ragen_core.algos.collapse (template-collapse MI diagnostics, SPEC §8).

Every expected number is derived by hand in the comments. Run: .venv/bin/python -m pytest tests/unit/algos -q
"""

from __future__ import annotations

import math

import pytest
import torch

from ragen_core.algos.collapse import MI_ZSCORE_EPS, collapse_metrics, matched_and_marginal, retrieval_hits
from ragen_core.tracking.logger import check_metric_names

LN = math.log


def test_two_prompts_golden() -> None:
    # Likelihoods p(z_i | x_j):  row 0: (0.3, 0.1) own x0;  row 1: (0.2, 0.6) own x1;  row 2: (0.4, 0.4) own x0.
    # matched  = p under the own prompt: 0.3, 0.6, 0.4
    # marginal = mean over the 2 prompts: 0.2, 0.4, 0.4
    # H(Z|X) = -(ln .3 + ln .6 + ln .4)/3 = -ln(.072)/3 = 2.631089/3 = 0.877030
    # H(Z)   = -(ln .2 + ln .4 + ln .4)/3 = -ln(.032)/3 = 3.442019/3 = 1.147340
    # I = H(Z) - H(Z|X) = (ln 1.5 + ln 1.5 + ln 1)/3 = 2 ln 1.5 / 3 = 0.270310
    cross = torch.tensor([[LN(.3), LN(.1)], [LN(.2), LN(.6)], [LN(.4), LN(.4)]])
    col = torch.tensor([0, 1, 0])
    m = collapse_metrics(cross, col)
    assert m["cond_entropy"] == pytest.approx(0.877030, abs=1e-6)
    assert m["marginal_entropy"] == pytest.approx(1.147340, abs=1e-6)
    assert m["mi"] == pytest.approx(0.270310, abs=1e-6)
    assert m["mi_upper_bound"] == pytest.approx(LN(2))
    # retrieval: rows 0 and 1 have their own prompt strictly on top (1 each); row 2 ties 2 ways (1/2)
    # -> (1 + 1 + 0.5)/3 = 0.833333; chance 1/2; no @k since no k in (2, 4, 8) is below N = 2
    assert m["retrieval_acc"] == pytest.approx(2.5 / 3)
    assert m["retrieval_chance"] == 0.5
    assert not any(key.startswith("retrieval_acc_top") for key in m)
    # marginal log-probs ln .2, ln .4, ln .4: deviations from their mean are -2d/3, d/3, d/3 with d = ln 2,
    # so the population std is sqrt((4/9 + 1/9 + 1/9)/3) d = sqrt(2)/3 ln 2 = 0.326753;
    # mi_zscore = 0.270310 / (0.326753 + 0.001) = 0.824735
    assert m["marginal_std"] == pytest.approx(0.326753, abs=1e-6)
    assert m["mi_zscore"] == pytest.approx(0.824735, abs=1e-5)
    assert (m["n_reasonings"], m["n_prompts"]) == (3.0, 2.0)


def test_top_k_retrieval_golden_with_ties() -> None:
    # N = 4, so @2 is reported and @4, @8 are not (k < N only).
    # g = columns strictly above the own entry, e = columns equal to it (itself included);
    # hit@k = clamp((k - g)/e, 0, 1)
    cross = torch.tensor([
        [-1.0, -2.0, -3.0, -4.0],  # own 1: g=1, e=1 -> @1 0,   @2 1
        [-5.0, -1.0, -1.0, -1.0],  # own 0: g=3, e=1 -> @1 0,   @2 0
        [-2.0, -2.0, -2.0, -3.0],  # own 2: g=0, e=3 -> @1 1/3, @2 2/3
        [0.0, -1.0, -2.0, -3.0],   # own 0: g=0, e=1 -> @1 1,   @2 1
    ])
    col = torch.tensor([1, 0, 2, 0])
    assert retrieval_hits(cross, col).tolist() == pytest.approx([0, 0, 1 / 3, 1])
    assert retrieval_hits(cross, col, 2).tolist() == pytest.approx([1, 0, 2 / 3, 1])
    m = collapse_metrics(cross, col)
    assert m["retrieval_acc"] == pytest.approx((0 + 0 + 1 / 3 + 1) / 4)  # 1/3
    assert m["retrieval_acc_top2"] == pytest.approx((1 + 0 + 2 / 3 + 1) / 4)  # 2/3
    assert (m["retrieval_chance"], m["retrieval_chance_top2"]) == (0.25, 0.5)
    assert "retrieval_acc_top4" not in m and "retrieval_acc_top8" not in m


def test_input_agnostic_reasoning_has_zero_mi_and_chance_retrieval() -> None:
    # Every column of a row equal: p(z|x) does not depend on x. marginal = ln(N e^a / N) = a = matched,
    # so every pointwise MI is exactly 0, H(Z) = H(Z|X) = -mean(a) = -(-1-2-...-10)/10 = 5.5.
    # Ties count in expectation: each row's own prompt is one of N tied columns, so top-k hits k/N
    # whatever the prompts are (here deliberately unbalanced: 7 of 10 rows belong to column 0, which the
    # reference's first-index argmax would score 0.7).
    n = 8
    a = -torch.arange(1.0, 11.0)  # [10]
    cross = a.unsqueeze(1).expand(-1, n)  # [10, 8]
    col = torch.tensor([0, 0, 0, 0, 0, 0, 0, 3, 5, 7])
    m = collapse_metrics(cross, col)
    assert m["mi"] == pytest.approx(0.0, abs=1e-12) and m["mi_zscore"] == pytest.approx(0.0, abs=1e-9)
    assert m["cond_entropy"] == pytest.approx(5.5) and m["marginal_entropy"] == pytest.approx(5.5)
    assert m["retrieval_acc"] == pytest.approx(1 / 8) == m["retrieval_chance"]
    assert m["retrieval_acc_top2"] == pytest.approx(2 / 8) and m["retrieval_acc_top4"] == pytest.approx(4 / 8)
    assert "retrieval_acc_top8" not in m  # 8 is not below N = 8


def test_reasoning_that_copies_the_input_reaches_log_n() -> None:
    # p(z_i | own x) = 1 and 0 under every other prompt: matched = 0, marginal = ln(1/N) = -ln N,
    # so I = ln N (the bound), H(Z|X) = 0, H(Z) = ln N, retrieval 1 at every k.
    n = 6
    col = torch.tensor([0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5])
    cross = torch.full((12, n), float("-inf"))
    cross[torch.arange(12), col] = 0.0
    m = collapse_metrics(cross, col)
    assert m["mi"] == pytest.approx(LN(n)) and m["mi"] == pytest.approx(m["mi_upper_bound"])
    assert m["cond_entropy"] == pytest.approx(0.0) and m["marginal_entropy"] == pytest.approx(LN(n))
    assert m["retrieval_acc"] == m["retrieval_acc_top2"] == m["retrieval_acc_top4"] == 1.0
    # every marginal is -ln 6: std 0 (up to float rounding), so the z-score is ln 6 / eps
    assert m["marginal_std"] == pytest.approx(0.0, abs=1e-12)
    assert m["mi_zscore"] == pytest.approx(LN(n) / MI_ZSCORE_EPS, rel=1e-6)
    # nearly copying (other prompts 1000 nats less likely) is the same within e^-1000
    soft = torch.where(torch.isinf(cross), torch.tensor(-1000.0), cross)
    assert collapse_metrics(soft, col)["mi"] == pytest.approx(LN(n))


def test_one_prompt() -> None:
    # N = 1: the mixture is the prompt itself, so marginal = matched, I = 0 = ln 1, retrieval 1 = chance.
    # H(Z|X) = H(Z) = -(-3 - 5)/2 = 4.
    m = collapse_metrics(torch.tensor([[-3.0], [-5.0]]), torch.tensor([0, 0]))
    assert m["mi"] == 0.0 and m["mi_upper_bound"] == 0.0
    assert m["cond_entropy"] == 4.0 and m["marginal_entropy"] == 4.0
    assert m["retrieval_acc"] == 1.0 == m["retrieval_chance"]
    assert not any("@" in key for key in m)


def test_mi_is_bounded_by_log_n_and_invariant_to_order() -> None:
    # Per row, matched <= logsumexp, so matched - marginal <= ln N: the estimate never exceeds ln N.
    # Relabelling the prompts (a column permutation, prompt_col mapped along) or reordering the
    # reasonings changes nothing.
    gen = torch.Generator().manual_seed(0)
    cross = torch.randn(20, 5, generator=gen) * 30 - 100  # sequence log-probs of a few dozen tokens
    col = torch.randint(0, 5, (20,), generator=gen)
    m = collapse_metrics(cross, col)
    assert m["mi"] <= LN(5) + 1e-12
    perm = torch.tensor([3, 0, 4, 1, 2])  # new column k holds old column perm[k]
    inverse = torch.argsort(perm)
    rows = torch.randperm(20, generator=gen)
    again = collapse_metrics(cross[:, perm][rows], inverse[col][rows])
    assert again == pytest.approx(m)
    # and the inputs are left as they were
    assert torch.equal(cross, cross.clone()) and cross.dtype == torch.float32


def test_matched_and_marginal_golden() -> None:
    # row [ln .1, ln .3, ln .2], own column 1: matched ln .3; marginal ln((.1 + .3 + .2)/3) = ln .2
    matched, marginal = matched_and_marginal(torch.tensor([[LN(.1), LN(.3), LN(.2)]]), torch.tensor([1]))
    assert matched.item() == pytest.approx(LN(.3)) and marginal.item() == pytest.approx(LN(.2))


@pytest.mark.parametrize(("cross", "col", "match"), [
    (torch.zeros(3, 2), torch.tensor([0, 1]), "need cross_logp"),
    (torch.zeros(2, 2), torch.tensor([0, 2]), "0..1"),
    (torch.zeros(2, 2), torch.tensor([-1, 0]), "0..1"),
    (torch.zeros(0, 2), torch.zeros(0, dtype=torch.long), "no reasoning"),
    (torch.zeros(2, 0), torch.tensor([0, 0]), "no reasoning"),
    (torch.zeros(2), torch.tensor([0, 0]), "need cross_logp"),
])
def test_bad_inputs_say_what_is_wrong(cross: torch.Tensor, col: torch.Tensor, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        collapse_metrics(cross, col)


def test_every_metric_name_is_one_mlflow_accepts() -> None:
    """The names go to MLflow as collapse/<scope>/<name>; '@2' was refused there and failed a Sokoban run."""
    cross = -torch.rand(12, 9)
    m = collapse_metrics(cross, torch.arange(12) % 9)
    assert {"retrieval_acc_top2", "retrieval_acc_top4", "retrieval_acc_top8"} <= set(m)
    check_metric_names({f"collapse/first_turn/{name}": value for name, value in m.items()})
