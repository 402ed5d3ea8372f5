"""The Echo-Trap monitor: early warning of StarPO collapse from per-iteration diagnostics.

RAGEN §4 (and SPEC §1, §6): in a collapsing run the in-group reward std and the policy's
token entropy fall first; then the gradient norm spikes and success drops. The monitor
follows reward std and entropy *relative to their early-run level* and the gradient norm
as a z-score against its recent history, emits ``health/*`` metrics every iteration, a
warning when the early signs persist, and, with ``action="stop"``, asks the trainer to
end the run cleanly when a gradient spike confirms them.

The level term tells convergence from collapse: a run that has solved its task shows the same
early signs (zero reward std, falling entropy), at its best success. With ``level_drop`` set,
the signs count only while the run's level (its training success, averaged over the last
``patience`` updates) is at least ``level_drop`` below the best such average it has had.

    mon = CollapseMonitor(action="stop")
    rep = mon.update(step=it, reward_std=0.42, entropy=1.3, grad_norm=0.8, level=0.9)
    logger.log_metrics(rep.metrics, step=it)
    if rep.warning: print(rep.warning)
    if rep.stop: raise SystemExit(rep.reason)      # the trainer saves and ends instead
    ckpt["health"] = mon.state_dict()              # restore with mon.load_state_dict(...)

Pure Python and deterministic: no MLflow, no torch, no clock.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

__all__ = ["CollapseMonitor", "HealthReport", "MonitorState"]

ACTIONS = ("warn", "stop", "off")
MIN_GRAD_HISTORY = 10


@dataclass(frozen=True)
class HealthReport:
    """What one update of the monitor says."""

    metrics: dict[str, float]
    """health/reward_std_ratio, health/entropy_ratio, health/grad_norm_z, health/collapse_score,
    health/early_warning (1.0 while the early signs have lasted ``patience`` updates), health/level_gap (the best
    ``patience``-update mean of the level so far minus the current one; NaN until known)."""
    warning: str | None
    """A message for the person watching, or None."""
    stop: bool
    """True when the run should end now (only with action 'stop')."""
    reason: str | None
    """Why it should stop, for the run's final summary and tags."""


@dataclass(frozen=True)
class MonitorState:
    """Everything the monitor remembers; saved in checkpoints so a resumed run judges alike."""

    seen: int = 0
    """Updates averaged into the early-run level (stops growing at baseline_iters)."""
    std_sum: float = 0.0
    entropy_sum: float = 0.0
    grad_norms: tuple[float, ...] = ()
    """The last ``grad_window`` finite gradient norms, oldest first."""
    streak: int = 0
    """Consecutive updates on which reward std or entropy was below its threshold."""
    warned: bool = False
    """The early warning for the current streak has been given."""
    last_step: int | None = None
    levels: tuple[float, ...] = ()
    """The last ``patience`` finite levels (training success), oldest first."""
    best_level: float = -math.inf
    """The best average of ``patience`` consecutive levels so far."""


