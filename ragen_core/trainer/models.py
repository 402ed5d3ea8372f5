"""The models one StarPO update touches: actor, critic, and (only when KL is on) a reference policy.

    models = build_policy_models(cfg)                  # loads cfg.model.name via ragen_core.models
    values = critic_values(models, input_ids, attention_mask)
    ref = reference_logprobs(models, input_ids, attention_mask, temperature=1.0, chunk=128)

- actor: the causal LM, fully fine-tuned or with LoRA adapters (peft, ``lora_rank > 0``).
- critic "separate" (default): a copy of the base LM's decoder plus a scalar
  head, as the reference initialises its critic from the same model; it gets
  LoRA adapters too under LoRA. "head": a value head on the actor's last hidden
  state, so one forward gives log-probs and values. "none": no critic (GRPO).
- reference: built only when ``algorithm.kl_coef > 0`` (SPEC §4: no reference
  pass at all when KL is off). Full fine-tuning keeps a frozen copy of the base;
  LoRA needs no copy: the reference is the actor with its adapters disabled.

Run the tests with ``python -m pytest tests/unit/trainer -q``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from ragen_core.config import ExperimentConfig, ModelConfig
from ragen_core.models import causal_lm, load_model, lora_model, unwrap_lora
from ragen_core.trainer.forward import decoder_and_head, hidden_states, policy_forward, shift_values
from ragen_core.trainer.lora_fused import fuse_lora_linears

if TYPE_CHECKING:
    from peft import LoraConfig

__all__ = ["PolicyModels", "ValueModel", "build_policy_models", "critic_values", "reference_logprobs", "resolve_device"]


class ValueModel(nn.Module):
    """A decoder backbone with a scalar head: per-token values of a separate critic."""

    def __init__(self, backbone: nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(hidden_size, 1)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """input_ids, attention_mask: [B, T] -> values [B, T] aligned with tokens (0 at t = 0)."""
        hidden = hidden_states(self.backbone, input_ids, attention_mask)  # [B, T, H]
        return shift_values(self.head(hidden.to(self.head.weight.dtype)).squeeze(-1))


@dataclass
class PolicyModels:
    """Live modules of a run (mutable on purpose: the optimiser updates them in place)."""

    actor: nn.Module
    """Causal LM (a peft PeftModel under LoRA)."""
    critic: ValueModel | None
    """Separate critic (algorithm.critic == 'separate'), else None."""
    value_head: nn.Linear | None
    """Value head on the actor's hidden state (algorithm.critic == 'head'), else None."""
    ref: nn.Module | None
    """Frozen reference LM; None when KL is off, and under LoRA (adapters disabled instead)."""
    use_reference: bool
    """True when the update needs reference log-probs (kl_coef > 0)."""
    lora: bool

    @property
    def device(self) -> torch.device:
        return next(self.actor.parameters()).device

    def train(self) -> None:
        for m in (self.actor, self.critic, self.value_head):
            if m is not None:
                m.train()


