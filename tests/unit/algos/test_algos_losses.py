"""Tests for ragen_core.algos.losses: each clip regime, dual clip, each aggregation, value loss, KL,
entropy and log-probs, all with hand-derived values. Run: python -m pytest tests/unit/algos -q
"""

from __future__ import annotations

import math

import pytest
import torch

from ragen_core.algos import losses

F64 = torch.float64
ONE = torch.ones(1, 1, dtype=torch.bool)


def one_token(advantage: float, ratio: float, **kw):
    """policy_loss on a single token with the given advantage and ratio; returns (loss, d loss/d logprob, stats)."""
    logprobs = torch.tensor([[math.log(ratio)]], dtype=F64, requires_grad=True)
    old = torch.zeros(1, 1, dtype=F64)
    loss, stats = losses.policy_loss(logprobs, old, torch.tensor([[advantage]], dtype=F64), ONE, **kw)
    loss.backward()
    return loss.item(), logprobs.grad.item(), {k: v.item() for k, v in stats.items()}


# clip_low 0.2, clip_high 0.28, dual clip 3: the ratio is clipped to [0.8, 1.28].
# L = max(−A·r, −A·clip(r)); for A < 0 then L = min(L, −A·3). dL/dlogp = −A·r where the unclipped term is
# the active one (d r / d logp = r), else 0.
CLIP_REGIMES = [
    # (A, r, loss, grad, which stat is 1)
    (1.0, 1.1, -1.1, -1.1, None),  # inside the trust region: −A·r
    (1.0, 1.5, -1.28, 0.0, "clipfrac_upper"),  # A > 0, r above 1 + 0.28: −A·1.28, no gradient
    (1.0, 0.5, -0.5, -0.5, None),  # A > 0, r below 0.8: max(−0.5, −0.8) keeps the unclipped term
    (-1.0, 0.5, 0.8, 0.0, "clipfrac_lower"),  # A < 0, r below 0.8: max(0.5, 0.8) = 0.8, no gradient
    (-1.0, 1.5, 1.5, 1.5, None),  # A < 0, r above 1.28: max(1.5, 1.28) = 1.5 < 3 (dual clip not reached)
    (-1.0, 4.0, 3.0, 0.0, "dual_clipfrac"),  # A < 0, r = 4: max(4, 1.28) = 4, dual clip min(4, 3) = 3
    (2.0, 4.0, -2.56, 0.0, "clipfrac_upper"),  # A > 0 never dual-clips: max(−8, −2·1.28) = −2.56
    (0.0, 2.0, 0.0, 0.0, None),  # no advantage, no loss
]


@pytest.mark.parametrize(("adv", "ratio", "loss", "grad", "flag"), CLIP_REGIMES)
def test_policy_loss_each_clip_regime(
    adv: float, ratio: float, loss: float, grad: float, flag: str | None
) -> None:
    got_loss, got_grad, stats = one_token(adv, ratio, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    assert got_loss == pytest.approx(loss)
    assert got_grad == pytest.approx(grad)
    for name in ("clipfrac_upper", "clipfrac_lower", "dual_clipfrac"):
        assert stats[name] == (1.0 if name == flag else 0.0), name
    assert stats["approx_kl"] == pytest.approx((ratio - 1) - math.log(ratio))  # k3 of KL(old ‖ new)
    assert stats["n_tokens"] == 1.0


def test_dual_clip_off_and_symmetric_clip() -> None:
    # without dual clip, A = −2, r = 4: max(8, 2·1.28) = 8, gradient −A·r = 8
    loss, grad, stats = one_token(-2.0, 4.0, dual_clip=None)
    assert (loss, grad, stats["dual_clipfrac"]) == (pytest.approx(8.0), pytest.approx(8.0), 0.0)
    # vanilla StarPO symmetric 0.2: A = 1, r = 1.25 is now clipped to 1.2
    loss, grad, stats = one_token(1.0, 1.25, clip_low=0.2, clip_high=0.2)
    assert (loss, grad, stats["clipfrac_upper"]) == (pytest.approx(-1.2), 0.0, 1.0)


def test_policy_loss_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="dual_clip"):
        one_token(1.0, 1.0, dual_clip=0.5)
    with pytest.raises(ValueError, match="clip_low"):
        one_token(1.0, 1.0, clip_low=1.0)
    with pytest.raises(ValueError, match="aggregation"):
        one_token(1.0, 1.0, agg="sum")
    with pytest.raises(ValueError, match="shapes"):  # [B] advantages must be broadcast by the caller
        z = torch.zeros(2, 3)
        losses.policy_loss(z, z, torch.zeros(2), z.bool())
    with pytest.raises(ValueError, match="shapes"):
        losses.value_loss(
            torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(3), torch.ones(2, 3, dtype=torch.bool)
        )


