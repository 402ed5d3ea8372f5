"""What a sweep trial trains: the search space and its translation into ``--set`` overrides.

    from ragen_core.sweeps.space import grid_space, trial_overrides
    grid_space(sweep)            # {"responses_per_prompt": [1, 2, 4], "algorithm.filter_value": [0.25, 0.5]}
    trial_overrides({"responses_per_prompt": 4}, base_cfg)
    # ['rollout.prompts_per_iter=32', 'rollout.responses_per_prompt=4']   (base P x N = 8 x 16)

The three named knobs have the paper's semantics (RAGEN §5, SPEC §5, §7):

- ``responses_per_prompt: N`` at a fixed total batch P x N (Table 2): P = (base P x base N) / N,
  which must divide. N = 1 has no in-group std, so the StarPO-S filter is switched off for
  that point (``filter_strategy=none, filter_value=1.0``), as the paper's Table 2 row 1 must be.
- ``actions_per_turn: k`` (Table 3): ``max_actions_per_turn = k``, ``max_actions_per_episode = 5k``.
- ``online_k: k`` (Online-k): ``trainer.online_k = k``; the config scales P by k itself.

Any other config key goes in ``space`` (a list of choices, or ``{low, high, log, step}`` for
TPE/random). ``bases`` adds a grid dimension ``base`` over experiment files, so one study
covers e.g. Sokoban and FrozenLake and the table gets both as columns. Pure functions.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from ragen_core.config import (
    ConfigError,
    ExperimentConfig,
    SweepConfig,
    data_dir,
    load_experiment,
    load_sweep,
)

__all__ = [
    "BASE_PARAM",
    "KNOBS",
    "SweepPlan",
    "base_files",
    "check_sweep",
    "grid_space",
    "is_range",
    "knob_overrides",
    "plan_sweep",
    "suggest_params",
    "trial_experiment",
    "trial_overrides",
    "yaml_value",
]

KNOBS = ("responses_per_prompt", "actions_per_turn", "online_k")
"""The paper's rollout-design knobs (RAGEN §5); each takes a list of positive integers."""

BASE_PARAM = "base"
"""Name of the grid dimension over base experiment files (present only when ``bases`` is set)."""

EPISODE_ACTIONS_PER_TURN_LIMIT = 5
"""Table 3: max actions per episode is 5k for k actions per turn (5 turns of k actions)."""

RANGE_KEYS = {"low", "high", "log", "step"}

RUN_TAGS = ("algo", "env", "preset", "seed", "estimator", "model")
"""Tags every training run carries (tracking/run_meta.py), which a study may group by."""


def yaml_value(value: Any) -> str:
    """A value as ``--set`` text that load_experiment parses back to the same value (1e-6 -> '1.0e-06')."""
    text = yaml.safe_dump(value, default_flow_style=True, width=math.inf)
    return text.removesuffix("\n...\n").removesuffix("\n")


def is_range(choices: Any) -> bool:
    return isinstance(choices, Mapping)


