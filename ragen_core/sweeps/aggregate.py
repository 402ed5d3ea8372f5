"""A study's runs by group (StarPO vs StarPO-S over seeds): curves with a band, a table per group, and the
collapse monitor judged against what the runs did.

    from ragen_core.sweeps.aggregate import write_study
    runs = fetch_runs(uri, run_ids)                       # RunHistory records (tracking/history.py)
    paths = write_study([r.history for r in runs], Path("data/sweeps/echo-trap/study"), group_by="preset")

- :func:`band`: mean and sample std (ddof 1; 0 for one seed) over the seeds that logged a step.
- :func:`group_table`: per group, final and peak validation success (mean ± std over seeds), the mean
  iteration of the peak, how many seeds collapsed, update and rollout seconds per iteration.
- :func:`collapse_at`: a run collapsed when its success curve ends at least ``drop`` below its peak;
  the collapse step is the first step after the peak from which success stayed that low.
- :func:`signal_fires`: when each monitor signal fired in a run: ``echo_trap`` (the Echo-Trap monitor's
  first early warning, RAGEN §4) and RAGEN-2's rules ``reward_std``, ``val_success``, ``empty_filter`` and
  ``template`` (the first step their streak reached the patience).
- :func:`judge`: per run and signal, ``hit`` (fired at or before the collapse; the lead is how many
  iterations before), ``late``, ``miss``, ``false alarm`` (fired, the run did not collapse), ``fired`` (on a run
  of no progress, :func:`no_progress`) or ``quiet``.
- :func:`first_moves`: which of entropy, reward std and MI moved first: the first step after a
  ``baseline``-point window where the signal differs from the window's mean by ``frac`` of it.

Pure Python over plain data (matplotlib only inside :func:`write_study`); no MLflow, no Optuna.
"""

from __future__ import annotations

import csv
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ragen_core.config import HealthConfig
from ragen_core.tracking.plots import plot_curves
from ragen_core.tracking.run_history import RunHistory, success_series

__all__ = [
    "GRAD_COLUMNS",
    "MOVE_SIGNALS",
    "REPLY_METRICS",
    "RULE_PATIENCE_KEYS",
    "RUN_CSV_METRICS",
    "SIGNALS",
    "STEP_GROUP_METRICS",
    "STUDY_CURVES",
    "STUDY_PREFIXES",
    "GroupRow",
    "Judgement",
    "band",
    "collapse_at",
    "first_move",
    "first_moves",
    "grad_markdown",
    "grad_rows",
    "group_bands",
    "group_runs",
    "group_table",
    "judge",
    "monitor_rows",
    "no_progress",
    "reply_markdown",
    "rule_patience",
    "run_rows",
    "signal_fires",
    "step_group_markdown",
    "study_metrics",
    "summary_metrics",
    "write_study",
]

Series = Sequence[tuple[int, float]]

STUDY_CURVES = {
    "validation success": "val/success",
    "train success (rollouts)": "rollout/success",
    "in-group reward std (all)": "rollout/reward_std_all",
    "in-group reward std (kept)": "rollout/reward_std_kept",
    "entropy": "actor/entropy",
    "first-turn I(X;Z) (nats)": "collapse/first_turn/mi",
    "retrieval accuracy": "collapse/first_turn/retrieval_acc",
    "grad norm": "actor/grad_norm",
    "response length (tokens)": "response/length_mean",
    "think length (tokens)": "response/think_length_mean",
}
"""Plot title -> metric of the study's curves (one subplot each, a line and a band per group)."""

SIGNALS = ("echo_trap", "reward_std", "val_success", "empty_filter", "template")
"""The monitor's signals judged on every run (tracking/health.py and tracking/early_stop.py)."""

RULE_PATIENCE_KEYS = {"reward_std": "std_rule_patience", "val_success": "val_rule_patience",
                      "empty_filter": "empty_rule_patience", "template": "template_patience"}
"""HealthConfig field holding each rule's patience."""

MOVE_SIGNALS = {"entropy": "actor/entropy", "reward std": "rollout/reward_std_all", "MI": "collapse/first_turn/mi"}
"""The signals :func:`first_moves` orders (which one moved first)."""


def rule_patience(health: HealthConfig | None = None) -> dict[str, int]:
    """Rule -> its patience in ``health`` (the defaults when None)."""
    h = health or HealthConfig()
    return {rule: getattr(h, key) for rule, key in RULE_PATIENCE_KEYS.items()}