def test_policy_loss_stats_are_token_means_over_the_mask() -> None:
    # four tokens, third masked out: regimes upper-clip, inside, (masked: lower clip), dual clip
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]], dtype=F64)
    ratio = torch.tensor([[1.5, 1.0, 0.5, 4.0]], dtype=F64)
    mask = torch.tensor([[True, True, False, True]])
    loss, stats = losses.policy_loss(ratio.log(), torch.zeros_like(ratio), adv, mask)
    # token-mean of [−1.28, −1, ·, 3] over 3 tokens = 0.72/3
    assert loss.item() == pytest.approx(0.72 / 3)
    assert stats["clipfrac_upper"].item() == pytest.approx(1 / 3)
    assert stats["clipfrac_lower"].item() == 0.0
    assert stats["dual_clipfrac"].item() == pytest.approx(1 / 3)
    # k3 per token: r=1.5: 0.5 − ln 1.5; r=1: 0; r=4: 3 − ln 4
    assert stats["approx_kl"].item() == pytest.approx((0.5 - math.log(1.5) + 3 - math.log(4)) / 3)
    assert all(v.dim() == 0 and not v.requires_grad for v in stats.values())


# A loss matrix with junk (99) outside the mask and an all-masked third row:
#   row 0: tokens 1, 2, 3 -> sum 6, mean 2;   row 1: token 4 -> sum 4, mean 4;   row 2: nothing
LOSSES = torch.tensor([[1.0, 2.0, 3.0, 99.0], [4.0, 99.0, 99.0, 99.0], [99.0] * 4], dtype=F64)
LMASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
AGG_GOLDEN = [
    # (agg, no normaliser, normaliser=10, mini-batch normaliser)
    ("token-mean", (1 + 2 + 3 + 4) / 4, 10 / 10, 4.0),  # over the 4 tokens
    ("seq-mean-token-sum", (6 + 4) / 2, 10 / 10, 2.0),  # over the 2 rows that have tokens
    ("seq-mean-token-mean", (2 + 4) / 2, 6 / 10, 2.0),
]


@pytest.mark.parametrize(("agg", "plain", "with_norm", "count"), AGG_GOLDEN)
def test_each_aggregation(agg: str, plain: float, with_norm: float, count: float) -> None:
    reduce = losses.AGGREGATIONS[agg]
    assert reduce(LOSSES, LMASK).item() == pytest.approx(plain)
    assert reduce(LOSSES, LMASK, 10.0).item() == pytest.approx(with_norm)
    assert losses.aggregation_normaliser(LMASK, agg) == count
    # through policy_loss: with r = 1 and A = −loss, each token's loss is exactly LOSSES (A < 0, 3·|A| > |A|)
    zeros = torch.zeros_like(LOSSES)
    loss, _ = losses.policy_loss(zeros, zeros, -LOSSES, LMASK, agg=agg)
    assert loss.item() == pytest.approx(plain)


def test_aggregations_give_zero_on_an_empty_mask() -> None:
    empty = torch.zeros_like(LMASK)
    for agg, reduce in losses.AGGREGATIONS.items():
        assert reduce(LOSSES, empty).item() == 0.0, agg
        assert losses.aggregation_normaliser(empty, agg) == 1.0


