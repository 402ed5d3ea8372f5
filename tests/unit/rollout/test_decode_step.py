"""The fast decode step (ragen_core/rollout/generators/decode_step.py) computes what model.forward computes."""

from __future__ import annotations

import functools

import pytest
import torch
from trained_lora import with_trained_lora

from ragen_core.models.tiny import tiny_random
from ragen_core.rollout.generators import cpu_attention, decode_step
from ragen_core.rollout.generators.base import SamplingParams
from ragen_core.rollout.generators.decode_step import decode_step_for
from ragen_core.rollout.generators.hf import HFGenerator
from ragen_core.rollout.generators.kv import cache_layers, growing_cache
from tests.conftest import require


@pytest.fixture(params=["panels", "onednn"])
def matmuls(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The fast step's fp32 weight matmuls forced onto cpu_attention's panels, or onto oneDNN's packed weights, whatever
    this CPU would pick by itself (cpu_attention.panels_pay)."""
    if request.param == "panels":
        require(cpu_attention.kernel_available(), "the CPU kernel is not built (no compiler?)")
    monkeypatch.setattr(decode_step, "panels_pay", lambda: request.param == "panels")
    return str(request.param)


def _tiny(seed: int, heads: str):
    """tiny_random's model and tokenizer; ``heads`` "grouped": the same config with 4 query heads over 2 key/value
    heads (head size 32), so that each key/value head serves a group of query heads, as in SmolLM2 (9 over 3) and
    Qwen2.5 (14 over 2); "single": tiny_random's own 2 query heads over 1."""
    model, tok = tiny_random(seed=seed)
    if heads == "grouped":
        config = type(model.config)(**{**model.config.to_dict(), "num_attention_heads": 4, "num_key_value_heads": 2,
                                       "head_dim": 32})
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = type(model)(config)
    return model.eval(), tok


def _prefilled(model, prompts: list[list[int]], pad: int = 0):
    """Left-padded batch of ``prompts`` prefilled with model.forward: (cache with room, mask)."""
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, width - len(p):] = torch.tensor(p)
        mask[b, width - len(p):] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.inference_mode():
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
    return growing_cache(cache_layers(out.past_key_values), room=8), mask


def _suffixed(kept_mask: torch.Tensor, suffixes: list[list[int]]):
    """A later turn's suffixes on kept caches of ``kept_mask``: (ids [B, T] left-padded, their positions, the mask
    [B, W + T] over the kept columns and the new ones)."""
    new = max(map(len, suffixes))
    ids = torch.zeros(len(suffixes), new, dtype=torch.long)
    mask = torch.cat([kept_mask, torch.zeros(len(suffixes), new, dtype=torch.long)], dim=1)
    for b, sfx in enumerate(suffixes):
        ids[b, new - len(sfx):] = torch.tensor(sfx)
        mask[b, mask.shape[1] - len(sfx):] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, kept_mask.shape[1]:]
    return ids, positions, mask


def _padded_batch(seed: int):
    """A tiny model (eval mode), its fast step, and two equal caches with room of three left-padded prompts
    prefilled by model.forward (one for the step, one for model.forward), with their mask."""
    model, _ = tiny_random(seed=seed)
    model.eval()
    step = decode_step_for(model)
    assert step is not None
    prompts = [[5, 9, 13, 2, 7, 30], [11, 4], [8, 8, 8, 1]]
    fast_cache, mask = _prefilled(model, prompts)
    slow_cache, _ = _prefilled(model, prompts)
    return model, step, fast_cache, slow_cache, mask