def resolve_device(device: str) -> torch.device:
    """'auto' -> cuda when available, else cpu."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _lora_config(model_cfg: ModelConfig) -> LoraConfig:
    # lazily: peft is slow to import and only LoRA needs it
    from peft import LoraConfig

    target = model_cfg.lora_target
    targets: str | list[str] = target if target == "all-linear" else [t.strip() for t in target.split(",") if t.strip()]
    return LoraConfig(r=model_cfg.lora_rank, lora_alpha=model_cfg.lora_alpha, lora_dropout=0.0, target_modules=targets)


def _enable_checkpointing(model: nn.Module) -> None:
    # Non-reentrant checkpointing works with frozen inputs (LoRA) without enable_input_require_grads.
    causal_lm(model).gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def build_policy_models(cfg: ExperimentConfig, base: nn.Module | None = None) -> PolicyModels:
    """Actor, critic and reference for ``cfg`` (model, algorithm sections).

    ``base`` is the loaded causal LM; None loads ``cfg.model.name`` with
    ``ragen_core.models.load_model``. A given ``base`` is copied, never modified.
    Parameter initialisation of new heads draws from torch's global RNG, so seed
    it first (``init_state`` does).
    """
    mcfg, acfg = cfg.model, cfg.algorithm
    device = resolve_device(mcfg.device)
    if base is None:
        base = load_model(mcfg.name, dtype=getattr(torch, mcfg.dtype), device=str(device))
    else:
        base = copy.deepcopy(base).to(device)
    hidden_size = int(causal_lm(base).config.hidden_size)
    decoder, _ = decoder_and_head(base)

    critic = ValueModel(copy.deepcopy(decoder), hidden_size).to(device) if acfg.critic == "separate" else None
    ref = None
    if acfg.uses_reference and mcfg.lora_rank == 0:
        ref = copy.deepcopy(base).eval().requires_grad_(False)
    actor: nn.Module = base
    if mcfg.lora_rank > 0:
        # lazily: peft is slow to import and only LoRA needs it
        from peft import get_peft_model

        actor = get_peft_model(base, _lora_config(mcfg))
        fuse_lora_linears(actor)
        if critic is not None:
            critic.backbone = get_peft_model(critic.backbone, _lora_config(mcfg))
            fuse_lora_linears(critic.backbone)
    value_head = nn.Linear(hidden_size, 1).to(device) if acfg.critic == "head" else None
    if mcfg.gradient_checkpointing:
        _enable_checkpointing(unwrap_lora(actor))
        if critic is not None:
            _enable_checkpointing(unwrap_lora(critic.backbone))
    fp32_masters(actor, critic, value_head)
    models = PolicyModels(actor, critic, value_head, ref, acfg.uses_reference, mcfg.lora_rank > 0)
    models.train()
    return models


def fp32_masters(*modules: nn.Module | None) -> None:
    """Trained weights in float32, whatever dtype the model was loaded in: an optimizer step on bf16 weights
    rounds away any update below the weight's precision (about 1/256 of it: at lr 1e-6 nearly all of them).
    The frozen weights (a LoRA base, the reference) keep their dtype; peft casts between the two, and
    trainer.precision=bf16 computes under autocast."""
    for module in modules:
        if module is None:
            continue
        for p in module.parameters():
            if p.requires_grad and p.dtype != torch.float32:
                p.data = p.data.float()


def critic_values(
    models: PolicyModels, input_ids: torch.Tensor, attention_mask: torch.Tensor, hidden: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-token values [B, T] from the separate critic, or from the actor's value head.

    ``hidden`` ([B, T, H], the actor's last hidden states) is used by the "head"
    critic; without it the actor's decoder is run.
    """
    if models.critic is not None:
        return models.critic(input_ids, attention_mask)
    if models.value_head is None:
        raise ValueError("this configuration has no critic (algorithm.critic == 'none')")
    if hidden is None:
        hidden = hidden_states(decoder_and_head(models.actor)[0], input_ids, attention_mask)
    head = models.value_head
    return shift_values(head(hidden.to(head.weight.dtype)).squeeze(-1))


@torch.no_grad()
def reference_logprobs(
    models: PolicyModels,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float,
    chunk: int,
    start: int = 1,
    scored: torch.Tensor | None = None,
) -> torch.Tensor:
    """Log-probs [B, T] of the tokens under the reference policy (frozen copy, or actor without adapters).

    Positions before ``start``, or with ``scored`` ([B, T] bool) those it leaves out, are not scored and hold 0
    (see ``forward.chunked_logprobs``).
    """
    if not models.use_reference:
        raise ValueError("no reference policy: algorithm.kl_coef is 0")
    if models.ref is not None:
        return policy_forward(models.ref, input_ids, attention_mask, temperature, chunk, entropy_grad=False,
                              start=start, scored=scored).logprobs
    # A reference without a frozen copy is LoRA's (build_policy_models), so the actor is a peft model here.
    with lora_model(models.actor).disable_adapter():  # LoRA: the base model is the reference
        return policy_forward(models.actor, input_ids, attention_mask, temperature, chunk, entropy_grad=False,
                              start=start, scored=scored).logprobs
