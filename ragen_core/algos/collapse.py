"""Template-collapse diagnostics (SPEC §8; RAGEN-2, arXiv 2604.06268): does the reasoning depend on the input?

    from ragen_core.algos.collapse import collapse_metrics
    m = collapse_metrics(cross_logp, prompt_col)   # [M, N] log p(z_i | x_j), [M] own column of each z_i

Entropy alone cannot tell "varied reasoning that reads the state" from "varied reasoning that
ignores it" (template collapse). RAGEN-2 measures the second with the mutual information I(X;Z)
between the prompt X (everything before the reasoning content, ``<think>`` included) and the
reasoning content Z (between the tags), under the batch's empirical input distribution: uniform
over its N distinct prompts. Given the teacher-forced log-probs of every sampled reasoning z_i
under every distinct prompt x_j:

    matched_i  = log p(z_i | x_{c(i)})                        c(i) = prompt_col[i], its own prompt
    marginal_i = log p_mix(z_i) = logsumexp_j log p(z_i | x_j) − log N
    H(Z|X) = −mean_i matched_i      H(Z) = −mean_i marginal_i      I(X;Z) = H(Z) − H(Z|X) ≤ log N

I is a Monte-Carlo estimate: near 0 it can dip slightly below 0 (noise, not a violation).
Retrieval accuracy asks whether the prompt that makes z_i most likely is its own (chance 1/N).
Definitions follow the reference implementation (mll-lab-nu/RAGEN ``ragen/trainer/collapse_metrics.py``,
``docs/reference_mutual_information_metrics.md``), with two deliberate differences:

- Ties count as a uniformly random tie-break, in expectation (the reference's ``argmax`` takes
  the first column, so an input-agnostic model scores the share of rows whose prompt happens to
  be column 0). A row whose own entry ties with e − 1 other columns at the top scores 1/e, so an
  input-agnostic model (all columns equal) scores exactly the chance level 1/N; top-k likewise.
- N = 1 is allowed (the reference returns nothing): MI is 0 and retrieval 1 = chance.

The model side (teacher-forced matrix, one prefill per distinct prompt) is
``ragen_core/trainer/collapse.py``. Pure tensor functions (STYLE rule 1); arguments are never
modified. Tests: ``.venv/bin/python -m pytest tests/unit/algos/test_algos_collapse.py -q``.
"""

from __future__ import annotations

import math

import torch

__all__ = ["MI_ZSCORE_EPS", "RETRIEVAL_KS", "collapse_metrics", "matched_and_marginal", "retrieval_hits"]

RETRIEVAL_KS = (2, 4, 8)
"""Top-k retrieval accuracies reported besides top-1, each only where k < N (as the reference's @2, @4, @8)."""

MI_ZSCORE_EPS = 1e-3
"""Added to the std of the marginal log-probs in ``mi_zscore`` (the reference's ``std_eps``)."""


def _check(cross_logp: torch.Tensor, prompt_col: torch.Tensor) -> None:
    if cross_logp.dim() != 2 or prompt_col.dim() != 1 or prompt_col.shape[0] != cross_logp.shape[0]:
        raise ValueError(f"need cross_logp [M, N] and prompt_col [M], got {tuple(cross_logp.shape)} and "
                         f"{tuple(prompt_col.shape)}")
    m, n = cross_logp.shape
    if m == 0 or n == 0:
        raise ValueError(f"no reasoning or no prompt to compare (cross_logp is {m} x {n})")
    if prompt_col.dtype.is_floating_point or int(prompt_col.min()) < 0 or int(prompt_col.max()) >= n:
        raise ValueError(f"prompt_col must hold integer columns in 0..{n - 1}")


def matched_and_marginal(cross_logp: torch.Tensor, prompt_col: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(z_i | own prompt) and log p_mix(z_i) under the uniform prompt mixture. [M, N], [M] -> ([M], [M]).

    marginal_i = logsumexp_j cross_logp[i, j] − log N (log of the mean of the N likelihoods, stable).
    """
    _check(cross_logp, prompt_col)
    logp = cross_logp.to(torch.float64)  # [M, N] sums of hundreds of token log-probs: keep the digits
    matched = logp.gather(1, prompt_col.long().unsqueeze(1)).squeeze(1)  # [M]
    marginal = torch.logsumexp(logp, dim=1) - math.log(logp.shape[1])  # [M]
    return matched, marginal


def retrieval_hits(cross_logp: torch.Tensor, prompt_col: torch.Tensor, k: int = 1) -> torch.Tensor:
    """Per reasoning, the probability that its own prompt is among the top ``k`` columns. [M, N], [M] -> [M].

    Ties are broken uniformly at random, in expectation: with g columns strictly above the own entry
    and e columns equal to it (itself included), the own prompt takes one of ranks g+1..g+e with equal
    chance, so the hit probability is clamp((k − g) / e, 0, 1). Without ties this is the plain
    "argmax (or top-k) is the own column" indicator.
    """
    _check(cross_logp, prompt_col)
    own = cross_logp.gather(1, prompt_col.long().unsqueeze(1))  # [M, 1]
    above = (cross_logp > own).sum(dim=1).to(torch.float64)  # [M] g
    equal = (cross_logp == own).sum(dim=1).to(torch.float64)  # [M] e >= 1
    return ((k - above) / equal).clamp(0.0, 1.0)  # [M]


def collapse_metrics(cross_logp: torch.Tensor, prompt_col: torch.Tensor,
                     std_eps: float = MI_ZSCORE_EPS) -> dict[str, float]:
    """Mutual-information and retrieval diagnostics of a cross log-prob matrix (module docstring).

    cross_logp: [M, N], cross_logp[i, j] = log p(z_i | x_j), teacher-forced log-prob of reasoning i
    under distinct prompt j (sequence sums; per-token means work the same way). prompt_col: [M] long,
    the column of each reasoning's own prompt. Returns (nats where it applies):
    ``mi`` H(Z) − H(Z|X); ``cond_entropy`` H(Z|X); ``marginal_entropy`` H(Z); ``mi_upper_bound`` log N;
    ``retrieval_acc`` and ``retrieval_chance`` (1/N); ``retrieval_acc_top{k}`` and ``retrieval_chance_top{k}``
    (k/N) for k in :data:`RETRIEVAL_KS` below N; ``marginal_std`` the population std of log p_mix(z_i);
    ``mi_zscore`` mean_i (matched_i − marginal_i) / (marginal_std + std_eps), the reference's scale-free
    MI; ``n_reasonings`` M and ``n_prompts`` N.
    """
    matched, marginal = matched_and_marginal(cross_logp, prompt_col)  # [M], [M]
    m, n = cross_logp.shape
    pointwise = matched - marginal  # [M] log p(z|x) / p_mix(z), the pointwise mutual information
    marginal_std = marginal.std(unbiased=False)
    out = {
        "mi": float(pointwise.mean()),
        "cond_entropy": float(-matched.mean()),
        "marginal_entropy": float(-marginal.mean()),
        "mi_upper_bound": math.log(n),
        "retrieval_acc": float(retrieval_hits(cross_logp, prompt_col).mean()),
        "retrieval_chance": 1.0 / n,
        "marginal_std": float(marginal_std),
        "mi_zscore": float((pointwise / (marginal_std + std_eps)).mean()),
        "n_reasonings": float(m),
        "n_prompts": float(n),
    }
    for k in (k for k in RETRIEVAL_KS if k < n):
        out[f"retrieval_acc_top{k}"] = float(retrieval_hits(cross_logp, prompt_col, k).mean())
        out[f"retrieval_chance_top{k}"] = k / n
    return out
