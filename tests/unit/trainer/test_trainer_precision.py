"""trainer.precision: bf16 mixed precision keeps fp32 master weights, so the paper's lr 1e-6 still moves them.

An AdamW step on bf16 weights rounds away every update below about 1/256 of the weight (bf16 keeps 8 bits of
mantissa); Adam's first step moves each weight by about lr, so at lr 1e-6 almost nothing would change. With
fp32 masters and bf16 autocast the step moves the weights by what the fp32 run moves them.
"""

from __future__ import annotations

import pytest
import torch

from ragen_core.trainer import init_state, update
from ragen_core.trainer import models as trainer_models
from tests.conftest import require_module
from tests.unit.trainer.conftest import make_batch, make_cfg

LR = ["trainer.actor_lr=1e-6", "trainer.critic_lr=1e-6"]


def moved(*overrides: str) -> tuple[float, torch.dtype]:
    """Sum of |w_after - w_before| over the actor's trained weights after one update at lr 1e-6, and their dtype."""
    cfg = make_cfg("starpo-s", *LR, *overrides)
    state = init_state(cfg)
    params = [p for p in state.models.actor.parameters() if p.requires_grad]
    before = [p.detach().float().clone() for p in params]
    stats = update(state, make_batch(), cfg)
    assert stats.optimizer_steps == 1
    delta = sum(float((p.detach().float() - b).abs().sum()) for p, b in zip(params, before, strict=True))
    return delta, params[0].dtype


def first_step_grads(state, cfg) -> list[torch.Tensor]:
    """The actor's gradients at the first optimizer step of one update on ``make_batch()`` (the step then runs)."""
    seen: list[list[torch.Tensor]] = []
    original = state.actor_engine.step

    def step() -> float:
        seen.append([p.grad.clone() for p in state.actor_engine.params])
        return original()

    state.actor_engine.step = step
    update(state, make_batch(), cfg)
    return seen[0]


def test_bf16_mixed_precision_moves_the_weights_as_fp32_does_at_lr_1e6() -> None:
    fp32, fp32_dtype = moved()
    bf16, bf16_dtype = moved("model.dtype=bfloat16", "trainer.precision=bf16")
    assert fp32_dtype == bf16_dtype == torch.float32  # master weights
    print(f"sum |dw| at lr 1e-6: fp32 {fp32:.4g}, bf16 mixed {bf16:.4g}")
    assert bf16 == pytest.approx(fp32, rel=0.1)


def test_the_trap_adamw_on_bf16_weights_rounds_the_update_away(monkeypatch: pytest.MonkeyPatch) -> None:
    # What the trainer did before fp32 masters: the same update straight on bf16 weights.
    fp32, _ = moved()
    monkeypatch.setattr(trainer_models, "fp32_masters", lambda *modules: None)
    trapped, dtype = moved("model.dtype=bfloat16", "trainer.precision=bf16")
    print(f"sum |dw| at lr 1e-6: fp32 {fp32:.4g}, AdamW on bf16 weights {trapped:.4g}")
    assert dtype == torch.bfloat16 and trapped < 0.1 * fp32


def test_lora_keeps_a_bf16_base_and_trains_fp32_adapters() -> None:
    cfg = make_cfg("starpo-s", *LR, "model.dtype=bfloat16", "trainer.precision=bf16", "model.lora_rank=4")
    state = init_state(cfg)
    dtypes = {(p.requires_grad, p.dtype) for p in state.models.actor.parameters()}
    assert dtypes == {(True, torch.float32), (False, torch.bfloat16)}
    assert update(state, make_batch(), cfg).optimizer_steps == 1


def test_forwards_run_under_bf16_autocast_only_with_precision_bf16() -> None:
    a = torch.randn(4, 4)
    for precision, want in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        state = init_state(make_cfg("starpo-s", f"trainer.precision={precision}"))
        assert state.actor_engine.forward(torch.mm, a, a).dtype == want


def test_deepspeed_bf16_moves_the_weights_as_the_torch_engine_does() -> None:
    require_module("deepspeed", "the DeepSpeed engine (a dev dependency, in locks/cpu.txt)")
    torch_bf16, _ = moved("model.dtype=bfloat16", "trainer.precision=bf16")
    ds_bf16, dtype = moved("model.dtype=bfloat16", "trainer.precision=bf16", "trainer.backend=deepspeed")
    assert dtype == torch.float32
    assert ds_bf16 == pytest.approx(torch_bf16, rel=1e-3)