def test_a_step_gives_model_forwards_logits_and_cache_on_a_padded_batch(matmuls: str) -> None:
    model, step, fast_cache, slow_cache, mask = _padded_batch(seed=3)
    ids = torch.tensor([17, 3, 25])
    for _ in range(3):  # three steps: each appends a column
        positions = mask.sum(-1, keepdim=True)
        mask = torch.cat([mask, torch.ones(len(mask), 1, dtype=torch.long)], dim=1)
        fast = step.step(ids, positions[:, 0], mask, fast_cache)
        assert step.panels == (matmuls == "panels")
        with torch.inference_mode():
            slow = model(input_ids=ids[:, None], attention_mask=mask, position_ids=positions,
                         past_key_values=slow_cache, use_cache=True).logits[:, -1, :]
        torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-5)
        for (fk, fv), (sk, sv) in zip(cache_layers(fast_cache), cache_layers(slow_cache), strict=True):
            torch.testing.assert_close(fk, sk, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(fv, sv, rtol=1e-5, atol=1e-5)
        ids = fast.argmax(-1)


def test_a_finished_row_in_the_batch_leaves_the_others_as_model_forward_and_stays_finite() -> None:
    """Steps where row 1 has finished (its new columns masked, as the sampling loop feeds it): the fused kernel
    reads none of its cache, and the other rows' logits and cache are model.forward's; the finished row's logits
    and the keys and values written for it stay finite (later steps mask them, and masked terms must stay finite)."""
    require(cpu_attention.kernel_available(), "the CPU kernel is not built (no compiler?)")
    model, step, fast_cache, slow_cache, mask = _padded_batch(seed=4)
    ids = torch.tensor([17, 0, 25])  # row 1 feeds the pad id
    live = torch.tensor([1, 0, 1])
    for _ in range(3):
        positions = mask.sum(-1, keepdim=True)
        mask = torch.cat([mask, live[:, None]], dim=1)
        fast = step.step(ids, positions[:, 0], mask, fast_cache)
        with torch.inference_mode():
            slow = model(input_ids=ids[:, None], attention_mask=mask, position_ids=positions,
                         past_key_values=slow_cache, use_cache=True).logits[:, -1, :]
        assert torch.isfinite(fast).all()
        torch.testing.assert_close(fast[[0, 2]], slow[[0, 2]], rtol=1e-5, atol=1e-5)
        for (fk, fv), (sk, sv) in zip(cache_layers(fast_cache), cache_layers(slow_cache), strict=True):
            assert torch.isfinite(fk).all() and torch.isfinite(fv).all()
            torch.testing.assert_close(fk[[0, 2]], sk[[0, 2]], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(fv[[0, 2]], sv[[0, 2]], rtol=1e-5, atol=1e-5)
        ids = torch.where(live == 1, fast.argmax(-1), 0)


@pytest.mark.parametrize("lora", [False, True])
def test_a_prefill_gives_model_forwards_logits_and_cache_on_top_of_kept_caches(lora: bool, matmuls: str) -> None:
    """A later turn's prefill: rows of different kept lengths (left-padded, zeros) and different suffix lengths
    (left-padded too), T tokens a row through the fast step, against model.forward over the same cache: the last
    position's logits, and every real column of the cache; the padding's columns are finite."""
    model, _ = tiny_random(seed=3)
    if lora:
        model = with_trained_lora(model, ["q_proj", "v_proj", "up_proj"])
    model.eval()
    step = decode_step_for(model)
    assert step is not None
    kept, suffixes = [[5, 9, 13, 2, 7, 30], [11, 4], [8, 8, 8, 1]], [[17, 3, 25, 6], [40], [2, 2]]
    fast_cache, kept_mask = _prefilled(model, kept)
    slow_cache, _ = _prefilled(model, kept)
    ids, positions, mask = _suffixed(kept_mask, suffixes)
    fast = step.prefill(ids, positions, mask, fast_cache)
    assert step.panels == (matmuls == "panels")
    with torch.inference_mode():
        slow = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=slow_cache,
                     use_cache=True).logits[:, -1, :]
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-5)
    real = mask.bool()
    for (fk, fv), (sk, sv) in zip(cache_layers(fast_cache), cache_layers(slow_cache), strict=True):
        assert fk.shape == sk.shape and torch.isfinite(fk).all() and torch.isfinite(fv).all()
        for b in range(len(kept)):  # heads x real columns
            torch.testing.assert_close(fk[b][:, real[b]], sk[b][:, real[b]], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(fv[b][:, real[b]], sv[b][:, real[b]], rtol=1e-5, atol=1e-5)


def test_a_prefill_takes_attention_output_in_a_gpus_memory_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA's attention kernels may return [B, heads, T, d] laid out as [B, T, heads, d]; with several key/value
    heads the prefill must still give model.forward's logits."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=300, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).eval()
    original = torch.nn.functional.scaled_dot_product_attention

    def gpu_layout(*args: object, **kwargs: object) -> torch.Tensor:
        out = original(*args, **kwargs)  # type: ignore[arg-type]
        return out.transpose(1, 2).contiguous().transpose(1, 2)  # the same values, heads innermost but one

    step = decode_step_for(model)
    assert step is not None
    kept, suffixes = [[5, 9, 13, 2, 7, 30], [11, 4]], [[17, 3, 25], [40, 41, 42]]
    fast_cache, kept_mask = _prefilled(model, kept)
    slow_cache, _ = _prefilled(model, kept)
    ids = torch.tensor(suffixes)
    mask = torch.cat([kept_mask, torch.ones(2, 3, dtype=torch.long)], dim=1)
    positions = (mask.cumsum(-1) - 1)[:, kept_mask.shape[1]:]
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", gpu_layout)
    fast = step.prefill(ids, positions, mask, fast_cache)
    with torch.inference_mode():
        slow = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=slow_cache,
                     use_cache=True).logits[:, -1, :]
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads", ["single", "grouped"])
@pytest.mark.parametrize("lora", [False, True])
def test_generations_with_and_without_the_fast_step_agree(lora: bool, heads: str, matmuls: str) -> None:
    model, tok = _tiny(1, heads)
    if lora:
        model = with_trained_lora(model, ["q_proj", "v_proj", "up_proj"])
    prompts = [[5, 9, 13, 2, 7, 30], [11, 4], [8, 8, 8, 1], [11, 4]]
    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=7)
    fast_gen = HFGenerator(model, tok, fast_decode=True)
    fast = fast_gen.generate(prompts, params)
    slow = HFGenerator(model, tok, fast_decode=False).generate(prompts, params)
    assert fast_gen._step is not None and fast_gen._step.panels == (matmuls == "panels")
    assert HFGenerator(model, tok)._step is not None  # on by default (RolloutConfig.fast_decode)
    for f, s in zip(fast, slow, strict=True):
        assert f.token_ids == s.token_ids and f.finish_reason == s.finish_reason
        torch.testing.assert_close(torch.tensor(f.logprobs), torch.tensor(s.logprobs), rtol=0, atol=1e-4)


