"""Collapse accounting (ragen_core/sweeps/accounting.py) on hand-made curves: each class, its numbers and its
failure mode, and the monitor's verdicts per class."""

from __future__ import annotations

import pytest

from ragen_core.compare import RunHistory
from ragen_core.sweeps.accounting import episodes, failure_mode, fire_steps, score, verdict_counts

PATIENCE = {"reward_std": 2, "val_success": 1, "empty_filter": 3, "template": 2}


def _run(val: list[tuple[int, float]], **histories: list[tuple[int, float]]) -> RunHistory:
    h = {"val/success": tuple(val)}
    h.update({k.replace("__", "/"): tuple(v) for k, v in histories.items()})
    return RunHistory(name="r", run_id="r", tags={"preset": "starpo"}, histories=h)


def test_a_run_that_rises_and_stays_is_converged_from_where_it_stayed_near_its_best() -> None:
    run = _run([(0, 0.4), (5, 0.8), (10, 0.97), (15, 1.0), (20, 0.95)])
    [ep] = episodes(run, drop=0.15)
    # best 1.0: every point from step 10 on is >= 0.85, step 5 (0.8) is not; level = (0.97 + 1.0 + 0.95) / 3
    assert (ep.kind, ep.start, ep.end) == ("converged", 10, 20)
    assert ep.level == pytest.approx(2.92 / 3)


def test_a_run_that_never_rose_above_its_start_made_no_progress_and_a_warning_there_is_only_fired() -> None:
    # 4x4 FrozenLake at its start: 0.14 and no higher than 0.22 (under 0.14 + 0.15); the template rule's streak
    # reaches its patience at 20 while nothing was learned
    run = _run([(0, 0.14), (5, 0.22), (10, 0.12), (15, 0.2), (20, 0.12), (25, 0.14)],
               health__template_streak=[(15, 1.0), (20, 2.0)])
    [ep] = episodes(run, drop=0.15)
    assert (ep.kind, ep.start, ep.end) == ("no progress", 0, 25)
    assert ep.level == pytest.approx(0.94 / 6)
    verdicts = {(v.signal, v.episode.kind): (v.verdict, v.fired_at) for v in score(run, "g", PATIENCE)}
    assert verdicts[("template", "no progress")] == ("fired", 20)
    assert verdicts[("echo_trap", "no progress")] == ("quiet", None)
    # one that rose 0.15 or more is converged; one that started within 0.15 of full success has nowhere to rise
    assert [e.kind for e in episodes(_run([(0, 0.14), (5, 0.3), (10, 0.29)]), drop=0.15)] == ["converged"]
    assert [e.kind for e in episodes(_run([(0, 0.9), (5, 0.95), (10, 0.92)]), drop=0.15)] == ["converged"]
    # a collapse from where it started is still a collapse
    assert [e.kind for e in episodes(_run([(0, 0.5), (5, 0.55), (10, 0.1)]), drop=0.15)] == ["sustained collapse"]


def test_a_dip_that_recovers_is_transient_with_its_depth_duration_and_mode() -> None:
    # seed 1 of the study: 1.00 -> 0.02 -> 1.00. Training metrics at the trough: replies parse, none at the cap
    run = _run([(0, 0.6), (5, 1.0), (10, 0.5), (15, 0.02), (20, 1.0), (25, 1.0)],
               rollout__format_ok_ratio=[(s, 0.98) for s in range(26)],
               response__clip_ratio=[(s, 0.0) for s in range(26)])
    dip, conv = episodes(run, drop=0.15)
    # the best so far is 1.0 at step 5; 10 (0.5) is the first low point, 15 (0.02) the trough, 20 back within 0.15
    assert (dip.kind, dip.start, dip.end, dip.trough, dip.duration) == ("transient dip", 10, 20, 15, 10)
    assert dip.depth == pytest.approx(0.98)
    assert dip.mode == "wrong action"  # on Bandit: the other arm
    assert (conv.kind, conv.start, conv.end) == ("converged", 20, 25)


