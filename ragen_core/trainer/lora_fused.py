"""LoRA linears whose adapter output is accumulated into the base output by the matrix product itself.

    from ragen_core.trainer.lora_fused import fuse_lora_linears
    n = fuse_lora_linears(peft_model)   # the peft LoRA Linear layers that now take the fused path

peft's ``Linear`` adds its adapter as ``result + lora_B(lora_A(x)) * scaling``: the B product writes a
tensor as large as the layer's output, the scaling multiplies all of it, the sum writes a third one, and
the backward multiplies the output-sized gradient by the scaling again. Here the scaling goes on A's output
(n × rank, tiny) and B's product is accumulated into the base output in place (``addmm_``, beta 1: the
BLAS call reads and writes the output once). On the vanilla StarPO update of the Bandit study (LoRA rank 16
on every projection of the default model) those output-sized passes were ~10% of the update's time.

Under autocast (bf16 training over fp32 weights) the layer's input is cast to the autocast dtype once, for the
base product and A's, where autocast would cast it for each; the layers that read the same input (q, k, v; gate,
up) share that one copy (:func:`_low_copy`). Each use's gradient goes back to the input in the input's dtype and
adds up there, as autocast's separate casts add up theirs. B's weight is cast to the output's dtype for the
in-place product, as autocast would cast it for B's own.

The result is the same function: (x A^T · s) B^T against (x A^T B^T) · s, equal up to rounding. The fused
path runs only for the plain case: one active vanilla-LoRA adapter, adapters enabled and not merged, an
``nn.Linear`` base layer, no LoRA bias, the adapter's weights in one floating dtype and the base weight and the
input in it too (or, under autocast, the base weight in it or in the autocast dtype), no extra arguments, and no
module hooks on lora_B (DeepSpeed ZeRO-3 gathers a partitioned weight in such a hook; lora_B's weight is read
directly here). Anything else runs peft's own forward, unchanged: the reference pass under ``disable_adapter``, a
merged model, DoRA and the other variants.

Tests: ``.venv/bin/python -m pytest tests/unit/trainer/test_lora_fused.py -q`` (values and gradients against
peft's forward, with and without autocast, each fallback case).
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
    if args or kwargs or layer.disable_adapters or layer.merged:
        return None
    active = [a for a in layer.active_adapters if a in layer.lora_A]
    if len(active) != 1 or active[0] in layer.lora_variant:
        return None
    name = active[0]
    base, lora_a, lora_b = layer.base_layer, layer.lora_A[name], layer.lora_B[name]
    if (type(base) is not nn.Linear or not isinstance(layer.lora_dropout[name], nn.Identity)
            or lora_b.bias is not None or lora_b._forward_pre_hooks or lora_b._forward_hooks):
        return None
    dtype = lora_a.weight.dtype
    if lora_b.weight.dtype != dtype or not dtype.is_floating_point:
        return None
    if torch.is_autocast_enabled(x.device.type):  # the base weight as it is or as autocast's frozen copy
        low = torch.get_autocast_dtype(x.device.type)
        return name if x.dtype in (dtype, low) and base.weight.dtype in (dtype, low) else None
    return name if x.dtype == base.weight.dtype == dtype else None


class _SharedCast(torch.autograd.Function):
    """One use of a lower-precision copy of x that was made once (:func:`_low_copy`): forward the copy, backward
    the use's gradient in x's dtype to x. Each use is a node of its own, so x's gradient adds up in x's dtype, as
    it does over autocast's one cast per use."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
        ctx.dtype = x.dtype
        return low.view_as(low)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.to(ctx.dtype), None


_LOW_COPY = "_ragen_low_copy"
"""The attribute of an input tensor that holds its autocast-dtype copy: (dtype, version, copy)."""


def _low_copy(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in ``dtype`` for one use, the copy made at x's first use and kept on x (while x is unchanged) for the
    layers after it that read the same tensor (q, k and v read one normed input)."""
    if x.dtype == dtype:
        return x
    if x.is_inference():  # no version counter to tell whether a kept copy is still x's
        return x.to(dtype)
    held = getattr(x, _LOW_COPY, None)
    if held is None or held[0] != dtype or held[1] != x._version:
        with torch.no_grad():
            held = (dtype, x._version, x.detach().to(dtype))
        setattr(x, _LOW_COPY, held)
    if not (torch.is_grad_enabled() and x.requires_grad):
        return held[2]
    out: torch.Tensor = _SharedCast.apply(x, held[2])
    return out


def _fused_forward(self: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """base(x) + s · B(A(x)) with B's product accumulated into base(x) in place. x: [..., in] -> [..., out]."""
    name = _adapter(self, x, args, kwargs)
    if name is None:
        return super(type(self), self).forward(x, *args, **kwargs)  # peft's own
    if torch.is_autocast_enabled(x.device.type):
        x = _low_copy(x, torch.get_autocast_dtype(x.device.type))
    flat = x.reshape(-1, x.shape[-1])  # [n, in] 2-D, so the base output is a fresh tensor, not a view
    out = self.base_layer(flat)  # [n, out] (its own hooks run)
    low = self.lora_A[name](flat) * self.scaling[name]  # [n, r] the scaling on the small side
    out.addmm_(low.to(out.dtype), self.lora_B[name].weight.to(out.dtype).t())  # [n, out] += [n, r] @ [r, out]
    return out.view(*x.shape[:-1], out.shape[-1])
