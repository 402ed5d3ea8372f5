"""The common text-environment interface (SPEC §2, DESIGN §3): gymnasium's API shape over strings.

Every env is a ``gymnasium.Env[str, str]``::

    obs, info = env.reset(seed=123)                                  # obs: str
    obs, reward, terminated, truncated, info = env.step("Left")      # one action (a name, or free text)
    env.action_names, env.instruction, env.legend                    # list[str], str, dict[str, str]

Env code knows nothing about tokens or prompts: ``instruction`` is plain rules text,
``legend`` maps grid symbols to their meaning, and the rollout layer turns them into a prompt.

Contract shared by all envs (checked by tests/unit/envs/test_envs_conformance.py):

* ``info`` always holds ``success`` (bool), ``action_is_effective`` (bool: the game state
  changed), ``invalid_action`` (bool), ``action`` (the canonical action or None) and
  ``steps`` (actions taken this episode). Values are plain JSON types.
* ``info["state_key"]`` (after ``reset`` and every ``step``) is ``env.state_key``: a string equal
  exactly when two states of the env are equal, the state being everything that decides the
  observations and the rules' outcomes from here on (a Sokoban grid with its boxes and player, a
  FrozenLake map and position, ...). The step count and the dynamics generator are not part of it,
  so a state reached by two action paths, or in two episodes, has one key (GiGPO's anchor states).
* An unknown, empty or non-string action never raises: the game state is unchanged, the
  reward is 0.0, ``invalid_action`` is True, and the call still counts towards
  ``max_steps`` so that an episode always ends.
* ``terminated`` / ``truncated`` mean what they mean in gymnasium: the game reached a
  terminal state / the env's own step budget ``max_steps`` ran out. Stepping after the end
  returns the final observation with reward 0.0 and ``info["episode_over"] = True``.
* ``render()`` returns exactly the current observation string.
* Determinism: ``reset(seed=s)`` derives two independent generators from ``s``: the
  *layout* generator (level, map, arm order, goal) and the *dynamics* generator
  (``self.np_random``: bandit payouts, ice slips). Same seed and same actions give
  identical observations, rewards and infos, in any process. ``options={"dynamics_seed": k}``
  keeps the layout of seed ``s`` but draws a different stream of stochastic outcomes, so a
  rollout group can share an initial state without sharing luck. ``reset()`` without a seed
  uses the previous episode's seed + 1 (0 on a fresh env), so unseeded runs are reproducible too.

Run the conformance suite: ``.venv/bin/python -m pytest tests/unit/envs -q``.
"""

from __future__ import annotations

import json
import string
from dataclasses import dataclass, field
from typing import Any, ClassVar

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from pydantic import ConfigDict, validate_call

__all__ = ["MAX_TEXT_CHARS", "TEXT_CHARSET", "StepOutcome", "TextEnv", "checked_params"]

# Nominal gymnasium spaces: observations and actions are strings. The charset is what the
# built-in renderers use; free-form envs may echo other Unicode, so the spaces are descriptive,
# not a validation rule.
TEXT_CHARSET: str = string.printable + "√›—…·×÷−"
MAX_TEXT_CHARS: int = 100_000

checked_params = validate_call(config=ConfigDict(strict=True, allow_inf_nan=False))
"""Decorator of every env constructor: its signature is the env's parameter schema (types, and bounds as
``Annotated[int, Field(ge=1)]``), checked by pydantic before the body runs. Strict, because a config's YAML
``true`` is no count and ``"3"`` no number; finite, because an ``.inf`` reward or probability poisons every
return. A bad or unknown parameter raises pydantic's ValidationError (a ValueError) naming it, whether the env
is built directly, by ``make`` or while an experiment config is loaded (config.py builds each env once)."""


@dataclass(frozen=True)
class StepOutcome:
    """What a subclass's ``_apply`` reports for one recognised action."""

    reward: float = 0.0
    terminated: bool = False
    effective: bool = True
    """The game state changed (SPEC §6 "effective actions")."""
    invalid: bool = False
    """The action was recognised syntactically but rejected (treated like an unknown action)."""
    success: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    """Extra env-specific info entries (plain JSON values)."""


