"""FrozenLake with a new random map per seed and slippery ice (SPEC §2; RAGEN paper §4).

Map (layout generator): each cell is frozen with probability ``p_frozen`` (0.8), else a hole;
start and goal are two distinct random frozen cells, and the map is redrawn until the goal is
reachable from the start over frozen cells. Moves (dynamics generator): on slippery ice the
intended direction happens with probability 1/3 and each perpendicular direction with 1/3,
never the opposite one (gymnasium's ``is_slippery`` rule); a move off the board leaves the
player in place. Reward +1 on reaching the goal; the episode terminates in a hole or at the
goal. ``info["executed_action"]`` names the direction actually taken.

Symbols (SPEC §2): ``P`` player, ``_`` frozen, ``O`` hole, ``G`` goal, ``X`` player in a
hole, ``√`` player on the goal. Actions Left/Down/Right/Up (gymnasium's order).
``reset(options={"map": ["SFFF", "FHFH", ...]})`` loads a gymnasium-style map (S start,
F frozen, H hole, G goal), used by tests.

    from ragen_core.envs import make
    env = make("FrozenLake", size=4, p_frozen=0.8, slippery=True)
    obs, info = env.reset(seed=123); env.step("Left")
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Annotated, Any

import numpy as np
from pydantic import Field

from ragen_core.envs.base import StepOutcome, TextEnv, checked_params

__all__ = ["DEFAULT_SYMBOLS", "MAX_SIZE", "CoordFrozenLakeEnv", "FrozenLakeEnv", "generate_map"]

Pos = tuple[int, int]
# Index order matters: (a - 1) % 4 and (a + 1) % 4 are the perpendicular moves of a.
ACTIONS: tuple[str, ...] = ("Left", "Down", "Right", "Up")
_DELTAS: tuple[Pos, ...] = ((0, -1), (1, 0), (0, 1), (-1, 0))
_MEANINGS = ("player", "frozen", "hole", "goal", "player in hole", "player on goal")
DEFAULT_SYMBOLS = "P_OGX√"
MAX_SIZE = 32
"""Largest side of a map: each try of the map generator is O(size²) and a prompt shows the whole map."""


def _reachable(frozen: np.ndarray, start: Pos, goal: Pos) -> bool:
    n_rows, n_cols = frozen.shape
    seen, queue = {start}, deque([start])
    while queue:
        r, c = queue.popleft()
        if (r, c) == goal:
            return True
        for dr, dc in _DELTAS:
            q = (r + dr, c + dc)
            if 0 <= q[0] < n_rows and 0 <= q[1] < n_cols and frozen[q] and q not in seen:
                seen.add(q)
                queue.append(q)
    return False


def generate_map(rng: np.random.Generator, size: int = 4, p_frozen: float = 0.8,
                 max_tries: int = 10_000) -> list[str]:
    """A gymnasium-style map (rows of S/F/H/G) with a reachable goal."""
    for _ in range(max_tries):
        frozen = rng.random((size, size)) < p_frozen
        cells = [(int(r), int(c)) for r, c in zip(*np.nonzero(frozen), strict=True)]  # row-major, deterministic
        if len(cells) < 2:
            continue
        i, j = rng.choice(len(cells), size=2, replace=False)
        start, goal = cells[int(i)], cells[int(j)]
        if _reachable(frozen, start, goal):
            rows = [["F" if frozen[r, c] else "H" for c in range(size)] for r in range(size)]
            rows[start[0]][start[1]], rows[goal[0]][goal[1]] = "S", "G"
            return ["".join(row) for row in rows]
    raise RuntimeError(f"no {size}x{size} map with p_frozen={p_frozen} after {max_tries} tries")


class FrozenLakeEnv(TextEnv):
    """Walk to the goal over slippery ice (SPEC §2 table, row FrozenLake)."""

    name = "FrozenLake"

    @checked_params
    def __init__(
        self,
        *,
        size: Annotated[int, Field(ge=2, le=MAX_SIZE)] = 4,
        p_frozen: Annotated[float, Field(gt=0.0, le=1.0)] = 0.8,
        slippery: bool = True,
        symbols: str | Sequence[str] = DEFAULT_SYMBOLS,
        max_steps: Annotated[int, Field(ge=1)] | None = 10,
    ) -> None:
        super().__init__(max_steps=max_steps)
        symbols = "".join(symbols)
        if len(symbols) != 6 or len(set(symbols)) != 6:
            raise ValueError(f"symbols must be 6 distinct characters ({', '.join(_MEANINGS)}), got {symbols!r}")
        self.size, self.p_frozen, self.slippery = size, float(p_frozen), bool(slippery)
        self.symbols = symbols
        self.reward_range = (0.0, 1.0)
        self._map: list[str] = []
        self._pos: Pos = (0, 0)

    @property
    def legend(self) -> dict[str, str]:
        return dict(zip(self.symbols, _MEANINGS, strict=True))

    @property
    def lake_map(self) -> list[str]:
        """The current map in gymnasium letters (S start, F frozen, H hole, G goal)."""
        return list(self._map)

    @property
    def position(self) -> Pos:
        return self._pos

    def _reset(self, rng: np.random.Generator, options: dict[str, Any]) -> dict[str, Any]:
        if "map" in options:
            rows = [str(r) for r in options["map"]]
            if len({len(r) for r in rows}) != 1 or sum(r.count("S") for r in rows) != 1 \
                    or sum(r.count("G") for r in rows) != 1 or set("".join(rows)) - set("SFHG"):
                raise ValueError("a map is equal-length rows of S/F/H/G with one S and one G")
        else:
            rows = generate_map(rng, self.size, self.p_frozen)
        self._map = rows
        self._pos = next((r, row.index("S")) for r, row in enumerate(rows) if "S" in row)
        return {}

    def _apply(self, action: str) -> StepOutcome:
        a = ACTIONS.index(action)
        if self.slippery:
            # SPEC §2: intended with prob 1/3, each perpendicular 1/3, never backwards.
            a = (a - 1 + int(self.np_random.integers(3))) % 4
        dr, dc = _DELTAS[a]
        r, c = self._pos[0] + dr, self._pos[1] + dc
        n_rows, n_cols = len(self._map), len(self._map[0])
        new = (r, c) if 0 <= r < n_rows and 0 <= c < n_cols else self._pos
        moved = new != self._pos
        self._pos = new
        tile = self._map[new[0]][new[1]]
        at_goal = tile == "G"
        return StepOutcome(
            reward=1.0 if at_goal else 0.0, terminated=tile in "GH", effective=moved, success=at_goal,
            info={"executed_action": ACTIONS[a], "slipped": ACTIONS[a] != action, "in_hole": tile == "H"},
        )

    def _action_names(self) -> tuple[str, ...]:
        return ACTIONS

    def _state(self) -> Any:
        return {"map": list(self._map), "player": list(self._pos)}

    def _instruction(self) -> str:
        return (
            "You are crossing a frozen lake. Walk to the goal without falling into a hole. "
            "The ice is slippery: you may move in a direction perpendicular to the one you chose."
        )

    def render(self) -> str:
        if not self._map:
            return ""
        player, frozen, hole, goal, player_hole, player_goal = tuple(self.symbols)
        plain = {"S": frozen, "F": frozen, "H": hole, "G": goal}
        on = {"S": player, "F": player, "H": player_hole, "G": player_goal}
        return "\n".join(
            "".join(on[ch] if (r, c) == self._pos else plain[ch] for c, ch in enumerate(row))
            for r, row in enumerate(self._map)
        )


class CoordFrozenLakeEnv(FrozenLakeEnv):
    """FrozenLake observed as RAGEN-2's CoordFrozenLake: the zero-indexed coordinates of the start, the goal, the
    player and the holes, then the symbol grid. Maps, slips and rewards are FrozenLake's."""

    def render(self) -> str:
        grid = super().render()
        if not self._map:
            return grid

        def cells(letter: str) -> list[Pos]:
            return [(r, c) for r, row in enumerate(self._map) for c, ch in enumerate(row) if ch == letter]

        tile = self._map[self._pos[0]][self._pos[1]]
        player = {"G": "Player on goal", "H": "Player in hole"}.get(tile, "Player")
        entities = (("Start", cells("S")), ("Goal", cells("G")), (player, [self._pos]), ("Holes", cells("H")))
        lines = [f"Board size: {len(self._map)} rows x {len(self._map[0])} cols (zero-indexed)."]
        lines += [f"{label}: {', '.join(f'({r}, {c})' for r, c in found)}" for label, found in entities if found]
        return "Coordinates: \n" + "\n".join(lines) + "\nGrid Map: \n" + grid

    def _instruction(self) -> str:
        n = len(self._map) if self._map else self.size
        return (
            "You are crossing a frozen lake. Walk to the goal without falling into a hole. You are given a symbol "
            "grid and the zero-indexed coordinates (row, column) of the start, the goal, the player and the holes, "
            f"from the top-left corner (0, 0) to the bottom-right corner ({n - 1}, {n - 1}). The ice is slippery: "
            "you may move in a direction perpendicular to the one you chose."
        )
