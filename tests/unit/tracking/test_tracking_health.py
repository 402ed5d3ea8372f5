"""Echo-Trap monitor: golden collapse sequence, steady and converged runs, state round trip."""

from __future__ import annotations

import json
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ragen_core.tracking.health import CollapseMonitor

# Baseline (steps 0-4): reward std 0.5, entropy 2.0, grad norms 1.0 1.2 0.8 1.2 0.8.
BASE = [(0.5, 2.0, g) for g in (1.0, 1.2, 0.8, 1.2, 0.8)]
# Then: healthy (5), std falls (6), entropy falls too (7), still low (8, 9), grad spike (10).
COLLAPSE = [*BASE, (0.5, 2.0, 1.0), (0.1, 1.8, 1.0), (0.1, 0.8, 1.0), (0.05, 0.8, 1.0),
            (0.05, 0.8, 1.0), (0.05, 0.8, 3.0)]


def run(mon: CollapseMonitor, seq: list[tuple[float, float, float]], start: int = 0) -> list:
    return [mon.update(start + i, s, e, g) for i, (s, e, g) in enumerate(seq)]


def test_collapse_sequence_golden_values_warning_then_stop() -> None:
    reps = run(CollapseMonitor(action="stop"), COLLAPSE)
    # Early level = mean of steps 0-4: std 0.5, entropy 2.0.
    # step 6: std ratio 0.1/0.5 = 0.2 < 0.3 -> signal; entropy 1.8/2.0 = 0.9 -> none; streak 1
    assert reps[6].metrics["health/reward_std_ratio"] == pytest.approx(0.2)
    assert reps[6].metrics["health/entropy_ratio"] == pytest.approx(0.9)
    assert reps[6].metrics["health/collapse_score"] == 1.0
    # step 7: entropy 0.8/2.0 = 0.4 < 0.5 -> both signals, score 2, streak 2 (< patience 3)
    assert reps[7].metrics["health/collapse_score"] == 2.0
    assert reps[6].warning is None and reps[7].warning is None
    # step 8: streak 3 = patience -> the early warning, once
    assert reps[8].metrics["health/reward_std_ratio"] == pytest.approx(0.1)
    assert reps[8].metrics["health/early_warning"] == 1.0
    assert "early warning" in reps[8].warning and not reps[8].stop
    assert reps[9].warning is None and not reps[9].stop
    # step 10: history = grad norms of steps 0-9 = 1, 1.2, .8, 1.2, .8, 1, 1, 1, 1, 1:
    # mean 1.0, population var = 4 * 0.2^2 / 10 = 0.016, std 0.126491;
    # (10 norms: enough history; std 0.126 is above the floor 0.1 * mean = 0.1)
    # z = (3.0 - 1.0) / 0.126491 = 15.811 > 4 -> spike, on top of the early signs -> stop
    last = reps[10]
    assert last.metrics["health/grad_norm_z"] == pytest.approx(2.0 / math.sqrt(0.016))
    assert last.metrics["health/collapse_score"] == 3.0
    assert last.stop and "collapse at step 10" in last.reason and "stopping" in last.warning
    # nothing before step 10 asked to stop
    assert not any(r.stop for r in reps[:10])


def test_warn_action_reports_but_never_stops_and_off_is_silent() -> None:
    warn = run(CollapseMonitor(action="warn"), COLLAPSE)
    assert not any(r.stop for r in warn)
    assert warn[10].reason is not None and "stop would end" in warn[10].warning
    off = run(CollapseMonitor(action="off"), COLLAPSE)
    assert all(r.warning is None and not r.stop for r in off)
    assert off[10].metrics == warn[10].metrics  # same diagnostics either way


def test_baseline_phase_ratios_are_against_the_running_mean() -> None:
    mon = CollapseMonitor()
    r0 = mon.update(0, 0.5, 2.0, 1.0)
    r1 = mon.update(1, 0.3, 1.0, 1.0)
    # step 0: 0.5 / 0.5 = 1; step 1: mean(0.5, 0.3) = 0.4 -> 0.3 / 0.4 = 0.75, mean(2, 1) = 1.5 -> 1/1.5
    assert r0.metrics["health/reward_std_ratio"] == 1.0
    assert r1.metrics["health/reward_std_ratio"] == pytest.approx(0.75)
    assert r1.metrics["health/entropy_ratio"] == pytest.approx(1 / 1.5)
    # fewer than 10 grad norms seen -> no z-score yet, and no signals while the level forms
    assert r1.metrics["health/grad_norm_z"] == 0.0 and r1.metrics["health/collapse_score"] == 0.0


