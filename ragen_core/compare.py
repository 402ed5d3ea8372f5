"""Side-by-side comparison of training runs (StarPO vs StarPO-S): the table and the curves, from metric histories.

The pure part of ``ragen compare`` (flows/compare.py): it takes :class:`RunHistory` records (read from
MLflow by :mod:`ragen_core.tracking.history`, or built by hand in tests) and makes

- one :class:`CompareRow` per run: final and peak success, the iteration of the peak, whether the
  Echo Trap was detected (RAGEN §4: any ``health/early_warning`` or a ``stop_reason`` tag), mean
  update seconds, iterations;
- the table as Markdown and CSV;
- the paper-style curves (RAGEN Fig. 3-5: success, in-group reward std, entropy, gradient norm,
  response and think length over iterations) as PNGs, one line per run.

    from ragen_core.compare import RunHistory, summarize, table_markdown, write_outputs
    runs = [RunHistory("starpo-1", "abc", {"algo": "starpo", "env": "Bandit"}, {"val/success": ((0, 0.2), (1, 0.5))})]
    print(table_markdown([summarize(r) for r in runs]))
    write_outputs(runs, Path("compare-out"))

Iterations are MLflow steps, as on the x axis of the plots: training metrics at step i come from
iteration i (0 = the first); ``val/...`` at step i describe the policy after i updates (0 = untrained).
A quantity a run did not log is shown as ``n/a``, never as 0. :class:`RunHistory`, :func:`success_series`
and the curves' metric names live in ragen_core/tracking/run_history.py (tracking builds the records);
the first two are re-exported here.

Tests: ``.venv/bin/python -m pytest tests/unit/test_compare.py -q``.
"""

from __future__ import annotations

import csv
import io
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ragen_core.tracking.plots import plot_curves
from ragen_core.tracking.run_history import RunHistory, Series, curve_metrics, success_series

__all__ = [
    "COLUMNS",
    "CompareRow",
    "RunHistory",
    "plot_histories",
    "run_labels",
    "success_series",
    "summarize",
    "table_csv",
    "table_markdown",
    "write_outputs",
]


@dataclass(frozen=True)
class CompareRow:
    """One run's line in the comparison table; None means the run did not log it (shown as n/a)."""

    run: str
    run_id: str
    algo: str
    env: str
    success_from: str | None
    """'val' or 'train' (see :func:`success_series`)."""
    final_success: float | None
    peak_success: float | None
    peak_iteration: int | None
    """First step at which the peak was reached (ties go to the earliest)."""
    collapse: bool | None
    """True when any health/early_warning fired or the run was stopped; None when no health metric was logged."""
    collapse_at: int | None
    """First step with an early warning."""
    stop_reason: str | None
    update_s_mean: float | None
    iterations: int
    """Training iterations: last step of any non-``val/`` metric + 1."""


def _mean(series: Series) -> float | None:
    finite = [v for _, v in series if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else None


def summarize(run: RunHistory) -> CompareRow:
    """The table row of one run (module docstring); never modifies ``run``."""
    source, success = success_series(run)
    points = sorted(p for p in success if math.isfinite(p[1]))
    peak = max((v for _, v in points), default=None)
    peak_at = next((s for s, v in points if v == peak), None)
    warnings = run.histories.get("health/early_warning", ())
    first_warning = next((s for s, v in sorted(warnings) if v > 0), None)
    stop_reason = run.tags.get("stop_reason") or None
    collapse = (first_warning is not None or stop_reason is not None) if (warnings or stop_reason) else None
    # val/... at step i is the policy after i updates (one more point than updates): count updates only
    last_step = max((s for name, series in run.histories.items() if not name.startswith("val/") for s, _ in series),
                    default=-1)
    return CompareRow(
        run=run.name, run_id=run.run_id, algo=run.algo, env=run.env, success_from=source,
        final_success=points[-1][1] if points else None, peak_success=peak, peak_iteration=peak_at,
        collapse=collapse, collapse_at=first_warning, stop_reason=stop_reason,
        update_s_mean=_mean(run.histories.get("timing/update_s", ())), iterations=last_step + 1,
    )


COLUMNS = ("run", "algo", "env", "success from", "final success", "peak success", "peak at iter",
           "collapse", "update s (mean)", "iterations", "run id")


def _num(value: float | None, fmt: str = ".3f") -> str:
    return "n/a" if value is None else format(value, fmt)


def _collapse_text(row: CompareRow) -> str:
    if row.collapse is None:
        return "n/a"
    if not row.collapse:
        return "no"
    parts = [f"yes (warning at iter {row.collapse_at})" if row.collapse_at is not None else "yes"]
    if row.stop_reason:
        parts.append(f"stopped: {row.stop_reason}")
    return "; ".join(parts)


def _cells(row: CompareRow) -> tuple[str, ...]:
    return (row.run, row.algo, row.env, row.success_from or "n/a", _num(row.final_success), _num(row.peak_success),
            _num(row.peak_iteration, "d"), _collapse_text(row), _num(row.update_s_mean, ".2f"), str(row.iterations),
            row.run_id)


def table_markdown(rows: Sequence[CompareRow]) -> str:
    """The rows as a Markdown table (``|`` inside a cell is escaped)."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join("---" for _ in COLUMNS) + "|"]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in _cells(r)) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def table_csv(rows: Sequence[CompareRow]) -> str:
    """The rows as CSV with raw numbers (empty cell for n/a), for pandas or a spreadsheet."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["run", "algo", "env", "success_from", "final_success", "peak_success", "peak_iteration",
                     "collapse", "collapse_at", "stop_reason", "update_s_mean", "iterations", "run_id"])
    for r in rows:
        writer.writerow(["" if v is None else v for v in (
            r.run, r.algo, r.env, r.success_from, r.final_success, r.peak_success, r.peak_iteration,
            r.collapse, r.collapse_at, r.stop_reason, r.update_s_mean, r.iterations, r.run_id)])
    return out.getvalue()


def run_labels(runs: Sequence[RunHistory]) -> list[str]:
    """Legend labels ``name (algo)``; a label shared by several runs gets the run id's first 8 characters."""
    base = [f"{r.name} ({r.algo})" for r in runs]
    return [f"{b} [{r.run_id[:8]}]" if base.count(b) > 1 else b for b, r in zip(base, runs, strict=True)]


def plot_histories(runs: Sequence[RunHistory]) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """``plot_curves`` input: label -> plot title -> points (each run's own env tag picks its success metric)."""
    return {
        label: {title: list(run.histories.get(metric, ())) for title, metric in curve_metrics(run.env).items()}
        for label, run in zip(run_labels(runs), runs, strict=True)
    }


def _slug(title: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")


def write_outputs(runs: Sequence[RunHistory], out_dir: Path, title: str | None = None) -> list[Path]:
    """Write table.md, table.csv, curves.png (all curves) and one PNG per curve into ``out_dir``; returns the paths."""
    if not runs:
        raise ValueError("nothing to compare: no runs")
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = [summarize(r) for r in runs]
    (out_dir / "table.md").write_text(table_markdown(rows))
    (out_dir / "table.csv").write_text(table_csv(rows))
    histories = plot_histories(runs)
    titles = list(curve_metrics(runs[0].env))
    title = title or " vs ".join(run_labels(runs))
    pngs = [plot_curves(histories, titles, out_dir / "curves.png", title)]
    pngs += [plot_curves(histories, [t], out_dir / f"{_slug(t)}.png", title) for t in titles]
    return [out_dir / "table.md", out_dir / "table.csv", *pngs]
