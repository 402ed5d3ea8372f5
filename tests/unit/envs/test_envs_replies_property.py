"""Generated model replies through parse -> match -> step, on every registered env.

Hypothesis builds replies from the pieces a model emits (think/answer tags in any order and nesting, the
env's own action names in any case, ``||``, whitespace, junk, long runs) and plays each through
``parse_response`` and ``env.step`` as the rollout loop does. For every call: no exception; an invalid action
leaves the state exactly as it was (``render()`` before == after) with reward 0; and no call takes more than
50 ms of CPU time (``time.thread_time``: a guard against quadratic or hanging paths, not a benchmark, blind to
other processes and to the worker's other threads; a call over the limit is timed once more and fails only
if it is over again, so one garbage collection or preemption does not fail it).

200 replies per env from Hypothesis in the default suite (it shrinks a failure to a short reply); 10,000 in the
slow one (``make test-slow``) from a seeded plain-Python draw of the same pieces, about 50x cheaper a reply than
Hypothesis's engine (whose bookkeeping was most of the test's 50 s an env on two cores).
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ragen_core.envs import TextEnv, list_envs, make
from ragen_core.rollout.parse import ParsedResponse, parse_response

CALL_CPU_S = 0.05
T = TypeVar("T")
ENVS = list_envs()


def _pieces(env: TextEnv) -> st.SearchStrategy[str]:
    names = [n for n in env.action_names if "<" not in n] or ["Up"]
    name = st.sampled_from(names)
    return st.one_of(
        st.sampled_from(["<think>", "</think>", "<answer>", "</answer>", "||", " ", "\n", " || "]),
        name,
        name.map(str.upper),
        name.map(str.lower),
        st.text(max_size=12),
        st.sampled_from(["search[blue shirt]", "click[Buy Now]", "(3 + 5) * 2", "Dragon", "Phoenix", "x" * 2000]),
    )


@st.composite
def replies(draw: st.DrawFn, env: TextEnv) -> str:
    return "".join(draw(st.lists(_pieces(env), max_size=30)))


_FIXED = ["<think>", "</think>", "<answer>", "</answer>", "||", " ", "\n", " || "]
_JUNK = ["search[blue shirt]", "click[Buy Now]", "(3 + 5) * 2", "Dragon", "Phoenix", "x" * 2000]


def _char(rng: random.Random) -> str:
    """A character as ``st.text`` draws them: mostly ASCII, sometimes any code point but a surrogate."""
    if rng.random() < 0.6:
        return chr(rng.randrange(32, 127))
    code = rng.randrange(0, sys.maxunicode + 1)
    return chr(code) if not 0xD800 <= code <= 0xDFFF else " "


def _drawn_reply(rng: random.Random, env: TextEnv) -> str:
    """:func:`replies` without Hypothesis: up to 30 of the same six kinds of piece, each kind equally likely."""
    names = [n for n in env.action_names if "<" not in n] or ["Up"]
    pieces = []
    for _ in range(rng.randrange(31)):
        kind = rng.randrange(6)
        name = rng.choice(names)
        pieces.append([rng.choice(_FIXED), name, name.upper(), name.lower(),
                       "".join(_char(rng) for _ in range(rng.randrange(13))), rng.choice(_JUNK)][kind])
    return "".join(pieces)


_built: dict[str, TextEnv] = {}


def _env(name: str) -> TextEnv:
    if name not in _built:  # built once per env (WebShop loads its catalogue)
        _built[name] = make(name)
    return _built[name]


def _timed(call: Callable[..., T], *args: Any) -> tuple[T, float]:
    """``call(*args)`` and the CPU seconds of this thread it took."""
    started = time.thread_time()
    out = call(*args)
    return out, time.thread_time() - started


def _play(env: TextEnv, text: str, think: bool, seed: int) -> None:
    def parse() -> ParsedResponse:
        return parse_response(text, think=think, max_actions=5)

    parsed, cpu = _timed(parse)
    if cpu >= CALL_CPU_S:  # once more: a slow path is slow again, a collection or preemption is not
        assert _timed(parse)[1] < CALL_CPU_S, f"parse took too long on a {len(text)}-char reply ({cpu:.3f} s)"
    env.reset(seed=seed)
    for i, action in enumerate(parsed.actions):
        before = env.render()
        (obs, reward, terminated, truncated, info), cpu = _timed(env.step, action)
        if cpu >= CALL_CPU_S:  # a step changes the state: the same state is played again to time it once more
            env.reset(seed=seed)
            for earlier in parsed.actions[:i]:
                env.step(earlier)
            (obs, reward, terminated, truncated, info), again = _timed(env.step, action)
            assert again < CALL_CPU_S, f"{env.name}: step({action[:40]!r}) took too long ({cpu:.3f} s)"
        assert obs == env.render()
        if info["invalid_action"]:
            assert obs == before and reward == 0.0, f"{env.name}: invalid {action[:40]!r} changed the state"
        if terminated or truncated:
            break


def _check(name: str, n: int) -> None:
    env = _env(name)

    @settings(max_examples=n, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(text=replies(env), think=st.booleans(), seed=st.integers(0, 50))
    def run(text: str, think: bool, seed: int) -> None:
        _play(env, text, think, seed)

    run()


@pytest.mark.parametrize("name", ENVS)
def test_generated_replies_parse_and_step_cleanly(name: str) -> None:
    _check(name, 200)


@pytest.mark.slow
@pytest.mark.parametrize("name", ENVS)
def test_ten_thousand_generated_replies_per_env(name: str) -> None:
    env, rng = _env(name), random.Random(f"replies-{name}")
    for _ in range(10_000):
        reply = _drawn_reply(rng, env)
        try:
            _play(env, reply, think=rng.random() < 0.5, seed=rng.randrange(51))
        except BaseException as err:
            raise AssertionError(f"{name}: the reply {reply[:200]!r} failed") from err
