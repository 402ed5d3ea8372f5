"""Parse a model reply into thoughts and actions (SPEC §3 "Parsing").

    from ragen_core.rollout.parse import parse_response
    p = parse_response("<think>go left</think><answer>Left || Up</answer>", think=True, max_actions=5)
    p.think, p.actions, p.ok        # 'go left', ['Left', 'Up'], True

Rules, in order:

1. Take the FIRST match of ``<think>(.*?)</think>\\s*<answer>(.*?)</answer>`` (DOTALL); in
   NoThink mode (``think=False``) the first ``<answer>(.*?)</answer>``. No match: ``ok`` is False.
2. Split the answer on ``||``, strip each piece, drop empty pieces (a trailing ``||`` is not a
   fault, as in the reference), keep the first ``max_actions`` (the rest are counted in
   ``n_cut``; cutting is not a fault, SPEC §3).
3. ``ok`` is False on any format fault: no match, an empty answer, or a tag inside the captured
   think/answer text (nested tags such as ``<think><think>..</think></think>`` or
   ``<answer><answer>Up</answer></answer>``: the reply did not follow the format even though
   the lazy pattern found a match). With nested tags the actions are still reported; the loop
   runs the ones the env recognises and penalises the turn. A repeated think/answer block
   after the first is ignored (first match wins), which is not a fault.

The parser does not know an env's action names: whether an action exists is decided by the
rollout loop with ``env.match_action`` (case-insensitive), see :func:`match_actions`.

Run its tests: ``.venv/bin/python -m pytest tests/unit/rollout/test_rollout_parse.py -q``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["ACTION_SEP", "ActionMatch", "ParsedResponse", "match_actions", "parse_response"]

ACTION_SEP = "||"
"""Separator between actions inside <answer> (SPEC §3)."""

_THINK_ANSWER = re.compile(r"<think>(.*?)</think>\s*<answer>(.*?)</answer>", re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_TAGS = ("<think>", "</think>", "<answer>", "</answer>")
_WHITESPACE = re.compile(r"\s+")
"""What ``\\s*`` in :data:`_THINK_ANSWER` skips (the same Unicode whitespace)."""


@dataclass(frozen=True)
class ParsedResponse:
    """What a reply says, and whether it followed the required format."""

    think: str
    """Stripped text inside <think>..</think> ('' in NoThink mode or when nothing matched)."""
    actions: list[str]
    """Stripped, non-empty action strings, at most ``max_actions`` (not yet matched to names)."""
    ok: bool
    """False on any format fault (module docstring, rule 3)."""
    answer: str = ""
    """Stripped raw text inside <answer>..</answer>."""
    n_cut: int = 0
    """Actions dropped because the reply gave more than ``max_actions``."""
    error: str = ""
    """Why ``ok`` is False ('' when ok): 'no match', 'empty answer' or 'nested tag'."""


def parse_response(text: str, think: bool = True, max_actions: int = 5) -> ParsedResponse:
    """Parse ``text`` per SPEC §3; never raises on any string (see the module docstring).

    Linear in ``len(text)`` whatever the reply holds (:func:`_first_match`).
    """
    if max_actions < 1:
        raise ValueError(f"max_actions must be >= 1, got {max_actions}")
    match = _first_match(text, think)
    if match is None:
        return ParsedResponse(think="", actions=[], ok=False, error="no match")
    think_text, answer = match[0].strip(), match[1].strip()
    pieces = [a.strip() for a in answer.split(ACTION_SEP)]
    pieces = [a for a in pieces if a]
    actions, n_cut = pieces[:max_actions], max(0, len(pieces) - max_actions)
    error = ""
    if any(tag in think_text or tag in answer for tag in _TAGS):
        error = "nested tag"
    elif not actions:
        error = "empty answer"
    return ParsedResponse(
        think=think_text, actions=actions, ok=not error, answer=answer, n_cut=n_cut, error=error
    )


def _first_match(text: str, think: bool) -> tuple[str, str] | None:
    """(think, answer) of the first match of :data:`_THINK_ANSWER` (or :data:`_ANSWER` with ``think=False``),
    exactly as ``re.search`` finds it, in one left-to-right pass.

    ``re.search`` is quadratic here: it retries the lazy pattern from every ``<think>``, and a 64 kB reply of
    ``<think></think>x`` blocks took 1.5 s (340 kB did not finish in 5 s). The same match, found directly:
    the leftmost ``<think>`` can always start the match if any start can (every later start sees a subset of
    its candidates), and its lazy group ends at the first ``</think>`` followed by whitespace and ``<answer>``;
    the answer ends at the first ``</answer>`` after that, and if there is none, no later candidate has one either.
    """
    if not think:
        start = text.find("<answer>")
        end = text.find("</answer>", start + len("<answer>")) if start >= 0 else -1
        return None if end < 0 else ("", text[start + len("<answer>"):end])
    opened = text.find("<think>")
    if opened < 0:
        return None
    body = opened + len("<think>")
    close = text.find("</think>", body)
    while close >= 0:
        after = close + len("</think>")
        gap = _WHITESPACE.match(text, after)
        at = gap.end() if gap else after
        if text.startswith("<answer>", at):
            answer = at + len("<answer>")
            end = text.find("</answer>", answer)
            return None if end < 0 else (text[body:close], text[answer:end])
        close = text.find("</think>", at)  # the whitespace run holds no '</think>'; every char is read once
    return None


@dataclass(frozen=True)
class ActionMatch:
    """The outcome of matching a reply's action strings to an env's actions."""

    valid: tuple[str, ...]
    """Canonical names of the recognised actions, in the reply's order."""
    unknown: tuple[str, ...]
    """Action strings the env did not recognise (they are skipped and the turn is penalised)."""


def match_actions(actions: Sequence[str], match: Callable[[str], str | None]) -> ActionMatch:
    """Match each action string with ``match`` (e.g. ``env.match_action``, case-insensitive)."""
    valid: list[str] = []
    unknown: list[str] = []
    for text in actions:
        name = match(text)
        (unknown if name is None else valid).append(text if name is None else name)
    return ActionMatch(valid=tuple(valid), unknown=tuple(unknown))