def test_a_run_that_ends_low_is_a_sustained_collapse_and_the_mode_comes_from_the_trough() -> None:
    # replies grow into the 48-token cap from step 12: at the trough (step 20) 70% are cut
    run = _run([(0, 0.5), (5, 0.9), (10, 0.85), (15, 0.4), (20, 0.1), (25, 0.2)],
               response__clip_ratio=[(0, 0.0), (12, 0.3), (18, 0.7)], rollout__format_ok_ratio=[(0, 1.0), (18, 0.3)])
    [ep] = episodes(run, drop=0.15)
    assert (ep.kind, ep.start, ep.end, ep.trough) == ("sustained collapse", 15, 25, 20)
    assert ep.depth == pytest.approx(0.8)  # 0.9 - 0.1
    assert ep.mode == "length cap"  # the cap wins over the format: the cut replies are why they do not parse
    assert failure_mode(run, 17) == "wrong action"  # at step 17 the last values are cap 0.3, format 1.0
    assert failure_mode(run, 19) == "length cap"
    formats = _run([(0, 1.0)], rollout__format_ok_ratio=[(0, 0.2)], response__clip_ratio=[(0, 0.1)])
    assert failure_mode(formats, 0) == "format"
    # replies at the cap that still parse chose wrong: the answer came before the cut (GRPO's lock onto the
    # safe arm, its replies padded to the cap after the answer)
    padded = _run([(0, 1.0)], rollout__format_ok_ratio=[(0, 1.0)], response__clip_ratio=[(0, 1.0)])
    assert failure_mode(padded, 0) == "wrong action"
    assert failure_mode(_run([(0, 1.0)], response__clip_ratio=[(0, 0.9)]), 0) == "length cap"  # no format metric
    assert failure_mode(_run([(0, 1.0)]), 0) is None  # no training metrics: no mode


def test_an_entropy_eruption_is_a_stretch_above_the_factor_of_the_early_level() -> None:
    # early level: mean of the first 3 points = 1.0; above 1.5x at steps 6 and 7 (peak 2.6x), then back
    entropy = [(0, 1.1), (1, 1.0), (2, 0.9), (3, 1.2), (4, 1.4), (5, 1.3), (6, 2.0), (7, 2.6), (8, 1.2)]
    run = _run([(0, 0.5), (5, 0.6)], actor__entropy=entropy)
    eruption = [e for e in episodes(run) if e.kind == "entropy eruption"]
    assert len(eruption) == 1
    assert (eruption[0].start, eruption[0].end, eruption[0].duration) == (6, 7, 1)
    assert eruption[0].level == pytest.approx(2.6)


def test_the_monitor_is_scored_per_class() -> None:
    # a dip at 10-20, converged from 20; the Echo-Trap warning is up at 8 (2 before the dip: a hit) and at 24
    # (inside the converged stretch, no failure near: a false alarm); the reward-std rule's streak reaches its
    # patience only at 12 (during the dip: late); the val rule never fires (a miss, and quiet when converged)
    run = _run([(0, 0.6), (5, 1.0), (10, 0.5), (15, 0.02), (20, 1.0), (25, 1.0)],
               health__early_warning=[(s, 1.0 if s in (8, 24) else 0.0) for s in range(26)],
               health__reward_std_streak=[(s, 2.0 if s == 12 else 0.0) for s in range(26)])
    assert fire_steps(run, "echo_trap", PATIENCE) == [8, 24]
    assert fire_steps(run, "reward_std", PATIENCE) == [12]
    verdicts = {(v.signal, v.episode.kind): (v.verdict, v.fired_at) for v in score(run, "starpo", PATIENCE, lead=5)}
    assert verdicts[("echo_trap", "transient dip")] == ("hit", 8)
    assert verdicts[("echo_trap", "converged")] == ("false alarm", 24)
    assert verdicts[("reward_std", "transient dip")] == ("late", 12)
    assert verdicts[("reward_std", "converged")] == ("quiet", None)
    assert verdicts[("val_success", "transient dip")] == ("miss", None)
    counts = verdict_counts(score(run, "starpo", PATIENCE, lead=5))
    assert counts[("echo_trap", "converged")] == {"false alarm": 1}
    # converged from step 5; entropy erupts at 20-21 (early level 1.0). A warning at 17, inside the converged
    # stretch but 3 steps before the eruption, is the eruption's hit, not a false alarm on the convergence
    erupting = _run([(0, 0.6), (5, 1.0), (10, 1.0), (15, 1.0), (20, 1.0), (25, 1.0)],
                    actor__entropy=[(s, 2.0 if s in (20, 21) else 1.0) for s in range(26)],
                    health__early_warning=[(s, 1.0 if s == 17 else 0.0) for s in range(26)])
    v = {(x.signal, x.episode.kind): x.verdict for x in score(erupting, "g", PATIENCE, lead=5)}
    assert v[("echo_trap", "entropy eruption")] == "hit" and v[("echo_trap", "converged")] == "quiet"


def test_an_unknown_signal_is_refused() -> None:
    with pytest.raises(KeyError, match="unknown signal"):
        fire_steps(_run([(0, 1.0)]), "nonsense", PATIENCE)