STUDY_PREFIXES = ("grad/",)
"""Metric-name prefixes a study reads whole from each run: names that depend on the run's settings."""

REPLY_METRICS = ("rollout/first_empty_think", "rollout/first_distinct", "rollout/first_top_share",
                 "rollout/first_action_mi", "rollout/first_action_mi_shuffled")
"""Template collapse read from the replies (rollout/metrics.py ``first_turn_metrics``); a study fills them in from
a run's trajectory shards where its tracking lacks them (shards.py ``with_shard_metrics``)."""
STEP_GROUP_METRICS = ("rollout/step_group_share", "rollout/step_group_share_later")
"""How often a prompt group's turns met again in one state (GiGPO's step groups; rollout/metrics.py
``step_group_metrics``), over every turn and over the turns after the first; filled in from the shards too."""
RUN_CSV_METRICS = ("val/success", "rollout/success", "rollout/reward_std_all", "rollout/reward_std_kept",
                   "actor/entropy", "actor/grad_norm", "response/length_mean", "response/clip_ratio",
                   "response/think_length_mean", "rollout/format_ok_ratio", "collapse/first_turn/mi",
                   *REPLY_METRICS, *STEP_GROUP_METRICS, "health/early_warning", "health/level_gap", "timing/update_s",
                   "timing/rollout_s")
"""The columns of a study's per-run curves (runs.csv), one row per run and iteration."""


def study_metrics() -> tuple[str, ...]:
    """Every metric a study reads from a run (curves, per-run CSV, timing, the monitor's streaks and warnings)."""
    return tuple(dict.fromkeys((*STUDY_CURVES.values(), *RUN_CSV_METRICS, "timing/update_s", "timing/rollout_s",
                                "health/early_warning", *(f"health/{rule}_streak" for rule in RULE_PATIENCE_KEYS))))


def band(series_by_run: Iterable[Series]) -> list[tuple[int, float, float, int]]:
    """(step, mean, std, n) for every step any run logged: the mean and sample std over the runs that have it.

    Non-finite values are left out; a step with one value has std 0.
    """
    values: dict[int, list[float]] = {}
    for series in series_by_run:
        for step, value in series:
            if math.isfinite(value):
                values.setdefault(int(step), []).append(float(value))
    return [(step, statistics.fmean(vs), statistics.stdev(vs) if len(vs) > 1 else 0.0, len(vs))
            for step, vs in sorted(values.items())]


def group_runs(runs: Sequence[RunHistory], group_by: str) -> dict[str, list[RunHistory]]:
    """Runs by the value of tag ``group_by`` (``n/a`` when a run lacks it), in order of first appearance.

    Several tags, comma-separated (``env,preset``), group by their values joined with ``/`` (``Bandit/starpo``).
    """
    keys = [k.strip() for k in group_by.split(",")]
    out: dict[str, list[RunHistory]] = {}
    for run in runs:
        out.setdefault("/".join(run.tags.get(k, "n/a") for k in keys), []).append(run)
    return out


def group_bands(groups: Mapping[str, Sequence[RunHistory]],
                metrics: Iterable[str]) -> dict[str, dict[str, list[tuple[int, float, float, int]]]]:
    """group -> metric -> :func:`band` over the group's runs."""
    return {g: {m: band(r.histories.get(m, ()) for r in runs) for m in metrics} for g, runs in groups.items()}


def collapse_at(series: Series, drop: float) -> int | None:
    """The step from which success stayed at least ``drop`` below the run's peak, if the run ended there.

    None when the curve ends within ``drop`` of its peak (no collapse) or is empty. Ties of the peak go
    to its first step.
    """
    points = sorted((int(s), float(v)) for s, v in series if math.isfinite(v))
    if not points:
        return None
    peak = max(v for _, v in points)
    peak_i = next(i for i, (_, v) in enumerate(points) if v == peak)
    low = peak - drop
    if points[-1][1] > low + 1e-12:
        return None
    first = len(points) - 1
    while first - 1 > peak_i and points[first - 1][1] <= low + 1e-12:
        first -= 1
    return points[first][0]


