"""Hostile input: 10,000 random strings plus known attacks sent to every registered env.

Random strings mix printable ASCII, brackets and FTS5/Python syntax characters, control and
format characters (NUL, zero-width, RTL override, BOM), non-Latin scripts, emoji, combining
marks and lone surrogates, some 10 kB long; they are sent raw, wrapped as ``search[...]`` /
``click[...]``, glued to valid action names, and as arithmetic-looking text. Known attacks:
code in Countdown answers, FTS5 syntax in queries, 10 kB junk, Unicode oddities. Every call
must return a well-formed step (no exception, reward within the declared range, info keys,
render() == observation).

Run: .venv/bin/python -m pytest tests/unit/envs/test_envs_hostile.py -q
"""

from __future__ import annotations

import random
import string

import numpy as np
import pytest

from ragen_core.envs import TextEnv, list_envs, make

N_RANDOM = 10_000
ALPHABET = (
    string.printable
    + '[]{}()<>"\'\\*^:|;~`@#$%&'
    + "\x00\x07\x1b\u200b\u200d\u202e\ufeff\u2028"
    + "éßçøñ中文日本語한국어العربيةעבריתрусский"
    + "🙂🔥👍🏽🧪"
    + "\u0301\u0327\u20dd"
    + "\ud800\udfff"
    + "×÷−√›"
)
KNOWN_ATTACKS = [
    "", " ", "\n", "\t\t", "\x00", "\ud800", "\u202eUp", "U\u200bp", "Ｕｐ", "UP!", "Up;Down", "Up||Down",
    "__import__('os').system('echo pwned')", "open('/etc/passwd').read()", "exec('import os')",
    "eval('1+1')", "9**9**9", "2**1000000", "(lambda: 1)()", "().__class__.__mro__",
    '"red shoes', "shoes AND socks", "NEAR(a b, 3)", "sho*", "^x", "title:x", "(((", ")))", "'; DROP TABLE docs; --",
    "search[" + '"' * 50 + "]", "search[NEAR(x y) AND z* OR \"q\"]", "search[" + "AND " * 300 + "]",
    "click[" + "x" * 10_000 + "]", "search[" + "é" * 10_000 + "]", "x" * 10_240, "[" * 5000 + "]" * 5000,
    "search[search[search[]]]", "click[click[buy now]]", "click[buy now", "click buy now", "CLICK [ BUY NOW ]",
    "<answer>Up</answer>", "<think>hmm</think>", "{{7*7}}", "${jndi:ldap://x}", "%s%s%s%n", "\\x00\\u0000",
    "1" * 5000, "(" * 300 + "1" + ")" * 300, "-" * 1000 + "1", "1e999", "nan", "inf", "0/0",
]


def _random_strings(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = 10_000 if i % 997 == 0 else rng.randint(0, 40)
        out.append("".join(rng.choice(ALPHABET) for _ in range(length)))
    return out


RANDOM = _random_strings(2024, N_RANDOM)


def _variants(env: TextEnv, k: int, s: str, rng: random.Random) -> str:
    """Raw string, bracketed forms, glued to a valid action name, or arithmetic-looking text."""
    kind = k % 6
    if kind == 1:
        return f"search[{s}]"
    if kind == 2:
        return f"click[{s}]"
    if kind == 3:
        name = rng.choice(env.action_names)
        return name + s if k % 2 else s + name
    if kind == 4:
        return "".join(rng.choice("0123456789+-*/(). ") for _ in range(len(s) % 30)) + s[:3]
    if kind == 5:
        name = rng.choice(env.action_names)
        return rng.choice([name.upper(), f"  {name.lower()}\n", name.swapcase()])
    return s


def _check(env: TextEnv, result: tuple) -> bool:
    obs, reward, terminated, truncated, info = result
    lo, hi = env.reward_range
    assert isinstance(obs, str) and obs == env.render()
    assert isinstance(reward, float) and lo - 1e-9 <= reward <= hi + 1e-9
    assert isinstance(terminated, bool) and isinstance(truncated, bool)
    assert {"success", "action_is_effective", "invalid_action", "steps"} <= set(info)
    if info["invalid_action"]:
        assert reward == 0.0
    return terminated or truncated


@pytest.mark.parametrize("name", list_envs())
def test_random_strings_never_crash(name: str) -> None:
    env = make(name)
    rng = random.Random(name)
    env.reset(seed=0)
    for k, s in enumerate(RANDOM):
        if _check(env, env.step(_variants(env, k, s, rng))):
            env.reset(seed=k)


@pytest.mark.parametrize("name", list_envs())
def test_known_attacks_never_crash(name: str) -> None:
    env = make(name, max_steps=None)
    for seed, attack in enumerate(KNOWN_ATTACKS):
        env.reset(seed=seed)
        _check(env, env.step(attack))
        # and once more one valid action later (a results page, a moved player), unless that ended it
        env.reset(seed=seed)
        if not _check(env, env.step(env.sample_action(np.random.default_rng(seed)))):
            _check(env, env.step(attack))