def test_the_fused_weights_follow_an_in_place_update() -> None:
    model, tok = tiny_random(seed=2)
    gen = HFGenerator(model, tok, fast_decode=True)
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=1)
    before = gen.generate([[5, 6, 7]], params)[0]
    with torch.no_grad():  # an optimizer step, in place
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    after = gen.generate([[5, 6, 7]], params)[0]
    reference = HFGenerator(model, tok, fast_decode=False).generate([[5, 6, 7]], params)[0]
    assert after.token_ids == reference.token_ids and after.token_ids != before.token_ids
    torch.testing.assert_close(torch.tensor(after.logprobs), torch.tensor(reference.logprobs), rtol=0, atol=1e-4)


def test_update_weights_rebuilds_the_fused_weights_when_the_versions_did_not_move() -> None:
    # DeepSpeed ZeRO-1/2 points each parameter's .data at its updated flat buffer: the weights change,
    # the version counters do not (measured). The trainer then calls update_weights, which must rebuild.
    model, tok = tiny_random(seed=2)
    gen = HFGenerator(model, tok, fast_decode=True)
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=1)
    before = gen.generate([[5, 6, 7]], params)[0]
    versions = [p._version for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data + torch.randn_like(p) * 0.5
    assert [p._version for p in model.parameters()] == versions  # what makes this case different
    gen.update_weights(model)
    after = gen.generate([[5, 6, 7]], params)[0]
    reference = HFGenerator(model, tok, fast_decode=False).generate([[5, 6, 7]], params)[0]
    assert after.token_ids == reference.token_ids and after.token_ids != before.token_ids
    torch.testing.assert_close(torch.tensor(after.logprobs), torch.tensor(reference.logprobs), rtol=0, atol=1e-4)


def test_an_unchanged_output_layer_is_not_packed_again() -> None:
    # Under LoRA an update moves only the adapters: the rebuild keeps the packed output layer (tied to the
    # embedding), and the step still samples what model.forward samples; a step on the embedding repacks it.
    model = with_trained_lora(tiny_random(seed=5)[0], ["q_proj", "v_proj", "up_proj"])
    tok = tiny_random(seed=5)[1]
    gen = HFGenerator(model, tok, fast_decode=True)
    step = gen._step
    assert step is not None
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=4)
    gen.generate([[5, 6, 7], [9, 2]], params)
    packed_head = step._head
    with torch.no_grad():  # an optimizer step on the adapters only
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(torch.randn_like(p) * 0.3)
    after = gen.generate([[5, 6, 7], [9, 2]], params)
    assert step._head is packed_head
    reference = HFGenerator(model, tok, fast_decode=False).generate([[5, 6, 7], [9, 2]], params)
    for a, r in zip(after, reference, strict=True):
        assert a.token_ids == r.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(r.logprobs), rtol=0, atol=1e-4)
    with torch.no_grad():
        model.get_base_model().model.embed_tokens.weight.mul_(1.5)
    moved = gen.generate([[5, 6, 7], [9, 2]], params)
    assert step._head is not packed_head
    reference = HFGenerator(model, tok, fast_decode=False).generate([[5, 6, 7], [9, 2]], params)
    for a, r in zip(moved, reference, strict=True):
        assert a.token_ids == r.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(r.logprobs), rtol=0, atol=1e-4)


