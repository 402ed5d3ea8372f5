"""Chunked forward passes: token log-probs, entropy and values without a full [B, T, V] logits tensor.

The output layer dominates memory for small models with big vocabularies: one
fp32 logits copy of 16×384 tokens over SmolLM2's 49k vocabulary is 1.2 GB, and
autograd keeps several. So the backbone runs once to give hidden states
[B, T, H], and the output layer is applied chunk by chunk over T
(``trainer.logprob_chunk``). When there is more than one chunk and gradients
are on, each chunk is recomputed in backward (activation checkpointing), so only
one chunk's logits ever exist, in forward or backward.

Alignment follows ``ragen_core.types``: ``logprobs[b, t]`` scores
``input_ids[b, t]`` from the hidden state at t − 1, and ``values[b, t]`` is the
critic's value of the state before token t is generated (hidden state at
t − 1), as veRL aligns them. Position 0 is never trained and holds 0.

Logits are divided by the rollout temperature so that, before any update, the
ratio to the sampling log-probs is 1 (as veRL does).

Run the tests with ``python -m pytest tests/unit/trainer -q``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ragen_core.algos import losses

__all__ = ["PolicyOutput", "chunked_logprobs", "decoder_and_head", "hidden_states", "policy_forward", "shift_values"]


class PolicyOutput(NamedTuple):
    """What one actor forward gives, all [B, T] aligned with input_ids (0 at position 0)."""

    logprobs: torch.Tensor
    entropy: torch.Tensor
    hidden: torch.Tensor  # [B, T, H] last hidden states (for a value head on the actor)


def decoder_and_head(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(decoder backbone, output layer) of a causal LM, looking through a peft wrapper.

    Works for any transformers ``*ForCausalLM`` (``get_decoder`` / ``get_output_embeddings``).
    With LoRA the decoder's linear layers already carry the adapters, so calling
    it trains them; ``with model.disable_adapter():`` turns them off for a reference pass.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = base.get_output_embeddings()
    if head is None:
        raise TypeError(f"{type(base).__name__} has no output layer; the actor must be a causal LM")
    return base.get_decoder(), head


def hidden_states(decoder: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Last hidden states of a decoder. input_ids, attention_mask: [B, T] -> [B, T, H].

    Rows are right-padded, so default positions 0..T−1 are right for every row.
    """
    out = decoder(input_ids=input_ids, attention_mask=attention_mask.long(), use_cache=False)
    return out.last_hidden_state


def _chunk_logprobs_entropy(
    hidden: torch.Tensor, labels: torch.Tensor, head: nn.Module, inv_temperature: float, entropy_grad: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of labels and entropy for one chunk. hidden: [B, C, H], labels: [B, C] -> ([B, C], [B, C])."""
    logits = head(hidden).float() * inv_temperature  # [B, C, V], the only logits tensor alive
    logprobs = losses.logprobs_from_logits(logits, labels)  # [B, C]
    entropy = losses.entropy_from_logits(logits if entropy_grad else logits.detach())  # [B, C]
    return logprobs, entropy


def chunked_logprobs(
    hidden: torch.Tensor,
    input_ids: torch.Tensor,
    head: nn.Module,
    temperature: float = 1.0,
    chunk: int = 128,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token log-probs and entropy, the output layer applied ``chunk`` positions at a time.

    hidden: [B, T, H], input_ids: [B, T] -> (logprobs [B, T], entropy [B, T]);
    logprobs[:, t] = log softmax(head(hidden[:, t−1]) / temperature)[input_ids[:, t]],
    entropy[:, t] the entropy of that same distribution; both 0 at t = 0.
    ``entropy_grad`` False detaches the entropy (it is then a diagnostic only).
    With gradients on and more than one chunk, each chunk is checkpointed so the
    backward pass recomputes its logits instead of keeping them.
    """
    h = hidden[:, :-1]  # [B, T-1, H] states that predict tokens 1..T-1
    labels = input_ids[:, 1:]  # [B, T-1]
    n = h.shape[1]
    starts = list(range(0, n, chunk))
    recompute = torch.is_grad_enabled() and len(starts) > 1
    parts_lp, parts_ent = [], []
    for s in starts:
        args = (h[:, s : s + chunk], labels[:, s : s + chunk], head, 1.0 / temperature, entropy_grad)
        lp, ent = checkpoint(_chunk_logprobs_entropy, *args, use_reentrant=False) if recompute else _chunk_logprobs_entropy(*args)
        parts_lp.append(lp)
        parts_ent.append(ent)
    zero = hidden.new_zeros(hidden.shape[0], 1, dtype=torch.float32)  # [B, 1] position 0
    logprobs = torch.cat([zero, *parts_lp], dim=1)  # [B, T]
    entropy = torch.cat([zero, *parts_ent], dim=1)  # [B, T]
    return logprobs, entropy


def policy_forward(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float = 1.0,
    chunk: int = 128,
    entropy_grad: bool = True,
) -> PolicyOutput:
    """One actor forward: backbone once, then chunked log-probs and entropy. [B, T] inputs -> PolicyOutput."""
    decoder, head = decoder_and_head(model)
    hidden = hidden_states(decoder, input_ids, attention_mask)  # [B, T, H]
    logprobs, entropy = chunked_logprobs(hidden, input_ids, head, temperature, chunk, entropy_grad)
    return PolicyOutput(logprobs, entropy, hidden)


def shift_values(per_state: torch.Tensor) -> torch.Tensor:
    """Align per-position critic outputs with tokens: values[:, t] = per_state[:, t−1], 0 at t = 0.

    per_state: [B, T] (value of the prefix ending at each position) -> [B, T].
    """
    return torch.cat([per_state.new_zeros(per_state.shape[0], 1), per_state[:, :-1]], dim=1)