def test_auto_precision_is_bf16_only_on_a_cpu_that_multiplies_bf16(tmp_path, monkeypatch) -> None:
    from ragen_core.trainer import engine

    plain, native, amx = tmp_path / "avx2", tmp_path / "avx512bf16", tmp_path / "amx"
    plain.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n")
    native.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512bw avx512_bf16 avx512_vnni\n")
    amx.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f amx_bf16 amx_tile\n")
    assert not engine.cpu_multiplies_bf16(str(plain))
    assert engine.cpu_multiplies_bf16(str(native)) and engine.cpu_multiplies_bf16(str(amx))
    assert not engine.cpu_multiplies_bf16(str(tmp_path / "missing"))  # not Linux: unknown, so fp32
    a = torch.randn(4, 4)
    for has_bf16, want in ((False, torch.float32), (True, torch.bfloat16)):
        monkeypatch.setattr(engine, "cpu_multiplies_bf16", lambda has=has_bf16: has)
        cfg = make_cfg("starpo-s", "trainer.precision=auto")
        assert engine.compute_precision(cfg) == ("bf16" if has_bf16 else "fp32")
        assert init_state(cfg).actor_engine.forward(torch.mm, a, a).dtype == want
        # on CUDA auto keeps fp32 (with TF32): bf16 autocast measured no faster there at these model sizes
        assert engine.compute_precision(make_cfg("starpo-s", "trainer.precision=auto", "model.device=cuda")) == "fp32"
    for fixed in ("fp32", "bf16"):
        assert engine.compute_precision(make_cfg("starpo-s", f"trainer.precision={fixed}")) == fixed


def test_bf16_lora_skips_the_input_casts_and_computes_the_same() -> None:
    """Under bf16 autocast over fp32 weights, LoRA layers hand their bf16 input to the adapters uncast
    (engine.keep_lora_inputs): peft's cast to fp32 was undone by autocast's cast back to bf16, an exact round
    trip, so the gradients are bitwise those of the casting layers; fp32 runs keep peft's default."""
    grads = {}
    for keep in (True, False):
        cfg = make_cfg("starpo-s", "trainer.precision=bf16", "model.lora_rank=4")
        state = init_state(cfg)
        layers = [m for m in state.models.actor.modules() if hasattr(m, "cast_input_dtype_enabled")]
        assert layers and all(not m.cast_input_dtype_enabled for m in layers)
        if not keep:
            for m in layers:
                m.cast_input_dtype_enabled = True
        grads[keep] = first_step_grads(state, cfg)
    for a, b in zip(grads[True], grads[False], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    fp32 = init_state(make_cfg("starpo-s", "trainer.precision=fp32", "model.lora_rank=4"))
    layers = [m for m in fp32.models.actor.modules() if hasattr(m, "cast_input_dtype_enabled")]
    assert layers and all(m.cast_input_dtype_enabled for m in layers)


@pytest.mark.parametrize("lora", [True, False], ids=["lora-base", "reference-model"])
def test_bf16_forwards_reuse_copies_of_the_frozen_weights_and_compute_the_same(lora: bool) -> None:
    """On a CPU under bf16 autocast the torch engine keeps bf16 copies of the frozen linear weights (a LoRA base,
    a separate reference model) instead of casting them in every forward (engine.FrozenCasts): the update's
    gradients are bitwise those of plain autocast; outside a forward the layers hold their fp32 weights; the
    copies are made once and remade when a weight changes; an output layer tied to the embedding gets a copy in
    the linear layer only, while the embedding looks up its fp32 weight."""
    overrides = ["trainer.precision=bf16", "model.lora_rank=4"] if lora else ["trainer.precision=bf16",
                                                                              "algorithm.kl_coef=0.01"]
    grads = {}
    for cached in (True, False):
        cfg = make_cfg("starpo-s", *overrides)
        state = init_state(cfg)
        frozen = state.actor_engine.frozen
        assert frozen is not None and frozen.layers
        models = [m for m in (state.models.actor, state.models.ref) if m is not None]
        embeddings = {id(m.weight): m for model in models for m in model.modules()
                      if isinstance(m, torch.nn.Embedding)}
        tied = [layer for layer in frozen.layers if id(layer.weight) in embeddings]
        assert len(tied) == 1  # the frozen model's output layer (the tiny model ties it)
        with frozen.swapped():
            assert tied[0].weight.dtype == torch.bfloat16
            assert {e.weight.dtype for e in embeddings.values()} == {torch.float32}
        if not cached:
            state.actor_engine.frozen = None
        grads[cached] = first_step_grads(state, cfg)
        if cached:
            assert {layer.weight.dtype for layer in frozen.layers} == {torch.float32}
            copies = {k: v[1] for k, v in frozen._copies.items()}
            assert len(copies) == len(frozen.layers)
            assert {c.dtype for c in copies.values()} == {torch.bfloat16}
            update(state, make_batch(), cfg)
            assert all(frozen._copies[k][1] is c for k, c in copies.items())  # reused, not cast again
            first = frozen.layers[0]
            with torch.no_grad():
                first.weight.mul_(2.0)  # the version counter moves
            doubled = first.weight.detach().to(torch.bfloat16)
            with frozen.swapped():
                assert first.weight is not copies[id(first)]
                torch.testing.assert_close(first.weight.detach(), doubled, rtol=0, atol=0)
    for a, b in zip(grads[True], grads[False], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
