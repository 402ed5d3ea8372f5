"""Env registry: ``make(name, **params)`` and ``list_envs()`` (DESIGN §3).

Each registered name points at an env class (imported lazily, so ``import ragen_core.envs``
stays cheap) plus the SPEC §2 default parameters of that variant; ``make`` merges the caller's
parameters over those defaults. Example::

    from ragen_core.envs import make, list_envs
    env = make("FrozenLake", size=4, p_frozen=0.8, slippery=True)
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

from ragen_core.envs.base import TextEnv

__all__ = ["EnvSpec", "env_spec", "list_envs", "make", "register"]


@dataclass(frozen=True)
class EnvSpec:
    """One registered env variant."""

    name: str
    entry_point: str
    """``"module.path:ClassName"`` of a TextEnv subclass."""
    description: str
    """One line for ``ragen envs``."""
    defaults: dict[str, Any] = field(default_factory=dict)
    """Constructor parameters of this variant (SPEC defaults); callers may override any."""

    @property
    def family(self) -> str:
        """The game this variant is a variant of: its class name without ``Env`` (Bandit, Sokoban, ...).

        Variants of one game (Bandit, BanditRev, BanditTest) are compared with each other, so tracking
        puts their runs into one MLflow experiment per family (``ragen-Bandit``).
        """
        cls = self.entry_point.rsplit(":", 1)[1]
        return cls.removesuffix("Env") or cls


_REGISTRY: dict[str, EnvSpec] = {}
# Names used by the paper / reference configs, accepted by make() but not listed.
_ALIASES: dict[str, str] = {
    "SimpleSokoban": "Sokoban",
    "LargeSokoban": "LargerSokoban",
    "SokobanDifferentGridVocab": "SokobanNewVocab",
}


def register(name: str, entry_point: str, description: str, **defaults: Any) -> EnvSpec:
    """Register (or replace) an env variant under ``name``."""
    if ":" not in entry_point:
        raise ValueError(f"entry_point must look like 'package.module:Class', got {entry_point!r}")
    spec = EnvSpec(name=name, entry_point=entry_point, description=description, defaults=dict(defaults))
    _REGISTRY[name] = spec
    return spec


def list_envs() -> list[str]:
    """Registered env names, in registration order."""
    return list(_REGISTRY)


def env_spec(name: str) -> EnvSpec:
    """The spec registered under ``name`` (case-insensitive; paper aliases accepted)."""
    key = _ALIASES.get(name, name)
    if key in _REGISTRY:
        return _REGISTRY[key]
    folded = {n.casefold(): n for n in [*_REGISTRY, *_ALIASES]}
    hit = folded.get(str(name).casefold())
    if hit is not None:
        return _REGISTRY[_ALIASES.get(hit, hit)]
    raise KeyError(f"unknown env {name!r}; registered envs: {', '.join(_REGISTRY)}")


def make(name: str, **params: Any) -> TextEnv:
    """Build the env registered as ``name`` with ``params`` overriding its defaults."""
    spec = env_spec(name)
    module_name, class_name = spec.entry_point.split(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    env = cls(**{**spec.defaults, **params})
    if not isinstance(env, TextEnv):
        raise TypeError(f"{spec.entry_point} did not build a TextEnv")
    env.name = spec.name
    return env


def _register_builtins() -> None:
    """The SPEC §2 variants. Teacher/Engineer is the other training pair for Bandit:
    ``make("Bandit", low_risk_name="Teacher", high_risk_name="Engineer")``."""
    register("Bandit", "ragen_core.envs.bandit:BanditEnv",
             "two-armed bandit, Phoenix (low risk) vs Dragon (high risk); one pull",
             low_risk_name="Phoenix", high_risk_name="Dragon")
    register("BanditRev", "ragen_core.envs.bandit:BanditEnv",
             "bandit with the names' roles swapped: Phoenix is the high-risk arm",
             low_risk_name="Dragon", high_risk_name="Phoenix")
    # Held-out pair, roles as in the reference config (lo_arm_name Trader, hi_arm_name Librarian).
    register("BanditTest", "ragen_core.envs.bandit:BanditEnv",
             "held-out bandit names: Trader (low risk) vs Librarian (high risk)",
             low_risk_name="Trader", high_risk_name="Librarian")
    # Sokoban levels as the reference makes them (RAGEN config/envs.yaml over
    # ragen/env/sokoban/config.py): search depth 300 (the default), 10 for LargerSokoban; the
    # carving walk takes gym-sokoban's int(1.7 * (height + width)) steps. The reference gives its
    # SokobanDifferentGridVocab depth 30; we keep 300 so that NewVocab shows exactly the Sokoban
    # level of each seed in other symbols (SPEC §2). Depth 30 changes ~3% of 6x6 levels and not
    # their difficulty; make("SokobanNewVocab", search_depth=30) gives the reference's.
    register("Sokoban", "ragen_core.envs.sokoban:SokobanEnv",
             "Sokoban 6x6 with 1 box, levels by reverse play (always solvable)",
             height=6, width=6, n_boxes=1, generator="reference", search_depth=300, room_steps=20)
    register("LargerSokoban", "ragen_core.envs.sokoban:SokobanEnv",
             "Sokoban 8x8 with 2 boxes",
             height=8, width=8, n_boxes=2, generator="reference", search_depth=10, room_steps=27)
    register("SokobanNewVocab", "ragen_core.envs.sokoban:SokobanEnv",
             "Sokoban 6x6, 1 box, drawn with other symbols (W . G C B A @)",
             height=6, width=6, n_boxes=1, symbols="W.GCBA@", generator="reference", search_depth=300,
             room_steps=20)
    register("FrozenLake", "ragen_core.envs.frozen_lake:FrozenLakeEnv",
             "4x4 slippery FrozenLake, new random map per seed, goal always reachable",
             size=4, p_frozen=0.8, slippery=True)
    # RAGEN-2's default envs (its config/envs.yaml): the same games observed as coordinates plus the grid.
    register("CoordSokoban", "ragen_core.envs.sokoban:CoordSokobanEnv",
             "Sokoban 6x6 with 1 box, observed as zero-indexed coordinates and the grid (RAGEN-2)",
             height=6, width=6, n_boxes=1, generator="reference", search_depth=300, room_steps=20)
    register("CoordFrozenLake", "ragen_core.envs.frozen_lake:CoordFrozenLakeEnv",
             "4x4 slippery FrozenLake observed as zero-indexed coordinates and the grid (RAGEN-2)",
             size=4, p_frozen=0.8, slippery=True)
    register("WebShop", "ragen_core.envs.webshop.env:WebShopEnv",
             "offline WebShop: search and buy from a generated catalogue (SQLite FTS5 search)")
    register("Countdown", "ragen_core.envs.countdown:CountdownEnv",
             "reach the target from 3-4 numbers with + - * / (one answer)")


_register_builtins()
