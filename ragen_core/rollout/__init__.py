"""Rollouts (SPEC §3, §5): prompt rendering, reply parsing, the multi-turn loop, token batches, evaluation.

    from ragen_core.rollout import run_rollouts, build_token_batch, rollout_metrics
    from ragen_core.rollout.evaluate import evaluate   # the module ``evaluate`` holds the function ``evaluate``
    from ragen_core.rollout.parse import parse_response
    from ragen_core.rollout.generators import make_generator

Modules: ``parse`` (replies → actions), ``prompts`` (the words), ``chat`` (the model's chat template,
stop tokens and spans: the only model-specific code), ``context`` (window and hard cap), ``loop``
(``run_rollouts``), ``batch`` (``build_token_batch``), ``evaluate``, ``metrics``, ``generators``
(hf / vllm backends), and generators without a model of their own: ``scripted`` (scripted replies, for
tests) and ``format_generators`` (replies in the required format, the format warm-up's data). Names are
imported lazily, so ``import ragen_core.rollout`` loads nothing heavy.
The function ``evaluate`` is not exported here: ``ragen_core.rollout.evaluate`` is its module (a
package attribute that Python rebinds to the submodule as soon as anything imports it).

Run the tests: ``.venv/bin/python -m pytest tests/unit/rollout -q``.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "parse_response": "parse",
    "ParsedResponse": "parse",
    "ChatRenderer": "chat",
    "run_rollouts": "loop",
    "context_limit": "loop",
    "build_token_batch": "batch",
    "EvalResult": "evaluate",
    "heldout_seeds": "evaluate",
    "rollout_metrics": "metrics",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        module = importlib.import_module(f"ragen_core.rollout.{_EXPORTS[name]}")
        return getattr(module, name)
    raise AttributeError(f"module 'ragen_core.rollout' has no attribute {name!r}")
