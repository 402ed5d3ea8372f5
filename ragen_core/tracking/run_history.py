"""A training run as read back from tracking: :class:`RunHistory` and the metric names its curves use.

    from ragen_core.tracking.run_history import RunHistory, success_series, wanted_metrics
    run = RunHistory("starpo-1", "abc", {"algo": "starpo", "env": "Bandit"}, {"val/success": ((0, 0.2), (1, 0.5))})
    success_series(run)          # ("val", ((0, 0.2), (1, 0.5)))
    wanted_metrics("Bandit")     # what tracking/history.py fetches per run

The record :func:`ragen_core.tracking.history.fetch_runs` builds and ``ragen compare``
(ragen_core/compare.py) and the study tables (ragen_core/sweeps/aggregate.py) read. It lives in
tracking, next to what produces it, so both readers depend downwards on tracking and tracking
imports nothing above it. Pure data and plain Python: no MLflow here.

Tests: ``.venv/bin/python -m pytest tests/unit/test_compare.py -q``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["RunHistory", "Series", "curve_metrics", "success_series", "wanted_metrics"]

Series = tuple[tuple[int, float], ...]
"""((step, value), ...) sorted by step."""


@dataclass(frozen=True)
class RunHistory:
    """One training run as read back from tracking: identity, tags and metric histories."""

    name: str
    run_id: str
    tags: dict[str, str] = field(default_factory=dict)
    """Tracking tags: ``algo``, ``env``, ``preset``, ``stop_reason`` (when the monitor stopped it), ..."""
    histories: dict[str, Series] = field(default_factory=dict)
    """metric name -> ((step, value), ...); a metric the run never logged is absent."""

    @property
    def algo(self) -> str:
        return self.tags.get("algo", "n/a")

    @property
    def env(self) -> str:
        return self.tags.get("env", "n/a")


def curve_metrics(env_tag: str) -> dict[str, str]:
    """Plot title -> metric name, in the order of the figure's subplots (RAGEN Fig. 3-5 plus timing)."""
    return {
        "train success (rollouts)": f"env/{env_tag}/success",
        "validation success": "val/success",
        "in-group reward std": "rollout/reward_std_all",
        "entropy": "actor/entropy",
        "grad norm": "actor/grad_norm",
        "response length (tokens)": "response/length_mean",
        "think length (tokens)": "response/think_length_mean",
        "update seconds": "timing/update_s",
    }


def wanted_metrics(env_tag: str) -> tuple[str, ...]:
    """Every metric the comparison table and the plots read for a run on ``env_tag``."""
    return (*curve_metrics(env_tag).values(), "health/early_warning")


def success_series(run: RunHistory) -> tuple[str | None, Series]:
    """The run's success curve and where it comes from: ``val`` (held-out, preferred) or ``train``.

    Falls back to training-rollout success for runs that never evaluated; (None, ()) when neither exists.
    """
    val = run.histories.get("val/success", ())
    if val:
        return "val", val
    train = run.histories.get(f"env/{run.env}/success", ())
    return ("train", train) if train else (None, ())
