"""The registry (make, list_envs, aliases, parameters) and the terminal player driven by a script.

Run: .venv/bin/python -m pytest tests/unit/envs/test_envs_play_registry.py -q
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
from collections.abc import Iterator

import pytest
from rich.console import Console

from ragen_core.envs import list_envs, make, register, registry
from ragen_core.envs.play import describe_envs, play

REGISTERED = ["Bandit", "BanditRev", "BanditTest", "Sokoban", "LargerSokoban", "SokobanNewVocab", "FrozenLake",
              "CoordSokoban", "CoordFrozenLake", "WebShop", "Countdown"]


# ---------------------------------------------------------------- registry
def test_registered_names() -> None:
    assert list_envs() == REGISTERED


def test_spec_defaults_and_overrides() -> None:
    larger = make("LargerSokoban")
    assert (larger.height, larger.width, larger.n_boxes, larger.max_steps) == (8, 8, 2, 10)
    small = make("Sokoban", max_steps=None, n_boxes=2)
    assert (small.height, small.n_boxes, small.max_steps) == (6, 2, None)
    lake = make("FrozenLake", size=6, p_frozen=0.9, slippery=False)
    assert (lake.size, lake.p_frozen, lake.slippery) == (6, 0.9, False)
    assert make("SokobanNewVocab").symbols == "W.GCBA@"
    assert make("Bandit").low_risk_reward == 0.15
    assert make("Bandit", low_risk_reward=0.1).low_risk_reward == 0.1  # the reference code's value


def test_aliases_and_case() -> None:
    assert make("SimpleSokoban").name == "Sokoban"
    assert make("LargeSokoban").name == "LargerSokoban"
    assert make("frozenlake").name == "FrozenLake"


def test_unknown_env_names_the_registered_ones() -> None:
    with pytest.raises(KeyError, match="Sokoban"):
        make("Tetris")


@pytest.mark.parametrize(("name", "params"), [
    ("Sokoban", {"symbols": "abc"}), ("Sokoban", {"symbols": "##_OXPS"}), ("Sokoban", {"height": 2}),
    ("FrozenLake", {"p_frozen": 0.0}), ("FrozenLake", {"size": 1}), ("Bandit", {"high_risk_prob": 1.5}),
    ("Countdown", {"min_numbers": 5, "max_numbers": 4}), ("Bandit", {"max_steps": 0}),
])
def test_bad_parameters_raise(name: str, params: dict) -> None:
    with pytest.raises(ValueError):
        env = make(name, **params)
        env.reset(seed=0)


def test_register_a_custom_variant() -> None:
    register("TinyLake", "ragen_core.envs.frozen_lake:FrozenLakeEnv", "3x3 lake", size=3)
    try:
        env = make("TinyLake")
        assert env.name == "TinyLake" and len(env.reset(seed=0)[0].splitlines()) == 3
    finally:
        del registry._REGISTRY["TinyLake"]
    with pytest.raises(ValueError):
        register("Bad", "no_colon_here", "x")


def test_import_is_light() -> None:
    code = ("import sys, json, ragen_core.envs; "
            "print(json.dumps([m for m in sys.modules if m == 'torch' or m.startswith('ragen_core.envs.')]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    # only the base and the registry are loaded; no env module, no torch
    assert sorted(json.loads(out.stdout)) == ["ragen_core.envs.base", "ragen_core.envs.registry"]


# ---------------------------------------------------------------- play
def _script(*lines: str):
    it: Iterator[str] = iter(lines)

    def input_fn(prompt: str) -> str:
        try:
            return next(it)
        except StopIteration:
            raise EOFError from None

    return input_fn


def _console() -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, width=200, color_system=None, force_terminal=False), buf


def test_describe_envs() -> None:
    rows = describe_envs()
    assert [n for n, _ in rows] == list_envs()
    assert all(d and "\n" not in d for _, d in rows)


def test_play_sokoban_shows_rewards_invalid_actions_and_quits() -> None:
    console, buf = _console()
    play("Sokoban", seed=3, console=console, input_fn=_script("bogus", "3", "q"))
    out = buf.getvalue()
    assert "Legend" in out and "box on target" in out
    assert "invalid action, nothing happened" in out
    assert "reward -0.10" in out  # "3" is the third listed action (Left): one step, -0.1
    assert "Quit after 2 steps, total reward -0.10." in out


def test_play_bandit_to_the_end() -> None:
    console, buf = _console()
    play("Bandit", seed=4, console=console, input_fn=_script("dragon"))
    out = buf.getvalue()
    assert "You pulled Dragon" in out and "success!" in out and "1 steps" in out


def test_play_countdown_with_the_solution() -> None:
    env = make("Countdown")
    env.reset(seed=8)
    console, buf = _console()
    play("Countdown", seed=8, console=console, input_fn=_script(env.solution))
    assert "success!" in buf.getvalue() and "reward +1.00" in buf.getvalue()


def test_play_webshop_prints_brackets_literally_and_stops_on_eof() -> None:
    console, buf = _console()
    play("WebShop", seed=0, console=console, input_fn=_script("search[black]", "1"))
    out = buf.getvalue()
    assert "search[<query>]" in out and "click[back to search]" in out and "click[next >]" in out
    assert "Bye." in out  # the script ran out: EOF ends the session quietly
