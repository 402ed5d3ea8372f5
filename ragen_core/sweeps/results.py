"""A study's results as a table like the paper's: rows = knob values, columns = validation
success per env/variant (RAGEN Tables 2 and 3), written as CSV, Markdown and PNG.

    table = table_rows(study.get_trials(), keys=["responses_per_prompt"])
    paths = write_table(table, Path("data/sweeps/table2"), title="table2")  # {"csv":..., "md":..., "png":...}

Per row and base experiment the best finished trial is shown (a COMPLETE one by its objective;
else the last PRUNED, else the last FAILed one), so a study that also searched other keys
still gives one row per knob setting. Success columns are the final evaluation's
``val/<tag>/success`` of each env the trial evaluated (the trial's ``val`` user attribute);
with several bases (e.g. Sokoban and FrozenLake) their columns sit side by side.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

__all__ = ["Table", "markdown_table", "table_rows", "write_table"]

STATE_RANK = {"COMPLETE": 0, "PRUNED": 1, "FAIL": 2}

COST_COLUMNS = {"tokens": "generated_tokens", "update_s": "update_seconds", "wall_s": "wall_seconds"}
"""Cost columns of the table -> keys of a trial's ``cost`` user attribute (sweeps/study.py's reporter)."""


class TrialLike(Protocol):
    """What the table reads from an Optuna FrozenTrial."""

    number: int
    params: dict[str, Any]
    user_attrs: dict[str, Any]
    values: list[float] | None

    @property
    def state(self) -> Any: ...


@dataclass(frozen=True)
class Table:
    """Rows (column -> value), the column order, the key columns and the success columns."""

    rows: list[dict[str, Any]]
    columns: list[str]
    keys: list[str]
    success_columns: list[str]


def _pick(trials: list[TrialLike], maximize: bool) -> TrialLike:
    done = [(t.values[0], t) for t in trials if t.state.name == "COMPLETE" and t.values]
    if done:
        return (max if maximize else min)(done, key=lambda vt: vt[0])[1]
    return max(trials, key=lambda t: (-STATE_RANK.get(t.state.name, 3), t.number))


def _sort_key(values: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple((0, v, "") if isinstance(v, (int, float)) and not isinstance(v, bool) else (1, 0, str(v))
                 for v in values)


def table_rows(
    trials: Sequence[TrialLike],
    keys: Sequence[str],
    base_param: str = "base",
    maximize: bool = True,
    cost: bool = False,
    base_order: Sequence[str] = (),
) -> Table:
    """One row per distinct value of ``keys``; a success column per env tag, bases in ``base_order``.

    Trials that never started a run (queued, running, or skipped as duplicates) are left out.
    """
    started = [t for t in trials if t.state.name in STATE_RANK and not t.user_attrs.get("skipped")]
    groups: dict[tuple[Any, ...], dict[Any, list[TrialLike]]] = {}
    for t in started:
        row_key = tuple(t.params.get(k) for k in keys)
        groups.setdefault(row_key, {}).setdefault(t.params.get(base_param), []).append(t)
    other = sorted({k for t in started for k in t.params if k not in keys and k != base_param})
    env_cols: list[str] = []
    rows = []
    costed = False
    for row_key in sorted(groups, key=_sort_key):
        by_base = sorted(groups[row_key].items(), key=lambda kv: (
            base_order.index(kv[0]) if kv[0] in base_order else len(base_order), str(kv[0])))
        chosen = [_pick(ts, maximize) for _, ts in by_base]
        row: dict[str, Any] = dict(zip(keys, row_key, strict=True))
        for k in other:
            row[k] = "|".join(dict.fromkeys(str(t.params.get(k, "")) for t in chosen))
        for t in chosen:
            for tag, success in (t.user_attrs.get("val") or {}).items():
                if tag not in env_cols:
                    env_cols.append(tag)
                row[tag] = success
        scored = [t.values[0] for t in chosen if t.values]
        row["objective"] = sum(scored) / len(scored) if scored else math.nan
        if cost:
            costs = [t.values[1] for t in chosen if t.values and len(t.values) > 1]
            row["cost"] = sum(costs) if costs else math.nan
        spent = [t.user_attrs["cost"] for t in chosen if isinstance(t.user_attrs.get("cost"), Mapping)]
        if spent:  # what the row cost, summed over its bases: generated tokens, update and wall seconds
            costed = True
            for col, kind in COST_COLUMNS.items():
                row[col] = sum(float(c.get(kind, math.nan)) for c in spent)
        row["state"] = "/".join(dict.fromkeys(t.state.name for t in chosen))
        row["trials"] = ",".join(str(t.number) for t in chosen)
        rows.append(row)
    columns = [*keys, *other, *env_cols, "objective", *(["cost"] if cost else []),
               *(COST_COLUMNS if costed else ()), "state", "trials"]
    return Table(rows, columns, list(keys), env_cols)


def _cell(value: Any, percent: bool) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if percent and isinstance(value, (int, float)):
        return f"{100 * value:.1f}"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def markdown_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str], success_cols: Sequence[str]) -> str:
    """A GitHub-flavoured Markdown table; success columns in percent with one decimal, like the paper."""
    head = [f"{c} (%)" if c in success_cols else c for c in columns]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(_cell(r.get(c), c in success_cols) for c in columns) + " |")
    return "\n".join(lines) + "\n"


def write_table(table: Table, out_dir: Path, title: str) -> dict[str, Path]:
    """Write ``results.csv``, ``results.md`` and ``results.png`` (grouped bars) into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rows, columns, success_cols = table.rows, table.columns, table.success_columns
    paths = {"csv": out_dir / "results.csv", "md": out_dir / "results.md", "png": out_dir / "results.png"}
    if "tokens" in columns:
        paths["cost_png"] = out_dir / "results-cost.png"
        _cost_chart(rows, table.keys, paths["cost_png"], title)
    with open(paths["csv"], "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(columns), extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    paths["md"].write_text(f"# {title}\n\n" + markdown_table(rows, columns, success_cols))
    _bar_chart(rows, table.keys, success_cols, paths["png"], title)
    return paths


def _cost_chart(rows: Sequence[Mapping[str, Any]], keys: Sequence[str], path: Path, title: str) -> None:
    """Success against cost: one point per row at (generated tokens, objective), and success per 1M tokens."""
    # lazily: matplotlib is slow to import (0.7 s) and only the plots need it
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.0, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    points = [(r, float(r["tokens"]), float(r["objective"])) for r in rows
              if isinstance(r.get("tokens"), float) and isinstance(r.get("objective"), float)
              and not math.isnan(r["tokens"]) and not math.isnan(r["objective"])]
    xs = [x for _, x, _ in points] or [0.0]
    near = 0.04 * (max(xs) - min(xs) or 1.0)  # labels of points this close in x and within 1 point of success stack
    placed: list[tuple[float, float]] = []
    for r, x, y in points:
        label = ", ".join(f"{k}={r.get(k)}" for k in keys)
        stacked = sum(abs(x - px) <= near and abs(100 * (y - py)) <= 1.0 for px, py in placed)
        placed.append((x, y))
        ax.scatter([x], [100 * y], s=30)
        ax.annotate(f"{label} ({100 * y / max(x / 1e6, 1e-9):.0f}%/Mtok)", (x, 100 * y), fontsize=7,
                    xytext=(4, 4 - 10 * stacked), textcoords="offset points")
    ax.set_xlabel("generated tokens (whole run)")
    ax.set_ylabel("objective: validation success (%)")
    ax.grid(True, alpha=0.3)
    ax.margins(x=0.25, y=0.1)
    ax.set_title(f"{title}\nsuccess against cost", fontsize=10)
    fig.savefig(path, format="png", dpi=100)


def _bar_chart(rows: Sequence[Mapping[str, Any]], keys: Sequence[str], cols: Sequence[str], path: Path,
               title: str) -> None:
    """Grouped bars: one group per row (knob setting), one bar per env column (object API, no pyplot)."""
    # lazily: matplotlib is slow to import (0.7 s) and only the plots need it
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(max(5.0, 1.2 * len(rows) + 2), 3.8), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    labels = [", ".join(f"{k}={r.get(k)}" for k in keys) for r in rows]
    width = 0.8 / max(1, len(cols))
    for j, col in enumerate(cols):
        heights = [100 * r[col] if isinstance(r.get(col), float) and not math.isnan(r[col]) else 0.0 for r in rows]
        bars = ax.bar([i + (j - (len(cols) - 1) / 2) * width for i in range(len(rows))], heights, width, label=col)
        ax.bar_label(bars, fmt="%.1f", fontsize=7)
    ax.set_xticks(range(len(rows)), labels, rotation=20 if len(rows) > 4 else 0, fontsize=8)
    ax.set_ylabel("validation success (%)")
    ax.set_ylim(0, 105)
    ax.grid(True, axis="y", alpha=0.3)
    if cols:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no finished trials", ha="center", va="center", transform=ax.transAxes, color="grey")
    ax.set_title(title)
    fig.savefig(path, format="png", dpi=100)