def test_value_loss_golden() -> None:
    # clip range 0.5; per token (err = (V − R)², clipped V_c = V_old + clip(V − V_old, ±0.5)):
    #   t0: V 1, V_old 0, R 2: err 1, V_c 0.5 -> 2.25: the clipped term wins (clipfrac), no gradient
    #   t1: V 1, V_old 0, R 0: err 1, V_c 0.5 -> 0.25: unclipped wins
    #   t2: V 2, V_old 2, R 3: err 1 = clipped 1
    # loss = 0.5 · (2.25 + 1 + 1)/3 = 0.708333; clipfrac 1/3
    values = torch.tensor([[1.0, 1.0, 2.0]], dtype=F64, requires_grad=True)
    old = torch.tensor([[0.0, 0.0, 2.0]], dtype=F64)
    returns = torch.tensor([[2.0, 0.0, 3.0]], dtype=F64)
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, stats = losses.value_loss(values, old, returns, mask, clip_range=0.5)
    assert loss.item() == pytest.approx(0.5 * 4.25 / 3)
    assert stats["value_clipfrac"].item() == pytest.approx(1 / 3)
    assert stats["value_error"].item() == pytest.approx(1.0)
    loss.backward()
    # d/dV of 0.5·(V − R)²/3 = (V − R)/3 on unclipped tokens: t1 (1 − 0)/3, t2 (2 − 3)/3; t0 clipped -> 0
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, 1 / 3, -1 / 3]], dtype=F64))
    unclipped, _ = losses.value_loss(values, old, returns, mask, clip_range=None)
    assert unclipped.item() == pytest.approx(0.5)


def test_kl_estimators_golden() -> None:
    # π = 0.5, π_ref = 0.25: k1 = ln 2; k3 with ρ = π_ref/π = 0.5: (0.5 − 1) − ln 0.5 = ln 2 − 0.5
    # π = 0.25, π_ref = 0.5: k1 = −ln 2; ρ = 2: (2 − 1) − ln 2 = 1 − ln 2
    logp = torch.tensor([[math.log(0.5), math.log(0.25)]], dtype=F64)
    ref = torch.tensor([[math.log(0.25), math.log(0.5)]], dtype=F64)
    ln2 = math.log(2)
    torch.testing.assert_close(losses.kl_penalty(logp, ref, "k1"), torch.tensor([[ln2, -ln2]], dtype=F64))
    torch.testing.assert_close(
        losses.kl_penalty(logp, ref, "k3"), torch.tensor([[ln2 - 0.5, 1 - ln2]], dtype=F64)
    )
    assert losses.kl_penalty(logp, logp, "k3").abs().max().item() == 0.0
    with pytest.raises(ValueError, match="k2"):
        losses.kl_penalty(logp, ref, "k2")


def test_kl_estimators_are_unbiased() -> None:
    # Exact expectation under π (no sampling): Σ π·k1 = KL(π‖π_ref); Σ π·k3 = Σ π_ref − 1 + KL = KL.
    logp = torch.log_softmax(torch.tensor([0.3, -1.0, 2.0, 0.1], dtype=F64), 0)
    ref = torch.log_softmax(torch.tensor([1.0, 0.0, -0.5, 0.2], dtype=F64), 0)
    exact = (logp.exp() * (logp - ref)).sum()
    for kind in ("k1", "k3"):
        est = (logp.exp() * losses.kl_penalty(logp[None], ref[None], kind)[0]).sum()
        assert est.item() == pytest.approx(exact.item()), kind


def test_entropy_from_logits_golden_and_against_torch() -> None:
    # uniform over 4 -> ln 4; p = [0.25, 0.75] from logits [0, ln 3] -> −(0.25 ln 0.25 + 0.75 ln 0.75) ≈ 0.562335
    assert losses.entropy_from_logits(torch.zeros(1, 1, 4, dtype=F64)).item() == pytest.approx(math.log(4))
    two = torch.tensor([[[0.0, math.log(3)]]], dtype=F64)
    assert losses.entropy_from_logits(two).item() == pytest.approx(0.5623351446188083)
    # huge logits: no overflow (shifted by the max)
    big = torch.tensor([[[1000.0, 1000.0, -1000.0]]], dtype=F64)
    assert losses.entropy_from_logits(big).item() == pytest.approx(math.log(2))
    logits = torch.randn(2, 3, 7, generator=torch.Generator().manual_seed(0), dtype=F64, requires_grad=True)
    expected = torch.distributions.Categorical(logits=logits).entropy()
    torch.testing.assert_close(losses.entropy_from_logits(logits), expected)
    assert torch.autograd.gradcheck(losses.entropy_from_logits, (logits,))