def knob_overrides(knob: str, value: int, base: ExperimentConfig) -> list[str]:
    """Overrides for one paper knob on ``base`` (see the module docstring for the semantics)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"knobs.{knob}: {value!r} is not a positive integer")
    r = base.rollout
    if knob == "responses_per_prompt":
        total = r.prompts_per_iter * r.responses_per_prompt
        if total % value:
            raise ConfigError(
                f"knobs.responses_per_prompt: {value} does not divide the fixed total batch "
                f"P x N = {r.prompts_per_iter} x {r.responses_per_prompt} = {total} of the base experiment"
            )
        out = [f"rollout.prompts_per_iter={total // value}", f"rollout.responses_per_prompt={value}"]
        if value == 1 and base.algorithm.filters:
            # A group of one has no reward std: the StarPO-S filter is undefined (SPEC §4), so the
            # N = 1 row trains on every group, like the paper's Table 2 must have.
            out += ["algorithm.filter_strategy=none", "algorithm.filter_value=1.0"]
        return out
    if knob == "actions_per_turn":
        return [f"rollout.max_actions_per_turn={value}",
                f"rollout.max_actions_per_episode={EPISODE_ACTIONS_PER_TURN_LIMIT * value}"]
    if knob == "online_k":
        return [f"trainer.online_k={value}"]
    raise ConfigError(f"knobs.{knob}: unknown knob; choose from {list(KNOBS)}")


def trial_overrides(params: Mapping[str, Any], base: ExperimentConfig,
                    sweep_overrides: Sequence[str] = ()) -> list[str]:
    """The ``--set`` list of one trial: the sweep's own overrides, then knobs, then space keys.

    ``base`` must already include ``sweep_overrides`` (the fixed total P x N is taken from it).
    The ``base`` grid parameter (which file) is not an override and is skipped here.
    """
    out = list(sweep_overrides)
    for knob in KNOBS:
        if knob in params:
            out += knob_overrides(knob, params[knob], base)
    out += [f"{k}={yaml_value(v)}" for k, v in params.items() if k not in KNOBS and k != BASE_PARAM]
    return out


def base_files(sweep: SweepConfig, sweep_dir: Path) -> dict[str, str]:
    """Base experiment files by the name used as the ``base`` parameter (the file stem)."""
    paths = [os.path.normpath(p) for p in (sweep.base, *(_resolve(b, sweep_dir) for b in sweep.bases))]
    out: dict[str, str] = {}
    for p in paths:
        stem = Path(p).stem
        if stem in out and out[stem] != p:
            raise ConfigError(f"bases: two base files are both named {stem!r}; rename one")
        out[stem] = p
    return out


def _resolve(path: str, sweep_dir: Path) -> str:
    p = Path(path)
    if p.is_absolute() or not (sweep_dir / p).exists():
        if not p.exists():
            raise ConfigError(f"bases: experiment file {path!r} not found (looked beside the sweep file and here)")
        return str(p)
    return str(sweep_dir / p)


def grid_space(sweep: SweepConfig, bases: Mapping[str, str] | None = None) -> dict[str, list[Any]]:
    """Every parameter with its finite list of values (knobs, space choices, ``base`` when several).

    A range needs ``step`` to be gridded; raises ConfigError otherwise.
    """
    out: dict[str, list[Any]] = {}
    if bases and len(bases) > 1:
        out[BASE_PARAM] = list(bases)
    for knob, values in sweep.knobs.items():
        out[knob] = _choices(f"knobs.{knob}", values)
    for key, choices in sweep.space.items():
        if is_range(choices):
            out[key] = _range_values(key, choices)
        else:
            out[key] = _choices(f"space.{key}", choices)
    return out


def _choices(path: str, values: Any) -> list[Any]:
    if not isinstance(values, list) or not values:
        raise ConfigError(f"{path}: expected a non-empty list of values, got {values!r}")
    if len(set(map(repr, values))) != len(values):
        raise ConfigError(f"{path}: values repeat in {values!r}")
    for v in values:
        if v is not None and not isinstance(v, (str, int, float, bool)):
            raise ConfigError(f"{path}: {v!r} is not a scalar (Optuna stores str, int, float, bool or null)")
    return list(values)


def _range_values(key: str, spec: Mapping[str, Any]) -> list[Any]:
    _check_range(key, spec)
    if spec.get("step") is None:
        raise ConfigError(f"space.{key}: the grid sampler needs a list of values or a range with a step")
    low, high, step = spec["low"], spec["high"], spec["step"]
    n = math.floor((high - low) / step + 1e-9) + 1
    values = [low + i * step for i in range(n)]
    if all(isinstance(x, int) for x in (low, high, step)):
        return [int(v) for v in values]
    return [round(v, 12) for v in values]


def _check_range(key: str, spec: Mapping[str, Any]) -> None:
    unknown = set(spec) - RANGE_KEYS
    if unknown or "low" not in spec or "high" not in spec:
        raise ConfigError(f"space.{key}: a range is {{low, high, log, step}} (low and high required), got {dict(spec)}")
    if not all(isinstance(spec[k], (int, float)) and not isinstance(spec[k], bool) for k in ("low", "high")):
        raise ConfigError(f"space.{key}: low and high must be numbers")
    if spec["low"] > spec["high"]:
        raise ConfigError(f"space.{key}: low {spec['low']} is above high {spec['high']}")
    if spec.get("log") and spec["low"] <= 0:
        raise ConfigError(f"space.{key}: a log range needs low > 0")


def trial_experiment(sweep: SweepConfig, params: Mapping[str, Any], bases: Mapping[str, str]) -> tuple[str, list[str]]:
    """(experiment file, overrides) that ``ragen train`` runs for one trial's ``params``."""
    name = params.get(BASE_PARAM, Path(sweep.base).stem)
    if name not in bases:
        raise ConfigError(f"base: {name!r} is not one of the sweep's base experiments {list(bases)}")
    path = bases[name]
    base_cfg = load_experiment(path, sweep.overrides)
    return path, trial_overrides(params, base_cfg, sweep.overrides)