def no_progress(series: Series, drop: float) -> bool:
    """Whether a run never rose ``drop`` above its first point (unless that point was already within ``drop`` of
    1.0) and did not collapse: it had nothing to converge to or collapse from (``accounting``'s no-progress class)."""
    points = sorted((int(s), float(v)) for s, v in series if math.isfinite(v))
    if not points or collapse_at(points, drop) is not None:
        return False
    best = max(v for _, v in points)
    return best < points[0][1] + drop - 1e-12 and points[0][1] < 1.0 - drop - 1e-12


def signal_fires(run: RunHistory, patience: Mapping[str, int]) -> dict[str, int | None]:
    """Signal -> the first step it fired in ``run`` (None: never, or the run did not log it).

    ``patience``: rule -> patience (HealthConfig's ``*_patience``); a rule fires when its streak reaches it.
    """
    out: dict[str, int | None] = {}
    warnings = sorted(run.histories.get("health/early_warning", ()))
    out["echo_trap"] = next((int(s) for s, v in warnings if v > 0), None)
    for rule in RULE_PATIENCE_KEYS:
        streak = sorted(run.histories.get(f"health/{rule}_streak", ()))
        need = int(patience.get(rule, 1))
        out[rule] = next((int(s) for s, v in streak if v >= need), None)
    return out


@dataclass(frozen=True)
class Judgement:
    """How one signal did on one run."""

    run: str
    group: str
    signal: str
    fired_at: int | None
    collapse_at: int | None
    verdict: str
    """hit, late, miss, false alarm, fired or quiet."""

    @property
    def lead(self) -> int | None:
        """Iterations between the signal and the collapse, for a hit."""
        if self.verdict != "hit" or self.fired_at is None or self.collapse_at is None:
            return None
        return self.collapse_at - self.fired_at


def judge(fired_at: int | None, collapsed_at: int | None, progressed: bool = True) -> str:
    """The verdict of one signal on one run (module docstring); ``progressed`` False: a run of no progress
    (:func:`no_progress`), on which a firing is ``fired``, not a false alarm."""
    if collapsed_at is None:
        return "quiet" if fired_at is None else "false alarm" if progressed else "fired"
    if fired_at is None:
        return "miss"
    return "hit" if fired_at <= collapsed_at else "late"


def first_move(series: Series, baseline: int = 3, frac: float = 0.3) -> int | None:
    """The first step after the first ``baseline`` points whose value differs from their mean by more than
    ``frac`` of it (up or down); None if it never does, or the series is too short or its baseline is 0."""
    points = sorted((int(s), float(v)) for s, v in series if math.isfinite(v))
    if len(points) <= baseline:
        return None
    level = statistics.fmean(v for _, v in points[:baseline])
    if level == 0:
        return None
    return next((s for s, v in points[baseline:] if abs(v - level) > frac * abs(level)), None)


def first_moves(run: RunHistory, baseline: int = 3, frac: float = 0.3) -> dict[str, int | None]:
    """Signal name (:data:`MOVE_SIGNALS`) -> the step it first moved in ``run``."""
    return {name: first_move(run.histories.get(metric, ()), baseline, frac) for name, metric in MOVE_SIGNALS.items()}


@dataclass(frozen=True)
class GroupRow:
    """One group's line of the study table; None where no run logged the quantity."""

    group: str
    seeds: int
    final_mean: float | None
    final_std: float | None
    peak_mean: float | None
    peak_std: float | None
    peak_iteration_mean: float | None
    collapsed: int
    update_s: float | None
    rollout_s: float | None


