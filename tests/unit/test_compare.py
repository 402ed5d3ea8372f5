"""Golden tests of ragen_core.compare on synthetic run histories (no MLflow, no flows)."""

from __future__ import annotations

import copy
import csv
import io
import math

import pytest

from ragen_core.compare import (
    RunHistory,
    plot_histories,
    run_labels,
    success_series,
    summarize,
    table_csv,
    table_markdown,
    write_outputs,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _run(name="r1", run_id="0123456789abcdef", tags=None, **histories):
    """histories given as keyword args with '__' for '/' (val__success -> val/success)."""
    return RunHistory(name, run_id, {"algo": "starpo", "env": "Bandit", **(tags or {})},
                      {k.replace("__", "/"): tuple(v) for k, v in histories.items()})


def test_peak_final_and_tie_goes_to_the_earliest_iteration():
    run = _run(val__success=[(0, 0.2), (1, 0.5), (2, 0.5), (3, 0.4)])
    row = summarize(run)
    # final = value at the last step (3) = 0.4; peak = max = 0.5, reached first at step 1 (tie with 2 -> earliest)
    assert (row.success_from, row.final_success, row.peak_success, row.peak_iteration) == ("val", 0.4, 0.5, 1)


def test_points_are_read_in_step_order_and_nan_is_skipped():
    run = _run(val__success=[(2, 0.1), (0, 0.3), (1, float("nan"))])
    row = summarize(run)
    # sorted: (0, 0.3), (1, nan: skipped), (2, 0.1) -> final 0.1, peak 0.3 at step 0
    assert (row.final_success, row.peak_success, row.peak_iteration) == (0.1, 0.3, 0)
    assert row.iterations == 0  # only val/ metrics: no training iteration recorded


def test_validation_success_is_preferred_and_train_success_is_the_fallback():
    both = _run(val__success=[(0, 0.9)], env__Bandit__success=[(0, 0.1), (1, 0.2)])
    assert success_series(both) == ("val", ((0, 0.9),))
    train_only = _run(env__Bandit__success=[(0, 0.1), (1, 0.25)])
    row = summarize(train_only)
    assert (row.success_from, row.final_success, row.peak_success, row.peak_iteration) == ("train", 0.25, 0.25, 1)
    # the env tag of the run picks the metric: a Sokoban run's Bandit curve is not its success
    other_env = _run(tags={"env": "Sokoban"}, env__Bandit__success=[(0, 1.0)])
    assert success_series(other_env) == (None, ())


def test_missing_metrics_are_none_and_shown_as_na():
    row = summarize(RunHistory("bare", "ffff0000", {}, {}))
    assert row.final_success is None and row.peak_success is None and row.peak_iteration is None
    assert row.collapse is None and row.update_s_mean is None and row.iterations == 0
    assert (row.algo, row.env, row.success_from) == ("n/a", "n/a", None)
    line = table_markdown([row]).splitlines()[2]
    assert line == "| bare | n/a | n/a | n/a | n/a | n/a | n/a | n/a | n/a | 0 | ffff0000 |"


def test_collapse_from_early_warning_or_stop_reason():
    warned = summarize(_run(health__early_warning=[(0, 0.0), (1, 0.0), (2, 1.0), (3, 1.0)]))
    assert (warned.collapse, warned.collapse_at, warned.stop_reason) == (True, 2, None)
    healthy = summarize(_run(health__early_warning=[(0, 0.0), (1, 0.0)]))
    assert (healthy.collapse, healthy.collapse_at) == (False, None)
    stopped = summarize(_run(tags={"stop_reason": "grad-norm spike"}))  # no health metric, but a stop tag
    assert (stopped.collapse, stopped.collapse_at, stopped.stop_reason) == (True, None, "grad-norm spike")


def test_update_seconds_mean_and_iteration_count():
    run = _run(timing__update_s=[(0, 1.0), (1, 2.0), (2, 4.5), (3, float("nan"))], val__success=[(0, 0.0), (9, 0.1)])
    row = summarize(run)
    assert row.update_s_mean == pytest.approx((1.0 + 2.0 + 4.5) / 3)  # 2.5; nan skipped
    # last training step (timing at 3) + 1; val at step 9 does not count (val step i = after i updates)
    assert row.iterations == 4


def test_markdown_table_golden():
    run = _run(name="smoke-a", run_id="abc", val__success=[(0, 0.25), (1, 0.5)], timing__update_s=[(0, 1.5), (1, 2.5)],
               health__early_warning=[(0, 0.0), (1, 1.0)], tags={"stop_reason": "collapse | confirmed"})
    assert table_markdown([summarize(run)]) == (
        "| run | algo | env | success from | final success | peak success | peak at iter | collapse "
        "| update s (mean) | iterations | run id |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|\n"
        "| smoke-a | starpo | Bandit | val | 0.500 | 0.500 | 1 "
        "| yes (warning at iter 1); stopped: collapse \\| confirmed | 2.00 | 2 | abc |\n"
    )


def test_csv_has_raw_numbers_and_empty_cells_for_na():
    rows = [summarize(_run(val__success=[(0, 0.125), (1, 0.0625)])), summarize(RunHistory("bare", "id2"))]
    parsed = list(csv.DictReader(io.StringIO(table_csv(rows))))
    assert len(parsed) == 2
    assert float(parsed[0]["final_success"]) == 0.0625 and float(parsed[0]["peak_success"]) == 0.125
    assert parsed[0]["peak_iteration"] == "0" and parsed[0]["collapse"] == ""
    assert parsed[1]["final_success"] == "" and parsed[1]["iterations"] == "0" and parsed[1]["run_id"] == "id2"


def test_labels_get_a_short_id_only_when_they_collide():
    a, b, c = _run("x", "aaaaaaaa1111"), _run("x", "bbbbbbbb2222"), _run("y", "cccc", tags={"algo": "starpo-s"})
    assert run_labels([a, b, c]) == ["x (starpo) [aaaaaaaa]", "x (starpo) [bbbbbbbb]", "y (starpo-s)"]


def test_plot_histories_use_each_runs_env_tag():
    bandit = _run("b", "1", env__Bandit__success=[(0, 0.5)])
    soko = _run("s", "2", tags={"env": "Sokoban"}, env__Sokoban__success=[(0, 0.1)], actor__entropy=[(0, 2.0)])
    hist = plot_histories([bandit, soko])
    assert hist["b (starpo)"]["train success (rollouts)"] == [(0, 0.5)]
    assert hist["s (starpo)"]["train success (rollouts)"] == [(0, 0.1)]
    assert hist["s (starpo)"]["entropy"] == [(0, 2.0)] and hist["b (starpo)"]["entropy"] == []


def test_summarize_does_not_modify_its_argument():
    run = _run(val__success=[(1, 0.5), (0, 0.2)], tags={"stop_reason": "x"})
    before = copy.deepcopy(run)
    summarize(run)
    plot_histories([run])
    assert run == before


def test_write_outputs_writes_tables_and_valid_pngs(tmp_path):
    runs = [_run("a", "1", val__success=[(0, 0.1), (1, 0.3)], actor__grad_norm=[(0, 1.0), (1, 5.0)]),
            _run("b", "2", tags={"algo": "starpo-s"}, env__Bandit__success=[(0, 0.2), (1, 0.4)])]
    files = write_outputs(runs, tmp_path / "out")
    names = [f.name for f in files]
    assert names[:3] == ["table.md", "table.csv", "curves.png"] and "grad-norm.png" in names
    assert len(names) == 3 + 8  # tables, all-curves figure, one figure per curve
    for f in files:
        assert f.stat().st_size > 0
        if f.suffix == ".png":
            assert f.read_bytes()[:8] == PNG_MAGIC
    table = (tmp_path / "out" / "table.md").read_text().splitlines()
    assert len(table) == 4 and table[2].startswith("| a | starpo |") and table[3].startswith("| b | starpo-s |")
    with pytest.raises(ValueError):
        write_outputs([], tmp_path / "none")


def test_infinite_values_do_not_break_the_mean():
    row = summarize(_run(timing__update_s=[(0, math.inf), (1, 3.0)]))
    assert row.update_s_mean == 3.0
