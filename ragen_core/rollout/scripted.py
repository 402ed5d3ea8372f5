"""A Generator that replies with scripted text: for testing prompts and the loop without a model.

    gen = ScriptedGenerator(tokenizer, "<think>push</think><answer>Up</answer>")
    gen = ScriptedGenerator(tokenizer, lambda call, row, prompt: "...")   # per call / row / context

It follows the ``Generator`` protocol (generators/base.py): each reply is the tokenizer's ids of
the text, then the first stop token, with finish reason "stop"; a reply longer than
``max_new_tokens`` is cut there with finish reason "length" and no stop token. Log-probs are a
made-up deterministic function of (call, row, position), so tests can check they travel intact.
Every call is recorded in ``calls`` (prompts, params, session ids) and ended sessions in ``ended``.
Scripts are written as whole assistant messages: when the prompt already ends with the tag a
scripted text starts with (the ``<think>`` / ``<answer>`` prefill, SPEC §3), the reply is the text
after it, as a model continuing from the prefill would write it.

Run the tests that use it: ``.venv/bin/python -m pytest tests/unit/rollout -q``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ragen_core.rollout.chat import decode_text
from ragen_core.rollout.generators.base import (
    FINISH_LENGTH,
    FINISH_STOP,
    STAT_KEYS,
    Generation,
    SamplingParams,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["ScriptedCall", "ScriptedGenerator"]

Script = Callable[[int, int, Sequence[int]], str]


@dataclass(frozen=True)
class ScriptedCall:
    """What one ``generate`` call received."""

    prompts: tuple[tuple[int, ...], ...]
    params: SamplingParams
    session_ids: tuple[Hashable, ...] | None


_PREFILLS = ("<think>", "<answer>")


def _continuation(text: str, prompt_tail: str) -> str:
    """``text`` without the prefilled tag that ``prompt_tail`` (the decoded end of the prompt) ends with."""
    for tag in _PREFILLS:
        if prompt_tail.endswith(tag) and text.startswith(tag):
            return text[len(tag):]
    return text


@dataclass
class ScriptedGenerator:
    """Replies with ``script(call_index, row_index, prompt_ids)`` (or one fixed text)."""

    tokenizer: PreTrainedTokenizerBase
    script: Script | str
    calls: list[ScriptedCall] = field(default_factory=list)
    ended: list[Hashable] = field(default_factory=list)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 session_ids: Sequence[Hashable] | None = None) -> list[Generation]:
        call = len(self.calls)
        self.calls.append(ScriptedCall(tuple(tuple(p) for p in prompts), params,
                                       None if session_ids is None else tuple(session_ids)))
        return [self._reply(call, row, prompt, params) for row, prompt in enumerate(prompts)]

    def _reply(self, call: int, row: int, prompt: Sequence[int], params: SamplingParams) -> Generation:
        text = self.script if isinstance(self.script, str) else self.script(call, row, prompt)
        text = _continuation(text, decode_text(self.tokenizer, prompt[-8:]))
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        ids += list(params.stop_token_ids[:1])
        finish = FINISH_STOP if params.stop_token_ids else FINISH_LENGTH
        if len(ids) > params.max_new_tokens:
            ids, finish = ids[: params.max_new_tokens], FINISH_LENGTH
        logprobs = tuple(-((call * 7 + row * 3 + k) % 11 + 1) / 8.0 for k in range(len(ids)))
        return Generation(token_ids=tuple(ids), logprobs=logprobs, finish_reason=finish)

    def end_sessions(self, session_ids: Iterable[Hashable]) -> None:
        self.ended.extend(session_ids)

    def update_weights(self, model: Any) -> None:
        return None

    @property
    def stats(self) -> dict[str, float]:
        return dict.fromkeys(STAT_KEYS, 0.0)
