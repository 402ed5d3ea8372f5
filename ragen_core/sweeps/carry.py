"""A study's finished trials carried in a file, so the study resumes on another machine.

    carry: carry/echo-trap-frozenlake.jsonl     # in the study YAML, relative to it
    ragen study studies/echo-trap-frozenlake.yaml
    git add studies/carry/echo-trap-frozenlake.jsonl   # then, on another machine, the same `ragen study` goes on

A study's state lives in its Optuna storage, its MLflow runs and its run folders, all under the data folder of
the machine it ran on. A long study on a CPU outlives a session, and the next session may start on a fresh
machine. With ``carry`` set, every finished trial (COMPLETE or PRUNED) is written to the file as one JSON line:
its grid point, value, curve and other attributes, and its run's tags, params and metric histories
(:func:`ragen_core.tracking.history.export_run`). The file is rewritten after each trial and at the end of
the study. When the study starts, each trial in the file whose grid point has no finished trial here yet is
added to the Optuna study as finished, and its run is made again in MLflow under the study's parent run, tagged
``carried_from`` with its first id. The report, ``ragen compare --parent`` and the grid sampler then treat it
like a trial that ran here. Its line stays as it was when the file is rewritten (its first trial number, times
and run id), so moving a study does not change the lines of the trials it carried.

What does not travel: run folders (checkpoints, trajectory shards, curves.png) and artifacts. The metrics a
report reads from a run's shards where its tracking lacks them (:mod:`ragen_core.sweeps.shards`) are filled into
the run's histories before it is written, so they travel. A trial that was
running when the file was written is not in it and runs again from its start. Lines are sorted by grid point,
so a diff shows what changed.

Tests: ``.venv/bin/python -m pytest tests/flows/test_study_carry.py -q``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from filelock import FileLock

from ragen_core.config import ConfigError, load_experiment
from ragen_core.sweeps.shards import with_shard_metrics
from ragen_core.sweeps.space import SweepPlan
from ragen_core.tracking.factory import tracking_uri
from ragen_core.tracking.history import export_run, import_run

if TYPE_CHECKING:
    import optuna  # lazily: see study.py's note

__all__ = ["CARRY_VERSION", "carry_in", "carry_out", "carry_writer", "read_carry", "trial_lines"]

CARRY_VERSION = 1
"""Format of a carry file's lines (``"carry"`` in each line); a line of another version is refused."""

_MACHINE_ATTRS = ("run_dir", "worker")
"""Trial attributes that name things of the machine a trial ran on; left out of the file."""

_FINISHED = ("COMPLETE", "PRUNED")


def _uri(plan: SweepPlan) -> str | None:
    base = load_experiment(plan.sweep.base, plan.sweep.overrides)
    return None if base.tracking.backend == "none" else tracking_uri(base)


def _point(params: Mapping[str, Any]) -> str:
    return json.dumps(dict(params), sort_keys=True)


def trial_lines(study: optuna.Study, uri: str | None, known: Sequence[Mapping[str, Any]] = ()
                ) -> list[dict[str, Any]]:
    """One record per finished trial of ``study`` (COMPLETE or PRUNED, not a skipped duplicate), sorted by grid
    point. ``known``: the records already in the file. A trial carried in from one of them is written as that
    record, unchanged (its first number, times and run id, not those it was given here); a trial whose run is in
    one of them takes the run from there, not read again."""
    from optuna.distributions import distribution_to_json  # lazily: see study.py's note

    by_run = {r["run"]["run_id"]: r for r in known if r.get("run")}
    by_trial = {(_point(r["params"]), r["number"]): r for r in known}
    out: list[dict[str, Any]] = []
    for t in study.get_trials(deepcopy=False):
        if t.state.name not in _FINISHED or t.user_attrs.get("skipped"):
            continue
        carried = t.user_attrs.get("carried_from") or {}
        original = by_trial.get((_point(t.params), carried.get("trial")))
        if original is not None:
            out.append(dict(original))
            continue
        run_id = t.user_attrs.get("mlflow_run_id")
        run = None
        if run_id and run_id in by_run:
            run = by_run[run_id]["run"]
        elif run_id and uri:
            run = _with_shard_metrics(export_run(uri, run_id), t.user_attrs.get("run_dir"))
        out.append({
            "carry": CARRY_VERSION, "study": study.study_name, "number": t.number, "state": t.state.name,
            "params": t.params, "distributions": {k: distribution_to_json(d) for k, d in t.distributions.items()},
            "values": t.values, "intermediate_values": {str(k): v for k, v in t.intermediate_values.items()},
            "user_attrs": {k: v for k, v in t.user_attrs.items() if k not in _MACHINE_ATTRS},
            "system_attrs": {k: t.system_attrs[k] for k in ("grid_id", "search_space") if k in t.system_attrs},
            "datetime_start": t.datetime_start.isoformat() if t.datetime_start else None,
            "datetime_complete": t.datetime_complete.isoformat() if t.datetime_complete else None,
            "run": run})
    return sorted(out, key=lambda r: (_point(r["params"]), r["number"]))


def _with_shard_metrics(run: dict[str, Any], run_dir: str | None) -> dict[str, Any]:
    """An :func:`export_run` record with the metrics read from the run's trajectory shards where its tracking lacks
    them (the shards do not travel)."""
    series = {name: tuple((int(step), value) for step, value in points) for name, points in run["metrics"].items()}
    filled = with_shard_metrics(series, run_dir)
    return {**run, "metrics": {name: [[step, value] for step, value in points] for name, points in filled.items()}}