def test_an_architecture_it_does_not_cover_falls_back_to_model_forward() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=64, n_positions=64))
    assert decode_step_for(gpt2) is None
    biased = LlamaForCausalLM(LlamaConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                                          num_attention_heads=2, num_key_value_heads=1, vocab_size=64,
                                          mlp_bias=True))
    assert decode_step_for(biased) is None  # attention biases are covered (Qwen2: tests/unit/test_qwen2.py)
    zero3, _ = tiny_random(seed=0)
    next(zero3.parameters()).ds_id = 0  # what DeepSpeed ZeRO-3 sets on the weights it partitions
    assert decode_step_for(zero3) is None


@pytest.mark.parametrize("heads", ["single", "grouped"])
@pytest.mark.parametrize("kernel", [True, False], ids=["fused-kernel", "flash-and-merge"])
@pytest.mark.parametrize("lora", [False, True])
def test_cascade_attention_over_shared_prompts_samples_what_model_forward_samples(lora: bool, kernel: bool,
                                                                                  heads: str, monkeypatch) -> None:
    """Prompt groups (N rows of one prompt, prefilled once): the fast step keeps the shared prompt once per
    group (decode_step.SharedPrefix), and each row attends to it and to its own tokens: in one call of the
    fused CPU kernel, or (without it) torch's flash kernel over each group's stacked rows merged with the rows'
    own part by log-sum-exps. Same ids and log-probs within 1e-4 as model.forward over every row's full cache,
    through early stops, the batch shrinking and a second turn that reuses each row's kept cache."""
    from ragen_core.rollout.generators import cpu_attention, decode_step

    if kernel:
        require(cpu_attention.compiler() is not None, "no C++ compiler ($CXX, else c++) to build the kernel")
        assert cpu_attention.kernel_available()
    model, tok = _tiny(4, heads)
    if lora:
        model = with_trained_lora(model, ["q_proj", "k_proj", "v_proj"])
    plans = []  # batch size of each cascade step, on the path under test
    if kernel:
        real_attention = decode_step.decode_attention
        monkeypatch.setattr(decode_step, "decode_attention", lambda q, *a, shared=None, **k: (
            shared is not None and plans.append(len(q))) or real_attention(q, *a, shared=shared, **k))
    else:
        monkeypatch.setenv("RAGEN_CPU_ATTENTION", "0")
        monkeypatch.setattr(cpu_attention, "_op", functools.cache(cpu_attention._op.__wrapped__))  # None here
        real_plan = decode_step.SharedPrefix.plan
        monkeypatch.setattr(decode_step.SharedPrefix, "plan",
                            lambda self, dtype: plans.append(len(self.source)) or real_plan(self, dtype))
    groups = [[5, 9, 13, 2, 7, 30, 12, 3], [11, 4], [8, 8, 8, 1, 40]]
    prompts = [p for p in groups for _ in range(4)]
    params = SamplingParams(max_new_tokens=16, temperature=1.0, seed=3, stop_token_ids=tuple(range(40, 130)))
    sessions = [f"s{i}" for i in range(len(prompts))]
    fast_gen, slow_gen = HFGenerator(model, tok, fast_decode=True), HFGenerator(model, tok, fast_decode=False)
    fast = fast_gen.generate(prompts, params, sessions)
    slow = slow_gen.generate(prompts, params, sessions)
    assert plans and max(plans) <= 12 and min(plans) < 12  # cascade on, and the batch shrank under it
    assert {g.finish_reason for g in fast} == {"stop", "length"}
    for f, s in zip(fast, slow, strict=True):
        assert f.token_ids == s.token_ids and f.finish_reason == s.finish_reason
        torch.testing.assert_close(torch.tensor(f.logprobs), torch.tensor(s.logprobs), rtol=0, atol=1e-4)
    # turn 2: each row's prompt extends its own dialogue, so nothing is shared; the kept caches carry on
    second = [list(p) + list(g.token_ids) + [7, 7] for p, g in zip(prompts, fast, strict=True)]
    fast2, slow2 = fast_gen.generate(second, params, sessions), slow_gen.generate(second, params, sessions)
    assert fast_gen.stats["reused_tokens"] > 0
    for f, s in zip(fast2, slow2, strict=True):
        assert f.token_ids == s.token_ids
        torch.testing.assert_close(torch.tensor(f.logprobs), torch.tensor(s.logprobs), rtol=0, atol=1e-4)


