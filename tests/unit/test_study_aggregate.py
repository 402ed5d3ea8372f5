"""A study's aggregation (ragen_core/sweeps/aggregate.py) against hand-computed numbers: the band over seeds,
the collapse step, the monitor's hit / late / miss / false-alarm accounting, which signal moved first,
the table per group and the files."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from ragen_core.compare import RunHistory
from ragen_core.sweeps.aggregate import (
    band,
    collapse_at,
    first_move,
    first_moves,
    grad_markdown,
    grad_rows,
    group_runs,
    group_table,
    judge,
    monitor_rows,
    no_progress,
    rule_patience,
    signal_fires,
    summary_metrics,
    write_study,
)

PATIENCE = {"reward_std": 2, "val_success": 1, "empty_filter": 3, "template": 2}


def test_band_is_the_mean_and_sample_std_over_the_seeds_that_logged_a_step() -> None:
    rows = band([[(0, 0.2), (5, 0.6)], [(0, 0.4), (5, 0.8)], [(0, 0.6), (5, math.nan)]])
    # step 0: mean (0.2 + 0.4 + 0.6) / 3 = 0.4; deviations -0.2, 0, 0.2 -> sample var 0.08 / 2 = 0.04 -> std 0.2
    # step 5: mean 0.7 over two seeds (the NaN is left out); deviations -0.1, 0.1 -> var 0.02 / 1 -> std 0.1414
    assert rows[0][0] == 0 and rows[0][1] == pytest.approx(0.4) and rows[0][2] == pytest.approx(0.2) and rows[0][3] == 3
    assert rows[1][0] == 5 and rows[1][1] == pytest.approx(0.7)
    assert rows[1][2] == pytest.approx(math.sqrt(0.02)) and rows[1][3] == 2
    assert band([[(3, 0.5)]]) == [(3, 0.5, 0.0, 1)]  # one seed: no spread
    assert band([]) == []


def test_collapse_is_where_success_stayed_below_the_peak_minus_the_drop() -> None:
    curve = [(0, 0.5), (5, 0.9), (10, 0.7), (15, 0.8), (20, 0.6), (25, 0.7)]
    # peak 0.9 at 5, threshold 0.75: 25 (0.7) and 20 (0.6) are under it, 15 (0.8) is not -> collapsed at 20
    assert collapse_at(curve, 0.15) == 20
    assert collapse_at(curve, 0.25) is None  # 0.7 > 0.9 - 0.25 = 0.65: the run ended near its peak
    assert collapse_at([(0, 0.9), (5, 0.7), (10, 0.6)], 0.15) == 5  # fell right after the peak and stayed
    assert collapse_at([(0, 0.5), (5, 0.5)], 0.15) is None
    assert collapse_at([], 0.15) is None


def test_the_verdicts() -> None:
    assert judge(10, 20) == "hit" and judge(20, 20) == "hit"
    assert judge(25, 20) == "late"
    assert judge(None, 20) == "miss"
    assert judge(10, None) == "false alarm"
    assert judge(None, None) == "quiet"
    # a run that made no progress had nothing to lose: a firing there is neither a hit nor a false alarm
    assert judge(10, None, progressed=False) == "fired" and judge(None, None, progressed=False) == "quiet"


def test_no_progress_is_a_run_that_never_rose_the_drop_above_its_start() -> None:
    assert no_progress([(0, 0.20), (5, 0.30), (10, 0.10), (15, 0.25)], 0.15)  # best 0.30 < 0.20 + 0.15
    assert not no_progress([(0, 0.20), (5, 0.40), (10, 0.30)], 0.15)  # rose 0.20 above its start
    assert not no_progress([(0, 0.90), (5, 0.95), (10, 0.92)], 0.15)  # started within the drop of 1.0
    assert not no_progress([(0, 0.20), (5, 0.34), (10, 0.05)], 0.15)  # ended 0.29 under its peak: a collapse
    assert not no_progress([], 0.15)


def test_the_monitor_table_calls_a_firing_on_a_run_without_progress_fired() -> None:
    flat = run("flat", "starpo", 0, val__success=[(0, 0.2), (5, 0.25), (10, 0.18)],
               health__early_warning=[(0, 0.0), (5, 1.0), (10, 1.0)])
    learnt = run("learnt", "starpo", 1, val__success=[(0, 0.2), (5, 0.8), (10, 0.9)],
                 health__early_warning=[(0, 0.0), (5, 1.0), (10, 1.0)])
    verdicts = {(j.run, j.signal): j.verdict for j in monitor_rows({"starpo": [flat, learnt]}, rule_patience(), 0.15)}
    assert verdicts[("flat", "echo_trap")] == "fired" and verdicts[("learnt", "echo_trap")] == "false alarm"


def run(name: str, preset: str, seed: int, **histories: list[tuple[int, float]]) -> RunHistory:
    return RunHistory(name, f"id-{name}", {"preset": preset, "seed": str(seed), "env": "Bandit"},
                      {k.replace("__", "/"): tuple(v) for k, v in histories.items()})


def test_groups_by_one_or_several_tags() -> None:
    runs = [run("a", "starpo", 0), run("b", "starpo-s", 0), run("c", "starpo", 1)]
    assert {g: [r.name for r in rs] for g, rs in group_runs(runs, "preset").items()} == \
           {"starpo": ["a", "c"], "starpo-s": ["b"]}
    assert list(group_runs(runs, "env, preset")) == ["Bandit/starpo", "Bandit/starpo-s"]
    assert list(group_runs(runs, "model")) == ["n/a"]


def test_signals_fire_when_the_streak_reaches_the_patience() -> None:
    r = run("a", "starpo", 0,
            health__early_warning=[(0, 0), (1, 0), (2, 1), (3, 1)],
            health__reward_std_streak=[(0, 0), (1, 1), (2, 2), (3, 3)],
            health__template_streak=[(0, 1), (5, 1)],
            health__empty_filter_streak=[(0, 0), (1, 0)])
    assert signal_fires(r, PATIENCE) == {"echo_trap": 2, "reward_std": 2, "val_success": None,
                                         "empty_filter": None, "template": None}


def test_the_monitor_accounting_over_a_study() -> None:
    # collapses at 20 (peak 0.9 at 5, then 0.6, 0.5); the Echo-Trap warning came at 10 -> hit, lead 10;
    # the reward-std rule fired at 25 -> late; nothing else fired -> misses
    collapsing = run("v0", "starpo", 0, val__success=[(0, 0.5), (5, 0.9), (10, 0.8), (20, 0.6), (30, 0.5)],
                     health__early_warning=[(9, 0), (10, 1)], health__reward_std_streak=[(24, 1), (25, 2)])
    # holds its peak; the reward-std rule fired at 7 -> false alarm; the rest quiet
    holding = run("s0", "starpo-s", 0, val__success=[(0, 0.5), (10, 0.9), (30, 0.85)],
                  health__reward_std_streak=[(6, 1), (7, 2)])
    js = {(j.run, j.signal): j for j in monitor_rows(group_runs([collapsing, holding], "preset"), PATIENCE, 0.15)}
    assert (js["v0", "echo_trap"].verdict, js["v0", "echo_trap"].lead) == ("hit", 10)
    assert js["v0", "echo_trap"].collapse_at == 20
    assert (js["v0", "reward_std"].verdict, js["v0", "reward_std"].lead) == ("late", None)
    assert js["v0", "template"].verdict == "miss" and js["v0", "val_success"].verdict == "miss"
    assert js["s0", "reward_std"].verdict == "false alarm" and js["s0", "reward_std"].fired_at == 7
    assert js["s0", "echo_trap"].verdict == "quiet" and js["s0", "echo_trap"].collapse_at is None


def test_first_move_leaves_the_early_level_by_the_fraction() -> None:
    # baseline mean (1 + 1.2 + 0.8) / 3 = 1.0; 1.1 is within 30%, 1.5 is not -> step 4
    assert first_move([(0, 1.0), (1, 1.2), (2, 0.8), (3, 1.1), (4, 1.5)]) == 4
    assert first_move([(0, 1.0), (1, 1.0), (2, 1.0), (3, 0.6)]) == 3  # downwards counts too
    assert first_move([(0, 1.0), (1, 1.0), (2, 1.0)]) is None  # nothing after the baseline
    assert first_move([(0, 0.0), (1, 0.0), (2, 0.0), (3, 5.0)]) is None  # no level to compare with
    r = run("a", "starpo", 0, actor__entropy=[(0, 1), (1, 1), (2, 1), (3, 2)],
            rollout__reward_std_all=[(0, 0.2), (1, 0.2), (2, 0.2), (3, 0.2), (4, 0.1)])
    assert first_moves(r) == {"entropy": 3, "reward std": 4, "MI": None}


def test_the_table_per_group() -> None:
    runs = [
        run("v0", "starpo", 0, val__success=[(0, 0.5), (10, 0.9), (20, 0.6)], timing__update_s=[(0, 2.0), (1, 4.0)]),
        run("v1", "starpo", 1, val__success=[(0, 0.5), (10, 0.7), (20, 0.7)], timing__update_s=[(0, 4.0)]),
        run("s0", "starpo-s", 0, val__success=[(0, 0.4), (10, 0.8), (20, 0.9)]),
    ]
    rows = {r.group: r for r in group_table(group_runs(runs, "preset"), 0.15)}
    v = rows["starpo"]
    # finals 0.6, 0.7 -> 0.65 +- 0.0707; peaks 0.9, 0.7 -> 0.8 +- 0.1414; peaks at 10 and 10
    assert (v.seeds, v.collapsed) == (2, 1)  # v0 ended 0.3 under its peak; v1 at it
    assert v.final_mean == pytest.approx(0.65) and v.final_std == pytest.approx(math.sqrt(0.005))
    assert v.peak_mean == pytest.approx(0.8) and v.peak_std == pytest.approx(math.sqrt(0.02))
    assert v.peak_iteration_mean == 10 and v.update_s == pytest.approx(3.5)  # per-run means 3.0 and 4.0
    metrics = summary_metrics(list(rows.values()))
    assert metrics["val/study/starpo/final_success_mean"] == pytest.approx(0.65)
    assert metrics["health/study/starpo/collapsed_seeds"] == 1 and metrics["timing/study/starpo/update_s"] == 3.5
    assert "timing/study/starpo-s/update_s" not in metrics  # not logged by that run: left out, not 0
    s = rows["starpo-s"]
    assert (s.seeds, s.collapsed, s.final_std, s.update_s, s.rollout_s) == (1, 0, 0.0, None, None)


def test_write_study_files(tmp_path: Path) -> None:
    runs = [run(f"{p}-{s}", p, s, val__success=[(0, 0.5), (5, 0.8 - 0.3 * (p == "starpo") * s)],
                actor__entropy=[(i, 1.0 + i * (p == "starpo")) for i in range(6)])
            for p in ("starpo", "starpo-s") for s in (0, 1)]
    paths = write_study(runs, tmp_path / "study", group_by="preset", patience=PATIENCE, title="t")
    md = paths["md"].read_text()
    assert "| starpo | 2 | 0.650 ± 0.212 | 0.650 ± 0.212 |" in md  # finals 0.8, 0.5 (peaks likewise: 0.5 is not 0.8)
    assert "| starpo-s | 2 | 0.800 ± 0.000 |" in md
    assert "| echo_trap | 0 | 0 | 0 | 0 | 0 | 4 | n/a |" in md  # nothing fired, nothing collapsed
    curves = paths["curves"].read_text().splitlines()
    assert curves[0] == "group,metric,step,mean,std,n"
    row = next(r.split(",") for r in curves if r.startswith("starpo,val/success,5,"))
    assert float(row[3]) == pytest.approx(0.65) and float(row[4]) == pytest.approx(0.3 / math.sqrt(2)) and row[5] == "2"
    assert paths["png"].read_bytes()[:4] == b"\x89PNG"
    assert paths["monitor"].read_text().count("\n") == 1 + 4 * 5
    # every run's own curves: starpo seed 1 logged val/success 0.5 at step 5 and entropy 1 + 5 there
    per_run = paths["runs"].read_text().splitlines()
    assert per_run[0].startswith("run,preset,seed,iteration,val/success,rollout/success,")
    header = per_run[0].split(",")
    row = dict(zip(header, next(r for r in per_run if r.startswith("starpo-1,starpo,1,5,")).split(","), strict=True))
    assert float(row["val/success"]) == pytest.approx(0.5) and float(row["actor/entropy"]) == pytest.approx(6.0)
    assert len(per_run) == 1 + 4 * 6  # four runs, entropy at steps 0-5
    # the accounting: starpo seed 1 stayed at 0.5 (no progress), the others rose to 0.8 at step 5
    # (converged from there); starpo's entropy rose 1, 2, ..., 6: over 1.5 x the mean of its first 3 points (2)
    # from step 3, up to 6 / 2 = 3 times it
    assert "| starpo-1 | starpo | no progress | 0 | 5 | - | - | 0.50 | - |" in md
    # columns: hit, late, miss, false alarm, quiet, fired
    assert "| template | no progress | - | - | - | - | 1 | 0 |" in md
    assert "| starpo-s-0 | starpo-s | converged | 5 | 5 | - | - | 0.80 | - |" in md
    assert "| starpo-0 | starpo | entropy eruption | 3 | 5 | - | 2 | 3.00 | - |" in md
    assert "| echo_trap | entropy eruption | 0 | 0 | 2 | - | - |" in md
    assert "Template signals in the replies" not in md  # no run logged the reply metrics
    episodes = paths["episodes"].read_text().splitlines()
    assert episodes[0] == "run,group,signal,class,start,end,depth,duration,level,mode,verdict,fired_at"
    with pytest.raises(ValueError, match="no runs"):
        write_study([], tmp_path / "x")


def test_the_reply_metrics_at_a_runs_start_and_end(tmp_path: Path) -> None:
    # MI 0.5 then 0.2 over shuffled 0.2 (excess 0.3 at the start: mean of the first 3 of 0.3, 0.3, 0.3; 0 at the
    # end); empty think 0.1, 0.1, 0.1, 0.7, 0.7, 0.7
    steps = range(6)
    templated = run("a", "starpo-s", 0, val__success=[(0, 0.1)],
                    rollout__first_action_mi=[(i, 0.5 if i < 3 else 0.2) for i in steps],
                    rollout__first_action_mi_shuffled=[(i, 0.2) for i in steps],
                    rollout__first_empty_think=[(i, 0.1 if i < 3 else 0.7) for i in steps],
                    rollout__first_distinct=[(i, 1.0) for i in steps],
                    rollout__first_top_share=[(i, 0.02) for i in steps])
    plain = run("b", "starpo", 0, val__success=[(0, 0.1)])
    md = write_study([templated, plain], tmp_path / "study", group_by="preset", patience=PATIENCE)["md"].read_text()
    assert "| a | starpo-s | 0.30 → 0.00 | 0.10 → 0.70 | 1.00 → 1.00 | 0.02 → 0.02 |" in md
    assert "| b |" not in md.split("Template signals in the replies")[1]


def test_how_often_states_recurred_per_run(tmp_path: Path) -> None:
    # all turns 0.9, 0.8, 1.0 (mean 0.9); later turns 0.6, 0.9, 0.9 (mean 0.8)
    keyed = run("g", "gigpo", 0, val__success=[(0, 0.1)],
                rollout__step_group_share=[(0, 0.9), (1, 0.8), (2, 1.0)],
                rollout__step_group_share_later=[(0, 0.6), (1, 0.9), (2, 0.9)])
    plain = run("b", "starpo", 0, val__success=[(0, 0.1)])
    paths = write_study([keyed, plain], tmp_path / "study", group_by="preset", patience=PATIENCE)
    section = paths["md"].read_text().split("## How often states recurred (step groups)")[1]
    assert "| g | gigpo | 0.90 (0.80-1.00) | 0.80 (0.60-0.90) |" in section
    assert "| b |" not in section
    per_run = paths["runs"].read_text().splitlines()
    header = per_run[0].split(",")
    row = dict(zip(header, next(r for r in per_run if r.startswith("g,gigpo,0,1,")).split(","), strict=True))
    assert float(row["rollout/step_group_share"]) == 0.8 and float(row["rollout/step_group_share_later"]) == 0.9
    assert "step groups" not in write_study([plain], tmp_path / "plain", patience=PATIENCE)["md"].read_text()


def test_gradient_buckets_by_group(tmp_path: Path) -> None:
    # two measurements (steps 0 and 5) of one run per group; the zero bucket of starpo-s is empty at step 5
    # (rows 0, no term logged) and the le_0.2 bucket is empty in both
    starpo = run("a", "starpo", 0, grad__zero__task=[(0, 0.2), (5, 0.4)], grad__zero__entropy=[(0, 0.1), (5, 0.1)],
                 grad__zero__kl=[(0, 0.1), (5, 0.3)], grad__zero__rows=[(0, 8.0), (5, 16.0)],
                 val__success=[(0, 0.5)],
                 **{"grad__gt_0.2__task": [(0, 3.0), (5, 1.0)], "grad__gt_0.2__entropy": [(0, 0.5), (5, 0.5)],
                    "grad__gt_0.2__kl": [(0, 0.5), (5, 0.5)], "grad__gt_0.2__rows": [(0, 8.0), (5, 8.0)],
                    "grad__le_0.2__rows": [(0, 0.0), (5, 0.0)]})
    snr = run("b", "starpo-s", 0, grad__zero__task=[(0, 0.5)], grad__zero__entropy=[(0, 0.25)],
              grad__zero__rows=[(0, 8.0), (5, 0.0)], val__success=[(0, 0.5)])
    rows = grad_rows({"starpo": [starpo], "starpo-s": [snr]})
    # run, group, seed, iteration, bucket, task, entropy, kl, value, rows; buckets zero, le, gt in each step
    assert rows[:3] == [["a", "starpo", "0", 0, "zero", 0.2, 0.1, 0.1, None, 8.0],
                        ["a", "starpo", "0", 0, "le_0.2", None, None, None, None, 0.0],
                        ["a", "starpo", "0", 0, "gt_0.2", 3.0, 0.5, 0.5, None, 8.0]]
    assert rows[-1] == ["b", "starpo-s", "0", 5, "zero", None, None, None, None, 0.0]
    md = "\n".join(grad_markdown(rows))
    # starpo zero: task (0.2 + 0.4) / 2 = 0.3; entropy 0.1; kl (0.1 + 0.3) / 2 = 0.2; rows (8 + 16) / 2 = 12;
    # task / (entropy + kl) per measurement: 0.2 / 0.2 = 1 and 0.4 / 0.4 = 1, mean 1
    assert "| starpo | zero | 2/2 | 12.0 | 0.3 | 0.1 | 0.2 | n/a | 1 |" in md
    assert "| starpo | le_0.2 | 0/2 | 0.0 | n/a | n/a | n/a | n/a | n/a |" in md
    # gt: task 2, ratios 3 / 1 and 1 / 1, mean 2
    assert "| starpo | gt_0.2 | 2/2 | 8.0 | 2 | 0.5 | 0.5 | n/a | 2 |" in md
    # starpo-s zero: one measurement with rows (0.5 / 0.25 = 2), rows (8 + 0) / 2 = 4
    assert "| starpo-s | zero | 1/2 | 4.0 | 0.5 | 0.25 | n/a | n/a | 2 |" in md
    paths = write_study([starpo, snr], tmp_path / "study", group_by="preset", patience=PATIENCE, title="t")
    assert paths["grad"].read_text().splitlines()[0] == "run,preset,seed,iteration,bucket,task,entropy,kl,value,rows"
    assert "## Gradient by reward-std bucket" in paths["md"].read_text()
    # without grad/ histories there is no grad.csv and no section
    plain = write_study([run("c", "starpo", 0, val__success=[(0, 0.5)])], tmp_path / "plain", patience=PATIENCE)
    assert "grad" not in plain and "Gradient by" not in plain["md"].read_text()
