"""The settings every generator the project builds gets from the experiment: the training session's and
``ragen evaluate``'s engines are built alike (``make_generator(backend, model, tokenizer, **generator_kwargs(...))``).

vLLM on CUDA shares the GPU with the trainer, so its engine gets an explicit share of the card's memory: the
configured ``rollout.vllm_gpu_memory``, or one sized from the model and the card (:func:`vllm_memory_share`),
never vLLM's own default of 0.9, which leaves the trainer nothing and which vLLM refuses to start with beside
a loaded actor. The engine's dtype follows the trainer's precision on CUDA (bf16 runs FlashAttention; the fp32
master weights are cast when synced), and each rank's engine runs on the rank's own GPU. On a CPU it follows the
trainer's resolved precision where the CPU has bf16 dot-product instructions, and is fp32 elsewhere. The hf
backend samples in the trainer's resolved precision too (``trainer.precision`` bf16, or ``auto`` on a CPU with
bf16 matmuls: its prefills under autocast, its decode steps' matmuls in bf16).
"""

from __future__ import annotations

from typing import Any

import torch

from ragen_core import distributed
from ragen_core.config import ExperimentConfig
from ragen_core.trainer.engine import compute_precision, cpu_multiplies_bf16

GIB = 1024**3
ENGINE_OVERHEAD_BYTES = GIB
"""Activations, CUDA graphs and allocator slack of a small engine, on top of its weights and KV cache."""
MAX_SHARE = 0.9


def vllm_memory_share(config: Any, n_params: int, dtype_bytes: int, rows: int, context: int,
                      card_bytes: int) -> float:
    """The share of a card's memory a vLLM engine needs: weights + the KV cache of ``rows`` sequences of
    ``context`` tokens + :data:`ENGINE_OVERHEAD_BYTES`, over ``card_bytes``; at most 0.9 (``config``: the model's
    transformers config, for layers, KV heads and head size)."""
    layers = int(config.num_hidden_layers)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    kv_per_token = 2 * layers * kv_heads * head_dim * dtype_bytes
    need = n_params * dtype_bytes + kv_per_token * rows * context + ENGINE_OVERHEAD_BYTES
    return round(min(MAX_SHARE, need / card_bytes), 4)


def generator_kwargs(cfg: ExperimentConfig, model: torch.nn.Module, device: torch.device, max_length: int | None,
                     value_head: torch.nn.Module | None = None) -> dict[str, Any]:
    """The ``make_generator`` keyword arguments of ``cfg.rollout.backend`` for ``model`` on ``device``."""
    r = cfg.rollout
    if r.backend == "hf":  # sampling in the trainer's precision, as the update will score the samples
        bf16 = compute_precision(cfg) == "bf16"
        return {"cache_reuse": r.cache_reuse, "max_length": max_length, "fast_decode": r.fast_decode,
                "value_head": value_head, "compute_dtype": torch.bfloat16 if bf16 else None}
    if device.type != "cuda":
        if r.vllm_sleep:
            from ragen_core.config import ConfigError

            raise ConfigError("rollout.vllm_sleep: vLLM's sleep mode frees GPU memory; it needs CUDA")
        # the CPU engine computes in bf16 where the trainer does and the CPU multiplies bf16 natively (on the
        # FrozenLake rollout of bench/rollout.py, AVX512-BF16: 340 tok/s against 203 in fp32)
        bf16 = compute_precision(cfg) == "bf16" and cpu_multiplies_bf16()
        return {"lora": r.vllm_lora, **({"dtype": "bfloat16"} if bf16 else {})}
    share = r.vllm_gpu_memory
    if share is None:
        base: Any = getattr(model, "get_base_model", lambda: model)()
        n_params = sum(p.numel() for p in base.parameters())
        dtype_bytes = 2 if cfg.trainer.precision == "bf16" else 4
        context = int(max_length or getattr(base.config, "max_position_embeddings", None) or 4096)
        rows = cfg.trajectories_per_rollout
        card = torch.cuda.get_device_properties(device.index or 0).total_memory
        share = vllm_memory_share(base.config, n_params, dtype_bytes, rows, context, card)
    return {"gpu_memory_utilization": share, "device_ids": distributed.engine_devices(device),
            "dtype": "bfloat16" if cfg.trainer.precision == "bf16" else None, "sleep_mode": r.vllm_sleep,
            "lora": r.vllm_lora}
