"""Collapse accounting: what each run of a study did, with convergence told apart from collapse.

On Bandit one answer is right for every prompt, so a converged run shows what the Echo-Trap monitor looks for
(zero reward std, falling entropy and MI) at its best success. Judging the monitor only by "did the run end
lower than its peak" scores every warning on a converged run as a false alarm and a dip that recovered as no
collapse at all. Here a run's success curve (validation where it has one,
:func:`ragen_core.tracking.run_history.success_series`) and its entropy are read as episodes:

- ``converged``: from ``start``, the first step from which every point is within ``drop`` of the run's best, to
  its last step, when the run does not end in a collapse; ``level`` is the mean success there.
- ``no progress``: instead of ``converged``, the whole run when it never rose ``drop`` above its first point and
  that point was not within ``drop`` of full success (1.0): nothing was learned, so there was nothing to converge
  to (on a multi-turn env a run can stay at its start while its replies lose their reasoning). ``level`` is its
  mean success.
- ``sustained collapse``: the run ends at least ``drop`` below its best (:func:`aggregate.collapse_at` gives
  ``start``, from which it stayed there); ``depth`` is the best minus the lowest point from ``start`` on.
- ``transient dip``: a stretch of points at least ``drop`` below the best so far, ended by a point back within
  ``drop`` of it (``end``, the recovery step); ``depth`` is the best so far minus the stretch's lowest point,
  ``duration`` the steps from its first low point to the recovery.
- ``entropy eruption``: a stretch of steps where the policy's entropy (``actor/entropy``) is above ``eruption``
  times its early level (the mean of its first ``baseline`` points): the rise RAGEN-2 reports beside collapse.

A collapse or a dip gets a failure mode from the run's own training metrics at its lowest point (the last logged
value at or before that step): when under half the replies parsed (``rollout/format_ok_ratio``), ``length cap``
if at least half were cut at max_new_tokens (``response/clip_ratio``: the cut is why they do not parse), else
``format``; when they parse, ``wrong action``, however long they are: the replies choose wrong (on Bandit, the
other arm: success there is choosing the higher-expected-value arm, so this is the lock onto the safe arm).
Without the format metric, a cap share of at least half gives ``length cap``.

:func:`score` judges each monitor signal per episode: on a collapse, a dip or an eruption ``hit`` (it fired in
the ``lead`` steps up to the episode's start), ``late`` (it fired during the episode) or ``miss``; on a converged
episode ``false alarm`` (it fired inside it, and not within ``lead`` steps before a failure episode) or ``quiet``;
on a no-progress episode ``fired`` (the same test) or ``quiet``: with no success to lose, a warning there is
neither confirmed nor refuted by the success curve, and the replies say more.

Pure Python over plain data, like the rest of ``sweeps``; tested on hand-made curves
(``tests/unit/test_study_accounting.py``).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ragen_core.sweeps.aggregate import RULE_PATIENCE_KEYS, SIGNALS, Series, collapse_at, no_progress
from ragen_core.tracking.run_history import RunHistory, success_series

__all__ = ["CLASSES", "FAILURES", "MODE_METRICS", "VERDICTS", "Episode", "EpisodeVerdict", "accounting_markdown",
           "episodes", "failure_mode", "fire_steps", "score", "verdict_counts"]

CLASSES = ("converged", "no progress", "sustained collapse", "transient dip", "entropy eruption")
FAILURES = ("sustained collapse", "transient dip", "entropy eruption")
"""The classes a signal should warn of; it should stay quiet on a converged run, and a no-progress run has no
success to lose."""
FAILURE_VERDICTS = ("hit", "late", "miss")
CONVERGED_VERDICTS = ("false alarm", "quiet")
NO_PROGRESS_VERDICTS = ("fired", "quiet")
VERDICTS = {**dict.fromkeys(FAILURES, FAILURE_VERDICTS), "converged": CONVERGED_VERDICTS,
            "no progress": NO_PROGRESS_VERDICTS}
"""The verdicts a signal can get on each class."""
MODE_METRICS = {"format": "rollout/format_ok_ratio", "length cap": "response/clip_ratio"}
"""The training metrics the failure mode is read from."""


@dataclass(frozen=True)
class Episode:
    """One classed window of a run."""

    kind: str
    start: int
    end: int
    """Its last step (a dip: the recovery step)."""
    depth: float | None = None
    """Collapse and dip: success lost (best so far minus the lowest point)."""
    duration: int | None = None
    """Dip: steps from its first low point to the recovery; eruption: steps from its first high point to its last."""
    level: float | None = None
    """Converged and no progress: mean success over the episode; eruption: the highest entropy over its early level."""
    mode: str | None = None
    """Collapse and dip: format, length cap or wrong action (module docstring); None where the metrics are missing."""
    trough: int | None = None
    """Collapse and dip: the step of the lowest point."""


def _points(series: Series) -> list[tuple[int, float]]:
    return sorted((int(s), float(v)) for s, v in series if math.isfinite(float(v)))


def _value_at(series: Series, step: int) -> float | None:
    """The last finite value logged at or before ``step``."""
    before = [v for s, v in _points(series) if s <= step]
    return before[-1] if before else None


def failure_mode(run: RunHistory, step: int) -> str | None:
    """The failure mode at ``step`` from the run's training metrics (module docstring); None without them."""
    fmt = _value_at(run.histories.get(MODE_METRICS["format"], ()), step)
    cap = _value_at(run.histories.get(MODE_METRICS["length cap"], ()), step)
    if fmt is None and cap is None:
        return None
    capped = cap is not None and cap >= 0.5
    if fmt is None:
        return "length cap" if capped else "wrong action"
    if fmt < 0.5:
        return "length cap" if capped else "format"
    return "wrong action"  # the replies parse: cut or not, they chose wrong


