"""critic/explained_var = 1 - Var(R - V) / Var(R) over the loss mask, and NaN when Var(R) is 0."""

from __future__ import annotations

import math

import torch

from ragen_core.trainer.update import _batch_metrics
from ragen_core.types import TokenBatch


def _batch(mask: torch.Tensor) -> TokenBatch:
    B, T = mask.shape
    z = torch.zeros(B, T)
    return TokenBatch(input_ids=torch.zeros(B, T, dtype=torch.long), attention_mask=torch.ones(B, T, dtype=torch.bool),
                      loss_mask=mask, old_logprobs=z, rewards=z, turn_ids=torch.zeros(B, T, dtype=torch.long),
                      turn_ends=torch.zeros(B, T, dtype=torch.bool), group_ids=torch.arange(B), returns=torch.zeros(B))


def test_explained_variance_golden() -> None:
    mask = torch.tensor([[False, True, True], [False, True, True]])
    returns = torch.tensor([[9.0, 1.0, 2.0], [9.0, 3.0, 4.0]])  # masked: 1, 2, 3, 4 -> unbiased var 5/3
    values = torch.tensor([[0.0, 1.0, 1.0], [0.0, 3.0, 3.0]])  # R - V masked: 0, 1, 0, 1 -> unbiased var 1/3
    m = _batch_metrics(_batch(mask), torch.zeros(2, 3), returns, values, None)
    assert math.isclose(m["critic/explained_var"], 1 - (1 / 3) / (5 / 3), rel_tol=1e-6)  # = 0.8


def test_explained_variance_is_nan_when_returns_do_not_vary() -> None:
    mask = torch.tensor([[False, True, True]])
    returns = torch.full((1, 3), -0.1)  # every episode failed alike: Var(R) = 0
    values = torch.tensor([[0.0, 0.3, -0.2]])
    m = _batch_metrics(_batch(mask), torch.zeros(1, 3), returns, values, None)
    assert math.isnan(m["critic/explained_var"])