def test_logprobs_from_logits() -> None:
    # logits [0, ln 3] -> p = [0.25, 0.75]
    logits = torch.tensor([[[0.0, math.log(3)], [0.0, math.log(3)]]], dtype=F64)
    lp = losses.logprobs_from_logits(logits, torch.tensor([[1, 0]]))
    torch.testing.assert_close(lp, torch.tensor([[math.log(0.75), math.log(0.25)]], dtype=F64))
    logits = torch.randn(2, 5, 11, generator=torch.Generator().manual_seed(1), dtype=F64)
    labels = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(2))
    expected = torch.log_softmax(logits, -1).gather(-1, labels[..., None])[..., 0]
    torch.testing.assert_close(losses.logprobs_from_logits(logits, labels), expected)


def test_logprobs_and_entropy_golden_and_equal_to_the_separate_functions() -> None:
    # logits [0, ln 3] -> p = [0.25, 0.75]: log-prob of label 1 is ln 0.75, of label 0 ln 0.25,
    # entropy −(0.25 ln 0.25 + 0.75 ln 0.75) ≈ 0.562335 at both positions.
    logits = torch.tensor([[[0.0, math.log(3)], [0.0, math.log(3)]]], dtype=F64)
    lp, ent = losses.logprobs_and_entropy(logits, torch.tensor([[1, 0]]))
    torch.testing.assert_close(lp, torch.tensor([[math.log(0.75), math.log(0.25)]], dtype=F64))
    torch.testing.assert_close(ent, torch.full((1, 2), 0.5623351446188083, dtype=F64))
    big = torch.tensor([[[1000.0, 1000.0, -1000.0]]], dtype=F64)  # shifted by the max: no overflow
    lp, ent = losses.logprobs_and_entropy(big, torch.tensor([[0]]))
    assert lp.item() == pytest.approx(math.log(0.5)) and ent.item() == pytest.approx(math.log(2))
    logits = torch.randn(2, 5, 11, generator=torch.Generator().manual_seed(1), dtype=F64, requires_grad=True)
    labels = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(2))
    lp, ent = losses.logprobs_and_entropy(logits, labels)
    torch.testing.assert_close(lp, losses.logprobs_from_logits(logits, labels))
    torch.testing.assert_close(ent, losses.entropy_from_logits(logits))
    before = logits.detach().clone()
    assert torch.autograd.gradcheck(lambda x: losses.logprobs_and_entropy(x, labels), (logits,))
    assert torch.equal(logits.detach(), before)  # not mutated


