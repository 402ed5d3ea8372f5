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

from torch import nn

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

__all__ = ["CausalLM", "LoraModel", "causal_lm", "lora_model", "unwrap_lora"]


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

    def save_pretrained(self, save_directory: str | os.PathLike[str], *, safe_serialization: bool = True) -> None: ...


class LoraModel(Protocol):
    """A peft ``PeftModel``: a causal LM with LoRA adapters."""

    def get_base_model(self) -> nn.Module: ...

    def disable_adapter(self) -> AbstractContextManager[None]: ...


def causal_lm(model: nn.Module) -> CausalLM:
    """``model`` typed as the causal LM it is (a cast: no run-time check)."""
    return cast(CausalLM, model)


def lora_model(model: nn.Module) -> LoraModel:
    """``model`` typed as the peft LoRA model it is (a cast: no run-time check)."""
    return cast(LoraModel, model)


def unwrap_lora(model: nn.Module) -> nn.Module:
    """The transformers model inside a peft wrapper; any other module itself."""
    return lora_model(model).get_base_model() if hasattr(model, "get_base_model") else model
