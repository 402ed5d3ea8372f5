"""Resolve a model spec to a local directory, and load its model and tokenizer.

    path = resolve_model("smollm2-135m-instruct")     # provisioned once, then returned at once
    model, tok = load_model(spec), load_tokenizer(spec)

The kinds of spec are in spec.py; the default model is provisioned by gguf.py, tiny-random by
tiny.py (and loaded in-process, with nothing written), both through the model cache (cache.py).

Run its tests: ``.venv/bin/python -m pytest tests/unit/test_models.py -q``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch  # needed for the default of load_model's dtype; transformers stays lazy

from ragen_core import vector_math
from ragen_core.models.gguf import fetch_default_model
from ragen_core.models.spec import check_user_dir, hf_snapshot, parse_spec
from ragen_core.models.tiny import ensure_tiny, tiny_random, tiny_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["load_model", "load_tokenizer", "resolve_model"]


def resolve_model(spec: str) -> Path:
    """A local directory holding config, safetensors weights and tokenizer for ``spec``.

    Provisions it when needed: the default model is fetched and converted once; tiny-random
    is built and saved under ``models/tiny-random-<seed>``; a local directory is checked and
    returned; a Hugging Face id is looked up in the local Hugging Face cache.
    Raises ModelError with a message saying what to do when that is impossible.
    """
    parsed = parse_spec(spec)
    if parsed.kind == "default":
        return fetch_default_model()
    if parsed.kind == "tiny":
        return ensure_tiny(parsed.seed, parsed.arch)
    if parsed.kind == "dir":
        return check_user_dir(Path(parsed.value))
    return hf_snapshot(parsed.value)


def load_tokenizer(spec: str) -> PreTrainedTokenizerBase:
    """The tokenizer of ``spec`` (tiny-random is built in-process, nothing is written)."""
    parsed = parse_spec(spec)
    if parsed.kind == "tiny":
        return tiny_tokenizer()
    # Imported here, as everywhere in this package: transformers takes seconds to import.
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model(spec))


def load_model(spec: str, dtype: torch.dtype = torch.float32, device: str = "cpu") -> PreTrainedModel:
    """The causal LM of ``spec`` in eval mode, on ``device``, in ``dtype`` (float32 by default).

    tiny-random is built in-process; every other spec is resolved (and provisioned) to a
    local directory and loaded from its safetensors.
    """
    # lazily: transformers takes seconds to import and only model code paths need it
    from transformers import AutoModelForCausalLM

    if torch.device(device).type == "cpu" and not torch.cuda.is_available():
        # DeepSpeed (installed for trainer.backend: deepspeed) is imported by accelerate on every
        # save_pretrained, and then warns that it is "unable to detect" a GPU and falls back to the
        # CPU. With no CUDA and the model on the CPU, name the CPU for it (what it would pick).
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    vector_math.resolve()  # before the model's first op: its first large one could run at low accuracy
    parsed = parse_spec(spec)
    if parsed.kind == "tiny":
        model, _ = tiny_random(parsed.seed, parsed.arch)
        return model.to(device=device, dtype=dtype)  # type: ignore[call-arg]  # transformers' wrapped .to (below)
    model = AutoModelForCausalLM.from_pretrained(resolve_model(spec), dtype=dtype)
    # transformers wraps PreTrainedModel.to in @wraps(nn.Module.to), and typeshed's functools._Wrapped is no
    # descriptor, so mypy sees an unbound function wanting ``self`` first: the annotation is wrong, not the call.
    return model.to(device).eval()  # type: ignore[arg-type]  # transformers' wrapped .to
