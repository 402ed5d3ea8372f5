"""Sokoban with levels made by reverse play, so every level is solvable (SPEC §2; RAGEN paper §4).

Two level generators, picked with ``generator=``; both are seeded by the layout generator.

``"reference"`` (default) reproduces how the reference (gym-sokoban's generator as RAGEN uses it)
makes levels, and therefore its difficulty:

1. carve a room: a walk of ``room_steps`` steps inside the border (it turns with probability
   0.35 per step) stamps one of five small floor patterns (a 1x3 or 3x1 bar, two L shapes, a 2x2
   square) around each cell it visits. The reference uses ``int(1.7 * (height + width))``
   steps: 20 on 6x6, 27 on 8x8;
2. put the player, then ``n_boxes`` targets, on random floor cells, with a box on each target;
3. reverse play: a depth-first search over reverse moves (the player steps up, down, left or
   right onto a free cell and pulls the box behind it, if any). A path longer than
   ``search_depth - 2`` moves is cut, and a state is expanded only the first time the search
   meets it. The search keeps the first state with the highest score
   ``box_swaps * displacement``: ``box_swaps`` counts how often the pulled box changed along
   the path (the first pull counts), ``displacement`` sums each box's Manhattan distance from
   its own target. A state scores 0 unless every target is clear of boxes and of the player,
   so a level is never already solved. A room whose best score is 0 is thrown away;
4. move the player a little: with probability 0.8 when the displacement is 1, else 0.5, take up
   to 3 random steps without pushing or revisiting a cell (after each step, go on with
   probability 0.5), so the player does not always start next to a box.

Each reverse move undoes a legal forward move (a pull undoes a push), and the final walk can be
walked back, so every level is solvable. The shortest solution is then found by a forward BFS
(up to ``MIN_MOVES_CAP`` moves, else ``None``) and reported as ``info["min_moves"]`` on reset.
Given ``min_moves`` / ``max_moves``, levels whose shortest solution lies outside that band are
drawn again (off by default, as in the reference).

``"uniform"`` is an exhaustive breadth-first reverse search from every solved state of a carved
room; it picks a solution length uniformly among those in ``[min_moves, max_moves]`` (default
2..10) that the room offers, then a state of that length. It makes a flatter difficulty
distribution than the reference (LargerSokoban is about 3x easier for a random policy).

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

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import Field

from ragen_core.envs.base import StepOutcome, TextEnv, checked_params

__all__ = [
    "DEFAULT_SYMBOLS",
    "LEVEL_GENERATORS",
    "MAX_BOXES",
    "MAX_MOVES",
    "MAX_SIDE",
    "MIN_MOVES_CAP",
    "NEW_VOCAB_SYMBOLS",
    "CoordSokobanEnv",
    "SokobanEnv",
    "SokobanLevel",
    "generate_level",
    "generate_reference_level",
    "generate_uniform_level",
    "parse_level",
    "reference_room_steps",
    "shortest_solution_length",
]

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


# ---------------------------------------------------------------------------- "uniform"
def _carve_room(rng: np.random.Generator, height: int, width: int, n_steps: int) -> frozenset[Pos]:
    """Random-walk floor carving inside the border (the ``"uniform"`` generator's simpler walk)."""
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


def _reverse_bfs(floor: frozenset[Pos], targets: frozenset[Pos],
                 max_depth: int) -> dict[tuple[Pos, frozenset[Pos]], int]:
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


def generate_uniform_level(
    rng: np.random.Generator, height: int = 6, width: int = 6, n_boxes: int = 1,
    min_moves: int = 2, max_moves: int = 10, max_tries: int = 1000,
) -> SokobanLevel:
    """A level whose shortest solution takes ``min_moves``..``max_moves`` actions, the length drawn
    uniformly among those the room offers (module docstring, ``"uniform"``)."""
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


# ---------------------------------------------------------------------------- "reference"
# Floor patterns stamped around each cell of the carving walk, as offsets from that cell: a
# horizontal bar, a vertical bar, two L shapes and a 2x2 square (gym-sokoban's five masks).
_STAMPS: tuple[tuple[Pos, ...], ...] = (
    ((0, -1), (0, 0), (0, 1)),
    ((-1, 0), (0, 0), (1, 0)),
    ((0, -1), (0, 0), (1, 0)),
    ((0, -1), (0, 0), (1, -1), (1, 0)),
    ((0, 0), (0, 1), (1, 0)),
)
_P_TURN = 0.35
"""Probability that the carving walk picks a new (uniformly random) direction before a step."""
_MAX_SEARCH_STATES = 300_000
"""The reference stops the reverse search after this many distinct states."""
_WANDER_STEPS, _P_WANDER_ON = 3, 0.5
"""The final player walk: at most 3 steps, going on after each with probability 0.5."""
MIN_MOVES_CAP = 30
"""Longest shortest solution the forward BFS looks for; ``info["min_moves"]`` is None beyond it."""
MAX_SIDE, MAX_BOXES, MAX_MOVES = 16, 4, 100
"""Bounds of the env's parameters: the reverse searches and the forward BFS grow with the room, the boxes and
the move band (the reference plays 6x6 and 8x8 with 1-2 boxes), and a bigger room would not finish a reset."""


def reference_room_steps(height: int, width: int) -> int:
    """The reference's carving-walk length for a room (gym-sokoban: ``int(1.7 * (height + width))``)."""
    return int(1.7 * (height + width))


def _carve_stamped_room(rng: np.random.Generator, height: int, width: int, n_steps: int) -> frozenset[Pos]:
    """Floor cells of a room carved by a turning walk that stamps a random pattern at each step."""
    d = _DIRS[int(rng.integers(4))]
    # The start may lie on the far border row/column; the first step's clamp brings it inside.
    r, c = int(rng.integers(1, height)), int(rng.integers(1, width))
    floor: set[Pos] = set()
    for _ in range(n_steps):
        if rng.random() < _P_TURN:
            d = _DIRS[int(rng.integers(4))]
        r, c = min(max(r + d[0], 1), height - 2), min(max(c + d[1], 1), width - 2)
        for dr, dc in _STAMPS[int(rng.integers(len(_STAMPS)))]:
            if 1 <= r + dr <= height - 2 and 1 <= c + dc <= width - 2:  # the border stays wall
                floor.add((r + dr, c + dc))
    return frozenset(floor)


def _reverse_search(
    floor: frozenset[Pos], targets: tuple[Pos, ...], player: Pos, search_depth: int,
) -> tuple[Pos, tuple[Pos, ...], int]:
    """The reference's depth-first reverse play from the solved state (module docstring, step 3).

    Returns the best state's player, its boxes (``boxes[i]`` started on ``targets[i]``) and its
    score; score 0 means no state beat the start. An explicit stack replaces the recursion and
    visits states in the same order: children pushed in reverse, so "up" is expanded first.
    """
    target_set = frozenset(targets)
    max_len = search_depth - 2  # the reference's time-to-live runs out at search_depth - 1 moves
    best: tuple[Pos, tuple[Pos, ...], int] = (player, targets, 0)
    explored: set[tuple[Pos, frozenset[tuple[Pos, bool]]]] = set()
    # (player, boxes, pulled at least once, box_swaps, index of the last pulled box, path length)
    stack = [(player, targets, (False,) * len(targets), 0, -1, 0)]
    while stack:
        p, boxes, pulled, swaps, last, length = stack.pop()
        if length > max_len or len(explored) >= _MAX_SEARCH_STATES:
            continue
        # The reference's state identity: player and box cells, and which boxes were ever pulled
        # (box identities are not part of it, so the first path to a state decides its score).
        key = (p, frozenset(zip(boxes, pulled, strict=True)))
        if key in explored:
            continue
        explored.add(key)
        if swaps and p not in target_set and target_set.isdisjoint(boxes):
            displacement = sum(abs(b[0] - t[0]) + abs(b[1] - t[1]) for b, t in zip(boxes, targets, strict=True))
            if swaps * displacement > best[2]:
                best = (p, boxes, swaps * displacement)
        children = []
        for d in _DIRS:
            nxt = _add(p, d)
            if nxt not in floor or nxt in boxes:
                continue
            behind = _sub(p, d)
            if behind in boxes:  # pull: the box follows the player into its old cell
                i = boxes.index(behind)
                children.append((nxt, (*boxes[:i], p, *boxes[i + 1:]), (*pulled[:i], True, *pulled[i + 1:]),
                                 swaps + (i != last), i, length + 1))
            else:
                children.append((nxt, boxes, pulled, swaps, last, length + 1))
        stack.extend(reversed(children))
    return best


def _wander(rng: np.random.Generator, floor: frozenset[Pos], boxes: frozenset[Pos], player: Pos,
            p_move: float) -> Pos:
    """The reference's final player walk: with probability ``p_move``, up to 3 steps onto free,
    not yet visited cells (no pushing), going on after each step with probability 0.5."""
    if rng.random() > p_move:
        return player
    visited = [player]
    for step in range(1, _WANDER_STEPS + 1):
        options = [q for q in (_add(player, d) for d in _DIRS)
                   if q in floor and q not in boxes and q not in visited]
        if not options:
            break
        player = options[int(rng.integers(len(options)))]
        visited.append(player)
        if step >= _WANDER_STEPS or rng.random() > _P_WANDER_ON:
            break
    return player


def shortest_solution_length(level: SokobanLevel, cap: int = MIN_MOVES_CAP) -> int | None:
    """Fewest actions that put every box on a target (forward BFS), or None if more than ``cap``."""
    if level.boxes <= level.targets:
        return 0
    floor, targets = level.floor, level.targets
    seen = {(level.player, level.boxes)}
    frontier = [(level.player, level.boxes)]
    for k in range(1, cap + 1):
        nxt_frontier = []
        for player, boxes in frontier:
            for d in _DIRS:
                nxt = _add(player, d)
                if nxt not in floor:
                    continue
                new_boxes = boxes
                if nxt in boxes:
                    beyond = _add(nxt, d)
                    if beyond not in floor or beyond in boxes:
                        continue
                    new_boxes = (boxes - {nxt}) | {beyond}
                    if new_boxes <= targets:
                        return k
                state = (nxt, new_boxes)
                if state not in seen:
                    seen.add(state)
                    nxt_frontier.append(state)
        if not nxt_frontier:
            return None
        frontier = nxt_frontier
    return None


def generate_reference_level(
    rng: np.random.Generator, height: int = 6, width: int = 6, n_boxes: int = 1,
    search_depth: int = 300, room_steps: int | None = None,
    min_moves: int | None = None, max_moves: int | None = None, max_tries: int = 1000,
) -> SokobanLevel:
    """A level made the reference's way (module docstring, ``"reference"``).

    ``room_steps`` defaults to the reference's ``int(1.7 * (height + width))``. ``min_moves`` /
    ``max_moves`` (optional) redraw levels whose shortest solution falls outside the band.
    """
    if (height - 2) * (width - 2) < n_boxes + 2:
        raise ValueError(f"a {height}x{width} room cannot hold {n_boxes} boxes")
    if search_depth < 3:
        raise ValueError(f"search_depth must be >= 3 (a pull needs a path of one move), got {search_depth}")
    if min_moves is not None and max_moves is not None and not 1 <= min_moves <= max_moves:
        raise ValueError(f"need 1 <= min_moves <= max_moves, got {min_moves}, {max_moves}")
    steps = reference_room_steps(height, width) if room_steps is None else room_steps
    if steps < 1:
        raise ValueError(f"room_steps must be >= 1, got {steps}")
    cap = max(MIN_MOVES_CAP, max_moves or 0)
    for _ in range(max_tries):
        floor = _carve_stamped_room(rng, height, width, steps)
        cells = sorted(floor)  # row-major, as the reference lists free cells
        if len(cells) <= n_boxes + 1:
            continue
        player = cells.pop(int(rng.integers(len(cells))))
        targets = tuple(cells.pop(int(rng.integers(len(cells)))) for _ in range(n_boxes))
        player, boxes, score = _reverse_search(floor, targets, player, search_depth)
        if score == 0:  # no pull got every box off the targets: the reference tries another room
            continue
        displacement = sum(abs(b[0] - t[0]) + abs(b[1] - t[1]) for b, t in zip(boxes, targets, strict=True))
        box_set = frozenset(boxes)
        player = _wander(rng, floor, box_set, player, p_move=0.8 if displacement == 1 else 0.5)
        level = SokobanLevel(height, width, floor, frozenset(targets), box_set, player)
        k = shortest_solution_length(level, cap)
        if (min_moves is not None and (k is None or k < min_moves)) or (
                max_moves is not None and (k is None or k > max_moves)):
            continue
        return dataclasses.replace(level, min_moves=k)
    raise RuntimeError(f"no {height}x{width} level with {n_boxes} boxes after {max_tries} tries")


LEVEL_GENERATORS: dict[str, Callable[..., SokobanLevel]] = {
    "reference": generate_reference_level,
    "uniform": generate_uniform_level,
}
"""Level generators by name (the env's ``generator=``); module docstring."""


def generate_level(rng: np.random.Generator, height: int = 6, width: int = 6, n_boxes: int = 1, *,
                   generator: str = "reference", **params: Any) -> SokobanLevel:
    """A level from the generator named ``generator`` with its own ``params``."""
    if generator not in LEVEL_GENERATORS:
        raise ValueError(f"unknown generator {generator!r}; choose from {sorted(LEVEL_GENERATORS)}")
    return LEVEL_GENERATORS[generator](rng, height, width, n_boxes, **params)


def parse_level(text: str | Sequence[str], symbols: str = DEFAULT_SYMBOLS) -> SokobanLevel:
    """Read a level drawn with ``symbols`` (wall, empty, target, box on target, box, player, player on target)."""
    rows = text.strip("\n").split("\n") if isinstance(text, str) else list(text)
    wall, _empty, target, box_t, box, player, player_t = tuple(symbols)
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

    @checked_params
    def __init__(
        self,
        *,
        height: Annotated[int, Field(ge=3, le=MAX_SIDE)] = 6,
        width: Annotated[int, Field(ge=3, le=MAX_SIDE)] = 6,
        n_boxes: Annotated[int, Field(ge=1, le=MAX_BOXES)] = 1,
        generator: Literal["reference", "uniform"] = "reference",
        search_depth: Annotated[int, Field(ge=3, le=10_000)] = 300,
        room_steps: Annotated[int, Field(ge=1, le=10_000)] | None = None,
        min_moves: Annotated[int, Field(ge=1, le=MAX_MOVES)] | None = None,
        max_moves: Annotated[int, Field(ge=1, le=MAX_MOVES)] | None = None,
        symbols: str | Sequence[str] = DEFAULT_SYMBOLS,
        max_steps: Annotated[int, Field(ge=1)] | None = 10,
        step_reward: float = -0.1,
        box_on_reward: float = 1.0,
        box_off_reward: float = -1.0,
        solved_reward: float = 10.0,
    ) -> None:
        super().__init__(max_steps=max_steps)
        symbols = "".join(symbols)
        if len(symbols) != 7 or len(set(symbols)) != 7:
            raise ValueError(f"symbols must be 7 distinct characters ({', '.join(_MEANINGS)}), got {symbols!r}")
        if (height - 2) * (width - 2) < n_boxes + 2:  # what the generators need, checked before the first reset
            raise ValueError(f"n_boxes: a {height}x{width} room cannot hold {n_boxes} boxes")
        if generator == "uniform":  # it needs a band: 2..10 unless given
            min_moves, max_moves = 2 if min_moves is None else min_moves, 10 if max_moves is None else max_moves
        if min_moves is not None and max_moves is not None and min_moves > max_moves:
            raise ValueError(f"min_moves ({min_moves}) exceeds max_moves ({max_moves})")
        self.height, self.width, self.n_boxes = height, width, n_boxes
        self.generator, self.search_depth = generator, search_depth
        self.room_steps = reference_room_steps(height, width) if room_steps is None else room_steps
        self.min_moves, self.max_moves = min_moves, max_moves
        # Each generator gets its own parameters; "uniform" needs a band (above), for
        # "reference" the band is an optional filter (module docstring).
        self._generator_params: dict[str, Any] = {"min_moves": min_moves, "max_moves": max_moves}
        if generator == "reference":
            self._generator_params.update(search_depth=search_depth, room_steps=self.room_steps)
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
        return dict(zip(self.symbols, _MEANINGS, strict=True))

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
            level = generate_level(rng, self.height, self.width, self.n_boxes, generator=self.generator,
                                   **self._generator_params)
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

    def _state(self) -> Any:
        # The grid in the default symbols holds all of it: walls, floor, targets, boxes and the player.
        return self._grid(DEFAULT_SYMBOLS)

    def render(self) -> str:
        return self._grid(self.symbols)

    def _grid(self, symbols: str) -> str:
        """The current state drawn with ``symbols`` ('' before the first reset)."""
        if self._level is None:
            return ""
        wall, empty, target, box_t, box, player, player_t = tuple(symbols)
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


def _coords(cells: Sequence[Pos] | frozenset[Pos]) -> str:
    return ", ".join(f"({r}, {c})" for r, c in sorted(cells))


class CoordSokobanEnv(SokobanEnv):
    """Sokoban observed as RAGEN-2's CoordSokoban: the zero-indexed coordinates of the walls, targets, boxes and
    the player, then the symbol grid. Levels, actions and rewards are Sokoban's."""

    def render(self) -> str:
        grid = super().render()
        if self._level is None:
            return grid
        lv = self._level
        walls = [(r, c) for r in range(lv.height) for c in range(lv.width) if (r, c) not in lv.floor]
        entities = (("Walls", walls), ("Targets", lv.targets), ("Boxes", self._boxes - lv.targets),
                    ("Boxes on target", self._boxes & lv.targets),
                    ("Player", [self._player] if self._player not in lv.targets else []),
                    ("Player on target", [self._player] if self._player in lv.targets else []))
        lines = [f"Board size: {lv.height} rows x {lv.width} cols (zero-indexed)."]
        lines += [f"{label}: {_coords(cells)}" for label, cells in entities if cells]
        return "Coordinates: \n" + "\n".join(lines) + "\nGrid Map: \n" + grid

    def _instruction(self) -> str:
        return (
            "You are solving a Sokoban puzzle. You are the player and must push every box onto a target. "
            "You are given a symbol grid and the zero-indexed coordinates (row, column) of the walls, the player, "
            f"each box and each target, from the top-left corner (0, 0) to the bottom-right corner "
            f"({self.height - 1}, {self.width - 1}). Moving into a box pushes it one cell in the same direction if "
            "that cell is free. You cannot pull a box, push two boxes at once, or push a box into a wall."
        )
