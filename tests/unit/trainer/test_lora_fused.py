"""The fused LoRA linear (ragen_core/trainer/lora_fused.py): the same values and gradients as peft's forward, and
peft's own forward, untouched, wherever the fused path does not apply.

Run: .venv/bin/python -m pytest tests/unit/trainer/test_lora_fused.py -q
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable

import pytest
import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora.layer import Linear as LoraLinear

from ragen_core.models import tiny_random
from ragen_core.trainer.engine import FrozenCasts
from ragen_core.trainer.lora_fused import fuse_lora_linears
from ragen_core.trainer.models import build_policy_models
from tests.unit.trainer.conftest import make_cfg


def _lora(dropout: float = 0.0) -> torch.nn.Module:
    model, _ = tiny_random(0)
    # init_lora_weights=False: B random, not zero, so the adapter's term is not zero and is checked. The adapters
    # draw from a seeded stream: the model does not depend on which tests ran before in the process.
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout,
                                                target_modules="all-linear", init_lora_weights=False))


def _loss_and_grads(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids).logits  # [B, T, V]
    loss = logits.float().pow(2).mean()
    loss.backward()
    trained = [p for p in model.parameters() if p.requires_grad]
    assert trained and all(p.grad is not None for p in trained)
    return logits.detach(), [p.grad.clone() for p in trained]  # type: ignore[union-attr]


def _count_addmm_(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls = [0]
    original = torch.Tensor.addmm_

    def counted(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        calls[0] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "addmm_", counted)
    return calls


def test_fused_equals_peft_values_and_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    plain = _lora()
    fused = copy.deepcopy(plain)
    n = fuse_lora_linears(fused)
    layers = sum(type(m) is LoraLinear for m in plain.modules())
    assert n == layers and n > 0
    ids = torch.randint(0, 200, (3, 11), generator=torch.Generator().manual_seed(0))
    want_logits, want_grads = _loss_and_grads(plain, ids)
    calls = _count_addmm_(monkeypatch)
    got_logits, got_grads = _loss_and_grads(fused, ids)
    assert calls[0] == n  # every LoRA layer took the fused path once
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-5, atol=1e-5)
    assert len(got_grads) == len(want_grads)
    for got, want in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_fusing_is_idempotent_and_survives_deepcopy() -> None:
    model = _lora()
    n = fuse_lora_linears(model)
    assert fuse_lora_linears(model) == n
    copied = copy.deepcopy(model)
    kinds = {type(m).__name__ for m in copied.modules() if isinstance(m, LoraLinear)}
    assert kinds == {"FusedLoraLinear"}


def _bf16_base(model: torch.nn.Module) -> None:
    """A frozen bf16 model under fp32 adapters: peft casts between them."""
    model.to(torch.bfloat16)
    for m in model.modules():
        if isinstance(m, LoraLinear):
            m.lora_A.float()
            m.lora_B.float()


def _hook_lora_b(model: torch.nn.Module) -> None:
    """A forward hook on each lora_B, as DeepSpeed ZeRO-3 puts on a module whose weight it partitions."""
    for m in model.modules():
        if isinstance(m, LoraLinear):
            m.lora_B["default"].register_forward_pre_hook(lambda *_: None)


def _merge(model: torch.nn.Module) -> None:
    model.merge_adapter()  # type: ignore[operator]


def _disabled(model: torch.nn.Module) -> contextlib.AbstractContextManager[None]:
    return model.disable_adapter()  # type: ignore[operator,no-any-return]


CASES: dict[str, tuple[float, Callable[[torch.nn.Module], None] | None, Callable[[torch.nn.Module],
            contextlib.AbstractContextManager[object]] | None]] = {
    # case: (lora dropout, a change to the model, a context the forward runs in)
    "disabled": (0.0, None, _disabled),  # the reference pass under LoRA
    "merged": (0.0, _merge, None),
    "dropout": (0.1, None, None),
    "bf16_base": (0.0, _bf16_base, None),
    "hooked_b": (0.0, _hook_lora_b, None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_cases_the_fused_path_leaves_to_peft_run_peft_unchanged(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    dropout, change, context = CASES[case]
    plain = _lora(dropout=dropout)
    fused = copy.deepcopy(plain)
    fuse_lora_linears(fused)
    ids = torch.randint(0, 200, (2, 7), generator=torch.Generator().manual_seed(1))

    def run(model: torch.nn.Module) -> torch.Tensor:
        if change is not None:
            change(model)
        model.eval()
        with context(model) if context is not None else contextlib.nullcontext(), torch.no_grad():
            return model(input_ids=ids).logits

    want = run(plain)
    calls = _count_addmm_(monkeypatch)
    got = run(fused)
    assert calls[0] == 0
    torch.testing.assert_close(got, want, rtol=0, atol=0)  # peft's own forward: the very same numbers


def _autocast_loss_and_grads(model: torch.nn.Module, ids: torch.Tensor,
                             frozen_bf16: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """_loss_and_grads under bf16 autocast; ``frozen_bf16``: the frozen base weights swapped for bf16 copies, as
    the trainer's FrozenCasts does on a CPU."""
    casts = FrozenCasts([model], torch.bfloat16) if frozen_bf16 else None
    with torch.autocast("cpu", dtype=torch.bfloat16), casts.swapped() if casts else contextlib.nullcontext():
        return _loss_and_grads(model, ids)