def test_steady_noisy_run_never_warns() -> None:
    rng = random.Random(0)
    mon = CollapseMonitor(action="stop")
    for step in range(200):
        rep = mon.update(step, rng.uniform(0.35, 0.65), rng.uniform(1.6, 2.4), rng.uniform(0.8, 1.2))
        assert rep.warning is None and not rep.stop
        assert rep.metrics["health/collapse_score"] == 0.0


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.floats(0.4, 0.6), st.floats(1.8, 2.2), st.floats(0.9, 1.1)), min_size=1, max_size=60))
def test_bounded_healthy_sequences_never_stop(seq: list[tuple[float, float, float]]) -> None:
    # ratios stay >= 0.4/0.6 = 0.67 and >= 1.8/2.2 = 0.82: never below 0.3 / 0.5, so no early signs
    reps = run(CollapseMonitor(action="stop"), seq)
    assert not any(r.stop for r in reps)
    assert all(r.metrics["health/early_warning"] == 0.0 for r in reps)


def test_converged_run_warns_but_does_not_stop() -> None:
    # A solved task (Bandit at 100%): reward std -> 0 and entropy falls, but gradients shrink
    # smoothly (negative z), so the early warning fires and no stop follows.
    seq = [*BASE] + [(0.0, 0.5, 0.8 * 0.9**k) for k in range(30)]
    reps = run(CollapseMonitor(action="stop"), seq)
    assert any(r.warning and "early warning" in r.warning for r in reps)
    assert not any(r.stop for r in reps)


def test_grad_z_spread_is_floored_at_a_tenth_of_the_mean() -> None:
    mon = CollapseMonitor()
    reps = run(mon, [(0.5, 2.0, 1.0)] * 10 + [(0.5, 2.0, 1.3), (0.5, 2.0, 1.5)])
    # flat history (std 0): spread floor 0.1 * 1.0 -> z = 0.3 / 0.1 = 3 (no spike)
    assert reps[10].metrics["health/grad_norm_z"] == pytest.approx(3.0)
    assert reps[10].warning is None
    # history now 10 x 1.0 + 1.3: mean 1.3/11 + 10/11 = 1.02727, pop std = 0.08624 < floor 0.102727
    # z = (1.5 - 1.02727) / 0.102727 = 4.6018 > 4 -> spike (a warning only: no early signs)
    assert reps[11].metrics["health/grad_norm_z"] == pytest.approx((1.5 - 11.3 / 11) / (0.1 * 11.3 / 11))
    assert "spike" in reps[11].warning and not reps[11].stop


def test_non_finite_grad_norm_is_a_spike_and_stays_out_of_history() -> None:
    seq = [*COLLAPSE[:10], (0.05, 0.8, float("nan"))]
    mon = CollapseMonitor(action="stop")
    reps = run(mon, seq)
    assert reps[10].stop and math.isnan(reps[10].metrics["health/grad_norm_z"])
    assert len(mon.state.grad_norms) == 10


def test_zero_early_level_disables_that_signal() -> None:
    # every trajectory got the same reward early (e.g. all format penalties): std level 0 -> ratio 1.0
    reps = run(CollapseMonitor(), [(0.0, 2.0, 1.0)] * 10)
    assert all(r.metrics["health/reward_std_ratio"] == 1.0 for r in reps)
    assert all(r.metrics["health/collapse_score"] == 0.0 for r in reps)


def test_warning_repeats_only_after_recovery() -> None:
    low = (0.05, 0.8, 1.0)
    seq = [*BASE, low, low, low, low, (0.5, 2.0, 1.0), low, low, low]
    reps = run(CollapseMonitor(), seq)
    warned_at = [i for i, r in enumerate(reps) if r.warning]
    assert warned_at == [7, 12]  # 3rd low update of each streak (steps 5-7, then 10-12)


def test_state_dict_round_trip_continues_identically() -> None:
    a = CollapseMonitor(action="stop")
    run(a, COLLAPSE[:8])
    saved = json.loads(json.dumps(a.state_dict()))  # checkpoint-friendly plain data
    b = CollapseMonitor(action="stop")
    b.load_state_dict(saved)
    assert b.state == a.state
    assert run(a, COLLAPSE[8:], start=8) == run(b, COLLAPSE[8:], start=8)


@pytest.mark.parametrize(
    "kwargs",
    [{"action": "halt"}, {"std_drop": 0.0}, {"entropy_drop": 1.5}, {"grad_z": 0.0}, {"patience": 0},
     {"baseline_iters": 0}, {"grad_window": 5}],
)
def test_bad_thresholds_are_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        CollapseMonitor(**kwargs)


def test_accepts_the_health_config_section() -> None:
    from ragen_core.config import ExperimentConfig, to_dict
    from ragen_core.tracking import EarlyStopRules

    echo_keys = ("action", "baseline_iters", "std_drop", "entropy_drop", "grad_z", "patience")
    health = ExperimentConfig().health
    mon = CollapseMonitor(**{k: v for k, v in to_dict(health).items() if k in echo_keys})
    assert (mon.baseline_iters, mon.std_drop, mon.patience, mon.action) == (5, 0.3, 3, "warn")
    rules = EarlyStopRules.from_config(health)  # the rest of the section: RAGEN-2's rules, warn by default
    assert rules.actions == {"reward_std": "warn", "val_success": "warn", "empty_filter": "warn", "template": "warn"}
    assert (rules.std_frac, rules.std_baseline, rules.std_patience, rules.val_patience, rules.empty_patience) == \
           (0.1, 10, 10, 5, 5)
