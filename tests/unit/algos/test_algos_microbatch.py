"""Micro-batch invariance (STYLE rule 8, DESIGN §4): one micro-batch of 8 rows and eight micro-batches of
one row give the same accumulated gradients when each micro-batch loss uses the mini-batch normaliser.

A tiny embedding + linear "language model" with a value head stands in for the policy; the losses are
the real ones from ragen_core.algos.losses. Run: python -m pytest tests/unit/algos -q
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ragen_core.algos import losses

VOCAB, WIDTH, B, T = 13, 8, 8, 7


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)
        self.value = nn.Linear(WIDTH, 1)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.embed(ids))  # [B, T, W]
        return self.head(h), self.value(h).squeeze(-1)  # [B, T, V], [B, T]


def make_batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (B, T), generator=g)
    labels = torch.randint(0, VOCAB, (B, T), generator=g)
    # rows with very different numbers of loss tokens, env gaps, and one row with none at all
    lengths = torch.tensor([7, 1, 3, 5, 0, 2, 6, 4])
    mask = torch.arange(T)[None, :] < lengths[:, None]  # [B, T]
    mask = mask & ~((torch.arange(T) == 2)[None, :] & (lengths[:, None] > 4))  # a gap at position 2
    return {
        "ids": ids,
        "labels": labels,
        "mask": mask,
        "old_logprobs": -2.5 + 0.3 * torch.randn(B, T, generator=g),
        "advantages": torch.randn(B, T, generator=g),
        "old_values": 0.2 * torch.randn(B, T, generator=g),
        "returns": torch.randn(B, T, generator=g),
    }


def total_loss(model: TinyLM, batch: dict[str, torch.Tensor], rows: list[int], agg: str, norm: float | None):
    mb = {k: v[rows] for k, v in batch.items()}
    logits, values = model(mb["ids"])
    logprobs = losses.logprobs_from_logits(logits, mb["labels"])
    pg, _ = losses.policy_loss(
        logprobs, mb["old_logprobs"], mb["advantages"], mb["mask"], agg=agg, normaliser=norm
    )
    entropy = losses.AGGREGATIONS[agg](losses.entropy_from_logits(logits), mb["mask"], norm)
    vf, _ = losses.value_loss(values, mb["old_values"], mb["returns"], mb["mask"], agg=agg, normaliser=norm)
    return pg - 0.001 * entropy + vf


def grads(
    batch, splits: list[list[int]], agg: str, norm: float | None, average: bool = False
) -> torch.Tensor:
    torch.manual_seed(1)
    model = TinyLM()
    for rows in splits:
        loss = total_loss(model, batch, rows, agg, norm)
        (loss / len(splits) if average else loss).backward()  # gradients accumulate across micro-batches
    return torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.mark.parametrize("agg", list(losses.AGGREGATIONS))
def test_one_micro_batch_of_8_equals_eight_of_1(agg: str) -> None:
    batch = make_batch()
    norm = losses.aggregation_normaliser(batch["mask"], agg)  # computed once on the whole mini-batch
    whole = grads(batch, [list(range(B))], agg, None)  # plain loss of the whole mini-batch
    ones = grads(batch, [[i] for i in range(B)], agg, norm)
    pairs = grads(batch, [[0, 5, 3, 1], [4, 2, 7, 6]], agg, norm)
    assert whole.abs().max() > 1e-3  # the comparison is not between zeros
    torch.testing.assert_close(ones, whole, atol=1e-6, rtol=0)
    torch.testing.assert_close(pairs, whole, atol=1e-6, rtol=0)


def test_without_the_normaliser_token_mean_is_not_exact() -> None:
    # The naive way (average of per-micro-batch token means) weights a 1-token row like a 7-token row.
    batch = make_batch()
    whole = grads(batch, [list(range(B))], "token-mean", None)
    naive = grads(batch, [[i] for i in range(B)], "token-mean", None, average=True)
    assert (naive - whole).abs().max() > 1e-3
