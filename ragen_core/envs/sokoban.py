"""Sokoban with levels made by reverse play, so every level is solvable (SPEC §2; RAGEN paper §4).

Level generation (seeded by the layout generator):
1. carve a room: a random walk inside the border walls marks floor cells;
2. put ``n_boxes`` boxes on random target cells: a *solved* state;
3. play backwards, exhaustively: a breadth-first search over reverse moves (the player steps
   to a free cell and may *pull* the box it walks away from) from every solved state. Each
   reverse move undoes one legal forward move (a pull undoes a push), so every state found is
   solvable, and its BFS depth is the length of its shortest solution;
4. pick a difficulty uniformly among the solution lengths in ``[min_moves, max_moves]`` that
   the room offers (default 2..10, so a level fits SPEC's 10-action budget), then a state of
   that difficulty. ``reset`` reports it as ``info["min_moves"]``.

Forward rules are exact: moving into a box pushes it one cell if the cell beyond is floor
without a box; no pulling, no pushing two boxes, no pushing into a wall. Rewards per action
(reference gym-sokoban values, SPEC §2): −0.1, +1 when a box lands on a target, −1 when a box
leaves one, +10 when all boxes are on targets (the episode then terminates, success).

Symbols (SPEC §2): ``#`` wall, ``_`` empty, ``O`` target, ``√`` box on target, ``X`` box,
``P`` player, ``S`` player on target; SokobanNewVocab uses ``W . G C B A @`` and its legend
shows those. ``reset(options={"level": text})`` loads a hand-made level written in the
env's symbols (used by tests).

    from ragen_core.envs import make
    env = make("Sokoban"); print(env.reset(seed=3)[0]); env.step("Up")
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ragen_core.envs.base import StepOutcome, TextEnv

__all__ = ["DEFAULT_SYMBOLS", "NEW_VOCAB_SYMBOLS", "SokobanEnv", "SokobanLevel", "generate_level", "parse_level"]

Pos = tuple[int, int]

ACTIONS: dict[str, Pos] = {"Up": (-1, 0), "Down": (1, 0), "Left": (0, -1), "Right": (0, 1)}
_DIRS: tuple[Pos, ...] = tuple(ACTIONS.values())
_MEANINGS = ("wall", "empty", "target", "box on target", "box", "player", "player on target")
DEFAULT_SYMBOLS = "#_O√XPS"
NEW_VOCAB_SYMBOLS = "W.GCBA@"


@dataclass(frozen=True)
class SokobanLevel:
    """A Sokoban state: every cell not in ``floor`` is a wall."""

    height: int
    width: int
    floor: frozenset[Pos]
    targets: frozenset[Pos]
    boxes: frozenset[Pos]
    player: Pos
    min_moves: int | None = None
    """Length of the shortest solution when known (generated levels)."""


def _add(p: Pos, d: Pos) -> Pos:
    return (p[0] + d[0], p[1] + d[1])


def _sub(p: Pos, d: Pos) -> Pos:
    return (p[0] - d[0], p[1] - d[1])


def _carve_room(rng: np.random.Generator, height: int, width: int, n_steps: int) -> frozenset[Pos]:
    """Random-walk floor carving inside the border (the idea of gym-sokoban's topology step)."""
    lo_r, hi_r, lo_c, hi_c = 1, height - 2, 1, width - 2
    pos = (int(rng.integers(lo_r, hi_r + 1)), int(rng.integers(lo_c, hi_c + 1)))
    d = _DIRS[int(rng.integers(4))]
    floor = {pos}
    for _ in range(n_steps):
        if rng.random() < 0.35:
            d = _DIRS[int(rng.integers(4))]
        nxt = _add(pos, d)
        pos = (min(max(nxt[0], lo_r), hi_r), min(max(nxt[1], lo_c), hi_c))
        floor.add(pos)
        if rng.random() < 0.3:  # widen the corridor now and then, so rooms are not all 1-wide
            side = _add(pos, _DIRS[int(rng.integers(4))])
            if lo_r <= side[0] <= hi_r and lo_c <= side[1] <= hi_c:
                floor.add(side)
    return frozenset(floor)


def _reverse_bfs(floor: frozenset[Pos], targets: frozenset[Pos], max_depth: int) -> dict[tuple[Pos, frozenset[Pos]], int]:
    """Exhaustive reverse play: every state within ``max_depth`` reverse moves of a solved state.

    Sources are the solved box placement with the player on any free floor cell. A reverse move
    is the player stepping to a free neighbour, optionally pulling the box it walks away from;
    each one undoes exactly one legal forward move (a pull undoes a push), so the BFS depth of a
    state is the length of its shortest forward solution.
    """
    start = [(p, targets) for p in sorted(floor - targets)]
    depth: dict[tuple[Pos, frozenset[Pos]], int] = dict.fromkeys(start, 0)
    frontier = start
    for k in range(1, max_depth + 1):
        nxt_frontier = []
        for player, boxes in frontier:
            for d in _DIRS:
                nxt = _add(player, d)
                if nxt not in floor or nxt in boxes:
                    continue
                behind = _sub(player, d)
                moves = [(nxt, boxes)]
                if behind in boxes:
                    moves.append((nxt, (boxes - {behind}) | {player}))
                for state in moves:
                    if state not in depth:
                        depth[state] = k
                        nxt_frontier.append(state)
        frontier = nxt_frontier
    return depth


def generate_level(
    rng: np.random.Generator, height: int = 6, width: int = 6, n_boxes: int = 1,
    min_moves: int = 2, max_moves: int = 10, max_tries: int = 1000,
) -> SokobanLevel:
    """A level whose shortest solution takes ``min_moves``..``max_moves`` actions (module docstring)."""
    inner = (height - 2) * (width - 2)
    if inner < n_boxes + 2:
        raise ValueError(f"a {height}x{width} room cannot hold {n_boxes} boxes")
    if not 1 <= min_moves <= max_moves:
        raise ValueError(f"need 1 <= min_moves <= max_moves, got {min_moves}, {max_moves}")
    for _ in range(max_tries):
        floor = _carve_room(rng, height, width, n_steps=int(1.5 * inner))
        if len(floor) < n_boxes + 3:
            continue
        cells = sorted(floor)  # sorted: iteration order must not depend on set hashing
        pick = rng.permutation(len(cells))[:n_boxes]
        targets = frozenset(cells[i] for i in pick)
        depth = _reverse_bfs(floor, targets, max_moves)
        # BFS order is deterministic (sorted sources, fixed direction order), so is this list.
        by_depth: dict[int, list[tuple[Pos, frozenset[Pos]]]] = {}
        for state, k in depth.items():
            if k >= min_moves:
                by_depth.setdefault(k, []).append(state)
        if by_depth:
            # Difficulty first (uniform over the solution lengths this room offers), then a
            # state of that difficulty: otherwise short levels would dominate small rooms.
            k = sorted(by_depth)[int(rng.integers(len(by_depth)))]
            player, boxes = by_depth[k][int(rng.integers(len(by_depth[k])))]
            return SokobanLevel(height, width, floor, targets, boxes, player, min_moves=k)
    raise RuntimeError(f"no {height}x{width} level with {n_boxes} boxes after {max_tries} tries")


def parse_level(text: str | Sequence[str], symbols: str = DEFAULT_SYMBOLS) -> SokobanLevel:
    """Read a level drawn with ``symbols`` (wall, empty, target, box on target, box, player, player on target)."""
    rows = text.strip("\n").split("\n") if isinstance(text, str) else list(text)
    wall, _empty, target, box_t, box, player, player_t = symbols
    floor, targets, boxes, players = set(), set(), set(), []
    for r, row in enumerate(rows):
        for c, ch in enumerate(row):
            if ch == wall:
                continue
            if ch not in symbols:
                raise ValueError(f"unknown symbol {ch!r} at row {r}, column {c}")
            floor.add((r, c))
            if ch in (target, box_t, player_t):
                targets.add((r, c))
            if ch in (box, box_t):
                boxes.add((r, c))
            if ch in (player, player_t):
                players.append((r, c))
    if len(players) != 1 or len(boxes) != len(targets) or not boxes:
        raise ValueError("a level needs exactly one player and as many boxes (>= 1) as targets")
    height, width = len(rows), max(len(row) for row in rows)
    return SokobanLevel(height, width, frozenset(floor), frozenset(targets), frozenset(boxes), players[0])


class SokobanEnv(TextEnv):
    """Push every box onto a target (SPEC §2 table, row Sokoban)."""

    name = "Sokoban"

    def __init__(
        self,
        *,
        height: int = 6,
        width: int = 6,
        n_boxes: int = 1,
        min_moves: int = 2,
        max_moves: int = 10,
        symbols: str | Sequence[str] = DEFAULT_SYMBOLS,
        max_steps: int | None = 10,
        step_reward: float = -0.1,
        box_on_reward: float = 1.0,
        box_off_reward: float = -1.0,
        solved_reward: float = 10.0,
    ) -> None:
        super().__init__(max_steps=max_steps)
        symbols = "".join(symbols)
        if len(symbols) != 7 or len(set(symbols)) != 7:
            raise ValueError(f"symbols must be 7 distinct characters ({', '.join(_MEANINGS)}), got {symbols!r}")
        if height < 3 or width < 3 or n_boxes < 1:
            raise ValueError("need height, width >= 3 and n_boxes >= 1")
        self.height, self.width, self.n_boxes = height, width, n_boxes
        self.min_moves, self.max_moves = min_moves, max_moves
        self.symbols = symbols
        self.step_reward, self.box_on_reward = float(step_reward), float(box_on_reward)
        self.box_off_reward, self.solved_reward = float(box_off_reward), float(solved_reward)
        # One action moves at most one box, so one step sees at most one on/off event.
        self.reward_range = (
            self.step_reward + min(0.0, self.box_off_reward, self.box_on_reward),
            self.step_reward + max(0.0, self.box_on_reward) + max(0.0, self.solved_reward),
        )
        self._level: SokobanLevel | None = None
        self._boxes: frozenset[Pos] = frozenset()
        self._player: Pos = (0, 0)

    @property
    def legend(self) -> dict[str, str]:
        return dict(zip(self.symbols, _MEANINGS))

    @property
    def level(self) -> SokobanLevel:
        """The current state as a level record (boxes and player where they are now; min_moves unset)."""
        if self._level is None:
            raise RuntimeError("call reset() first")
        return SokobanLevel(self._level.height, self._level.width, self._level.floor,
                            self._level.targets, self._boxes, self._player)

    def _reset(self, rng: np.random.Generator, options: dict[str, Any]) -> dict[str, Any]:
        if "level" in options:
            level = parse_level(options["level"], self.symbols)
        else:
            level = generate_level(rng, self.height, self.width, self.n_boxes, self.min_moves, self.max_moves)
        self._level, self._boxes, self._player = level, level.boxes, level.player
        return {"boxes_on_target": len(level.boxes & level.targets), "n_boxes": len(level.boxes),
                "min_moves": level.min_moves}

    def _apply(self, action: str) -> StepOutcome:
        assert self._level is not None
        floor, targets = self._level.floor, self._level.targets
        d = ACTIONS[action]
        nxt = _add(self._player, d)
        boxes = self._boxes
        moved = False
        if nxt in floor and nxt not in boxes:
            self._player, moved = nxt, True
        elif nxt in boxes:
            beyond = _add(nxt, d)
            if beyond in floor and beyond not in boxes:  # exactly one box, into free floor
                boxes = (boxes - {nxt}) | {beyond}
                self._player, moved = nxt, True
        before = len(self._boxes & targets)
        self._boxes = boxes
        after = len(boxes & targets)
        solved = after == len(boxes)
        reward = self.step_reward
        if after > before:
            reward += self.box_on_reward
        elif after < before:
            reward += self.box_off_reward
        if solved:
            reward += self.solved_reward
        return StepOutcome(
            reward=reward, terminated=solved, effective=moved, success=solved,
            info={"boxes_on_target": after, "n_boxes": len(boxes)},
        )

    def _action_names(self) -> tuple[str, ...]:
        return tuple(ACTIONS)

    def _instruction(self) -> str:
        return (
            "You are solving a Sokoban puzzle. You are the player and must push every box onto a "
            "target. Moving into a box pushes it one cell in the same direction if that cell is free. "
            "You cannot pull a box, push two boxes at once, or push a box into a wall."
        )

    def render(self) -> str:
        if self._level is None:
            return ""
        wall, empty, target, box_t, box, player, player_t = self.symbols
        lv = self._level
        rows = []
        for r in range(lv.height):
            row = []
            for c in range(lv.width):
                p = (r, c)
                on_t = p in lv.targets
                if p not in lv.floor:
                    row.append(wall)
                elif p == self._player:
                    row.append(player_t if on_t else player)
                elif p in self._boxes:
                    row.append(box_t if on_t else box)
                else:
                    row.append(target if on_t else empty)
            rows.append("".join(row))
        return "\n".join(rows)
