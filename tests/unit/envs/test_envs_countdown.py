"""Countdown: generated problems are solvable, the SPEC §2 reward table on hand-computed answers,
and code/attack strings are rejected without anything being executed.

Run: .venv/bin/python -m pytest tests/unit/envs/test_envs_countdown.py -q
"""

from __future__ import annotations

import builtins
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ragen_core.envs import make
from ragen_core.envs.countdown import generate_problem, parse_expression, score_answer

NUMBERS, TARGET = (3, 4, 2, 1), 5


@settings(max_examples=200, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**32 - 1))
def test_generated_problems_have_a_solution(seed: int) -> None:
    p = generate_problem(np.random.default_rng(seed))
    assert 3 <= len(p.numbers) <= 4 and all(1 <= n <= 100 for n in p.numbers)
    assert 1 <= p.target <= 100
    value, literals = parse_expression(p.solution)
    assert value == p.target and sorted(literals) == sorted(Fraction(n) for n in p.numbers)
    assert score_answer(p.solution, p.numbers, p.target).reward == 1.0


@pytest.mark.parametrize(("answer", "reward", "why"), [
    ("3 + 4 - 2 * 1", 1.0, "3+4-2 = 5, all four numbers once"),
    ("3 * 4 / 2 - 1", 1.0, "12/2-1 = 5"),
    ("3 × 4 ÷ 2 − 1", 1.0, "unicode operators read as * / -"),
    ("3 + 4 - 2 * 1 = 5", 1.0, "trailing '= result' ignored"),
    ("3.0 + 4 - 2 * 1", 1.0, "3.0 equals the number 3"),
    ("(3 + 4) / (2 - 1)", 0.1, "7: exact numbers, wrong value"),
    ("(3 + 4) / (2 - 2 * 1)", 0.0, "2 twice: not exactly the numbers (and a division by zero)"),
    ("(3 + 4) / (2 * 1 - 2)", 0.0, "2 twice: not exactly the numbers"),
    ("(3 + 4 + 2) / (1 - 1)", 0.0, "1 twice"),
    ("3 + 2", 0.0, "right value, but 4 and 1 unused"),
    ("3 + 4 + 2 + 1 + 0", 0.0, "extra number 0"),
    ("-3 + 4 + 2 * 1 + 2", 0.0, "extra 2"),
    ("4 - 3 + 2 * 1 + 0 * 0", 0.0, "extra zeros"),
    ("1 / (4 - 2 - 2) + 3", 0.0, "2 twice"),
])
def test_reward_table(answer: str, reward: float, why: str) -> None:
    assert score_answer(answer, NUMBERS, TARGET).reward == reward, why


def test_division_by_zero_with_exact_numbers_is_wrong_not_an_error() -> None:
    s = score_answer("3 / (4 - 2 * 2) + 1", (3, 4, 2, 2, 1), 5)
    assert s.valid and s.value is None and s.uses_numbers and not s.correct and s.reward == 0.1


ATTACKS = [
    "__import__('os').system('echo pwned')",
    "open('/etc/passwd').read()",
    "exec('x=1')",
    "eval('1+1')",
    "(lambda: 5)()",
    "[x for x in range(10**9)]",
    "9**9**9",
    "2 ** 1000000",
    "10**10**10",
    "1" * 300,
    "(" * 150 + "1" + ")" * 150,
    "1+" * 200 + "1",
    "1e308 * 1e308",
    "0x1f",
    "1_000",
    "True + 4",
    "None",
    "'5'",
    "b'5'",
    "f'{5}'",
    "5; import os",
    "5\nimport os",
    "\x00",
    "١٢٣",  # Arabic-Indic digits
    "５",  # full-width digit
    "().__class__.__bases__[0].__subclasses__()",
    "globals()",
    "3 if 1 else 4",
    "x := 5",
    "{1: 2}",
    "1 // 1",
    "3 % 2",
    "~3",
    "not 3",
    "3 < 4",
    "3 @ 4",
    "3 << 40",
    "a+b",
    "1 + 2 = x",
    "",
    "   ",
    "=",
]


@pytest.mark.parametrize("attack", ATTACKS)
def test_attacks_score_zero_without_running(attack: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the checker must never execute code")

    monkeypatch.setattr(builtins, "eval", refuse)
    monkeypatch.setattr(builtins, "exec", refuse)
    s = score_answer(attack, NUMBERS, TARGET)
    assert s.reward == 0.0 and not s.correct and not s.valid and s.reason


def test_code_in_an_answer_has_no_side_effect(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    env = make("Countdown")
    env.reset(seed=0)
    _obs, reward, terminated, truncated, info = env.step(f"open({str(marker)!r}, 'w').write('x')")
    assert not marker.exists()
    assert reward == 0.0 and info["invalid_action"] and truncated and not terminated


def test_env_episode() -> None:
    env = make("Countdown")
    obs, info = env.reset(seed=4)
    assert obs == f"Numbers: {list(env.numbers)}\nTarget: {env.target}"
    assert info["numbers"] == list(env.numbers) and info["target"] == env.target
    obs, reward, terminated, truncated, info = env.step(env.solution)
    assert (reward, terminated, truncated, info["success"]) == (1.0, True, False, True)
    assert "(correct)" in obs and env.render() == obs


def test_retry_after_a_malformed_answer_when_budget_allows() -> None:
    env = make("Countdown", max_steps=3)
    env.reset(seed=4)
    _, reward, terminated, truncated, info = env.step("I think it's 42")
    assert (reward, terminated, truncated, info["invalid_action"]) == (0.0, False, False, True)
    _, reward, terminated, _, info = env.step(env.solution)
    assert reward == 1.0 and terminated and info["steps"] == 2


def test_wrong_answer_with_exact_numbers_gets_format_credit() -> None:
    env = make("Countdown")
    env.reset(seed=4)
    nums = env.numbers
    wrong = " + ".join(map(str, nums))
    if sum(nums) == env.target:
        wrong = " * ".join(map(str, nums))
    _, reward, terminated, _, info = env.step(wrong)
    assert reward == 0.1 and terminated and not info["success"] and info["uses_numbers"]