@pytest.mark.parametrize("kernel", [True, False], ids=["fused-kernel", "torch-attention"])
def test_a_bf16_cache_over_shared_prompts_and_kept_caches_scores_as_autocast_does(kernel: bool, monkeypatch) -> None:
    """compute_dtype bf16 over fp32 weights with the generator's bf16 cache: prompt groups on their first turn
    (cascade attention: the fused kernel over fp32 shared columns and bf16 own ones, or without it torch's flash
    kernel over the bf16 cache merged by log-sum-exps), then a second turn on the kept bf16 caches (the fused
    kernel, or torch's attention in bf16). Every sampled id's log-prob is what one forward under bf16 autocast
    gives it, within bf16 rounding."""
    if kernel:
        require(cpu_attention.compiler() is not None, "no C++ compiler ($CXX, else c++) to build the kernel")
        assert cpu_attention.kernel_available()
    else:
        monkeypatch.setenv("RAGEN_CPU_ATTENTION", "0")
        monkeypatch.setattr(cpu_attention, "_op", functools.cache(cpu_attention._op.__wrapped__))  # None here
    cascades = []
    real_step = decode_step.LlamaDecodeStep.step
    monkeypatch.setattr(decode_step.LlamaDecodeStep, "step", lambda self, *a, **k: (
        cascades.append(a[-1] is not None or k.get("prefix") is not None)) or real_step(self, *a, **k))
    model, tok = tiny_random(seed=4)
    model.eval()
    gen = HFGenerator(model, tok, compute_dtype=torch.bfloat16)
    groups = [[5, 9, 13, 2, 7, 30, 12, 3], [11, 4], [8, 8, 8, 1, 40]]
    prompts = [p for p in groups for _ in range(4)]
    sessions = [f"s{i}" for i in range(len(prompts))]
    for turn in range(2):
        out = gen.generate(prompts, SamplingParams(max_new_tokens=12, temperature=1.0, seed=turn), sessions)
        assert any(cascades) == (turn == 0)
        cascades.clear()
        kept = {t.dtype for session in gen._sessions.values() for layer in session.layers for t in layer}
        assert kept == {torch.bfloat16}
        for prompt, g in zip(prompts, out, strict=True):
            ids = torch.tensor([list(prompt) + list(g.token_ids)])
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
            auto = torch.log_softmax(logits, -1).gather(1, torch.tensor(g.token_ids)[:, None]).squeeze(1)
            torch.testing.assert_close(torch.tensor(g.logprobs), auto, rtol=0, atol=1e-2)
        prompts = [list(p) + list(g.token_ids) + [7, 7] for p, g in zip(prompts, out, strict=True)]
    assert gen.stats["reused_tokens"] > 0