def check_sweep(sweep: SweepConfig, bases: Mapping[str, str]) -> int:
    """Refuse a sweep that cannot run, before any training; returns the number of grid points (0 if not gridded).

    Every grid point is built into an ExperimentConfig, so a knob value that does not divide
    P x N, or a key that does not exist, fails here naming the parameter set.
    """
    unknown = set(sweep.knobs) - set(KNOBS)
    if unknown:
        raise ConfigError(f"knobs: unknown {sorted(unknown)}; choose from {list(KNOBS)}")
    if not sweep.knobs and not sweep.space and len(bases) < 2:
        raise ConfigError("knobs/space: a sweep needs at least one knob or space key")
    if sweep.cost_objective != "none" and sweep.pruner != "none":
        raise ConfigError("pruner: Optuna cannot prune a two-objective study; with cost_objective set pruner: none")
    if sweep.sampler != "grid" and sweep.n_trials is None:
        raise ConfigError(f"n_trials: the {sweep.sampler} sampler needs n_trials")
    for key, choices in sweep.space.items():
        if is_range(choices):
            _check_range(key, choices)
    _check_collisions(sweep)
    for key in (sweep.group_by or "").split(",") if sweep.group_by is not None else ():
        is_base = key.strip() == BASE_PARAM and len(bases) > 1
        if key.strip() not in (*RUN_TAGS, *sweep.knobs, *sweep.space) and not is_base:
            raise ConfigError(f"group_by: {key.strip()!r} is neither a swept parameter nor a run tag {list(RUN_TAGS)}")
    for base in bases.values():
        if load_experiment(base, sweep.overrides).eval.every == 0:
            raise ConfigError(f"base: {base} has eval.every = 0; a sweep needs validation success to optimise")
    if sweep.sampler != "grid":
        # TPE/random may use continuous ranges: check every choice and both ends of every range, one at a time.
        singles = {**_finite_part(sweep, bases),
                   **{k: [c["low"], c["high"]] for k, c in sweep.space.items() if is_range(c)}}
        _check_points(sweep, bases, [{k: x} for k, xs in singles.items() for x in xs])
        return 0
    grid = grid_space(sweep, bases)
    names = list(grid)
    points = [dict(zip(names, combo, strict=True)) for combo in itertools.product(*grid.values())]
    return _check_points(sweep, bases, points)


def _finite_part(sweep: SweepConfig, bases: Mapping[str, str]) -> dict[str, list[Any]]:
    finite = dataclasses.replace(sweep, space={k: v for k, v in sweep.space.items() if not is_range(v)})
    return grid_space(finite, bases)


def _check_points(sweep: SweepConfig, bases: Mapping[str, str], points: list[dict[str, Any]]) -> int:
    for params in points:
        try:
            path, overrides = trial_experiment(sweep, params, bases)
            load_experiment(path, overrides)
        except ConfigError as e:
            raise ConfigError(f"trial {params}: {e}") from None
    return len(points)


KNOB_KEYS = {
    "responses_per_prompt": ("rollout.prompts_per_iter", "rollout.responses_per_prompt"),
    "actions_per_turn": ("rollout.max_actions_per_turn", "rollout.max_actions_per_episode"),
    "online_k": ("trainer.online_k",),
}
"""Config keys each knob sets (a space key among them would fight the knob). The N = 1 filter switch is
left out: a space over the filter stays possible, and a point that asks for it with N = 1 is refused."""


def _check_collisions(sweep: SweepConfig) -> None:
    for key in sweep.space:
        for knob in sweep.knobs:
            if key in KNOB_KEYS.get(knob, ()):
                raise ConfigError(f"space.{key}: this key is set by the knob {knob!r}; sweep one or the other")


@dataclasses.dataclass(frozen=True)
class SweepPlan:
    """A checked sweep: its config, base files by name, the grid (None unless gridded) and target trials."""

    sweep: SweepConfig
    path: str
    bases: dict[str, str]
    grid: dict[str, list[Any]] | None
    target: int

    @property
    def table_keys(self) -> list[str]:
        """Row keys of the results table: the knobs, or every swept key when there are none."""
        if self.sweep.knobs:
            return list(self.sweep.knobs)
        return [k for k in (*self.sweep.space,) if k != BASE_PARAM] or [BASE_PARAM]

    @property
    def out_dir(self) -> Path:
        """The sweep's own folder: results table, study report, the parent run's outbox."""
        return data_dir() / "sweeps" / self.sweep.name


def plan_sweep(path: str | Path, overrides: Sequence[str] = ()) -> SweepPlan:
    """Load and check a sweep file (``overrides`` are ``--set`` keys of the sweep itself)."""
    sweep = load_sweep(path, overrides)
    bases = base_files(sweep, Path(path).parent)
    n_grid = check_sweep(sweep, bases)
    if sweep.sampler == "grid":
        return SweepPlan(sweep, str(path), bases, grid_space(sweep, bases), min(sweep.n_trials or n_grid, n_grid))
    assert sweep.n_trials is not None  # check_sweep refuses tpe/random without n_trials
    return SweepPlan(sweep, str(path), bases, None, sweep.n_trials)


def suggest_params(trial: Any, plan: SweepPlan) -> dict[str, Any]:
    """Ask an Optuna trial for every swept parameter (categorical lists; int/float ranges for TPE/random)."""
    if plan.grid is not None:
        return {k: trial.suggest_categorical(k, v) for k, v in plan.grid.items()}
    params = {k: trial.suggest_categorical(k, v) for k, v in _finite_part(plan.sweep, plan.bases).items()}
    for key, spec in plan.sweep.space.items():
        if not is_range(spec):
            continue
        ints = all(isinstance(spec.get(k, 1), int) for k in ("low", "high", "step"))
        if ints and not spec.get("log"):
            params[key] = trial.suggest_int(key, spec["low"], spec["high"], step=spec.get("step") or 1)
        else:
            params[key] = trial.suggest_float(key, spec["low"], spec["high"], log=bool(spec.get("log")),
                                              step=spec.get("step"))
    return params
