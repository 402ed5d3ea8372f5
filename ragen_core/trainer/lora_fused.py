"""LoRA linears whose adapter output is accumulated into the base output by the matrix product itself.

    from ragen_core.trainer.lora_fused import fuse_lora_linears
    n = fuse_lora_linears(peft_model)   # the peft LoRA Linear layers that now take the fused path

peft's ``Linear`` adds its adapter as ``result + lora_B(lora_A(x)) * scaling``: the B product writes a
tensor as large as the layer's output, the scaling multiplies all of it, the sum writes a third one, and
the backward multiplies the output-sized gradient by the scaling again. Here the scaling goes on A's output
(n × rank, tiny) and B's product is accumulated into the base output in place (``addmm_``, beta 1: the
BLAS call reads and writes the output once). On the vanilla StarPO update of the Bandit study (LoRA rank 16
on every projection of the default model) those output-sized passes were ~10% of the update's time.

The result is the same function: (x A^T · s) B^T against (x A^T B^T) · s, equal up to rounding. The fused
path runs only for the plain case: one active vanilla-LoRA adapter, adapters enabled and not merged, an
``nn.Linear`` base layer, no LoRA bias, every weight and the input in one dtype, no autocast, no extra
arguments, and no module hooks on lora_B (DeepSpeed ZeRO-3 gathers a partitioned weight in such a hook;
lora_B's weight is read directly here). Anything else runs peft's own forward, unchanged: the reference
pass under ``disable_adapter``, a merged model, DoRA and the other variants.

Tests: ``.venv/bin/python -m pytest tests/unit/trainer/test_lora_fused.py -q`` (values and gradients against
peft's forward, each fallback case).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["fuse_lora_linears"]


def fuse_lora_linears(model: nn.Module) -> int:
    """Give every peft LoRA ``Linear`` in ``model`` the fused forward (module docstring). -> how many.

    Each such layer becomes an instance of a subclass whose ``forward`` is the fused one (a class, not a bound
    method in the instance, so that ``copy.deepcopy`` of the model keeps it); idempotent.
    """
    fused = _fused_class()
    count = 0
    for module in model.modules():
        if type(module) in (fused, fused.__base__):  # peft's plain LoRA Linear only, not other layer kinds
            module.__class__ = fused
            count += 1
    return count


_FUSED: list[type[nn.Module]] = []


def _fused_class() -> type[nn.Module]:
    """peft's LoRA ``Linear`` with :func:`_fused_forward` as its forward (made once, on first use)."""
    if not _FUSED:
        # lazily: peft is slow to import and only LoRA needs it
        from peft.tuners.lora.layer import Linear as LoraLinear

        _FUSED.append(type("FusedLoraLinear", (LoraLinear,), {"forward": _fused_forward, "__module__": __name__}))
    return _FUSED[0]


def _adapter(layer: Any, x: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """The one adapter the fused path may run for this call, or None when peft's forward must."""
    if args or kwargs or layer.disable_adapters or layer.merged or torch.is_autocast_enabled(x.device.type):
        return None
    active = [a for a in layer.active_adapters if a in layer.lora_A]
    if len(active) != 1 or active[0] in layer.lora_variant:
        return None
    name = active[0]
    base, lora_a, lora_b = layer.base_layer, layer.lora_A[name], layer.lora_B[name]
    if (type(base) is not nn.Linear or not isinstance(layer.lora_dropout[name], nn.Identity)
            or lora_b.bias is not None or lora_b._forward_pre_hooks or lora_b._forward_hooks):
        return None
    if not x.dtype == base.weight.dtype == lora_a.weight.dtype == lora_b.weight.dtype:
        return None
    return name


def _fused_forward(self: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """base(x) + s · B(A(x)) with B's product accumulated into base(x) in place. x: [..., in] -> [..., out]."""
    name = _adapter(self, x, args, kwargs)
    if name is None:
        return super(type(self), self).forward(x, *args, **kwargs)  # peft's own
    flat = x.reshape(-1, x.shape[-1])  # [n, in] 2-D, so the base output is a fresh tensor, not a view
    out = self.base_layer(flat)  # [n, out] (its own hooks run)
    low = self.lora_A[name](flat) * self.scaling[name]  # [n, r] the scaling on the small side
    out.addmm_(low, self.lora_B[name].weight.t())  # [n, out] += [n, r] @ [r, out]
    return out.view(*x.shape[:-1], out.shape[-1])
