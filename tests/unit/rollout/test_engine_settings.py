"""Every generator gets its settings from the experiment (ragen_core/rollout/engine_settings.py): on CUDA a vLLM
engine gets an explicit memory share sized from the model and the card, the trainer's precision as its dtype,
the rank's own GPU; on the CPU none of that applies."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ragen_core.config import ConfigError
from ragen_core.rollout.engine_settings import ENGINE_OVERHEAD_BYTES, GIB, generator_kwargs, vllm_memory_share
from ragen_core.trainer import engine
from tests.unit.trainer.conftest import make_cfg

QWEN25_05B = SimpleNamespace(num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, head_dim=64,
                             hidden_size=896)


def test_the_memory_share_of_qwen2_5_0_5b_on_an_80_gib_card_golden() -> None:
    # bf16: weights 494,032,768 x 2 B; KV per token 2 (k, v) x 24 layers x 2 heads x 64 x 2 B = 12,288 B;
    # 128 rows x 4096 tokens of it = 6,442,450,944 B; + 1 GiB; over 80 GiB
    need = 494_032_768 * 2 + 12_288 * 128 * 4096 + GIB
    assert ENGINE_OVERHEAD_BYTES == GIB
    share = vllm_memory_share(QWEN25_05B, 494_032_768, 2, rows=128, context=4096, card_bytes=80 * GIB)
    assert share == pytest.approx(round(need / (80 * GIB), 4)) and 0.09 < share < 0.1
    assert vllm_memory_share(QWEN25_05B, 494_032_768, 4, rows=4096, context=32768, card_bytes=80 * GIB) == 0.9


def test_on_cuda_a_vllm_engine_gets_a_share_the_precision_and_the_ranks_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "1")
    cfg = make_cfg("starpo-s", "rollout.backend=vllm", "trainer.precision=bf16", "rollout.vllm_gpu_memory=0.25")
    kw = generator_kwargs(cfg, torch.nn.Linear(2, 2), torch.device("cuda"), 2048)
    assert kw == {"gpu_memory_utilization": 0.25, "device_ids": [1], "dtype": "bfloat16", "sleep_mode": False,
                  "lora": "adapter"}
    fp32 = make_cfg("starpo-s", "rollout.backend=vllm", "rollout.vllm_gpu_memory=0.25", "rollout.vllm_sleep=true")
    kw = generator_kwargs(fp32, torch.nn.Linear(2, 2), torch.device("cuda"), 2048)
    assert kw["dtype"] is None and kw["sleep_mode"] is True


def test_on_the_cpu_vllm_needs_no_share_and_cannot_sleep() -> None:
    cfg = make_cfg("starpo-s", "rollout.backend=vllm")
    assert generator_kwargs(cfg, torch.nn.Linear(2, 2), torch.device("cpu"), 2048) == {"lora": "adapter"}
    with pytest.raises(ConfigError, match="needs CUDA"):
        generator_kwargs(make_cfg("starpo-s", "rollout.backend=vllm", "rollout.vllm_sleep=true"),
                         torch.nn.Linear(2, 2), torch.device("cpu"), 2048)
    hf = generator_kwargs(make_cfg("starpo-s"), torch.nn.Linear(2, 2), torch.device("cpu"), 2048)
    assert set(hf) == {"cache_reuse", "max_length", "fast_decode", "value_head", "compute_dtype"}


def test_on_the_cpu_vllm_computes_in_bf16_where_the_trainer_does_and_the_cpu_multiplies_bf16(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from ragen_core.rollout import engine_settings
    from ragen_core.trainer import engine

    def kwargs(*overrides: str) -> dict:
        return generator_kwargs(make_cfg("starpo-s", "rollout.backend=vllm", *overrides), torch.nn.Linear(2, 2),
                                torch.device("cpu"), 2048)

    for module in (engine_settings, engine):  # auto resolves through trainer.engine's own lookup
        monkeypatch.setattr(module, "cpu_multiplies_bf16", lambda: True)
    assert kwargs("trainer.precision=bf16") == {"lora": "adapter", "dtype": "bfloat16"}
    assert kwargs("trainer.precision=auto") == {"lora": "adapter", "dtype": "bfloat16"}
    assert kwargs("trainer.precision=fp32") == {"lora": "adapter"}
    for module in (engine_settings, engine):
        monkeypatch.setattr(module, "cpu_multiplies_bf16", lambda: False)
    assert kwargs("trainer.precision=bf16") == {"lora": "adapter"}  # emulated bf16: vLLM stays in fp32
    assert kwargs("trainer.precision=auto") == {"lora": "adapter"}


def test_the_hf_generator_samples_in_the_trainers_resolved_precision(monkeypatch: pytest.MonkeyPatch) -> None:
    def dtype(*overrides: str) -> torch.dtype | None:
        return generator_kwargs(make_cfg("starpo-s", *overrides), torch.nn.Linear(2, 2), torch.device("cpu"),
                                2048)["compute_dtype"]

    assert dtype() is None and dtype("trainer.precision=fp32") is None
    assert dtype("trainer.precision=bf16") == torch.bfloat16
    monkeypatch.setattr(engine, "cpu_multiplies_bf16", lambda: True)
    assert dtype("trainer.precision=auto") == torch.bfloat16
    monkeypatch.setattr(engine, "cpu_multiplies_bf16", lambda: False)
    assert dtype("trainer.precision=auto") is None
