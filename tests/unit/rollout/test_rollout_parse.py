"""Reply parsing (SPEC §3): golden cases, the nasty ones, and a property test over junk.

Run: .venv/bin/python -m pytest tests/unit/rollout/test_rollout_parse.py -q
"""

from __future__ import annotations

import random
import string

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ragen_core.envs import make
from ragen_core.rollout.parse import ParsedResponse, match_actions, parse_response


def test_basic_think_answer() -> None:
    p = parse_response("<think>go left</think><answer>Left || Up</answer>", think=True, max_actions=5)
    assert p == ParsedResponse(think="go left", actions=["Left", "Up"], ok=True, answer="Left || Up")


def test_whitespace_between_blocks_and_around_actions() -> None:
    p = parse_response("  <think>\n a \n</think>\n\n  <answer>  Up   ||Down||  </answer> trailing", think=True)
    assert (p.think, p.actions, p.ok) == ("a", ["Up", "Down"], True)  # trailing '||' is not a fault


@pytest.mark.parametrize(
    "text",
    [
        "<think>a</think><answer>Up",  # missing </answer>
        "<think>a<answer>Up</answer>",  # missing </think>
        "think>a</think><answer>Up</answer>",  # broken opening tag
        "<THINK>a</THINK><ANSWER>Up</ANSWER>",  # the pattern is case-sensitive (SPEC §3)
        "<answer>Up</answer>",  # think mode needs the think block
        "<think>a</think> then <answer>Up</answer>",  # only whitespace may separate the blocks
        "",
    ],
)
def test_missing_or_broken_tags_do_not_parse(text: str) -> None:
    p = parse_response(text, think=True)
    assert (p.ok, p.actions, p.think, p.error) == (False, [], "", "no match")


@pytest.mark.parametrize("answer", ["", "   ", "||", " || \n || "])
def test_empty_answer_is_a_fault(answer: str) -> None:
    p = parse_response(f"<think>t</think><answer>{answer}</answer>")
    assert (p.ok, p.actions, p.error) == (False, [], "empty answer")


def test_nested_think_is_a_fault_but_keeps_actions() -> None:
    # The lazy group first stops at the inner </think>, which is not followed by <answer>, so the
    # match extends to the outer one: think = "a<think>b</think>" holds a tag -> nested.
    p = parse_response("<think>a<think>b</think></think><answer>Up</answer>")
    assert (p.ok, p.error, p.think, p.actions) == (False, "nested tag", "a<think>b</think>", ["Up"])


def test_nested_answer_is_a_fault() -> None:
    # group 2 stops at the first </answer>: "<answer>Up"
    p = parse_response("<think>x</think><answer><answer>Up</answer></answer>")
    assert (p.ok, p.error, p.actions) == (False, "nested tag", ["<answer>Up"])


def test_repeated_blocks_first_match_wins() -> None:
    p = parse_response("<think>a</think><answer>Up</answer><think>b</think><answer>Down</answer>")
    assert (p.ok, p.think, p.actions) == (True, "a", ["Up"])


def test_more_than_max_actions_are_cut_without_fault() -> None:
    p = parse_response("<think>t</think><answer>A||B||C||D||E||F||G</answer>", max_actions=5)
    assert (p.ok, p.actions, p.n_cut) == (True, ["A", "B", "C", "D", "E"], 2)
    p1 = parse_response("<think>t</think><answer>A||B</answer>", max_actions=1)
    assert (p1.actions, p1.n_cut) == (["A"], 1)


def test_max_actions_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_actions"):
        parse_response("<answer>x</answer>", max_actions=0)


def test_unicode_is_kept_verbatim() -> None:
    p = parse_response("<think>déjà vu — √ 日本語 🙂</think><answer> Ｕｐ || Gauche </answer>")
    assert (p.ok, p.think, p.actions) == (True, "déjà vu — √ 日本語 🙂", ["Ｕｐ", "Gauche"])


