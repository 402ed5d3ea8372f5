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
    a = CollapseMonitor(action="stop", level_drop=0.1)
    for i, (s, e, g) in enumerate(COLLAPSE[:8]):
        a.update(i, s, e, g, level=0.5 + 0.05 * i)
    saved = json.loads(json.dumps(a.state_dict()))  # checkpoint-friendly plain data
    assert saved["levels"] == pytest.approx([0.75, 0.8, 0.85])
    b = CollapseMonitor(action="stop", level_drop=0.1)
    b.load_state_dict(saved)
    assert b.state == a.state
    assert run(a, COLLAPSE[8:], start=8) == run(b, COLLAPSE[8:], start=8)


def levelled(mon: CollapseMonitor, seq: list[tuple[float, float, float]], levels: list[float]) -> list:
    return [mon.update(i, s, e, g, level=lv) for i, ((s, e, g), lv) in enumerate(zip(seq, levels, strict=True))]


def test_the_level_term_keeps_a_run_converged_at_its_best_quiet() -> None:
    """The converged run above, with its success: it rises to 1.0 and stays. Zero reward std and low entropy at
    the run's best level are convergence: with the level term no early warning; without it, the false alarm."""
    seq = [*BASE] + [(0.0, 0.5, 0.8 * 0.9**k) for k in range(30)]
    levels = [0.5, 0.6, 0.7, 0.8, 0.9] + [1.0] * 30
    quiet = levelled(CollapseMonitor(action="stop", level_drop=0.1), seq, levels)
    assert not any(r.metrics["health/early_warning"] for r in quiet) and not any(r.warning for r in quiet)
    # golden: steps 0-1 have fewer than patience (3) levels, so no gap yet; step 2's mean (0.5+0.6+0.7)/3 = 0.6 is
    # the best so far (gap 0); at step 9 the mean is 1.0 and so is the best
    assert math.isnan(quiet[1].metrics["health/level_gap"])
    assert quiet[2].metrics["health/level_gap"] == pytest.approx(0.0)
    assert quiet[9].metrics["health/level_gap"] == pytest.approx(0.0)
    loud = levelled(CollapseMonitor(action="stop"), seq, levels)
    assert any(r.metrics["health/early_warning"] for r in loud)


def test_the_level_term_still_warns_when_success_falls_from_its_best() -> None:
    """The golden collapse with its success: 0.9 through step 6, then 0.7 from step 7. The 3-update means are
    0.9 (best) through step 6, then (0.9 + 0.9 + 0.7)/3 = 0.833 at 7 (gap 0.067 < 0.1: the signs do not
    count), (0.9 + 0.7 + 0.7)/3 = 0.767 at 8 (gap 0.133), 0.7 at 9 and 10. The streak starts at 8, so the
    warning comes at 10, two updates later than without the term, together with the spike's stop."""
    levels = [0.9] * 7 + [0.7] * 4
    reps = levelled(CollapseMonitor(action="stop", level_drop=0.1), COLLAPSE, levels)
    assert reps[7].metrics["health/level_gap"] == pytest.approx(0.9 - 2.5 / 3)
    assert reps[8].metrics["health/level_gap"] == pytest.approx(0.9 - 2.3 / 3)
    assert [r.metrics["health/early_warning"] for r in reps[6:]] == [0.0, 0.0, 0.0, 0.0, 1.0]
    assert reps[10].stop and "early warning" in reps[10].warning
    unknown = levelled(CollapseMonitor(action="stop", level_drop=0.1), COLLAPSE, [math.nan] * len(COLLAPSE))
    assert unknown == run(CollapseMonitor(action="stop"), COLLAPSE)  # no level known: no judgement from it


@pytest.mark.parametrize(
    "kwargs",
    [{"action": "halt"}, {"std_drop": 0.0}, {"entropy_drop": 1.5}, {"grad_z": 0.0}, {"patience": 0},
     {"baseline_iters": 0}, {"grad_window": 5}, {"level_drop": -0.1}, {"level_drop": 1.5}],
)
def test_bad_thresholds_are_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        CollapseMonitor(**kwargs)


def test_accepts_the_health_config_section() -> None:
    from ragen_core.config import ExperimentConfig, to_dict
    from ragen_core.tracking import EarlyStopRules

    echo_keys = ("action", "baseline_iters", "std_drop", "entropy_drop", "grad_z", "patience", "level_drop")
    health = ExperimentConfig().health
    mon = CollapseMonitor(**{k: v for k, v in to_dict(health).items() if k in echo_keys})
    assert (mon.baseline_iters, mon.std_drop, mon.patience, mon.action, mon.level_drop) == (5, 0.3, 3, "warn", 0.1)
    rules = EarlyStopRules.from_config(health)  # the rest of the section: RAGEN-2's rules, warn by default
    assert rules.actions == {"reward_std": "warn", "val_success": "warn", "empty_filter": "warn", "template": "warn"}
    assert (rules.std_frac, rules.std_baseline, rules.std_patience, rules.val_patience, rules.empty_patience) == \
           (0.1, 10, 10, 5, 5)
