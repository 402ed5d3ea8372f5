"""CoordSokoban and CoordFrozenLake (RAGEN-2's default envs): the reference's observation, coordinates then the
grid, over exactly the original games. Conformance, determinism and state keys run for them with every
registered env (test_envs_conformance.py, test_state_keys.py)."""

from __future__ import annotations

import io

from rich.console import Console

from ragen_core.envs import make
from ragen_core.envs.play import play

LEVEL = ["######",
         "#_P__#",
         "#_X__#",
         "#_O√_#",
         "######"]


def test_coord_sokoban_observation_golden() -> None:
    env = make("CoordSokoban", height=5, width=6)
    obs, _ = env.reset(seed=0, options={"level": LEVEL})
    assert obs == ("Coordinates: \n"
                   "Board size: 5 rows x 6 cols (zero-indexed).\n"
                   "Walls: (0, 0), (0, 1), (0, 2), (0, 3), (0, 4), (0, 5), (1, 0), (1, 5), (2, 0), (2, 5), (3, 0), "
                   "(3, 5), (4, 0), (4, 1), (4, 2), (4, 3), (4, 4), (4, 5)\n"
                   "Targets: (3, 2), (3, 3)\n"     # every target, covered or not, as the reference lists them
                   "Boxes: (2, 2)\n"
                   "Boxes on target: (3, 3)\n"
                   "Player: (1, 2)\n"
                   "Grid Map: \n" + "\n".join(LEVEL))
    obs, reward, terminated, _, _ = env.step("Down")  # pushes the box onto the free target: solved
    assert terminated and reward == -0.1 + 1.0 + 10.0
    assert "Boxes on target: (3, 2), (3, 3)\nPlayer: (2, 2)\n" in obs and "\nBoxes: " not in obs
    assert "(0, 0) to the bottom-right corner (4, 5)" in env.instruction


def test_coord_sokoban_player_on_a_target() -> None:
    env = make("CoordSokoban")
    obs, _ = env.reset(seed=0, options={"level": ["#####", "#S__#", "#_X_#", "#_√_#", "#####"]})
    assert "Targets: (1, 1), (3, 2)\nBoxes: (2, 2)\nBoxes on target: (3, 2)\nPlayer on target: (1, 1)\n" in obs
    assert "\nPlayer: " not in obs


def test_coord_frozen_lake_observation_golden() -> None:
    env = make("CoordFrozenLake", slippery=False)
    obs, _ = env.reset(seed=0, options={"map": ["SFFH", "FHFF", "FFFG"]})
    assert obs == ("Coordinates: \n"
                   "Board size: 3 rows x 4 cols (zero-indexed).\n"
                   "Start: (0, 0)\nGoal: (2, 3)\nPlayer: (0, 0)\nHoles: (0, 3), (1, 1)\n"
                   "Grid Map: \n"
                   "P__O\n_O__\n___G")
    obs, *_ = env.step("Down")
    obs, _, terminated, _, _ = env.step("Right")  # into the hole at (1, 1)
    assert terminated and "Player in hole: (1, 1)\n" in obs and "\nPlayer: " not in obs
    env.reset(seed=0, options={"map": ["SG"]})
    obs, reward, terminated, _, info = env.step("Right")
    assert (reward, terminated, info["success"]) == (1.0, True, True) and "Player on goal: (0, 1)\n" in obs


def test_the_same_games_as_the_originals() -> None:
    # the same seed gives the same level or map, and the same actions the same rewards and ends (slips included)
    for name, coord in (("Sokoban", "CoordSokoban"), ("FrozenLake", "CoordFrozenLake")):
        plain, env = make(name), make(coord)
        for seed in range(5):
            a_obs, _ = plain.reset(seed=seed)
            b_obs, _ = env.reset(seed=seed)
            assert b_obs.endswith("Grid Map: \n" + a_obs) and b_obs.startswith("Coordinates: \n")
            for action in ("Up", "Left", "Down", "Right", "Down", "Left"):
                a, b = plain.step(action), env.step(action)
                assert a[1:4] == b[1:4] and b[0].endswith("Grid Map: \n" + a[0])
                if a[2] or a[3]:  # terminated or truncated
                    break
        assert env.state_key.startswith(f'["{coord}",') and env.state_key.split(",", 1)[1] == \
            plain.state_key.split(",", 1)[1]


def test_ragen_play_coord_frozen_lake() -> None:
    buf = io.StringIO()
    lines = iter(["Down", "q"])
    play("CoordFrozenLake", seed=3, console=Console(file=buf, width=120, force_terminal=False),
         input_fn=lambda prompt: next(lines))
    out = buf.getvalue()
    assert "CoordFrozenLake  seed 3" in out and "Board size: 4 rows x 4 cols (zero-indexed)." in out
    assert "Grid Map:" in out and "zero-indexed coordinates" in out