def _dips(points: list[tuple[int, float]], drop: float, until: int) -> list[tuple[int, int, float, int]]:
    """(first low step, recovery step, depth, trough step) of each dip that recovered at or before ``until``."""
    out: list[tuple[int, int, float, int]] = []
    best, low_from, low_min, trough = -math.inf, None, math.inf, 0
    for step, value in points:
        if step > until:
            break
        if low_from is None:
            if value <= best - drop + 1e-12:
                low_from, low_min, trough = step, value, step
            else:
                best = max(best, value)
            continue
        if value > best - drop + 1e-12:  # back within drop of the best before the dip
            out.append((low_from, step, best - low_min, trough))
            low_from, best = None, max(best, value)
        elif value < low_min:
            low_min, trough = value, step
    return out


def _eruptions(series: Series, eruption: float, baseline: int) -> list[Episode]:
    points = _points(series)
    if len(points) <= baseline:
        return []
    early = statistics.fmean(v for _, v in points[:baseline])
    if early <= 0:
        return []
    out, start, top, last = [], None, 0.0, 0
    for step, value in points[baseline:]:
        if value > eruption * early:
            start = step if start is None else start
            top, last = max(top, value / early), step
        elif start is not None:
            out.append(Episode("entropy eruption", start, last, duration=last - start, level=top))
            start, top = None, 0.0
    if start is not None:
        out.append(Episode("entropy eruption", start, last, duration=last - start, level=top))
    return out


def episodes(run: RunHistory, drop: float = 0.15, eruption: float = 1.5, baseline: int = 3) -> list[Episode]:
    """The run's classed episodes, in order of their start (module docstring)."""
    _, series = success_series(run)
    points = _points(series)
    out: list[Episode] = []
    if points:
        best = max(v for _, v in points)
        fell = collapse_at(points, drop)
        last = points[-1][0]
        dips_until = last if fell is None else fell
        for first, back, depth, trough in _dips(points, drop, dips_until):
            out.append(Episode("transient dip", first, back, depth=depth, duration=back - first,
                               mode=failure_mode(run, trough), trough=trough))
        if fell is not None:
            after = [(s, v) for s, v in points if s >= fell]
            trough, low = min(after, key=lambda p: (p[1], p[0]))
            out.append(Episode("sustained collapse", fell, last, depth=best - low, mode=failure_mode(run, trough),
                               trough=trough))
        elif no_progress(points, drop):
            out.append(Episode("no progress", points[0][0], last, level=statistics.fmean(v for _, v in points)))
        else:
            start = last
            for step, value in reversed(points):
                if value <= best - drop + 1e-12:  # the same threshold as a collapse and a dip
                    break
                start = step
            level = statistics.fmean(v for s, v in points if s >= start)
            out.append(Episode("converged", start, last, level=level))
    out += _eruptions(run.histories.get("actor/entropy", ()), eruption, baseline)
    return sorted(out, key=lambda e: (e.start, CLASSES.index(e.kind)))


