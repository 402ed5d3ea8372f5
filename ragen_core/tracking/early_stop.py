"""RAGEN-2's early-stop rules and a template-collapse rule, beside the Echo-Trap monitor (SPEC §8).

    rules = EarlyStopRules.from_config(cfg.health)
    rep = rules.update(step=it, metrics=iteration_metrics)   # reads the keys in RULE_INPUTS
    logger.log_metrics(rep.metrics, step=it)
    for line in rep.warnings: print(line)
    if rep.stop: ...                                          # end the run cleanly; rep.reason says why
    ckpt["rules"] = rules.state_dict()                        # restore with rules.load_state_dict(...)

The rules (each one ``warn``, ``stop`` or ``off``, from ``HealthConfig``):

- ``reward_std``: in-group reward std below ``std_rule_frac`` (10%) of its mean over the first
  ``std_rule_baseline`` (10) iterations, for ``std_rule_patience`` (10) iterations in a row.
- ``val_success``: validation success below ``val_rule_threshold`` (1%) for ``val_rule_patience``
  (5) validations in a row.
- ``empty_filter``: ``empty_rule_patience`` (5) iterations in a row whose filter kept nothing.
- ``template``: template collapse, RAGEN-2's failure that entropy cannot see: the first-turn
  mutual information between prompts and reasonings falls below ``template_mi_frac`` (30%) of its
  level over the first ``template_baseline`` (3) measurements, or below ``template_mi_floor`` (5%)
  of its upper bound log N, *while entropy holds* (the Echo-Trap monitor's entropy ratio at least
  ``template_entropy_hold``, 0.7), for ``template_patience`` (2) measurements in a row. Collapse
  diagnostics run every ``diagnostics.collapse_every`` iterations; the rule only looks at those.

The first three are RAGEN-2's trainer rules (mll-lab-nu/RAGEN); the thresholds are theirs. A rule
fires once (the first time its streak reaches the patience) and is remembered in the state.
Pure Python and deterministic: no MLflow, no torch, no clock.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ragen_core.config import HealthConfig

__all__ = ["HEALTH_STOP", "RULES", "EarlyStopRules", "RulesReport", "RulesState"]

RULES = ("reward_std", "val_success", "empty_filter", "template")
STOP_PREFIX = "health rule"
"""Every line these rules say starts with this."""
HEALTH_STOP = "health:"
"""A run's stop reason starts with this when a health check (these rules or the Echo-Trap monitor)
ended it; sweeps prune such trials (``SweepConfig.prune_on_health``)."""


@dataclass(frozen=True)
class RulesReport:
    """What one update of the rules says."""

    metrics: dict[str, float]
    """health/<rule>_streak for every rule on, health/rules_fired (count so far)."""
    warnings: tuple[str, ...]
    """One line per rule that fired at this step (action warn or stop)."""
    stop: bool
    """True when a rule with action 'stop' fired."""
    reason: str | None
    """Why the run should stop (``STOP_PREFIX`` first), or None."""
    fired: tuple[str, ...]
    """Rules that fired at this step."""


@dataclass(frozen=True)
class RulesState:
    """Everything the rules remember; saved in checkpoints so a resumed run judges alike."""

    std_baseline: tuple[float, ...] = ()
    """The first ``std_rule_baseline`` finite reward stds."""
    mi_baseline: tuple[float, ...] = ()
    """The first ``template_baseline`` finite MI measurements."""
    streaks: tuple[tuple[str, int], ...] = ()
    """(rule, consecutive signals) pairs."""
    fired: tuple[tuple[str, int], ...] = ()
    """(rule, step) of every rule that has fired."""


class EarlyStopRules:
    """The rules of the module docstring over one run's per-iteration metrics."""

    def __init__(self, actions: Mapping[str, str], *, std_frac: float = 0.1, std_baseline: int = 10,
                 std_patience: int = 10, val_threshold: float = 0.01, val_patience: int = 5,
                 empty_patience: int = 5, mi_frac: float = 0.3, mi_floor: float = 0.05,
                 entropy_hold: float = 0.7, template_baseline: int = 3, template_patience: int = 2) -> None:
        unknown = set(actions) - set(RULES)
        if unknown or any(a not in ("warn", "stop", "off") for a in actions.values()):
            raise ValueError(f"actions must map rules {RULES} to warn, stop or off; got {dict(actions)}")
        self.actions = {rule: actions.get(rule, "off") for rule in RULES}
        self.std_frac, self.std_baseline, self.std_patience = std_frac, std_baseline, std_patience
        self.val_threshold, self.val_patience, self.empty_patience = val_threshold, val_patience, empty_patience
        self.mi_frac, self.mi_floor, self.entropy_hold = mi_frac, mi_floor, entropy_hold
        self.template_baseline, self.template_patience = template_baseline, template_patience
        self.state = RulesState()

    @classmethod
    def from_config(cls, h: HealthConfig) -> EarlyStopRules:
        return cls({"reward_std": h.std_rule, "val_success": h.val_rule, "empty_filter": h.empty_rule,
                    "template": h.template_rule},
                   std_frac=h.std_rule_frac, std_baseline=h.std_rule_baseline, std_patience=h.std_rule_patience,
                   val_threshold=h.val_rule_threshold, val_patience=h.val_rule_patience,
                   empty_patience=h.empty_rule_patience, mi_frac=h.template_mi_frac, mi_floor=h.template_mi_floor,
                   entropy_hold=h.template_entropy_hold, template_baseline=h.template_baseline,
                   template_patience=h.template_patience)

    def update(self, step: int, metrics: Mapping[str, float]) -> RulesReport:
        """Judge one iteration's metrics; replaces ``self.state`` and returns the report."""
        s = self.state
        streaks, std_base, mi_base = dict(s.streaks), s.std_baseline, s.mi_baseline
        signals: dict[str, bool | None] = {}  # None: no measurement this step (the streak is kept)

        std = float(metrics.get("rollout/reward_std_all", math.nan))
        if math.isfinite(std):
            full = len(std_base) >= self.std_baseline
            level = sum(std_base) / len(std_base) if full else math.nan
            signals["reward_std"] = full and std < self.std_frac * level
            std_base = std_base if full else (*std_base, std)
        val = metrics.get("val/success")
        signals["val_success"] = None if val is None else float(val) < self.val_threshold
        kept = metrics.get("rollout/kept_groups")
        signals["empty_filter"] = None if kept is None else float(kept) == 0.0
        signals["template"], mi_base = self._template_signal(metrics, mi_base)

        patience = {"reward_std": self.std_patience, "val_success": self.val_patience,
                    "empty_filter": self.empty_patience, "template": self.template_patience}
        fired_now, warnings, stop_reasons = [], [], []
        already = {rule for rule, _ in s.fired}
        for rule, signal in signals.items():
            if self.actions[rule] == "off" or signal is None:
                continue
            streaks[rule] = streaks.get(rule, 0) + 1 if signal else 0
            if streaks[rule] >= patience[rule] and rule not in already:
                fired_now.append(rule)
                line = f"{STOP_PREFIX} {rule} at step {step}: {self._why(rule, patience[rule])}"
                warnings.append(line)
                if self.actions[rule] == "stop":
                    stop_reasons.append(line)
        fired = (*s.fired, *((rule, int(step)) for rule in fired_now))
        self.state = RulesState(std_base, mi_base, tuple(sorted(streaks.items())), fired)
        out = {f"health/{rule}_streak": float(streaks.get(rule, 0)) for rule in RULES if self.actions[rule] != "off"}
        out["health/rules_fired"] = float(len(fired))
        return RulesReport(out, tuple(warnings), bool(stop_reasons), "; ".join(stop_reasons) or None, tuple(fired_now))

    def _template_signal(self, metrics: Mapping[str, float],
                         mi_base: tuple[float, ...]) -> tuple[bool | None, tuple[float, ...]]:
        mi = metrics.get("collapse/first_turn/mi")
        bound = metrics.get("collapse/first_turn/mi_upper_bound")
        if mi is None or bound is None or not math.isfinite(float(mi)):
            return None, mi_base
        mi, bound = float(mi), float(bound)
        full = len(mi_base) >= self.template_baseline
        low = mi < self.mi_floor * bound or (full and mi < self.mi_frac * sum(mi_base) / len(mi_base))
        entropy_ratio = float(metrics.get("health/entropy_ratio", 1.0))
        holds = not math.isfinite(entropy_ratio) or entropy_ratio >= self.entropy_hold
        return low and holds, mi_base if full else (*mi_base, mi)

    def _why(self, rule: str, patience: int) -> str:
        return {
            "reward_std": f"reward std under {self.std_frac:.0%} of its early level for {patience} iterations",
            "val_success": f"validation success under {self.val_threshold:.0%} for {patience} validations",
            "empty_filter": f"the filter kept nothing for {patience} iterations",
            "template": (f"template collapse: first-turn MI under {self.mi_frac:.0%} of its early level or "
                         f"{self.mi_floor:.0%} of log N while entropy holds, {patience} measurements"),
        }[rule]

    def fired(self) -> dict[str, int]:
        """Rule -> the step it fired at."""
        return dict(self.state.fired)

    def state_dict(self) -> dict[str, Any]:
        """Plain-data state for checkpoints (JSON friendly)."""
        return {k: [list(x) if isinstance(x, tuple) else x for x in v]
                for k, v in dataclasses.asdict(self.state).items()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        def pairs(key: str) -> tuple[tuple[str, int], ...]:
            return tuple((str(a), int(b)) for a, b in state.get(key, ()))
        self.state = RulesState(tuple(float(x) for x in state.get("std_baseline", ())),
                                tuple(float(x) for x in state.get("mi_baseline", ())),
                                pairs("streaks"), pairs("fired"))
