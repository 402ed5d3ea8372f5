"""The hf backend on the real default model (SmolLM2-135M-Instruct): cache reuse equals full re-prefill.

Slow (loads the model, generates a few hundred tokens):
    .venv/bin/python -m pytest -m slow tests/unit/rollout/test_generators_default_model.py -q
Skipped when the default model is not provisioned (``ragen model fetch``); under CI that fails instead
(tests/conftest.py).
"""

from __future__ import annotations

import pytest
import torch

from ragen_core.rollout.generators import SamplingParams
from ragen_core.rollout.generators.hf import HFGenerator
from tests.conftest import require

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm():
    from ragen_core.models import DEFAULT_MODEL, ModelError, load_model, load_tokenizer

    try:
        return load_model(DEFAULT_MODEL), load_tokenizer(DEFAULT_MODEL)
    except ModelError as exc:  # not provisioned and not fetchable here
        require(False, f"default model unavailable: {exc}")
        raise  # unreachable: require skipped or failed


def _dialogue_heads(tokenizer):
    system = "You're a helpful assistant. You always respond by giving your reasoning and then your answer."
    users = [
        "You are solving the FrozenLake puzzle. Turn 1: State:\nG___\n_O_O\n____\n_P__\nDecide your move.",
        "Bandit: choose Phoenix or Dragon. Turn 1. Answer with <answer>arm</answer>.",
        "Hi",
    ]
    return [
        tokenizer.apply_chat_template(
            [{"role": "system", "content": system}, {"role": "user", "content": u}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        for u in users
    ]


def _three_turns(gen, tokenizer, heads):
    """Three simulated turns; returns [(contexts, generations)] per turn."""
    eot = tokenizer.convert_tokens_to_ids("<|im_end|>")
    user = tokenizer.encode(
        "\n<|im_start|>user\nTurn 2: reward 0. State: _P__<|im_end|>\n<|im_start|>assistant\n"
    )
    contexts = [list(h) for h in heads]
    history = []
    for turn in range(3):
        params = SamplingParams(max_new_tokens=24, seed=100 + turn, stop_token_ids=(eot,))
        out = gen.generate(contexts, params, session_ids=[f"ep{i}" for i in range(len(contexts))])
        history.append((contexts, out))
        contexts = [
            c
            + list(g.token_ids)
            + ([] if g.token_ids and g.token_ids[-1] == eot else [eot])
            + user[: len(user) - i]
            for i, (c, g) in enumerate(zip(contexts, out, strict=True))
        ]
    return history


def _full_prefill_logprobs(model, prompt, continuation, temperature=1.0):
    ids = torch.tensor([list(prompt) + list(continuation)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1]
    return (
        torch.log_softmax(logits / temperature, -1).gather(1, torch.tensor(continuation)[:, None]).squeeze(1)
    )


def test_cache_reuse_logprobs_within_1e4_of_full_reprefill(smollm):
    """The cache-reuse criterion: every sampled token's logprob with cache reuse equals a full re-prefill's."""
    model, tokenizer = smollm
    reuse = HFGenerator(model, tokenizer, cache_reuse=True)
    history = _three_turns(reuse, tokenizer, _dialogue_heads(tokenizer))
    worst = 0.0
    for contexts, out in history:
        for prompt, g in zip(contexts, out, strict=True):
            full = _full_prefill_logprobs(model, prompt, g.token_ids)
            worst = max(worst, float((torch.tensor(g.logprobs) - full).abs().max()))
    assert worst <= 1e-4, worst
    assert reuse.stats["reused_tokens"] > 0


def test_cache_reuse_agrees_with_naive_generator(smollm):
    """Same seeds: the naive generator samples the same tokens until a float-rounding flip (rare: the
    inverse-CDF target must fall within ~1e-6 of a token boundary), with logprobs within 1e-4. After a flip
    that row's later turns have another dialogue (prompt), so they are not compared."""
    model, tokenizer = smollm
    heads = _dialogue_heads(tokenizer)
    reuse = HFGenerator(model, tokenizer, cache_reuse=True)
    naive = HFGenerator(model, tokenizer, cache_reuse=False)
    compared = 0
    for (asked, got), (asked_naive, want) in zip(
        _three_turns(reuse, tokenizer, heads), _three_turns(naive, tokenizer, heads), strict=True
    ):
        for prompt, prompt_naive, a, b in zip(asked, asked_naive, got, want, strict=True):
            if list(prompt) != list(prompt_naive):
                continue  # an earlier turn flipped a token: another dialogue from there
            n = 0
            while n < min(len(a.token_ids), len(b.token_ids)) and a.token_ids[n] == b.token_ids[n]:
                n += 1
            compared += n
            assert all(abs(x - y) <= 1e-4 for x, y in zip(a.logprobs[:n], b.logprobs[:n], strict=True))
    assert compared >= 100  # most tokens agree
    assert reuse.stats["prefill_tokens"] < naive.stats["prefill_tokens"] / 2


def test_logprobs_match_teacher_forcing(smollm):
    model, tokenizer = smollm
    heads = _dialogue_heads(tokenizer)
    out = HFGenerator(model, tokenizer).generate(
        heads, SamplingParams(temperature=0.7, max_new_tokens=16, seed=1)
    )
    for prompt, g in zip(heads, out, strict=True):
        ids = torch.tensor([list(prompt) + list(g.token_ids)])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 : -1]
        expected = (
            torch.log_softmax(logits / 0.7, -1).gather(1, torch.tensor(g.token_ids)[:, None]).squeeze(1)
        )
        assert torch.allclose(torch.tensor(g.logprobs), expected, atol=1e-4)