def test_a_bf16_base_with_fp32_adapters_decodes_over_shared_prompts() -> None:
    """``model.dtype: bfloat16`` under LoRA: frozen bf16 weights, fp32 adapters (trainer.models.fp32_masters).
    The cascade over shared prompts merges its parts by fp32 log-sum-exps; the result goes back to bf16 before
    the output projection, and the fast prefill and steps sample what model.forward samples, within bf16
    rounding."""
    from ragen_core.trainer.models import fp32_masters

    model, tok = tiny_random(seed=4)
    model = with_trained_lora(model.to(torch.bfloat16), ["q_proj", "k_proj", "v_proj"])
    fp32_masters(model)
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}
    groups = [[5, 9, 13, 2, 7, 30, 12, 3], [11, 4], [8, 8, 8, 1, 40]]
    prompts = [p for p in groups for _ in range(4)]
    params = SamplingParams(max_new_tokens=16, temperature=1.0, seed=3)
    sessions = [f"s{i}" for i in range(len(prompts))]
    fast = HFGenerator(model, tok, fast_decode=True).generate(prompts, params, sessions)
    slow = HFGenerator(model, tok, fast_decode=False).generate(prompts, params, sessions)
    # the first token: the same uniform draw from distributions that differ by bf16 rounding (the fast prefill
    # multiplies by the merged bf16 weights, model.forward adds the adapters' product to the base's), so a draw
    # that falls near a boundary between two tokens may go either way
    same = [(f, s) for f, s in zip(fast, slow, strict=True) if f.token_ids[0] == s.token_ids[0]]
    assert len(same) >= len(prompts) - 1
    # later tokens: the same holds at every step up to the first token where the two paths' draws part (each
    # step is another such draw, so where they part is luck: 8 to 12 of 12 replies stayed equal over 16 tokens,
    # seeds 3-7 on an AVX2-only CPU); until then each step's log-prob agrees within bf16 rounding (at most 0.005
    # measured), and most of the tokens come before a parting (at least 0.78 of them measured)
    common = 0
    for f, s in zip(fast, slow, strict=True):
        pairs = enumerate(zip(f.token_ids, s.token_ids, strict=False))  # a reply may stop earlier than its twin
        part = next((i for i, (a, b) in pairs if a != b), min(len(f.token_ids), len(s.token_ids)))
        common += part
        assert all(abs(a - b) < 0.05 for a, b in zip(f.logprobs[:part], s.logprobs[:part], strict=True))
    assert common >= 0.5 * sum(len(f.token_ids) for f in fast)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float32], ids=["bf16-cache", "fp32-cache"])
