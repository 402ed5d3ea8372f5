"""A trial's objective from its validation curve, and its cost from the run's history.

    objective_value([(1, 0.2), (2, 0.5), (4, 0.3)], "final")  # 0.3
    objective_value([(1, 0.2), (2, 0.5), (4, 0.3)], "best")   # 0.5
    objective_value([(1, 0.2), (2, 0.5), (4, 0.3)], "auc")    # 0.3833... (trapezoids / span)
    run_cost(history_rows, "generated_tokens")                  # sum of perf/generated_tokens

The curve is what the trial reported to Optuna (step = iterations done, value = the sweep's
metric, validation success by default), so the same numbers drive pruning and the objective.
Pure functions over plain data.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from typing import Literal

__all__ = ["COST_KEYS", "objective_value", "run_cost"]

COST_KEYS = {
    "generated_tokens": ("perf/generated_tokens",),
    "seconds": ("timing/rollout_s", "timing/update_s", "timing/eval_s"),
    "update_seconds": ("timing/update_s",),
}
"""History keys summed over iterations for each cost objective."""


def objective_value(
    curve: Sequence[tuple[int, float]],
    kind: Literal["final", "best", "auc"],
    direction: Literal["maximize", "minimize"] = "maximize",
) -> float:
    """Final value, best value (in ``direction``), or the area under the curve per step.

    ``auc`` is the trapezoidal area divided by the step span, i.e. the curve's mean height, so
    runs of different lengths compare on one [0, 1] scale for success. One point: its value.
    """
    if not curve:
        raise ValueError("no validation values were reported; the run evaluated nothing")
    points = sorted(curve)
    values = [float(v) for _, v in points]
    if kind == "final":
        return values[-1]
    if kind == "best":
        return max(values) if direction == "maximize" else min(values)
    if kind == "auc":
        span = points[-1][0] - points[0][0]
        if span == 0:
            return values[-1]
        area = sum((s1 - s0) * (v0 + v1) / 2 for (s0, v0), (s1, v1) in itertools.pairwise(points))
        return area / span
    raise ValueError(f"unknown objective {kind!r}; choose final, best or auc")


def run_cost(history: Iterable[Mapping[str, float]], kind: str) -> float:
    """Sum of the cost keys over every iteration row of a run's history (0 for missing keys)."""
    if kind not in COST_KEYS:
        raise ValueError(f"unknown cost objective {kind!r}; choose from {list(COST_KEYS)}")
    return float(sum(float(row.get(k, 0.0)) for row in history for k in COST_KEYS[kind]))
