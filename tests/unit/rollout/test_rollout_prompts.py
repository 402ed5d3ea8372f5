"""The words of the dialogue (prompts.py), golden texts.

Run: .venv/bin/python -m pytest tests/unit/rollout/test_rollout_prompts.py -q
"""

from __future__ import annotations

import pytest

from ragen_core.rollout.prompts import first_user_text, fmt_reward, instruction_block, turn_text


def test_instruction_block_golden() -> None:
    block = instruction_block("Push boxes.", {"#": "wall", "P": "player"}, ["Up", "Down"], 3)
    assert block == (
        "Push boxes.\n"
        "Symbols: # wall, P player\n"
        "Available actions: Up, Down\n"
        'You can make up to 3 actions, separated by "||".'
    )
    # free-form envs list their actions per turn instead; no legend -> no Symbols line
    assert instruction_block("Shop.", {}, ["search[...]"], 1, free_form=True) == (
        'Shop.\nYou can make up to 1 actions, separated by "||".'
    )


def test_turn_text_first_and_later_turns() -> None:
    first = turn_text(0, "#P#\n", 10, think=True, max_new_tokens=128)
    assert first == (
        "Turn 1:\nState:\n#P#\n"
        "You have 10 actions left. Always output: <think> [your thoughts] </think> <answer> [your answer] </answer> "
        "with no extra text. Strictly follow this format. Max response length: 128 tokens."
    )
    later = turn_text(2, "#_P#", 4, think=False, max_new_tokens=64, prev_reward=0.9, prev_penalty=-0.1)
    assert later.startswith("Reward:\n0.9\nFormat penalty")
    assert "\n-0.1\n\nTurn 3:\nState:\n#_P#\nYou have 4 actions left." in later
    assert "<answer> [your answer] </answer>" in later and "<think>" not in later


@pytest.mark.parametrize(("value", "text"), [(0.1, "0.1"), (-0.1, "-0.1"), (10.0, "10"), (-0.0, "0"),
                                             (-1.5000000000000002, "-1.5"), (0.15, "0.15")])
def test_fmt_reward(value: float, text: str) -> None:
    assert fmt_reward(value) == text


def test_first_user_text() -> None:
    assert first_user_text("RULES", "Turn 1:") == "RULES\n\nTurn 1:"