@pytest.mark.parametrize("packed", [True, False], ids=["onednn", "f-linear"])
@pytest.mark.parametrize("lora", [False, True])
def test_a_bf16_step_over_fp32_weights_computes_what_autocast_computes(lora: bool, packed: bool,
                                                                       cache_dtype: torch.dtype) -> None:
    """compute_dtype bf16 (a trainer under bf16 autocast): the step's weight matmuls run in bf16; its cache is
    bf16 (``cache_dtype``, the keys and values autocast makes) as the generator makes it, and an fp32 cache given
    to it stays fp32. Its logits are model.forward's under torch.autocast within bf16 rounding, they are not the
    fp32 step's (the matmuls did run in bf16), and every cache column it appends has the cache's dtype."""
    model, _ = tiny_random(seed=3)
    if lora:
        model = with_trained_lora(model, ["q_proj", "v_proj", "up_proj"])
    model.eval()
    step, exact = decode_step_for(model, torch.bfloat16), decode_step_for(model)
    assert step is not None and exact is not None and step.matmul_dtype == step.cache_dtype == torch.bfloat16
    step.packed = step.packed and packed  # oneDNN's bf16 kernels where this CPU has them; F.linear otherwise
    prompts = [[5, 9, 13, 2, 7, 30], [11, 4], [8, 8, 8, 1]]
    (bf_cache, mask), (fp_cache, _), (auto_cache, _) = (_prefilled(model, prompts) for _ in range(3))
    bf_cache = growing_cache([(k.to(cache_dtype), v.to(cache_dtype)) for k, v in cache_layers(bf_cache)], room=8)
    ids = torch.tensor([17, 3, 25])
    for _ in range(3):
        positions = mask.sum(-1, keepdim=True)
        mask = torch.cat([mask, torch.ones(len(mask), 1, dtype=torch.long)], dim=1)
        fast = step.step(ids, positions[:, 0], mask, bf_cache)
        fp32 = exact.step(ids, positions[:, 0], mask, fp_cache)
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
            auto = model(input_ids=ids[:, None], attention_mask=mask, position_ids=positions,
                         past_key_values=auto_cache, use_cache=True).logits[:, -1, :].float()
        assert fast.dtype == torch.float32
        # logits of about 1: bf16's spacing there is 2^-7 (0.0078); autocast's attention runs in bf16 where the
        # step's accumulates in fp32, so the two differ by a rounding or two of the output, not more
        torch.testing.assert_close(fast, auto, rtol=0, atol=1e-2)
        assert (fast - fp32).abs().max() > 1e-3
        assert {t.dtype for layer in cache_layers(bf_cache) for t in layer} == {cache_dtype}
        ids = fp32.argmax(-1)


@pytest.mark.parametrize(("compute", "matmuls"), [(torch.float32, "panels"), (torch.float32, "onednn"),
                                                  (torch.bfloat16, "onednn")], ids=["fp32-panels", "fp32", "bf16"])
