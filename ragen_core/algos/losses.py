"""Losses and per-token quantities for the StarPO update (SPEC §4): PPO policy loss, clipped value
loss, KL estimators, entropy and log-probabilities from logits, and loss aggregations.

Pure tensor functions (STYLE rule 1); arguments are never modified (rule 3).
Shapes: B rows, T token positions, V vocabulary. ``mask`` is the ``loss_mask``
(True on generated tokens). Variants are picked from small dicts
(``AGGREGATIONS``, ``KL_ESTIMATORS``) rather than by branches inside the math
(STYLE rule 2).

Exact token-mean over micro-batches (DESIGN §4): a mini-batch split into
micro-batches gives the same gradient as the whole mini-batch when every
micro-batch loss is called with ``normaliser=aggregation_normaliser(mb_mask,
agg)`` computed once on the whole mini-batch's mask, and the micro-batch losses
are summed (gradients accumulated), not averaged.

Stats are 0-dim detached tensors (no device sync per micro-batch); call
``.item()`` when logging. Ratio-based stats are token means over this call's
mask; ``n_tokens`` is included so a caller can weight them across micro-batches.

Run the tests with ``python -m pytest tests/unit/algos -q``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ragen_core.algos.masked import masked_count, masked_mean, masked_sum

# Log-ratios are clamped before exp so one stale token cannot overflow the ratio (as verl does).
_LOGRATIO_CLAMP = 20.0

Aggregation = Callable[[torch.Tensor, torch.Tensor, "float | None"], torch.Tensor]


def token_mean(losses: torch.Tensor, mask: torch.Tensor, normaliser: float | None = None) -> torch.Tensor:
    """Sum of the masked token losses / number of loss tokens (or / ``normaliser``).

    losses: [B, T], mask: [B, T] bool -> 0-dim. ``normaliser`` is the number of loss
    tokens of the whole mini-batch, for exact accumulation over micro-batches.
    """
    count = masked_count(losses, mask).clamp(min=1.0) if normaliser is None else normaliser
    return masked_sum(losses, mask) / count


def _rows_with_tokens(mask: torch.Tensor) -> torch.Tensor:
    """Number of rows holding at least one loss token (0-dim float); empty rows do not dilute a mean."""
    return mask.bool().any(dim=1).sum().to(torch.get_default_dtype())


def seq_mean_token_sum(
    losses: torch.Tensor, mask: torch.Tensor, normaliser: float | None = None
) -> torch.Tensor:
    """Mean over rows of each row's summed token losses (or sum over rows / ``normaliser``).

    losses: [B, T], mask: [B, T] bool -> 0-dim. Rows without loss tokens are not
    counted; ``normaliser`` is the number of rows with loss tokens in the mini-batch.
    """
    per_row = masked_sum(losses, mask, dim=1)  # [B]
    count = _rows_with_tokens(mask).clamp(min=1.0) if normaliser is None else normaliser
    return per_row.sum() / count


def seq_mean_token_mean(
    losses: torch.Tensor, mask: torch.Tensor, normaliser: float | None = None
) -> torch.Tensor:
    """Mean over rows of each row's mean token loss (or sum over rows / ``normaliser``).

    losses: [B, T], mask: [B, T] bool -> 0-dim. Rows without loss tokens contribute
    0 and are not counted; ``normaliser`` as for :func:`seq_mean_token_sum`.
    """
    per_row = masked_mean(losses, mask, dim=1)  # [B]
    count = _rows_with_tokens(mask).clamp(min=1.0) if normaliser is None else normaliser
    return per_row.sum() / count


AGGREGATIONS: dict[str, Aggregation] = {
    "token-mean": token_mean,
    "seq-mean-token-sum": seq_mean_token_sum,
    "seq-mean-token-mean": seq_mean_token_mean,
}
"""Loss aggregation modes of SPEC §4, by config name."""

_COUNTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "token-mean": lambda mask: mask.bool().sum(),
    "seq-mean-token-sum": _rows_with_tokens,
    "seq-mean-token-mean": _rows_with_tokens,
}


def _aggregation(agg: str) -> Aggregation:
    if agg not in AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {agg!r}; choose one of {sorted(AGGREGATIONS)}")
    return AGGREGATIONS[agg]


def aggregation_normaliser(mask: torch.Tensor, agg: str) -> float:
    """The ``normaliser`` for ``agg`` over a whole mini-batch: its loss tokens or its rows with tokens.

    mask: [B, T] bool (the mini-batch's loss_mask) -> float (at least 1).
    """
    _aggregation(agg)
    return max(float(_COUNTS[agg](mask)), 1.0)


def _ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log ratio, ratio) of the current to the rollout policy, log ratio clamped to ±20. [B, T] each."""
    logratio = (logprobs - old_logprobs).clamp(-_LOGRATIO_CLAMP, _LOGRATIO_CLAMP)
    return logratio, logratio.exp()


def _check_same_shape(**tensors: torch.Tensor) -> None:
    """Refuse silently-broadcasting inputs, e.g. [B] advantages against [B, T] log-probs."""
    shapes = {name: tuple(x.shape) for name, x in tensors.items()}
    if len(set(shapes.values())) != 1:
        raise ValueError(f"expected equal [B, T] shapes; got {shapes}")


def _check_clips(clip_low: float, clip_high: float, dual_clip: float | None) -> None:
    if not (0.0 <= clip_low < 1.0 and clip_high >= 0.0):
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0; got {clip_low}, {clip_high}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (or None to disable); got {dual_clip}")


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    dual_clip: float | None = 3.0,
    agg: str = "token-mean",
    normaliser: float | None = None,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate with asymmetric clipping and dual clip (SPEC §4; DAPO clip-higher; dual-clip PPO).

    logprobs: [B, T] (with grad), old_logprobs: [B, T] (rollout policy),
    advantages: [B, T], mask: [B, T] bool -> (loss 0-dim, stats).
    Per token, r = exp(logprobs − old_logprobs) and
        L = max(−A·r, −A·clip(r, 1 − clip_low, 1 + clip_high)),
    and for A < 0 additionally L = min(L, −A·dual_clip), which bounds the loss
    (and zeroes the gradient) of a token whose ratio ran far above 1. ``dual_clip``
    None turns it off. ``token_weights`` ([B, T], no gradient: :func:`truncated_is_weights`) multiply L per
    token. L is reduced with ``AGGREGATIONS[agg]`` and ``normaliser``.
    The log ratio is clamped to ±20 before exp (no gradient beyond). Pass
    advantages detached; [B] advantages must be broadcast to [B, T] first.
    stats (0-dim detached tensors, token means over mask):
      clipfrac_upper  A > 0 and r > 1 + clip_high (upper clip binds)
      clipfrac_lower  A < 0 and r < 1 − clip_low (lower clip binds)
      dual_clipfrac   A < 0 and r > dual_clip (dual clip binds)
      approx_kl       k3 estimate of KL(rollout ‖ current): (r − 1) − log r
      n_tokens        number of masked tokens
    """
    _check_same_shape(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask)
    _check_clips(clip_low, clip_high, dual_clip)
    reduce = _aggregation(agg)
    logratio, ratio = _ratio(logprobs, old_logprobs)  # [B, T]
    unclipped = -advantages * ratio  # [B, T]
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)  # [B, T]
    per_token = torch.maximum(unclipped, clipped)  # [B, T]
    negative = advantages < 0  # [B, T]
    if dual_clip is not None:
        per_token = torch.where(negative, torch.minimum(per_token, -advantages * dual_clip), per_token)
    if token_weights is not None:
        _check_same_shape(logprobs=logprobs, token_weights=token_weights)
        per_token = per_token * token_weights.detach()
    loss = reduce(per_token, mask, normaliser)
    with torch.no_grad():
        r = ratio.detach()
        stats = {
            "clipfrac_upper": masked_mean(((advantages > 0) & (r > 1.0 + clip_high)).float(), mask),
            "clipfrac_lower": masked_mean((negative & (r < 1.0 - clip_low)).float(), mask),
            "dual_clipfrac": masked_mean((negative & (r > (dual_clip or float("inf")))).float(), mask),
            "approx_kl": masked_mean((r - 1.0) - logratio.detach(), mask),
            "n_tokens": masked_count(r, mask),
        }
    return loss, stats


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip_range: float | None = 0.5,
    agg: str = "token-mean",
    normaliser: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped critic loss 0.5·max((V − R)², (V_clip − R)²), V_clip = V_old + clip(V − V_old, ±clip_range).

    values: [B, T] (with grad), old_values: [B, T] (at rollout), returns: [B, T]
    (GAE targets), mask: [B, T] bool -> (loss 0-dim, stats). SPEC §4: clip range
    0.5; None disables clipping. Reduced with ``AGGREGATIONS[agg]`` and ``normaliser``.
    stats (0-dim detached, token means over mask): value_clipfrac (the clipped
    term is the larger one), value_error (mean squared error of the unclipped
    values), n_tokens.
    """
    _check_same_shape(values=values, old_values=old_values, returns=returns, mask=mask)
    reduce = _aggregation(agg)
    err = (values - returns) ** 2  # [B, T]
    if clip_range is None:
        clipped_err = err
    else:
        v_clip = old_values + (values - old_values).clamp(-clip_range, clip_range)  # [B, T]
        clipped_err = (v_clip - returns) ** 2  # [B, T]
    loss = 0.5 * reduce(torch.maximum(err, clipped_err), mask, normaliser)
    with torch.no_grad():
        stats = {
            "value_clipfrac": masked_mean((clipped_err > err).float(), mask),
            "value_error": masked_mean(err.detach(), mask),
            "n_tokens": masked_count(err.detach(), mask),
        }
    return loss, stats


def kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k1 = log π − log π_ref per token: unbiased for KL(π ‖ π_ref), can be negative. [B, T] -> [B, T]."""
    return logprobs - ref_logprobs


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k3 = (ρ − 1) − log ρ with ρ = π_ref / π: unbiased, ≥ 0, low variance (Schulman 2020). [B, T] -> [B, T].

    The log ratio is clamped to ±20 before exp, as for the policy ratio.
    """
    log_rho = (ref_logprobs - logprobs).clamp(-_LOGRATIO_CLAMP, _LOGRATIO_CLAMP)
    return log_rho.exp() - 1.0 - log_rho


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {"k1": kl_k1, "k3": kl_k3}
"""Per-token KL(π ‖ π_ref) estimators from samples of π (SPEC §4), by config name."""


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k1") -> torch.Tensor:
    """Per-token KL estimate of the current policy to the reference policy. [B, T], [B, T] -> [B, T].

    kind "k1" or "k3" (see :data:`KL_ESTIMATORS`). Use it in the reward (detached)
    or as a loss term aggregated like the policy loss.
    """
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {kind!r}; choose one of {sorted(KL_ESTIMATORS)}")
    return KL_ESTIMATORS[kind](logprobs, ref_logprobs)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim. logits: [B, T, V] -> [B, T] (differentiable).

    H = logsumexp(l) − Σ softmax(l)·l. With e = exp(l − max l) (made in place),
    S = Σ e, and Σ softmax·l = (e·l)/S,
    H = max l + log S − (e·l)/S. Compute in float32 (upcast bf16 logits first).
    """
    top = logits.detach().amax(dim=-1, keepdim=True)  # [B, T, 1]; a constant shift, no gradient needed
    e = (logits - top).exp_()  # [B, T, V] kept for backward
    total = e.sum(dim=-1)  # [B, T]
    # e·l as a product then a sum, not einsum("...v,...v->..."): on a CPU that becomes a batched [1, V] x [V, 1]
    # matmul, and with its backward (two more) it took 276 ms for 8 x 48 positions of a 49k vocabulary against
    # 158 ms this way, exp included (fp32). The product is a transient [B, T, V], freed after the sum.
    dot = (e * logits).sum(dim=-1)  # [B, T]
    return top.squeeze(-1) + total.log() - dot / total


def logprobs_and_entropy(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log softmax(logits)[label], entropy of softmax(logits)) per position, sharing one exp pass.

    logits: [B, T, V], labels: [B, T] long -> ([B, T], [B, T]), both differentiable; equal to
    (:func:`logprobs_from_logits`, :func:`entropy_from_logits`) on the logits in float32 (or in their own
    dtype when that is float32 or wider). With p = softmax(l), lse = logsumexp(l) and E = Σ p·l:
    log-prob = l[label] − lse and H = lse − E. The exponential over the vocabulary is the costly part of the
    output layer's loss for a 49k vocabulary, and it is taken once instead of twice.

    The gradient is written out (:class:`_LogprobsEntropy`): ∂ log-prob/∂l_j = 1[j = label] − p_j and
    ∂H/∂l_j = −p_j (l_j − E). Vocabulary-sized work makes as few fresh tensors as it can: on a CPU every fresh
    tensor larger than glibc's mmap threshold (32 MB at most) is new pages, and their first touch costs far more
    than the arithmetic (measured for 896 positions of a 49k vocabulary, 176 MB in fp32: a subtraction into a
    fresh tensor 60-240 ms, in place 7 ms). So the forward makes one fresh tensor, p, takes Σ p·l a few positions
    at a time, and keeps bf16 logits in bf16 for the backward (their fp32 values are the same numbers); the
    backward makes only the gradient, in the logits' dtype, working in float32 a few positions at a time.
    """
    out: tuple[torch.Tensor, torch.Tensor] = _LogprobsEntropy.apply(logits, labels)
    return out


_PIECE_BYTES = 8 << 20
"""On a CPU the float32 working copy of a few positions' logits (:class:`_LogprobsEntropy`) stays under this size,
well under glibc's mmap threshold, so the heap reuses its memory from piece to piece."""


def _pieces(logits: torch.Tensor) -> list[slice]:
    """Slices of the flattened positions of logits [..., V], each :data:`_PIECE_BYTES` of float32 at most on a CPU;
    one slice elsewhere. A GPU's caching allocator reuses its memory anyway, and there each piece costs kernel
    launches: on an H200, 2,048 positions of bf16 logits over a 151,936-id vocabulary took 31.6 ms forward and
    backward in 8 MB pieces against 11.6 ms in one (bench/cuda_check.py)."""
    n, vocab = logits.numel() // max(logits.shape[-1], 1), max(logits.shape[-1], 1)
    step = max(1, _PIECE_BYTES // (4 * vocab)) if logits.device.type == "cpu" else max(n, 1)
    return [slice(i, min(i + step, n)) for i in range(0, max(n, 1), step)]  # one empty slice for no positions


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for narrower floats (bf16, fp16), else the dtype itself (fp32, fp64)."""
    return dtype if torch.finfo(dtype).bits >= 32 else torch.float32


class _LogprobsEntropy(torch.autograd.Function):
    """:func:`logprobs_and_entropy` with its gradient written out (see there). Saves softmax(l) (float32 or
    wider) and l (in its own dtype)."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        work = _work_dtype(logits.dtype)
        top = logits.amax(dim=-1, keepdim=True).to(work)  # [B, T, 1] a shift against overflow (exact in bf16)
        p = logits.to(work, copy=True)  # [B, T, V] the one fresh vocabulary-sized tensor, made softmax in place
        p.sub_(top).exp_()
        total = p.sum(dim=-1, keepdim=True)  # [B, T, 1]
        p.div_(total)
        lse = (top + total.log()).squeeze(-1)  # [B, T]
        vocab = logits.shape[-1]
        flat_p, flat_l = p.view(-1, vocab), logits.reshape(-1, vocab)
        # E = Σ p·l a few positions at a time: the product is a small transient (a batched dot product would make
        # none, but it sums in a longer chain: 20x the rounding error over a 49k vocabulary)
        expected = torch.cat([(flat_p[s] * flat_l[s].to(work)).sum(dim=-1) for s in _pieces(logits)]).view(lse.shape)
        picked = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1).to(work)  # [B, T]
        ctx.save_for_backward(p, logits, labels, expected)
        return picked - lse, lse - expected

    @staticmethod
    def backward(ctx: Any, g_logprob: torch.Tensor, g_entropy: torch.Tensor) -> tuple[torch.Tensor, None]:
        p, logits, labels, expected = ctx.saved_tensors
        # ∂/∂l_j = g_lp (1[j = label] − p_j) − g_H p_j (l_j − E) = −p_j (g_lp + g_H (l_j − E)) + g_lp 1[j = label]
        vocab = logits.shape[-1]
        grad = torch.empty_like(logits)  # [B, T, V] the one new vocabulary-sized tensor, in the logits' dtype
        out, flat_l, flat_p = grad.view(-1, vocab), logits.reshape(-1, vocab), p.view(-1, vocab)
        e, lab = expected.reshape(-1, 1), labels.reshape(-1, 1)
        g_h, g_lp = g_entropy.reshape(-1, 1).to(p.dtype), g_logprob.reshape(-1, 1).to(p.dtype)
        for s in _pieces(logits):
            piece = flat_l[s].to(p.dtype, copy=True)  # [n, V] float32 working copy of a few positions
            piece.sub_(e[s]).mul_(g_h[s]).add_(g_lp[s]).mul_(flat_p[s]).neg_()
            piece.scatter_add_(-1, lab[s], g_lp[s])
            out[s].copy_(piece)
        return grad, None


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[label] per position. logits: [B, T, V], labels: [B, T] long -> [B, T].

    logits[b, t] must already be the distribution that scores labels[b, t]
    (the caller shifts by one for a causal LM). Uses gather − logsumexp, so
    the full log-softmax is never kept.
    """
    picked = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)  # [B, T]
    return picked - torch.logsumexp(logits, dim=-1)


def truncated_is_weights(trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance sampling between the rollout engine and the trainer (TIS, as TRL and verl use it).

    The tokens were sampled by the rollout engine (vLLM, or the hf generator) while PPO's ratio is taken against
    the trainer's own log-probs of the same weights (``old_logprobs: recompute``); where kernels and precision
    differ the two policies differ. Each token's loss is weighted by
        w = min(exp(trainer_logprobs − rollout_logprobs), cap),
    the ratio π_trainer / π_rollout truncated at ``cap`` (no gradient). [B, T] -> [B, T].
    """
    if cap < 1.0:
        raise ValueError(f"the truncation cap must be >= 1, got {cap}")
    _check_same_shape(trainer_logprobs=trainer_logprobs, rollout_logprobs=rollout_logprobs)
    with torch.no_grad():
        return torch.exp((trainer_logprobs - rollout_logprobs).clamp(-20.0, 20.0)).clamp(max=cap)