class CollapseMonitor:
    """Reward-std / entropy / grad-norm collapse detector (RAGEN §4 Echo Trap)."""

    def __init__(
        self,
        baseline_iters: int = 5,
        std_drop: float = 0.3,
        entropy_drop: float = 0.5,
        grad_z: float = 4.0,
        patience: int = 3,
        action: str = "warn",
        grad_window: int = 20,
        level_drop: float | None = None,
    ) -> None:
        """Thresholds (same names as ``HealthConfig``); defaults are judgement, not tuned:

        - ``baseline_iters=5``: the early-run level is the mean of the first 5 updates. Vanilla
          StarPO collapses after tens of iterations in the paper (Sokoban by ~40, Bandit and
          FrozenLake later, SPEC §7), so 5 updates are safely before it, yet average out some
          of the batch-to-batch noise of a P=8 prompt batch.
        - ``std_drop=0.3``: a signal when in-group reward std is below 30% of its early level.
          In the paper's collapsing runs it falls towards zero, while a healthy run's std
          moves by tens of percent between batches; a 70% fall is clearly outside that.
        - ``entropy_drop=0.5``: a signal when token entropy is below half its early level;
          entropy falls slowly in healthy RL too (the policy sharpens), so a larger margin.
        - ``grad_z=4.0``: a spike is a gradient norm more than 4 standard deviations above the
          mean of the last ``grad_window`` (20) updates (at least 10 needed): rare by chance
          even for the heavy-tailed norms of RL, and the window follows the slow drift of the
          norm during training.
        - ``patience=3``: the early signs must hold for 3 consecutive updates, so one odd
          batch never raises the warning.

        Stopping needs the early signs *and* a spike, never the early signs alone: a run that
        has solved its task (Bandit at 100%) also has zero reward std and low entropy, and its
        gradients stay small. Success is not an input: by the time it drops (the paper's
        confirmation) the run is already lost, which is what an early stop is meant to avoid.
        ``action``: 'warn' (report only), 'stop' (also set ``stop``), 'off' (metrics only).
        ``level_drop``: the level term (module docstring), in success units; None: off, the signs
        count at any level.
        """
        if action not in ACTIONS:
            raise ValueError(f"action {action!r} must be one of {', '.join(ACTIONS)}")
        if baseline_iters < 1 or patience < 1 or grad_window < MIN_GRAD_HISTORY:
            raise ValueError(f"baseline_iters and patience must be >= 1 and grad_window >= {MIN_GRAD_HISTORY}")
        if not (0.0 < std_drop <= 1.0 and 0.0 < entropy_drop <= 1.0):
            raise ValueError("std_drop and entropy_drop are fractions of the early level, in (0, 1]")
        if grad_z <= 0.0:
            raise ValueError("grad_z must be > 0")
        if level_drop is not None and not 0.0 <= level_drop <= 1.0:
            raise ValueError("level_drop is a drop in success, in [0, 1]")
        self.baseline_iters = baseline_iters
        self.std_drop = std_drop
        self.entropy_drop = entropy_drop
        self.grad_z = grad_z
        self.patience = patience
        self.action = action
        self.grad_window = grad_window
        self.level_drop = level_drop
        self.state = MonitorState()

    def update(self, step: int, reward_std: float, entropy: float, grad_norm: float,
               level: float = math.nan) -> HealthReport:
        """Judge one iteration's diagnostics (``level``: its training success, for the level term; NaN: not
        known); replaces ``self.state`` and returns the report."""
        s = self.state
        levels, best = s.levels, s.best_level
        if math.isfinite(level):
            levels = (levels + (float(level),))[-self.patience:]
        smoothed = sum(levels) / len(levels) if levels else math.nan
        if len(levels) == self.patience:
            best = max(best, smoothed)
        gap = best - smoothed if math.isfinite(best) and math.isfinite(smoothed) else math.nan
        # near its best level a run's low std and entropy are convergence, not a trap (unknown level: no judgement)
        at_best = self.level_drop is not None and math.isfinite(gap) and gap < self.level_drop
        # early-run level: mean over the first baseline_iters updates with finite values
        seen, std_sum, ent_sum = s.seen, s.std_sum, s.entropy_sum
        if seen < self.baseline_iters and math.isfinite(reward_std) and math.isfinite(entropy):
            seen, std_sum, ent_sum = seen + 1, std_sum + reward_std, ent_sum + entropy
        ready = seen >= self.baseline_iters
        std_ratio = _ratio(reward_std, std_sum / seen if seen else math.nan)
        ent_ratio = _ratio(entropy, ent_sum / seen if seen else math.nan)
        std_low = ready and std_ratio < self.std_drop
        ent_low = ready and ent_ratio < self.entropy_drop

        z, spike = self._grad_z(grad_norm, s.grad_norms)
        streak = s.streak + 1 if (std_low or ent_low) and not at_best else 0
        early = streak >= self.patience
        score = float(std_low) + float(ent_low) + float(spike)

        warning, stop, reason, warned = None, False, None, s.warned and streak > 0
        if self.action != "off":
            messages = []
            if early and not warned:
                warned = True
                messages.append(
                    f"Echo Trap early warning at step {step}: reward std at {std_ratio:.0%} and entropy "
                    f"at {ent_ratio:.0%} of their early-run level for {streak} updates (RAGEN §4)"
                )
            if spike:
                messages.append(f"gradient-norm spike at step {step}: z = {z:.1f} (threshold {self.grad_z:g})")
            if early and spike:
                reason = (
                    f"collapse at step {step}: reward std {std_ratio:.0%} and entropy {ent_ratio:.0%} of "
                    f"their early level for {streak} updates, then a gradient-norm spike (z = {z:.1f})"
                )
                stop = self.action == "stop"
                messages.append("stopping the run" if stop
                                else "collapse likely (health.action=stop would end the run)")
            warning = "; ".join(messages) or None

        grads = s.grad_norms
        if math.isfinite(grad_norm):
            grads = (grads + (float(grad_norm),))[-self.grad_window:]
        self.state = MonitorState(seen, std_sum, ent_sum, grads, streak, warned, int(step), levels, best)
        metrics = {
            "health/reward_std_ratio": std_ratio,
            "health/entropy_ratio": ent_ratio,
            "health/grad_norm_z": z,
            "health/collapse_score": score,
            "health/early_warning": float(early),
            "health/level_gap": gap,
        }
        return HealthReport(metrics=metrics, warning=warning, stop=stop, reason=reason)

    def _grad_z(self, grad_norm: float, history: tuple[float, ...]) -> tuple[float, bool]:
        """z-score of ``grad_norm`` against ``history`` (population std); a non-finite norm is a spike.

        No z before MIN_GRAD_HISTORY norms: with 5 values the spread is so uncertain that
        plain uniform noise gave z = 6.6 in a test. The spread is floored at 10% of the mean,
        so a "spike" is always at least +40% at z = 4; the paper's spikes are several-fold.
        """
        if not math.isfinite(grad_norm):
            return math.nan, True
        if len(history) < MIN_GRAD_HISTORY:
            return 0.0, False
        mean = sum(history) / len(history)
        std = math.sqrt(sum((g - mean) ** 2 for g in history) / len(history))
        z = (grad_norm - mean) / max(std, 0.1 * abs(mean), 1e-12)
        return z, z > self.grad_z

    def state_dict(self) -> dict[str, Any]:
        """Plain-data state for checkpoints (JSON/torch.save friendly)."""
        d = dataclasses.asdict(self.state)
        d["grad_norms"] = list(self.state.grad_norms)
        d["levels"] = list(self.state.levels)
        return d

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        d = dict(state)
        d["grad_norms"] = tuple(float(g) for g in d.get("grad_norms", ()))
        d["levels"] = tuple(float(v) for v in d["levels"])
        self.state = MonitorState(**d)


def _ratio(value: float, base: float) -> float:
    """value / base; 1.0 (no information) when the base is ~0 or unknown, NaN for a NaN value."""
    if not math.isfinite(value):
        return math.nan
    if not math.isfinite(base) or base <= 1e-12:
        return 1.0
    return value / base
