"""A trained LoRA adapter on a model, for the rollout tests (imported by name: the test folder is on sys.path)."""

from __future__ import annotations

import torch


def with_trained_lora(model: torch.nn.Module, targets: list[str]) -> torch.nn.Module:
    """``model`` under a rank-4 peft LoRA on ``targets``, its B matrices drawn at random: a trained adapter (B is
    zero at init, which would hide a missing merge of the adapters into fused weights)."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    return model
