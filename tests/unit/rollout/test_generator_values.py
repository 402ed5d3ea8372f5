"""The hf generator records a value head's values of the states it sampled in (Generation.values).

Reference: the head on the decoder's last hidden states of the whole dialogue (prompt + sampled ids), one
forward, as the trainer's critic forward computes them (trainer.models.critic_values): the value of sampled
id j is the head at the position before it.
"""

from __future__ import annotations

import pytest
import torch
from trained_lora import with_trained_lora

from ragen_core.models.tiny import tiny_random
from ragen_core.rollout.generators.base import SamplingParams
from ragen_core.rollout.generators.hf import HFGenerator, _final_norm


def _model(lora: bool, seed: int = 4) -> tuple[torch.nn.Module, object, torch.nn.Linear]:
    model, tok = tiny_random(seed=seed)
    if lora:
        model = with_trained_lora(model, ["q_proj", "v_proj", "up_proj"])
    torch.manual_seed(seed)
    head = torch.nn.Linear(model.config.hidden_size, 1)
    with torch.no_grad():
        head.weight.normal_(0, 1.0)
    return model, tok, head


def _reference(model: torch.nn.Module, head: torch.nn.Linear, prompt: list[int], ids: tuple[int, ...]) -> torch.Tensor:
    """[len(ids)] the head on the last hidden state before each sampled id, from one forward of the dialogue."""
    get_base = getattr(model, "get_base_model", None)
    decoder = (get_base() if callable(get_base) else model).model
    seq = torch.tensor([list(prompt) + list(ids)])
    with torch.no_grad():
        hidden = decoder(input_ids=seq).last_hidden_state[0]  # [T, H], after the final norm
        per_state = head(hidden).squeeze(-1)
    return per_state[len(prompt) - 1 : len(prompt) - 1 + len(ids)]


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("fast", [True, False])
def test_values_are_the_heads_values_of_the_sampled_states_over_two_turns(lora: bool, fast: bool) -> None:
    """Prompt groups (prefilled once, cascade attention on the fast step), early stops and the batch shrinking,
    then a second turn on the kept caches: every sampled id's value within 1e-4 of the one-forward reference."""
    model, tok, head = _model(lora)
    groups = [[5, 9, 13, 2, 7, 30, 12, 3], [11, 4], [8, 8, 8, 1, 40]]
    prompts = [p for p in groups for _ in range(4)]
    params = SamplingParams(max_new_tokens=16, temperature=1.0, seed=3, stop_token_ids=tuple(range(40, 130)))
    sessions = [f"s{i}" for i in range(len(prompts))]
    gen = HFGenerator(model, tok, fast_decode=fast, value_head=head)
    first = gen.generate(prompts, params, sessions)
    assert {g.finish_reason for g in first} == {"stop", "length"}
    second_prompts = [list(p) + list(g.token_ids) + [7, 7] for p, g in zip(prompts, first, strict=True)]
    second = gen.generate(second_prompts, params, sessions)
    assert gen.stats["reused_tokens"] > 0
    for turn_prompts, gens in ((prompts, first), (second_prompts, second)):
        for p, g in zip(turn_prompts, gens, strict=True):
            assert g.values is not None and len(g.values) == len(g.token_ids)
            torch.testing.assert_close(torch.tensor(g.values), _reference(model, head, p, g.token_ids),
                                       rtol=0, atol=1e-4)


def test_values_through_a_prefill_in_several_groups() -> None:
    """Distinct prompts prefilled in groups of a few tokens (``prefill_chunk_tokens``): each row's first value
    comes from its own group's last position."""
    model, tok, head = _model(lora=False, seed=5)
    prompts = [[5, 9, 13, 2, 7, 30], [11, 4], [8, 8, 8, 1], [3, 1, 4, 1, 5, 9, 2, 6], [7]]
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=11)
    gen = HFGenerator(model, tok, prefill_chunk_tokens=12, value_head=head)
    out = gen.generate(prompts, params)
    for p, g in zip(prompts, out, strict=True):
        assert g.values is not None
        torch.testing.assert_close(torch.tensor(g.values), _reference(model, head, p, g.token_ids), rtol=0, atol=1e-4)


def test_the_head_is_read_at_each_call_and_its_hook_is_gone_after() -> None:
    """An optimizer step on the head between calls is seen; the final norm carries no hook outside a call (a
    training forward must not feed it); without a head there are no values, and sampling is the same."""
    model, tok, head = _model(lora=False, seed=6)
    prompts = [[5, 9, 13, 2], [11, 4, 6]]
    params = SamplingParams(max_new_tokens=5, temperature=1.0, seed=2)
    gen = HFGenerator(model, tok, value_head=head)
    norm = _final_norm(model)
    assert norm is not None
    before = gen.generate(prompts, params)
    assert not norm._forward_hooks
    with torch.no_grad():
        head.weight.mul_(-2.0)
        head.bias.add_(1.0)
    after = gen.generate(prompts, params)
    for p, g0, g1 in zip(prompts, before, after, strict=True):
        assert g0.token_ids == g1.token_ids  # the head does not touch sampling
        torch.testing.assert_close(torch.tensor(g1.values), _reference(model, head, p, g1.token_ids),
                                   rtol=0, atol=1e-4)
    plain = HFGenerator(model, tok).generate(prompts, params)
    assert all(g.values is None for g in plain)
    assert [g.token_ids for g in plain] == [g.token_ids for g in before]