def test_nothink_mode() -> None:
    p = parse_response("<answer>Up || Left</answer>", think=False)
    assert (p.ok, p.think, p.actions) == (True, "", ["Up", "Left"])
    # a think block is simply ignored in NoThink mode; the first <answer> counts
    q = parse_response("<think>x</think><answer>Down</answer>", think=False)
    assert (q.ok, q.think, q.actions) == (True, "", ["Down"])
    assert not parse_response("<think>x</think>", think=False).ok


def test_match_actions_case_insensitive_and_unknown() -> None:
    env = make("Sokoban")
    p = parse_response("<think>t</think><answer>uP || LEFT || jump || right </answer>")
    m = match_actions(p.actions, env.match_action)
    assert m.valid == ("Up", "Left", "Right")
    assert m.unknown == ("jump",)


def test_ten_kilobytes_of_junk() -> None:
    rng = random.Random(0)
    alphabet = string.printable + "√日本<>/|"
    junk = "".join(rng.choice(alphabet) for _ in range(10_240))
    assert not parse_response(junk).ok
    # adversarial: thousands of openings with no valid block; still returns (and quickly)
    for text in ("<think>" * 1400 + "</think></answer>", "<think></think>" * 700 + "<answer>",
                 "<answer>" * 1400 + "</answer></think>"):
        assert parse_response(text).error == "no match"
    # a valid block after the junk is still found
    p = parse_response(junk.replace("<", "(") + "<think>ok</think><answer>Down</answer>")
    assert (p.ok, p.actions) == (True, ["Down"])


_TOKENS = st.sampled_from(["<think>", "</think>", "<answer>", "</answer>", "||", " ", "\n", "Up", "déjà", "√", "x"])


@settings(max_examples=200, deadline=None)
@given(parts=st.lists(_TOKENS | st.text(max_size=5), max_size=40), think=st.booleans(), k=st.integers(1, 6))
def test_never_raises_and_invariants_hold(parts: list[str], think: bool, k: int) -> None:
    text = "".join(parts)
    p = parse_response(text, think=think, max_actions=k)
    assert len(p.actions) <= k
    assert all(a == a.strip() and a for a in p.actions)
    assert "||" not in "".join(p.actions)
    assert p.ok == (p.error == "")
    if p.ok:
        assert p.actions and not any(tag in p.think + p.answer for tag in ("<think>", "</answer>"))
    if not think:
        assert p.think == ""


@settings(max_examples=400, deadline=None)
@given(parts=st.lists(_TOKENS | st.text(st.sampled_from(" \t\n\u3000x<>/"), max_size=4), max_size=40),
       think=st.booleans())
def test_the_one_pass_match_is_the_regex_match(parts: list[str], think: bool) -> None:
    """The linear matcher finds what ``re.search`` of the documented pattern finds, groups and all."""
    import re

    from ragen_core.rollout import parse

    text = "".join(parts)
    pattern = r"<think>(.*?)</think>\s*<answer>(.*?)</answer>" if think else r"<answer>(.*?)</answer>"
    m = re.search(pattern, text, re.DOTALL)
    want = None if m is None else ((m.group(1), m.group(2)) if think else ("", m.group(1)))
    assert parse._first_match(text, think) == want


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("text", "think"), [
    ("<answer></answer>" + "<think></think>x" * 64_000, True),  # 1 MB; the regex took 1.5 s at 64 kB
    ("</answer>" + "<answer>x" * 110_000, False),
    ("<think>" + "</think> \n" * 100_000 + "<answer>Up</answer>", True),
    ("<think>" * 150_000 + "</think><answer>Up", True),
])
def test_a_megabyte_reply_cannot_hang_the_parser(text: str, think: bool) -> None:
    """Hostile replies of about 1 MB parse at once (a guard against a hang, not a timing: the quadratic
    regex needed minutes for these; one pass needs milliseconds)."""
    p = parse_response(text, think=think)
    assert p.error in {"", "no match", "empty answer", "nested tag"}