def test_the_fused_small_ops_compute_what_the_separate_ops_compute(compute: torch.dtype, matmuls: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Where cpu_attention's step ops are built, a step runs its norms, rotary embedding, cache writes and SiLU
    through them (each once per layer), and a prefill its norms, rotary embedding with its cache writes, and SiLU;
    the logits and every cache column are those of the same steps and prefill with the separate torch ops, within
    float rounding, over steps that outgrow the cache's room (grouped query heads, a padded batch, fp32 and bf16
    matmuls)."""
    require(cpu_attention.kernel_available(), "the CPU kernel is not built (no compiler?)")
    monkeypatch.setattr(decode_step, "panels_pay", lambda: matmuls == "panels")  # bf16 matmuls never use panels
    model, _ = _tiny(seed=5, heads="grouped")
    calls: list[str] = []
    real = cpu_attention.step_ops()

    class Counted:
        def __getattr__(self, name: str):
            def call(*args, **kwargs):
                calls.append(name)
                return getattr(real, name)(*args, **kwargs)
            return call

    prompts = [[5, 9, 13, 2, 7, 30], [11, 4], [8, 8, 8, 1]]
    results = {}
    for fused in (True, False):
        monkeypatch.setattr(decode_step, "step_ops", (lambda: Counted()) if fused else (lambda: None))
        step = decode_step_for(model, compute)
        assert step is not None
        step._build()
        assert step.packed and step.panels == (matmuls == "panels")
        prefilled, mask = _prefilled(model, prompts)
        cache = growing_cache([(k.to(compute), v.to(compute)) for k, v in cache_layers(prefilled)], room=1)
        ids, logits = torch.tensor([17, 3, 25]), []
        for _ in range(3):
            positions = mask.sum(-1, keepdim=True)
            mask = torch.cat([mask, torch.ones(len(mask), 1, dtype=torch.long)], dim=1)
            logits.append(step.step(ids, positions[:, 0], mask, cache))
            ids = torch.tensor([4, 29, 11])
        # then a next turn's prefill of 30 tokens a row: 90 rows, which the fused ops split between threads
        new = torch.randint(1, 60, (3, 30), generator=torch.Generator().manual_seed(1))
        positions = mask.sum(-1, keepdim=True) + torch.arange(30)
        mask = torch.cat([mask, torch.ones(3, 30, dtype=torch.long)], dim=1)
        logits.append(step.prefill(new, positions, mask, cache))
        results[fused] = (torch.stack(logits), cache_layers(cache))
    layers = model.config.num_hidden_layers
    assert calls.count("rms_norm_to") == 2 * 4 * layers and calls.count("rotary_kv") == 3 * layers
    assert calls.count("rotary_prefill") == layers
    assert calls.count("silu_mul") == 4 * layers
    tol = {"rtol": 1e-5, "atol": 1e-5} if compute == torch.float32 else {"rtol": 0, "atol": 2e-2}
    torch.testing.assert_close(results[True][0], results[False][0], **tol)
    for (fk, fv), (sk, sv) in zip(results[True][1], results[False][1], strict=True):
        assert fk.dtype == sk.dtype == compute and fk.shape == sk.shape
        torch.testing.assert_close(fk.float(), sk.float(), **tol)
        torch.testing.assert_close(fv.float(), sv.float(), **tol)


def test_a_bf16_prefill_on_the_segment_kernel_computes_what_sdpa_computes(monkeypatch) -> None:
    """Head size 64 over a bf16 cache, where the CPU has AVX512-BF16: a prefill's attention runs cpu_attention's
    segment kernel (each query over the real columns before its own, and its own). Over kept caches with left
    padding and a hole, with left-padded suffixes, its logits and every real column it appends are the SDPA
    prefill's within bf16 rounding, and every column it writes is finite."""
    require(cpu_attention.compiler() is not None, "no C++ compiler to build the kernel")
    assert cpu_attention.kernel_available()
    if cpu_attention.segment_ops() is None:
        pytest.skip("this CPU has no AVX512-BF16: the prefill stays on SDPA")
    model, _ = tiny_random(seed=4)
    config = type(model.config)(**{**model.config.to_dict(), "hidden_size": 192, "num_attention_heads": 3,
                                   "num_key_value_heads": 1, "head_dim": 64})
    torch.manual_seed(4)
    model = type(model)(config).eval()
    kept, suffixes = [[5, 9, 13, 2, 7, 30, 4, 4], [11, 4], [8, 8, 8, 1, 9]], [[17, 3, 25, 6], [40], [2, 2]]
    caches, kept_mask = [], None
    for _ in range(2):
        cache, kept_mask = _prefilled(model, kept)
        cache = growing_cache([(k.bfloat16(), v.bfloat16()) for k, v in cache_layers(cache)], room=8)
        caches.append(cache)
    kept_mask[0, 3] = 0  # a hole, as cache reuse leaves between turns
    ids, positions, mask = _suffixed(kept_mask, suffixes)
    calls = []
    ops = cpu_attention.segment_ops()

    class Counting:
        def segment_attention_fwd(self, *args):
            calls.append(args[0].shape)
            return ops.segment_attention_fwd(*args)

    step = decode_step_for(model, torch.bfloat16)
    assert step is not None and step.cache_dtype == torch.bfloat16
    monkeypatch.setattr(decode_step, "segment_ops", lambda: Counting())
    fast = step.prefill(ids, positions, mask, caches[0])
    assert len(calls) == config.num_hidden_layers and calls[0] == (3, 3, ids.shape[1], 64)
    monkeypatch.setattr(decode_step, "segment_ops", lambda: None)
    sdpa = step.prefill(ids, positions, mask, caches[1])
    torch.testing.assert_close(fast, sdpa, rtol=0, atol=2e-2)
    real = mask.bool()
    for (fk, fv), (sk, sv) in zip(cache_layers(caches[0]), cache_layers(caches[1]), strict=True):
        assert torch.isfinite(fk.float()).all() and torch.isfinite(fv.float()).all()
        for b in range(len(kept)):
            torch.testing.assert_close(fk[b][:, real[b]].float(), sk[b][:, real[b]].float(), rtol=0, atol=5e-2)
            torch.testing.assert_close(fv[b][:, real[b]].float(), sv[b][:, real[b]].float(), rtol=0, atol=5e-2)