@pytest.mark.parametrize("piece_bytes", [4 * 11 * 3, 1 << 20])  # pieces of 3 positions, or one piece
def test_logprobs_and_entropy_of_bf16_logits_work_in_fp32_and_return_a_bf16_gradient(
        piece_bytes: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(losses, "_PIECE_BYTES", piece_bytes)
    g = torch.Generator().manual_seed(4)
    logits16 = (3 * torch.randn(2, 5, 11, generator=g)).bfloat16().requires_grad_()
    logits32 = logits16.detach().float().requires_grad_()  # the same numbers in fp32
    labels = torch.randint(0, 11, (2, 5), generator=g)
    w_lp, w_ent = torch.randn(2, 5, generator=g), torch.randn(2, 5, generator=g)
    lp16, ent16 = losses.logprobs_and_entropy(logits16, labels)
    lp32, ent32 = losses.logprobs_and_entropy(logits32, labels)
    assert lp16.dtype == ent16.dtype == torch.float32
    torch.testing.assert_close(lp16, lp32, rtol=0, atol=1e-6)
    torch.testing.assert_close(ent16, ent32, rtol=0, atol=1e-6)
    ((lp16 * w_lp).sum() + (ent16 * w_ent).sum()).backward()
    ((lp32 * w_lp).sum() + (ent32 * w_ent).sum()).backward()
    assert logits16.grad is not None and logits32.grad is not None
    assert logits16.grad.dtype == torch.bfloat16
    # the fp32 gradient rounded to bf16, as a cast back to the logits' dtype would give it
    torch.testing.assert_close(logits16.grad.float(), logits32.grad.bfloat16().float(), rtol=1e-2, atol=1e-6)
    empty = torch.zeros(1, 0, 11, dtype=torch.bfloat16, requires_grad=True)  # no positions
    lp, ent = losses.logprobs_and_entropy(empty, torch.zeros(1, 0, dtype=torch.long))
    assert lp.shape == ent.shape == (1, 0)


def test_logprobs_and_entropy_work_in_pieces_on_a_cpu_and_in_one_piece_elsewhere(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(losses, "_PIECE_BYTES", 4 * 11 * 3)  # 3 positions of an 11-id vocabulary a piece
    assert losses._pieces(torch.zeros(2, 5, 11)) == [slice(0, 3), slice(3, 6), slice(6, 9), slice(9, 10)]
    # a GPU's caching allocator reuses memory without the pieces, and each piece is kernel launches there
    assert losses._pieces(torch.zeros(2, 5, 11, device="meta")) == [slice(0, 10)]
    assert losses._pieces(torch.zeros(1, 0, 11, device="meta")) == [slice(0, 0)]  # no positions: one empty slice


def test_no_argument_mutated() -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 4, 5, generator=g)
    labels = torch.randint(0, 5, (2, 4), generator=g)
    lp, old, adv = (
        torch.randn(2, 4, generator=g),
        torch.randn(2, 4, generator=g),
        torch.randn(2, 4, generator=g),
    )
    mask = torch.rand(2, 4, generator=g) > 0.3
    inputs = (logits, labels, lp, old, adv, mask)
    copies = [x.clone() for x in inputs]
    losses.policy_loss(lp, old, adv, mask)
    losses.value_loss(lp, old, adv, mask)
    losses.kl_penalty(lp, old, "k3")
    losses.entropy_from_logits(logits)
    losses.logprobs_from_logits(logits, labels)
    for agg in losses.AGGREGATIONS.values():
        agg(lp, mask, 3.0)
    for x, c in zip(inputs, copies, strict=True):
        assert torch.equal(x, c)


def test_truncated_importance_sampling_weights_golden() -> None:
    # w = min(exp(trainer − rollout), cap): ratios e^0.5 = 1.6487, e^-1 = 0.3679, e^2 = 7.389 -> capped at 2
    trainer = torch.tensor([[-1.0, -3.0, -0.5]])
    rollout = torch.tensor([[-1.5, -2.0, -2.5]])
    w = losses.truncated_is_weights(trainer, rollout, cap=2.0)
    assert w[0].tolist() == pytest.approx([math.exp(0.5), math.exp(-1.0), 2.0])
    with pytest.raises(ValueError, match="cap must be >= 1"):
        losses.truncated_is_weights(trainer, rollout, cap=0.5)


def test_policy_loss_token_weights_multiply_each_token() -> None:
    # two tokens, A = 1, r = 1 (loss −1 each): weights 0.5 and 2 -> token-mean (−0.5 − 2) / 2 = −1.25;
    # the gradient of token i is −A·r·w_i / 2
    logprobs = torch.zeros(1, 2, requires_grad=True)
    loss, _ = losses.policy_loss(logprobs, torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2, dtype=torch.bool),
                                 agg="token-mean", token_weights=torch.tensor([[0.5, 2.0]]))
    loss.backward()
    assert float(loss) == pytest.approx(-1.25)
    assert logprobs.grad[0].tolist() == pytest.approx([-0.25, -1.0])