def _mean_std(values: Sequence[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def _run_mean(run: RunHistory, metric: str) -> float | None:
    vals = [v for _, v in run.histories.get(metric, ()) if math.isfinite(v)]
    return statistics.fmean(vals) if vals else None


def group_table(groups: Mapping[str, Sequence[RunHistory]], drop: float) -> list[GroupRow]:
    """One :class:`GroupRow` per group (success from :func:`ragen_core.tracking.run_history.success_series`)."""
    rows = []
    for group, runs in groups.items():
        finals, peaks, peak_steps, collapsed = [], [], [], 0
        for run in runs:
            _, series = success_series(run)
            points = sorted((s, v) for s, v in series if math.isfinite(v))
            if not points:
                continue
            peak = max(v for _, v in points)
            finals.append(points[-1][1])
            peaks.append(peak)
            peak_steps.append(next(s for s, v in points if v == peak))
            collapsed += collapse_at(points, drop) is not None
        upd = [x for x in (_run_mean(r, "timing/update_s") for r in runs) if x is not None]
        rol = [x for x in (_run_mean(r, "timing/rollout_s") for r in runs) if x is not None]
        fm, fs = _mean_std(finals)
        pm, ps = _mean_std(peaks)
        rows.append(GroupRow(group, len(runs), fm, fs, pm, ps, statistics.fmean(peak_steps) if peak_steps else None,
                             collapsed, statistics.fmean(upd) if upd else None, statistics.fmean(rol) if rol else None))
    return rows


def monitor_rows(groups: Mapping[str, Sequence[RunHistory]], patience: Mapping[str, int],
                 drop: float) -> list[Judgement]:
    """Every (run, signal) judgement of the study."""
    out = []
    for group, runs in groups.items():
        for run in runs:
            _, series = success_series(run)
            fell, progressed = collapse_at(series, drop), not no_progress(series, drop)
            for signal, fired in signal_fires(run, patience).items():
                out.append(Judgement(run.name, group, signal, fired, fell, judge(fired, fell, progressed)))
    return out


VERDICTS = ("hit", "late", "miss", "false alarm", "fired", "quiet")


def _num(value: float | None, fmt: str = ".3f") -> str:
    return "n/a" if value is None else format(value, fmt)


def _pm(mean: float | None, std: float | None) -> str:
    return "n/a" if mean is None else f"{mean:.3f} ± {std or 0.0:.3f}"


def _md(header: Sequence[str], rows: Iterable[Sequence[object]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return lines + ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]


def study_markdown(title: str, table: Sequence[GroupRow], judgements: Sequence[Judgement],
                   moves: Mapping[str, Mapping[str, int | None]], drop: float) -> str:
    """The study report: the table per group, the monitor's verdicts, and which signal moved first."""
    lines = [f"# {title}", "", (f"Success is validation success; a run collapsed when it ended at least {drop:g} "
                                "below its peak (the collapse step: from when it stayed there)."), ""]
    lines += _md(["group", "seeds", "final success", "peak success", "peak at iter (mean)", "collapsed",
                  "update s/iter", "rollout s/iter"],
                 [(r.group, r.seeds, _pm(r.final_mean, r.final_std), _pm(r.peak_mean, r.peak_std),
                   _num(r.peak_iteration_mean, ".1f"), f"{r.collapsed}/{r.seeds}", _num(r.update_s, ".2f"),
                   _num(r.rollout_s, ".2f")) for r in table])
    lines += ["", "## The monitor on these runs", "",
              ("Per signal: hit = fired at or before the collapse (mean lead in iterations), late = after it, "
               "miss = the run collapsed and it never fired, false alarm = fired on a run that did not collapse, "
               "fired = fired on a run that made no progress (never rose the collapse drop above its first "
               "evaluation: nothing to lose, so neither right nor wrong)."), ""]
    counts = []
    for signal in SIGNALS:
        js = [j for j in judgements if j.signal == signal]
        leads = [j.lead for j in js if j.lead is not None]
        counts.append((signal, *(sum(j.verdict == v for j in js) for v in VERDICTS),
                       _num(statistics.fmean(leads) if leads else None, ".1f")))
    lines += _md(["signal", *VERDICTS, "mean lead"], counts)
    lines += ["", "Per run (step it fired; '-' never):", ""]
    runs = list(dict.fromkeys((j.group, j.run) for j in judgements))
    by = {(j.run, j.signal): j for j in judgements}
    per_run = []
    for group, run in runs:
        fell = by[(run, SIGNALS[0])].collapse_at
        cells = [f"{by[(run, s)].verdict} ({'-' if by[(run, s)].fired_at is None else by[(run, s)].fired_at})"
                 for s in SIGNALS]
        per_run.append((run, group, "-" if fell is None else fell, *cells))
    lines += _md(["run", "group", "collapsed at", *SIGNALS], per_run)
    lines += ["", "## Which signal moved first", "",
              "The first step after the first 3 points where a signal left their mean by more than 30%.", ""]
    move_rows = []
    for run, steps in moves.items():
        moved = {k: v for k, v in steps.items() if v is not None}
        first = min(moved.values()) if moved else None
        leaders = ", ".join(k for k, v in moved.items() if v == first) if moved else "none"
        move_rows.append((run, *("-" if steps[k] is None else steps[k] for k in MOVE_SIGNALS), leaders))
    lines += _md(["run", *MOVE_SIGNALS, "first"], move_rows)
    return "\n".join(lines) + "\n"


def summary_metrics(table: Sequence[GroupRow]) -> dict[str, float]:
    """The table as metrics for the parent run, e.g. ``val/study/<group>/final_success_mean``,
    ``health/study/<group>/collapsed_seeds``, ``timing/study/<group>/update_s`` (None left out)."""
    out = {}
    for r in table:
        for key, value in (("val/study/{}/final_success_mean", r.final_mean),
                           ("val/study/{}/final_success_std", r.final_std),
                           ("val/study/{}/peak_success_mean", r.peak_mean),
                           ("val/study/{}/peak_success_std", r.peak_std),
                           ("val/study/{}/seeds", float(r.seeds)),
                           ("health/study/{}/collapsed_seeds", float(r.collapsed)),
                           ("timing/study/{}/update_s", r.update_s)):
            if value is not None:
                out[key.format(r.group)] = float(value)
    return out


GRAD_COLUMNS = ("task", "entropy", "kl", "value", "rows")
"""grad.csv's measured columns: the gradient norm of each loss term over a bucket's rows, and how many rows."""


def _bucket_order(bucket: str) -> tuple[int, float, str]:
    """zero, then le_<edge> by edge, then gt_<edge> (the order trainer.update.bucket_names makes)."""
    kind, _, edge = bucket.partition("_")
    try:
        value = float(edge)
    except ValueError:
        value = 0.0
    return ({"zero": 0, "le": 1, "gt": 2}.get(kind, 3), value, bucket)


def grad_rows(groups: Mapping[str, Sequence[RunHistory]]) -> list[list[object]]:
    """grad.csv's rows: run, group, seed, iteration, bucket, then :data:`GRAD_COLUMNS` (empty where not logged),
    from each run's ``grad/<bucket>/<term>`` histories (``diagnostics.grad_buckets_every``)."""
    rows: list[list[object]] = []
    for group, runs in groups.items():
        for run in runs:
            cells: dict[tuple[int, str], dict[str, float]] = {}
            for name, series in run.histories.items():
                head, _, rest = name.partition("/")
                bucket, _, term = rest.rpartition("/")
                if head != "grad" or not bucket or term not in GRAD_COLUMNS:
                    continue
                for step, value in series:
                    cells.setdefault((int(step), bucket), {})[term] = value
            for (step, bucket), values in sorted(cells.items(), key=lambda kv: (kv[0][0], _bucket_order(kv[0][1]))):
                rows.append([run.name, group, run.tags.get("seed", ""), step, bucket,
                             *(values.get(c) for c in GRAD_COLUMNS)])
    return rows


def grad_markdown(rows: Sequence[Sequence[object]]) -> list[str]:
    """The gradient analysis per group and bucket: measurements, mean rows, mean norm of each term over the
    measurements where the bucket had rows, and the task term over the regularisers (entropy + KL)."""
    if not rows:
        return []
    cells: dict[tuple[str, str], list[dict[str, float]]] = {}
    for _run, group, _seed, _step, bucket, *values in rows:
        cells.setdefault((str(group), str(bucket)), []).append(
            {c: float(v) for c, v in zip(GRAD_COLUMNS, values, strict=True) if isinstance(v, (int, float))})
    table = []
    for (group, bucket), measured in sorted(cells.items(), key=lambda kv: (kv[0][0], _bucket_order(kv[0][1]))):
        filled = [m for m in measured if m.get("rows", 0) > 0]

        def mean(term: str, of: list[dict[str, float]]) -> float | None:
            values = [m[term] for m in of if term in m and math.isfinite(m[term])]
            return statistics.fmean(values) if values else None

        ratios = [m["task"] / (m.get("entropy", 0.0) + m.get("kl", 0.0)) for m in filled
                  if "task" in m and m.get("entropy", 0.0) + m.get("kl", 0.0) > 0]
        table.append((group, bucket, f"{len(filled)}/{len(measured)}", _num(mean("rows", measured), ".1f"),
                      *(_num(mean(t, filled), ".3g") for t in ("task", "entropy", "kl", "value")),
                      _num(statistics.fmean(ratios) if ratios else None, ".3g")))
    return ["", "## Gradient by reward-std bucket", "",
            ("RAGEN-2's analysis, every `diagnostics.grad_buckets_every` iterations before the update, on the "
             "unfiltered batch: the gradient norm of each loss term over the groups of each in-group reward-std "
             "bucket, mean over the measurements where the bucket had rows; task ÷ regularisers is the mean of "
             "task / (entropy + KL) per measurement. StarPO-S keeps the groups of largest std, so its update "
             "never sees most of the zero and low buckets."), "",
            *_md(["group", "bucket", "with rows", "rows (mean)", "task", "entropy", "kl", "value",
                  "task ÷ regularisers"], table)]


def _write_csv(path: Path, header: Sequence[str], rows: Iterable[Sequence[object]]) -> Path:
    with path.open("w", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(header)
        writer.writerows([["" if v is None else v for v in row] for row in rows])
    return path


def run_rows(groups: Mapping[str, Sequence[RunHistory]]) -> list[list[object]]:
    """runs.csv's rows: run, group, seed, iteration, then :data:`RUN_CSV_METRICS` (empty where not logged)."""
    rows: list[list[object]] = []
    for group, runs in groups.items():
        for run in runs:
            by_metric = {m: dict(run.histories.get(m, ())) for m in RUN_CSV_METRICS}
            steps = sorted({int(s) for values in by_metric.values() for s in values})
            for step in steps:
                rows.append([run.name, group, run.tags.get("seed", ""), step,
                             *(by_metric[m].get(step) for m in RUN_CSV_METRICS)])
    return rows


def reply_markdown(groups: Mapping[str, Sequence[RunHistory]], span: int = 3) -> list[str]:
    """Each run's first-turn reply metrics (:data:`REPLY_METRICS`) at its start and its end: the mean over its
    first and its last ``span`` iterations. Empty when no run has them."""
    rows = []
    for group, runs in groups.items():
        for run in runs:
            mi, shuffled = run.histories.get("rollout/first_action_mi", ()), run.histories.get(
                "rollout/first_action_mi_shuffled", ())
            if not mi or not shuffled:
                continue
            excess = tuple((s, v - dict(shuffled)[s]) for s, v in mi if s in dict(shuffled))

            def ends(series: Series) -> str:
                values = [float(v) for _, v in sorted(series) if math.isfinite(float(v))]
                if not values:
                    return "-"
                return f"{statistics.fmean(values[:span]):.2f} → {statistics.fmean(values[-span:]):.2f}"

            rows.append((run.name, group, ends(excess), *(ends(run.histories.get(k, ())) for k in (
                "rollout/first_empty_think", "rollout/first_distinct", "rollout/first_top_share"))))
    if not rows:
        return []
    return ["", "## Template signals in the replies", "",
            (f"Each run's first-turn replies (every member of a prompt group sees the same state), mean of its first "
             f"{span} iterations → its last {span}: I(state; first action) above its shuffled level (nats; near 0: "
             "the first move does not depend on the state), the share with no reasoning tokens, distinct reply "
             "texts per reply, and the most common reply's share (module rollout/metrics.py)."), "",
            *_md(["run", "group", "I(state; first action) − shuffled", "empty think", "distinct", "top reply"],
                 rows)]


def step_group_markdown(groups: Mapping[str, Sequence[RunHistory]]) -> list[str]:
    """Per run, how often states recurred within a prompt group (:data:`STEP_GROUP_METRICS`): the mean over its
    iterations, with the lowest and highest iteration. Empty when no run has them."""
    def spread(series: Series) -> str:
        values = [float(v) for _, v in series if math.isfinite(float(v))]
        if not values:
            return "-"
        return f"{statistics.fmean(values):.2f} ({min(values):.2f}-{max(values):.2f})"

    rows = [(run.name, group, *(spread(run.histories.get(m, ())) for m in STEP_GROUP_METRICS))
            for group, runs in groups.items() for run in runs
            if any(run.histories.get(m) for m in STEP_GROUP_METRICS)]
    if not rows:
        return []
    return ["", "## How often states recurred (step groups)", "",
            ("Each run's share of turns that acted on a state another turn of the same prompt group also acted on "
             "(GiGPO's step groups: only these turns get a step advantage; a step group of one adds nothing), over "
             "every turn and over the turns after the first (a group's first turns all act on its initial state): "
             "the mean over the run's iterations (lowest-highest)."), "",
            *_md(["run", "group", "all turns", "turns after the first"], rows)]


def write_study(runs: Sequence[RunHistory], out_dir: Path, group_by: str = "preset", drop: float = 0.15,
                patience: Mapping[str, int] | None = None, title: str = "study", lead: int = 10) -> dict[str, Path]:
    """study.md, groups.csv, monitor.csv, episodes.csv (sweeps/accounting.py: what each run did and the
    monitor's verdicts per class, ``lead`` iterations counting as early), runs.csv (every run's curves),
    grad.csv (the gradient analysis per bucket, when the runs logged it),
    curves.csv and curves.png (mean line and ±1 std band per group) into ``out_dir``; returns them by kind."""
    from ragen_core.sweeps import accounting  # it builds on this module's collapse_at and signals

    if not runs:
        raise ValueError("nothing to aggregate: no runs")
    patience = rule_patience() if patience is None else patience
    out_dir.mkdir(parents=True, exist_ok=True)
    groups = group_runs(runs, group_by)
    table = group_table(groups, drop)
    judgements = monitor_rows(groups, patience, drop)
    moves = {run.name: first_moves(run) for run in runs}
    verdicts = [v for g, rs in groups.items() for r in rs for v in accounting.score(r, g, patience, drop, lead)]
    paths = {"md": out_dir / "study.md"}
    report = study_markdown(title, table, judgements, moves, drop)
    grads = grad_rows(groups)
    paths["md"].write_text(report + "\n" + "\n".join([*accounting.accounting_markdown(verdicts, lead),
                                                       *grad_markdown(grads), *reply_markdown(groups),
                                                       *step_group_markdown(groups)]) + "\n")
    if grads:
        paths["grad"] = _write_csv(out_dir / "grad.csv", ["run", group_by, "seed", "iteration", "bucket",
                                                          *GRAD_COLUMNS], grads)
    paths["episodes"] = _write_csv(out_dir / "episodes.csv", ["run", "group", "signal", "class", "start", "end",
                                                              "depth", "duration", "level", "mode", "verdict",
                                                              "fired_at"],
                                   [(v.run, v.group, v.signal, v.episode.kind, v.episode.start, v.episode.end,
                                     v.episode.depth, v.episode.duration, v.episode.level, v.episode.mode, v.verdict,
                                     v.fired_at) for v in verdicts])
    paths["runs"] = _write_csv(out_dir / "runs.csv", ["run", group_by, "seed", "iteration", *RUN_CSV_METRICS],
                               run_rows(groups))
    paths["groups"] = _write_csv(out_dir / "groups.csv", ["group", "seeds", "final_mean", "final_std", "peak_mean",
                                                          "peak_std", "peak_iteration_mean", "collapsed",
                                                          "update_s", "rollout_s"],
                                 [(r.group, r.seeds, r.final_mean, r.final_std, r.peak_mean, r.peak_std,
                                   r.peak_iteration_mean, r.collapsed, r.update_s, r.rollout_s) for r in table])
    paths["monitor"] = _write_csv(out_dir / "monitor.csv", ["run", "group", "signal", "fired_at", "collapse_at",
                                                            "verdict", "lead"],
                                  [(j.run, j.group, j.signal, j.fired_at, j.collapse_at, j.verdict, j.lead)
                                   for j in judgements])
    bands = group_bands(groups, STUDY_CURVES.values())
    paths["curves"] = _write_csv(out_dir / "curves.csv", ["group", "metric", "step", "mean", "std", "n"],
                                 [(g, m, *point) for g, by_metric in bands.items()
                                  for m, points in by_metric.items() for point in points])
    lines = {f"{g} (n={len(groups[g])})": {title_: [(s, mean) for s, mean, _, _ in bands[g][m]]
                                           for title_, m in STUDY_CURVES.items()} for g in groups}
    spread = {f"{g} (n={len(groups[g])})": {title_: [(s, mean - std, mean + std) for s, mean, std, _ in bands[g][m]]
                                            for title_, m in STUDY_CURVES.items()} for g in groups}
    paths["png"] = plot_curves(lines, list(STUDY_CURVES), out_dir / "curves.png", title, bands=spread)
    return paths