def fire_steps(run: RunHistory, signal: str, patience: Mapping[str, int]) -> list[int]:
    """Every step at which ``signal`` was up in ``run``: the Echo-Trap early warning (``echo_trap``) or a rule's
    streak at its patience (aggregate.SIGNALS)."""
    if signal == "echo_trap":
        return [int(s) for s, v in _points(run.histories.get("health/early_warning", ())) if v > 0]
    if signal not in RULE_PATIENCE_KEYS:
        raise KeyError(f"unknown signal {signal!r}; known: {', '.join(SIGNALS)}")
    need = int(patience.get(signal, 1))
    return [int(s) for s, v in _points(run.histories.get(f"health/{signal}_streak", ())) if v >= need]


@dataclass(frozen=True)
class EpisodeVerdict:
    """How one signal did on one episode of one run."""

    run: str
    group: str
    signal: str
    episode: Episode
    verdict: str
    """hit, late or miss (failure episodes); false alarm or quiet (converged); fired or quiet (no progress)."""
    fired_at: int | None
    """The step that decided it: the first fire in the hit window, during the episode, or inside it."""


def score(run: RunHistory, group: str, patience: Mapping[str, int], drop: float = 0.15, lead: int = 10,
          eruption: float = 1.5, baseline: int = 3) -> list[EpisodeVerdict]:
    """Every (signal, episode) verdict of one run (module docstring)."""
    found = episodes(run, drop, eruption, baseline)
    failures = [e for e in found if e.kind in FAILURES]
    out = []
    for signal in SIGNALS:
        fires = fire_steps(run, signal, patience)
        for ep in found:
            if ep.kind in FAILURES:
                early = [f for f in fires if ep.start - lead <= f <= ep.start]
                during = [f for f in fires if ep.start < f <= ep.end]
                verdict, at = (("hit", early[0]) if early else ("late", during[0]) if during else ("miss", None))
            else:
                warned = [f for f in fires if ep.start <= f <= ep.end
                          and not any(e.start - lead <= f <= e.end for e in failures)]
                up = "false alarm" if ep.kind == "converged" else "fired"
                verdict, at = (up, warned[0]) if warned else ("quiet", None)
            out.append(EpisodeVerdict(run.name, group, signal, ep, verdict, at))
    return out


def verdict_counts(verdicts: Sequence[EpisodeVerdict]) -> dict[tuple[str, str], dict[str, int]]:
    """(signal, class) -> verdict -> count."""
    out: dict[tuple[str, str], dict[str, int]] = {}
    for v in verdicts:
        cell = out.setdefault((v.signal, v.episode.kind), {})
        cell[v.verdict] = cell.get(v.verdict, 0) + 1
    return out


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def accounting_markdown(verdicts: Sequence[EpisodeVerdict], lead: int) -> list[str]:
    """The study report's accounting section: every run's episodes, then each signal's verdicts per class."""
    lines = ["## What each run did", "",
             ("Episodes of each run's success curve (module sweeps/accounting.py): converged (level = mean success "
              "there), no progress (never rose the collapse drop above its first point; level = mean success), "
              "sustained collapse and transient dip (depth = success lost, duration in iterations, failure "
              "mode at the lowest point), entropy eruption (level = highest entropy over its early level)."), "",
             "| run | group | class | from | to | depth | duration | level | mode |",
             "|---|---|---|---|---|---|---|---|---|"]
    seen: set[tuple[str, Episode]] = set()
    for v in verdicts:
        if (v.run, v.episode) in seen:
            continue
        seen.add((v.run, v.episode))
        e = v.episode
        lines.append(f"| {v.run} | {v.group} | {e.kind} | {e.start} | {e.end} | {_fmt(e.depth)} | "
                     f"{'-' if e.duration is None else e.duration} | {_fmt(e.level)} | {e.mode or '-'} |")
    columns = list(dict.fromkeys((*FAILURE_VERDICTS, *CONVERGED_VERDICTS, *NO_PROGRESS_VERDICTS)))
    lines += ["", "## The monitor per class", "",
              (f"On a failure class: hit = the signal was up in the {lead} iterations up to the episode's start, "
               "late = only during it, miss = never. On a converged episode: false alarm = up inside it (and not "
               f"within {lead} iterations before a failure), quiet = not. On a no-progress episode: fired = up "
               "inside it (the same test), quiet = not; the success curve cannot tell whether such a warning was "
               "right."), "",
              "| signal | class | " + " | ".join(columns) + " |",
              "|---|---|" + "---|" * len(columns)]
    counts = verdict_counts(verdicts)
    for signal in SIGNALS:
        for kind in CLASSES:
            cell = counts.get((signal, kind))
            if cell:
                lines.append(f"| {signal} | {kind} | " + " | ".join(
                    str(cell.get(k, 0)) if k in VERDICTS[kind] else "-" for k in columns) + " |")
    return lines