def read_carry(path: str | os.PathLike[str], study_name: str) -> list[dict[str, Any]]:
    """The records of a carry file ([] when there is none). A line that is not a record of this study in this
    format is a ConfigError naming the file and the line."""
    p = Path(path)
    if not p.is_file():
        return []
    records = []
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"carry: {p} line {n} is not JSON ({e.msg}); fix or remove the file") from None
        if not isinstance(record, dict) or record.get("carry") != CARRY_VERSION:
            raise ConfigError(f"carry: {p} line {n} is not a carried trial of format {CARRY_VERSION}")
        if record.get("study") != study_name:
            raise ConfigError(f"carry: {p} line {n} is a trial of study {record.get('study')!r}, not "
                              f"{study_name!r}; name another carry file")
        missing = [k for k in ("number", "state", "params", "distributions", "values") if k not in record]
        if missing or record["state"] not in _FINISHED:
            raise ConfigError(f"carry: {p} line {n}: {'missing ' + ', '.join(missing) if missing else 'state'} "
                              f"{record.get('state')!r}: only finished trials (COMPLETE, PRUNED) are carried")
        records.append(record)
    return records


def carry_out(plan: SweepPlan, study: optuna.Study, say: Callable[[str], None] = print) -> Path | None:
    """Rewrite the sweep's carry file with every finished trial; returns it (None when ``carry`` is not set, or
    the file could not be written: that is said, not raised, so the study goes on and the next trial's write
    tries again).

    Several workers finish trials: a lock in the sweep's folder orders them, and the file is replaced whole, so a
    reader never sees half of it."""
    if not plan.sweep.carry:
        return None
    path = Path(plan.sweep.carry)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        plan.out_dir.mkdir(parents=True, exist_ok=True)
        with FileLock(plan.out_dir / "carry.lock"):
            lines = trial_lines(study, _uri(plan), read_carry(path, plan.sweep.name))
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in lines))
            os.replace(tmp, path)
    except Exception as e:  # noqa: BLE001 -- a carry file that cannot be written must not stop the study
        say(f"[sweep] could not write the carry file {path}: {type(e).__name__}: {e}")
        tmp.unlink(missing_ok=True)
        return None
    return path


def carry_writer(plan: SweepPlan) -> Callable[[optuna.Study, optuna.trial.FrozenTrial], None]:
    """An ``optimize`` callback: rewrite the carry file when a trial finished (COMPLETE or PRUNED)."""

    def callback(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        if trial.state.name in _FINISHED:
            carry_out(plan, study)

    return callback


def carry_in(plan: SweepPlan, study: optuna.Study, parent_run_id: str | None,
             say: Callable[[str], None] = print) -> list[int]:
    """Add to ``study`` the carried trials whose grid point has no finished trial yet, each with its run made again
    under ``parent_run_id``; returns the new trials' numbers. Refused (ConfigError, nothing added) when the file
    does not fit this study: another grid, or runs to carry without tracking here."""
    import optuna  # lazily: see study.py's note
    from optuna.distributions import json_to_distribution

    if not plan.sweep.carry:
        return []
    records = read_carry(plan.sweep.carry, plan.sweep.name)
    space = {k: list(v) for k, v in plan.grid.items()} if plan.grid is not None else None
    for r in records:
        carried_space = (r.get("system_attrs") or {}).get("search_space")
        if space is not None and carried_space != space:
            raise ConfigError(f"carry: {plan.sweep.carry}: trial {r['number']} ran on the grid {carried_space}, "
                              f"this study's grid is {space}; name another carry file or study")
    done = {_point(t.params) for t in study.get_trials(deepcopy=False)
            if t.state.name in _FINISHED and not t.user_attrs.get("skipped")}
    todo = {_point(r["params"]): r for r in records if _point(r["params"]) not in done}
    uri = _uri(plan)
    if any(r.get("run") for r in todo.values()) and (uri is None or parent_run_id is None):
        raise ConfigError(f"carry: {plan.sweep.carry} holds tracked runs and this study's tracking is off; "
                          "turn tracking on to carry them")
    added = []
    for r in todo.values():
        attrs = dict(r.get("user_attrs") or {})
        if r.get("run"):
            assert uri is not None and parent_run_id is not None  # checked above
            number = len(study.get_trials(deepcopy=False))  # add_trial numbers the next trial so
            attrs["mlflow_run_id"] = import_run(uri, r["run"], parent_run_id,
                                                {"study": plan.sweep.name, "trial": str(number)})
        attrs["carried_from"] = {"trial": r["number"], "mlflow_run_id": (r.get("run") or {}).get("run_id")}
        values = r["values"]
        study.add_trial(optuna.trial.create_trial(
            state=optuna.trial.TrialState[r["state"]], params=r["params"],
            distributions={k: json_to_distribution(d) for k, d in r["distributions"].items()},
            values=values if r["state"] == "COMPLETE" else None,
            intermediate_values={int(k): v for k, v in (r.get("intermediate_values") or {}).items()},
            user_attrs=attrs, system_attrs=dict(r.get("system_attrs") or {})))
        added.append(len(study.get_trials(deepcopy=False)) - 1)
    if added:
        say(f"[sweep] carried in {len(added)} finished trial(s) from {plan.sweep.carry}: trials {added}")
    return added

