"""Context guard (SPEC §3 "Context control"): an optional window of the last k turns and a hard token cap.

Both the rollout loop (the prompt of each turn) and the batch builder (the training row) lay out a
dialogue through :func:`render_dialogue`, so the training row is exactly the last context the
model saw plus its last reply. When turns must go, the OLDEST go first; the system message and the
instruction block always stay: the first kept turn's user message is re-rendered with the
instruction block in front of it (``prompts.first_user_text``), as if it were the first turn.

Guard rule, for a dialogue of n turns (the last one being generated or just generated):
the start turn s is the smallest s >= max(min_start, n - window_turns) whose sequence fits in
``budget`` tokens; None when even the last turn alone does not fit (the caller ends the episode,
or the batch builder cuts the row from the left: never a crash).

Caveat (documented, inherent to windows): a kept turn's reply was sampled under the context of
ITS turn, which may have held older turns that the final row drops; its ``old_logprobs`` are
then the rollout's, under that longer context. With no window and no overflow every context is a
prefix of the next and the row is exact.

Run its tests: ``.venv/bin/python -m pytest tests/unit/rollout/test_rollout_context.py -q``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ragen_core.rollout.chat import ChatRenderer, RenderedSequence, assemble
from ragen_core.rollout.prompts import first_user_text

__all__ = ["HeadCache", "choose_start", "render_dialogue"]

HeadCache = dict[int, tuple[int, ...]]
"""Rendered head ids by start turn (heads of a given episode never change)."""


def choose_start(
    n_turns: int,
    length_of: Callable[[int], int],
    budget: int | None,
    window_turns: int | None = None,
    min_start: int = 0,
) -> int | None:
    """The first turn to keep (module docstring rule), or None when nothing fits."""
    lo = max(min_start, n_turns - window_turns if window_turns else 0, 0)
    for start in range(lo, n_turns):
        if budget is None or length_of(start) <= budget:
            return start
    return None


def render_dialogue(
    renderer: ChatRenderer,
    prompt_ids: Sequence[Sequence[int]],
    response_ids: Sequence[Sequence[int]],
    logprobs: Sequence[Sequence[float]],
    *,
    block: str | None,
    user_texts: Sequence[str] | None,
    budget: int | None,
    window_turns: int | None = None,
    min_start: int = 0,
    heads: HeadCache | None = None,
) -> RenderedSequence | None:
    """A dialogue's context (one response fewer than prompts) or training row, guarded.

    ``block`` and ``user_texts`` (the instruction block and each turn's user message) are needed
    only to re-render the head when turns are dropped; without them the first kept turn's own
    prompt delta stands in for the head (trajectories whose meta lacks them, e.g. hand-made in tests).
    ``heads`` caches rendered heads across calls for one episode.
    """
    cache: HeadCache = heads if heads is not None else {}

    def head(start: int) -> tuple[int, ...]:
        if start == 0 or block is None or user_texts is None:
            return tuple(prompt_ids[start])
        if start not in cache:
            cache[start] = renderer.head_ids(first_user_text(block, user_texts[start]))
        return cache[start]

    def length(start: int) -> int:
        body = sum(len(p) for p in prompt_ids[start + 1:]) + sum(len(r) for r in response_ids[start:])
        return len(head(start)) + body

    start = choose_start(len(prompt_ids), length, budget, window_turns, min_start)
    if start is None:
        return None
    return assemble(head(start), prompt_ids, response_ids, logprobs, start)
