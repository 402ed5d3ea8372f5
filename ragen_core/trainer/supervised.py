"""Supervised training on the reply tokens of token batches: the loss and the optimiser loop of the format warm-up.

    losses = train_format(model, batches, lr)          # one AdamW step per TokenBatch, lr decayed linearly
    loss = supervised_loss(model, input_ids, attention_mask, loss_mask)

The loss is the token-mean negative log-likelihood of the ``loss_mask`` tokens (the replies; the prompt and
the prefilled tag are context). :func:`prefix_detached_backward` computes it with each row's prompt prefix
under ``no_grad``, since the replies are a small share of each row. The format warm-up
(``ragen_core/trainer/warmup.py``) trains with it; the RL update's losses are in ``ragen_core/algos/losses.py``.

Run its tests: ``.venv/bin/python -m pytest tests/unit/trainer/test_warmup.py -q``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch.nn.functional import cross_entropy

from ragen_core.trainer.forward import decoder_and_head, hidden_states
from ragen_core.types import TokenBatch

__all__ = ["prefix_detached_backward", "supervised_loss", "train_format"]


def supervised_loss(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    loss_mask: torch.Tensor) -> torch.Tensor:
    """Token-mean negative log-likelihood of the ``loss_mask`` tokens. [B, T] inputs -> scalar.

    The output layer runs only on the states that predict a masked token (the replies are a small
    share of each row), which saves most of the [B, T, V] logits.
    """
    decoder, head = decoder_and_head(model)
    hidden = hidden_states(decoder, input_ids, attention_mask)  # [B, T, H]
    targets = loss_mask[:, 1:]  # [B, T-1] position t-1 predicts token t
    logits = head(hidden[:, :-1][targets]).float()  # [N, V]
    return cross_entropy(logits, input_ids[:, 1:][targets])


def prefix_detached_backward(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                             loss_mask: torch.Tensor, grad_margin: int = 8) -> float:
    """Backpropagate :func:`supervised_loss` with each row's prompt prefix computed under ``no_grad``; its value.

    [B, T] inputs. The forward is exact (same loss value as :func:`supervised_loss`); the gradient
    leaves out the paths through the keys/values of each row's prefix: every token before the first
    reply token except the last ``grad_margin`` ones. Those, the generation prompt and the end of
    the last user message, run with gradients, so the choice of the reply's first token (``<think>``)
    is trained through every layer. Why: the replies are ~10% of a row and the instruction prompt
    the rest; backward through the prompt would triple its cost, and rows with the same prefix
    (Bandit has two) share one prefix pass. ``grad_margin`` >= the row length gives the exact gradient.
    """
    decoder, head = decoder_and_head(model)
    device = input_ids.device
    n_targets = int(loss_mask[:, 1:].sum())
    if n_targets == 0:
        raise ValueError("no token of the batch is under the loss mask")
    groups: dict[tuple[int, ...], list[int]] = {}
    for b in range(input_ids.shape[0]):
        first = int(loss_mask[b].nonzero()[0]) if loss_mask[b].any() else int(attention_mask[b].sum())
        split = max(first - max(grad_margin, 1), 0)
        groups.setdefault(tuple(input_ids[b, :split].tolist()), []).append(b)
    total = 0.0
    for prefix, rows in groups.items():
        p, k = len(prefix), len(rows)
        end = int(attention_mask[rows].sum(1).max())
        ids = input_ids[rows, p:end]  # [k, S] suffixes, right-padded
        cache = None
        if p:
            with torch.no_grad():
                cache = decoder(input_ids=torch.tensor([prefix], device=device), use_cache=True).past_key_values
            cache.batch_repeat_interleave(k)
        mask = torch.cat([attention_mask.new_ones(k, p), attention_mask[rows, p:end]], dim=1).long()  # [k, P+S]
        positions = torch.arange(p, end, device=device).expand(k, -1)  # [k, S]
        hidden = decoder(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                         use_cache=cache is not None).last_hidden_state  # [k, S, H]
        targets = loss_mask[rows, p + 1:end]  # [k, S-1] suffix position j predicts suffix token j+1
        logits = head(hidden[:, :-1][targets]).float()  # [N_g, V]
        loss = cross_entropy(logits, ids[:, 1:][targets], reduction="sum") / n_targets
        loss.backward()
        total += float(loss.detach())
    return total


def train_format(model: torch.nn.Module, batches: Iterable[TokenBatch], lr: float, *,
                 grad_clip: float = 1.0, grad_margin: int = 8,
                 progress: Callable[[str], None] | None = None) -> list[float]:
    """One AdamW step per batch on :func:`supervised_loss` (via :func:`prefix_detached_backward`), lr decayed
    linearly from ``lr`` towards 0 over the batches; returns the losses.

    Trains ``model`` in place: the caller owns it (``warmup_model`` loads a fresh copy); it is left in eval mode.
    """
    batches = list(batches)
    device = next(model.parameters()).device
    # fused: one kernel over all parameters (on CPU ~3-8x cheaper than the per-tensor loop, measured)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0,
                                  fused=True)
    # Linear decay to ~0: with a constant lr the arm preference of the last few batches of 8 random
    # actions sticks (Bandit success swung 0.28-0.77 between checkpoints, measured); decaying averages
    # the action preference over the whole run, so it stays near the data's uniform one.
    n = len(batches)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 - step / n)
    losses: list[float] = []
    model.train()
    for step, batch in enumerate(batches):
        optimizer.zero_grad(set_to_none=True)
        loss = prefix_detached_backward(model, batch.input_ids.to(device), batch.attention_mask.to(device),
                                        batch.loss_mask.to(device), grad_margin)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        schedule.step()
        losses.append(loss)
        if progress is not None and (step % 10 == 9 or step == len(batches) - 1):
            progress(f"format warm-up: step {step + 1}/{len(batches)}, loss {loss:.3f}")
    model.eval()
    return losses