@pytest.mark.parametrize("frozen_bf16", [False, True])
def test_fused_under_autocast_equals_peft_under_autocast(frozen_bf16: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    plain = _lora()
    fused = copy.deepcopy(plain)
    n = fuse_lora_linears(fused)
    ids = torch.randint(0, 200, (3, 11), generator=torch.Generator().manual_seed(0))
    want_logits, want_grads = _autocast_loss_and_grads(plain, ids, frozen_bf16)
    exact_logits, exact_grads = _loss_and_grads(copy.deepcopy(plain), ids)  # fp32: the rounding's yardstick
    calls = _count_addmm_(monkeypatch)
    got_logits, got_grads = _autocast_loss_and_grads(fused, ids, frozen_bf16)
    assert calls[0] == n  # the fused path under autocast
    assert got_logits.dtype == want_logits.dtype == torch.bfloat16
    # bf16 rounds differently on the two paths (the adapter's product is summed into the output in fp32 here),
    # and on this tiny model both are 1-5% (of the largest entry) from the fp32 result. The fused one must be as
    # close as peft's over all tensors, and no tensor far off. Over 24 draws of the adapters: the total error
    # 0.69-1.30 times peft's; a tensor's largest error 0.96 times peft's at the median, worse on 44% of them, up
    # to 4.2 times on a small one (rounding on few entries)
    total_got = total_want = 0.0
    for got, want, exact in zip([got_logits, *got_grads], [want_logits, *want_grads], [exact_logits, *exact_grads],
                                strict=True):
        scale = exact.float().abs().max()
        err_got = float((got.float() - exact.float()).abs().max() / scale)
        err_want = float((want.float() - exact.float()).abs().max() / scale)
        assert err_got <= max(5 * err_want, 2e-2), (tuple(got.shape), err_got, err_want)
        total_got += float((got.float() - exact.float()).pow(2).sum())
        total_want += float((want.float() - exact.float()).pow(2).sum())
    assert total_got ** 0.5 <= 1.5 * total_want ** 0.5, (total_got ** 0.5, total_want ** 0.5)


def test_layers_reading_one_input_share_its_autocast_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _lora()
    fuse_lora_linears(model)
    copies = [0]
    original = torch.Tensor.to

    def counted(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        out = original(self, *args, **kwargs)
        if self.dtype == torch.float32 and out.dtype == torch.bfloat16 and self.shape[:-1] in ((33,), (3, 11)):
            copies[0] += 1  # an activation's copy ([3, 11, in] or [33, in]), not a weight's
        return out

    monkeypatch.setattr(torch.Tensor, "to", counted)
    ids = torch.randint(0, 200, (3, 11), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=ids).logits.float().sum().backward()
    layers = model.get_base_model().config.num_hidden_layers
    # per layer: the attention's normed input once for q, k and v; the MLP's once for gate and up (o_proj and
    # down_proj read bf16 already)
    assert copies[0] == 2 * layers


def test_the_fused_path_runs_in_inference_mode_under_autocast() -> None:
    plain = _lora()
    fused = copy.deepcopy(plain)
    fuse_lora_linears(fused)
    ids = torch.randint(0, 200, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        exact = plain(input_ids=ids).logits.float()  # fp32: the rounding's yardstick
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.inference_mode():
        got, want = fused(input_ids=ids).logits, plain(input_ids=ids).logits
    # Each path's bf16 logits are 1-6% (of the largest) from fp32's on this tiny model, over 16 draws of the
    # adapters, and the two paths' rounding differ from each other by as much: the fused one must be about as
    # close to fp32 as peft's
    scale = exact.abs().max()
    err_got, err_want = (float((x.float() - exact).abs().max() / scale) for x in (got, want))
    assert err_got <= max(2 * err_want, 3e-2), (err_got, err_want)


def test_policy_models_under_lora_use_the_fused_layers() -> None:
    models = build_policy_models(make_cfg("starpo", "model.lora_rank=4", "algorithm.critic=separate"))
    assert models.critic is not None
    for module in (models.actor, models.critic):
        kinds = {type(m).__name__ for m in module.modules() if isinstance(m, LoraLinear)}
        assert kinds == {"FusedLoraLinear"}
