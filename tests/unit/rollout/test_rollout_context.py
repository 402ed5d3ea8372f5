"""Context guard (context.py): which turns a window and a token cap keep, and the re-rendered head.

Run: .venv/bin/python -m pytest tests/unit/rollout/test_rollout_context.py -q
"""

from __future__ import annotations

from ragen_core.models import load_tokenizer
from ragen_core.rollout.chat import ChatRenderer
from ragen_core.rollout.context import choose_start, render_dialogue
from ragen_core.rollout.prompts import first_user_text

# Sequence length when starting at turn s, for a 5-turn dialogue (made-up, decreasing in s).
LENGTHS = {0: 100, 1: 80, 2: 60, 3: 40, 4: 20}


def test_choose_start_without_limits_keeps_everything() -> None:
    assert choose_start(5, LENGTHS.__getitem__, budget=None) == 0


def test_choose_start_window_keeps_last_k_turns() -> None:
    # window 2 of 5 turns: turns 3 and 4 stay -> start 3
    assert choose_start(5, LENGTHS.__getitem__, budget=None, window_turns=2) == 3
    assert choose_start(5, LENGTHS.__getitem__, budget=None, window_turns=9) == 0


def test_choose_start_cap_drops_oldest_first() -> None:
    assert choose_start(5, LENGTHS.__getitem__, budget=100) == 0  # fits exactly
    assert choose_start(5, LENGTHS.__getitem__, budget=65) == 2  # 100, 80 too long; 60 fits
    assert choose_start(5, LENGTHS.__getitem__, budget=65, min_start=3) == 3  # never go back
    assert choose_start(5, LENGTHS.__getitem__, budget=19) is None  # not even the last turn


def test_render_dialogue_drops_turns_and_rerenders_the_head() -> None:
    tok = load_tokenizer("tiny-random")
    renderer = ChatRenderer(tok, "sys")
    block = "RULES"
    texts = ["Turn 1:\nState:\nA", "Reward:\n0\n\nTurn 2:\nState:\nB", "Reward:\n1\n\nTurn 3:\nState:\nC"]
    replies = [list(renderer.encode("<answer>Up</answer>")) + [tok.eos_token_id] for _ in range(2)]
    prompts = [renderer.head_ids(first_user_text(block, texts[0]))]
    prompts += [renderer.transition_ids(replies[i], texts[i + 1]) for i in range(2)]
    lps = [[-1.0] * len(r) for r in replies]
    full = render_dialogue(renderer, prompts, replies, lps, block=block, user_texts=texts, budget=None)
    assert full is not None and full.start_turn == 0
    windowed = render_dialogue(renderer, prompts, replies, lps, block=block, user_texts=texts, budget=None,
                               window_turns=1)
    assert windowed is not None and windowed.start_turn == 2
    # the head of the kept turn: system + the instruction block in front of turn 3's own message
    assert windowed.input_ids == list(renderer.head_ids(first_user_text(block, texts[2])))
    text = tok.decode(windowed.input_ids)
    assert "RULES\n\nReward:\n1\n\nTurn 3:" in text and "State:\nA" not in text
    # a cap between the two lengths drops turn 0 only
    mid = render_dialogue(renderer, prompts, replies, lps, block=block, user_texts=texts, budget=len(full) - 1)
    assert mid is not None and mid.start_turn == 1 and len(mid) <= len(full) - 1
    # without the texts the kept turn's own prompt delta stands in for the head
    bare = render_dialogue(renderer, prompts, replies, lps, block=None, user_texts=None, budget=None, window_turns=1)
    assert bare is not None and bare.input_ids == list(prompts[2])
