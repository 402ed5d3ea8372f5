"""Typed views of a causal LM: the transformers and peft methods ragen_core calls beyond ``nn.Module``'s.

torch types an unknown attribute of an ``nn.Module`` as ``Tensor | Module`` (what its ``__getattr__``
returns), so ``model.get_decoder()`` on a module typed ``nn.Module`` does not type-check. The models
ragen_core trains are transformers ``*ForCausalLM`` models, wrapped under LoRA in a peft ``PeftModel``
(which forwards the transformers methods to the model inside). The Protocols below name the methods used;
:func:`causal_lm` and :func:`lora_model` are the one place where an ``nn.Module`` is seen as one of them.
They are ``typing.cast``: nothing is checked or changed at run time.

Nothing to run here; ``make typecheck`` (mypy) checks the callers.
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Protocol, cast

import torch
from torch import nn

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

__all__ = ["CausalLM", "LoraModel", "causal_lm", "lora_model", "merged_state_dict", "unwrap_lora"]


class CausalLM(Protocol):
    """A transformers ``*ForCausalLM`` model, or a peft model around one.

    A decoder inside one (a ``PreTrainedModel`` too) has ``config``, ``gradient_checkpointing_enable``
    and ``save_pretrained`` as well: the trainer enables checkpointing on a separate critic's decoder.
    """

    @property
    def config(self) -> PreTrainedConfig: ...

    def get_decoder(self) -> nn.Module: ...

    def get_output_embeddings(self) -> nn.Module | None: ...

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict[str, bool] | None = None) -> None: ...

    def save_pretrained(self, save_directory: str | os.PathLike[str], *, safe_serialization: bool = True,
                        state_dict: dict[str, torch.Tensor] | None = None) -> None: ...


class LoraModel(Protocol):
    """A peft ``PeftModel``: a causal LM with LoRA adapters."""

    def get_base_model(self) -> nn.Module: ...

    def disable_adapter(self) -> AbstractContextManager[None]: ...

    def save_pretrained(self, save_directory: str, safe_serialization: bool = True) -> None: ...


def causal_lm(model: nn.Module) -> CausalLM:
    """``model`` typed as the causal LM it is (a cast: no run-time check)."""
    return cast(CausalLM, model)


def lora_model(model: nn.Module) -> LoraModel:
    """``model`` typed as the peft LoRA model it is (a cast: no run-time check)."""
    return cast(LoraModel, model)


def unwrap_lora(model: nn.Module) -> nn.Module:
    """The transformers model inside a peft wrapper; any other module itself."""
    return lora_model(model).get_base_model() if hasattr(model, "get_base_model") else model


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The weights of the plain transformers model, named as its own ``state_dict``, with every active LoRA
    delta added into its base layer. ``model`` itself is left untouched (peft's ``merge_adapter`` and
    ``unmerge_adapter`` would round the trained base weights twice).

    What an inference engine that knows nothing of LoRA loads (the vLLM backend's weight sync). Without peft
    it is the model's own state dict (detached, not copied).
    """
    if not hasattr(model, "get_base_model"):
        return {name: t.detach() for name, t in model.state_dict().items()}
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora import LoraLayer  # lazily: peft only for LoRA models

    base = lora_model(model).get_base_model()
    merged: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, module in base.named_modules():
            if isinstance(module, LoraLayer):
                if not isinstance(module, LoraLinear):  # ragen targets linear projections only (config.py)
                    raise NotImplementedError(f"merging a {type(module).__name__} LoRA layer ({name})")
                weight = cast(torch.Tensor, module.get_base_layer().weight).detach()
                for adapter in module.active_adapters:
                    if adapter in module.lora_A and not module.merged:
                        weight = weight + module.get_delta_weight(adapter).to(weight.dtype)
                merged[f"{name}.weight"] = weight
    out: dict[str, torch.Tensor] = {}
    for name, t in base.state_dict().items():
        if ".lora_" in name:
            continue
        plain = name.replace(".base_layer.", ".")
        out[plain] = merged.get(plain, t.detach())
    return out
