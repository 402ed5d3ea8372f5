"""Everything model-specific about a dialogue, in one place (STYLE rule 13): chat template, stop tokens, spans.

The dialogue of an episode is built in TOKEN space, incrementally, so training sees exactly the ids
the model saw and sampled (SPEC §3; the reference re-serialised text instead):

    renderer = ChatRenderer(tokenizer, system_prompt)
    head = renderer.head_ids(first_user)          # system + first user message + generation prompt (+ prefill)
    # ... the model samples reply ids r0 (ending with the stop token when it stopped) ...
    delta = renderer.transition_ids(r0, user1)    # closes reply 0, adds user message 1 + generation prompt
    context = head + r0 + delta                   # prompt of turn 1; r0 is never re-tokenised

Nothing here knows a model family. What the template puts around an assistant message is derived
once from the tokenizer's own ``chat_template`` by rendering probe conversations with a sentinel
reply: the text after the sentinel, up to the next generation prompt, is the *transition*. Its
leading special token (``<|im_end|>`` for ChatML, ``<|eot_id|>`` for Llama 3, ...) is the
end-of-turn token: it becomes a stop token for sampling, and when a reply already ends with it
(it was sampled, so it is trained on), the transition continues after it; when a reply was cut at
``max_new_tokens`` the transition keeps it, so the assistant message is still closed properly.
Whatever the template writes after the end-of-turn token (ChatML's ``\\n``) belongs to the next
prompt, never to the loss mask.

``prefill`` (``<think>``, or ``<answer>`` in NoThink; ``rollout.prefill``) is appended after every
generation prompt, as the reference does: the model continues from inside the format. It is part of
the prompt's ids (context, not a trained token); :meth:`ChatRenderer.reply_text` puts it back in front
of the sampled text for parsing and reading.

A system message is always passed (templates such as SmolLM2's and Qwen's inject a default system
prompt otherwise); templates that reject the system role get it prepended to the first user text.
Limitation: a template that rewrites EARLIER assistant messages (Qwen3 drops their <think> part) is
rendered here as it was sampled, never rewritten; the sequence stays exactly what the model saw.

:func:`assemble` lays out a context or training row as spans and records which spans the model
generated: the loss mask is derived from those spans, never from token values.

Run its tests: ``.venv/bin/python -m pytest tests/unit/rollout/test_rollout_chat.py -q`` (tiny model) and
``-m slow tests/integration/test_masks_default_model.py`` (SmolLM2's template).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from jinja2.exceptions import TemplateError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["ChatRenderer", "RenderedSequence", "Span", "assemble", "decode_text"]

_SENTINEL = "RAGENSENTINELREPLY"
_PROBE_USER = "RAGENPROBEUSER"


def decode_text(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
    """``tokenizer.decode`` of one id sequence, typed as the str it is (transformers types the batched list too)."""
    text = tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
    if not isinstance(text, str):
        raise TypeError(f"decode of one sequence returned {type(text).__name__}, not str")
    return text


class ChatRenderer:
    """Renders a multi-turn dialogue into token ids with ``tokenizer``'s own chat template.

    Immutable after construction; construct once per (tokenizer, system prompt).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, system_prompt: str, prefill: str = "") -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "the tokenizer has no chat_template; use an instruct/chat model or set tokenizer.chat_template"
            )
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt
        self.prefill = prefill
        """Text after every generation prompt that the reply continues from (``<think>``; SPEC §3): context, never
        trained."""
        self._system_role = self._supports_system_role()
        tail = self._tail("x")
        self.end_of_turn_id, self.end_of_turn_text = self._end_of_turn(tail)
        stops = [self.end_of_turn_id] if self.end_of_turn_id is not None else []
        eos = getattr(tokenizer, "eos_token_id", None)
        stops += [int(eos)] if isinstance(eos, int) else []
        self.stop_token_ids: tuple[int, ...] = tuple(dict.fromkeys(stops))
        """Ids that end a reply: the template's end-of-turn token and the tokenizer's eos."""

    # ------------------------------------------------------------------ rendering
    def head_ids(self, first_user_text: str) -> tuple[int, ...]:
        """System message + first user message + generation prompt (+ prefill), as ids (the start of every context)."""
        return self.encode(self.render([self._user(first_user_text, first=True)], add_generation_prompt=True)
                           + self.prefill)

    def transition_ids(self, prev_response_ids: Sequence[int], user_text: str) -> tuple[int, ...]:
        """Ids that follow a sampled reply: close it, add the user message ``user_text``, open the next reply.

        The template's end-of-turn text is left out when the reply's last sampled id is the
        end-of-turn token (it is already in the sequence, as a generated token).
        """
        tail = self._tail(user_text)
        ended = bool(prev_response_ids) and self.end_of_turn_id is not None
        if ended and int(prev_response_ids[-1]) == self.end_of_turn_id:
            tail = tail[len(self.end_of_turn_text):]
        return self.encode(tail + self.prefill)

    def messages(self, first_user_text: str, replies: Sequence[str], user_texts: Sequence[str]) -> list[dict[str, str]]:
        """The chat messages equivalent to a rendered dialogue (for reading and for template checks)."""
        out = self._system() + [self._user(first_user_text, first=True)]
        # user_texts has one text per reply, or one fewer (none yet after the last reply): the None pads that case
        for reply, user in zip(replies, list(user_texts) + [None], strict=False):
            out.append({"role": "assistant", "content": reply})
            if user is not None:
                out.append({"role": "user", "content": user})
        return out

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        """The template's text for ``messages`` (the system message is added here)."""
        full = messages if messages and messages[0]["role"] == "system" else self._system() + messages
        text = self.tokenizer.apply_chat_template(full, tokenize=False, add_generation_prompt=add_generation_prompt)
        if not isinstance(text, str):
            raise TypeError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}, not str")
        return text

    def encode(self, text: str) -> tuple[int, ...]:
        """Ids of template text; the template already wrote any BOS, so none is added here."""
        return tuple(int(i) for i in self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode_reply(self, response_ids: Sequence[int]) -> str:
        """The sampled ids as text (special tokens such as the stop token removed), without the prefill."""
        return decode_text(self.tokenizer, response_ids, skip_special_tokens=True)

    def reply_text(self, response_ids: Sequence[int]) -> str:
        """The assistant message as it reads: the prefill the reply continued from, then the sampled text.

        This is what is parsed (the reference adds the prefilled tag back the same way).
        """
        return self.prefill + self.decode_reply(response_ids)

    def count_tokens(self, text: str) -> int:
        return len(self.encode(text)) if text else 0

    # ------------------------------------------------------------------ probing the template
    def _system(self) -> list[dict[str, str]]:
        return [{"role": "system", "content": self.system_prompt}] if self._system_role else []

    def _user(self, text: str, first: bool = False) -> dict[str, str]:
        if first and not self._system_role and self.system_prompt:
            text = f"{self.system_prompt}\n\n{text}"
        return {"role": "user", "content": text}

    def _supports_system_role(self) -> bool:
        probe = [{"role": "system", "content": "s"}, {"role": "user", "content": _PROBE_USER}]
        try:
            self.tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
        except TemplateError:  # e.g. Gemma's template: raise_exception("System role not supported")
            return False
        return True

    def _tail(self, user_text: str) -> str:
        """Template text after an assistant reply's content, through the next generation prompt."""
        probe = [self._user(_PROBE_USER, first=True), {"role": "assistant", "content": _SENTINEL},
                 {"role": "user", "content": user_text}]
        text = self.render(probe, add_generation_prompt=True)
        at = text.find(_SENTINEL)
        if at < 0:
            raise ValueError("the chat template drops assistant messages from the history; "
                             "it cannot render multi-turn episodes")
        return text[at + len(_SENTINEL):]

    def _end_of_turn(self, tail: str) -> tuple[int | None, str]:
        """The special token the template closes an assistant message with, if it starts with one."""
        ids = self.encode(tail)
        special = {int(i) for i in getattr(self.tokenizer, "all_special_ids", [])}
        if not ids or ids[0] not in special:
            return None, ""
        text = decode_text(self.tokenizer, [ids[0]], skip_special_tokens=False)
        return (ids[0], text) if tail.startswith(text) else (None, "")


# ---------------------------------------------------------------------- spans


@dataclass(frozen=True)
class Span:
    """A run of ids in a rendered sequence: prompt/env text, or one sampled reply."""

    ids: tuple[int, ...]
    generated: bool
    """True for a reply's sampled ids (trained on); False for template, prompt and env text."""
    turn: int
    """Index of the turn (in ``Trajectory.turns``) the span belongs to."""
    logprobs: tuple[float, ...] = ()
    """Sampling log-probs of ``ids`` (generated spans only)."""


@dataclass(frozen=True)
class RenderedSequence:
    """A context or training row as spans; masks are derived from the spans, never from token values."""

    spans: tuple[Span, ...]
    start_turn: int
    """First turn in the sequence; the turns before it were dropped by the context guard."""

    @property
    def input_ids(self) -> list[int]:
        return [i for s in self.spans for i in s.ids]

    @property
    def loss_mask(self) -> list[bool]:
        return [s.generated for s in self.spans for _ in s.ids]

    @property
    def old_logprobs(self) -> list[float]:
        return [lp for s in self.spans for lp in (s.logprobs if s.generated else (0.0,) * len(s.ids))]

    @property
    def turn_ids(self) -> list[int]:
        return [s.turn for s in self.spans for _ in s.ids]

    @property
    def turn_ends(self) -> list[bool]:
        """True on the last id of each non-empty generated span (a turn's last generated token)."""
        out: list[bool] = []
        for s in self.spans:
            out += [s.generated and k == len(s.ids) - 1 for k in range(len(s.ids))]
        return out

    def __len__(self) -> int:
        return sum(len(s.ids) for s in self.spans)


def assemble(
    head_ids: Sequence[int],
    prompt_ids: Sequence[Sequence[int]],
    response_ids: Sequence[Sequence[int]],
    logprobs: Sequence[Sequence[float]],
    start: int = 0,
) -> RenderedSequence:
    """Lay out turns ``start..`` after ``head_ids`` (which replaces ``prompt_ids[start]``).

    ``prompt_ids[i]`` is turn i's prompt delta (turn 0's is the head of an undropped dialogue);
    ``response_ids[i]`` its sampled reply. With as many responses as prompts the result is a
    training row; with one response fewer it is the context for generating the last turn's reply.
    """
    n = len(prompt_ids)
    if len(response_ids) not in (n, n - 1) or len(logprobs) != len(response_ids):
        raise ValueError(f"{n} prompts need {n} or {n - 1} responses with logprobs, "
                         f"got {len(response_ids)}/{len(logprobs)}")
    if not 0 <= start < n:
        raise ValueError(f"start turn {start} is outside 0..{n - 1}")
    spans = [Span(tuple(head_ids), False, start)]
    for i in range(start, n):
        if i > start:
            spans.append(Span(tuple(prompt_ids[i]), False, i))
        if i < len(response_ids):
            if len(logprobs[i]) != len(response_ids[i]):
                raise ValueError(f"turn {i}: {len(response_ids[i])} ids but {len(logprobs[i])} logprobs")
            spans.append(Span(tuple(response_ids[i]), True, i, tuple(float(x) for x in logprobs[i])))
    return RenderedSequence(spans=tuple(spans), start_turn=start)