class TextEnv(gym.Env[str, str]):
    """Base class of all text environments; subclasses implement ``_reset``, ``_apply``, ``render``.

    The public ``reset`` / ``step`` here enforce the shared contract (module docstring), so each
    game only writes its rules.
    """

    # gymnasium's Env annotates metadata as an instance variable; it is class-level data there too
    metadata: ClassVar[dict[str, Any]] = {"render_modes": ["ansi"]}  # type: ignore[misc]
    name: str = "TextEnv"
    """Registered name / env tag (set by ``make``)."""
    free_form_actions: ClassVar[bool] = False
    """True when actions are free text (WebShop, Countdown): the rollout layer must not match
    them against ``action_names``; it passes the text and lets the env judge it."""
    reward_range: tuple[float, float] = (0.0, 1.0)
    """Declared per-step reward bounds (lo, hi)."""
    budget_from_rollout: ClassVar[bool] = True
    """The env's step limit ``max_steps`` follows the rollout's ``max_actions_per_episode`` unless the env's
    params set it (SPEC §5: the Table 3 study's 5×k budget); False for one-action games (Bandit, Countdown),
    whose single step is a rule of the game."""

    def __init__(self, *, max_steps: int | None = None) -> None:
        if max_steps is not None and max_steps < 1:
            raise ValueError(f"max_steps must be >= 1 or None, got {max_steps}")
        self.max_steps = max_steps
        self.render_mode = "ansi"
        self.observation_space = spaces.Text(MAX_TEXT_CHARS, min_length=0, charset=TEXT_CHARSET)
        self.action_space = spaces.Text(MAX_TEXT_CHARS, min_length=0, charset=TEXT_CHARSET)
        self._seed: int | None = None
        self._steps = 0
        self._terminated = False
        self._truncated = False
        self._success = False
        self._has_reset = False

    # ----------------------------------------------------------------- public API
    @property
    def max_episode_actions(self) -> int | None:
        """The env's own action budget per episode (None: only the rollout layer limits it)."""
        return self.max_steps

    @property
    def action_names(self) -> list[str]:
        """The actions available now (fixed-action envs: the full fixed list)."""
        return list(self._action_names())

    @property
    def instruction(self) -> str:
        """Rules text for the prompt (no answer-format text: that belongs to the rollout layer)."""
        return self._instruction()

    @property
    def legend(self) -> dict[str, str]:
        """Symbol -> meaning for the grid (empty for envs without a grid)."""
        return {}

    @property
    def state_key(self) -> str:
        """The current state as a string: equal exactly when the states are equal (module docstring).

        Canonical JSON of the env's name and its ``_state()``, so it is hashable, a plain JSON value in
        ``info``, stored as is in Parquet, and the same in every process.
        """
        return json.dumps([self.name, self._state()], sort_keys=True, separators=(",", ":"), ensure_ascii=False)

    @property
    def episode_seed(self) -> int | None:
        """Seed of the current episode (None before the first reset)."""
        return self._seed

    def match_action(self, text: object) -> str | None:
        """The canonical action named by ``text`` (case-insensitive, surrounding space ignored), else None."""
        if not isinstance(text, str):
            return None
        key = text.strip().casefold()
        if not key:
            return None
        for name in self._action_names():
            if name.casefold() == key:
                return name
        return None

    def sample_action(self, rng: np.random.Generator) -> str:
        """A random action that is valid now (for random agents, tests and benchmarks)."""
        names = self._action_names()
        return names[int(rng.integers(len(names)))]

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        """Start an episode; see the module docstring for how ``seed`` and ``options`` are used."""
        if seed is None:
            seed = 0 if self._seed is None else self._seed + 1
        seed = int(seed)
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        options = dict(options or {})
        dynamics_seed = int(options.pop("dynamics_seed", 0))
        # Two independent streams from one seed (numpy SeedSequence spawn keys), so the
        # layout of seed s never depends on how the dynamics stream is used, and vice versa.
        layout_rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(0,)))
        self.np_random = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(1, dynamics_seed)))
        self._np_random_seed = seed
        self._seed = seed
        self._steps = 0
        self._terminated = False
        self._truncated = False
        self._success = False
        self._has_reset = True
        extra = self._reset(layout_rng, options)
        info: dict[str, Any] = {"seed": seed, "success": False, **extra, "state_key": self.state_key}
        return self.render(), info

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Apply one action; unknown actions get the defined no-op outcome (never an exception)."""
        if not self._has_reset:
            raise RuntimeError(f"{self.name}: call reset() before step()")
        if self._terminated or self._truncated:
            info = self._base_info(None, effective=False, invalid=True)
            info["episode_over"] = True
            info["state_key"] = self.state_key
            return self.render(), 0.0, self._terminated, self._truncated, info
        self._steps += 1
        canonical = self.match_action(action)
        outcome = StepOutcome(effective=False, invalid=True) if canonical is None else self._apply(canonical)
        if outcome.invalid:
            # Defined outcome of a bad action: no state change, no reward (documented contract).
            outcome = StepOutcome(effective=False, invalid=True, info=outcome.info)
        reward = float(outcome.reward)
        self._terminated = bool(outcome.terminated)
        self._success = self._success or bool(outcome.success)
        self._truncated = (not self._terminated) and self.max_steps is not None and self._steps >= self.max_steps
        info = self._base_info(None if outcome.invalid else canonical, outcome.effective, outcome.invalid)
        info.update(outcome.info)
        info["state_key"] = self.state_key
        return self.render(), reward, self._terminated, self._truncated, info

    def render(self) -> str:
        """The current observation string (identical to what reset/step returned last)."""
        raise NotImplementedError

    # ----------------------------------------------------------------- subclass hooks
    def _reset(self, rng: np.random.Generator, options: dict[str, Any]) -> dict[str, Any]:
        """Build the initial state from the layout generator; return extra reset-info entries."""
        raise NotImplementedError

    def _apply(self, action: str) -> StepOutcome:
        """Apply one canonical action to the state."""
        raise NotImplementedError

    def _action_names(self) -> tuple[str, ...]:
        raise NotImplementedError

    def _state(self) -> Any:
        """The full current state as plain JSON values, in a canonical order (``state_key`` encodes it)."""
        raise NotImplementedError

    def _instruction(self) -> str:
        raise NotImplementedError

    # ----------------------------------------------------------------- helpers
    def _base_info(self, action: str | None, effective: bool, invalid: bool) -> dict[str, Any]:
        return {
            "success": self._success,
            "action_is_effective": bool(effective),
            "invalid_action": bool(invalid),
            "action": action,
            "steps": self._steps,
        }

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} seed={self._seed}>"
