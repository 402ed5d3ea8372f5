"""Metrics read back from a run's trajectory shards, for runs whose tracking lacks them.

    from ragen_core.sweeps.shards import local_run_dir, with_shard_metrics
    histories = with_shard_metrics(histories, local_run_dir(run_name))

The session logs the first-turn reply metrics and how often states recurred (``ragen_core.rollout.metrics``);
runs made by code that did not log them still have their Parquet shards while their folder is on this machine.
A study's report (trials.py), ``ragen compare --group-by`` (flows/compare.py) and a study's carry file (carry.py)
fill them in from there.
"""

from __future__ import annotations

from pathlib import Path

from ragen_core.store.run_dir import RunDir
from ragen_core.tracking.run_history import Series

__all__ = ["local_run_dir", "with_shard_metrics"]


def with_shard_metrics(histories: dict[str, Series], run_dir: str | None) -> dict[str, Series]:
    """``histories`` with the metrics read from the replies and states (``rollout.metrics``: the first-turn reply
    metrics of ``first_turn_metrics``, how often states recurred in ``step_group_metrics``) computed from the run's
    trajectory shards at the iterations its tracking lacks them (runs made by code that did not log them);
    unchanged when the run's folder is not here."""
    if not run_dir or not Path(run_dir).is_dir():
        return histories
    from ragen_core.rollout.metrics import first_turn_metrics, step_group_metrics  # lazily: torch comes with it
    from ragen_core.store.parquet import read_run, read_trajectories

    frame = read_run(run_dir)
    if frame.empty:
        return histories
    out = dict(histories)
    for iteration in sorted(int(i) for i in frame["iteration"].unique()):
        trajs = read_trajectories(frame[frame["iteration"] == iteration])
        for key, value in {**first_turn_metrics(trajs), **step_group_metrics(trajs)}.items():
            logged = dict(out.get(key, ()))
            logged.setdefault(iteration, value)
            out[key] = tuple(sorted(logged.items()))
    return out


def local_run_dir(name: str) -> str | None:
    """The folder of the run ``name`` under ``$RAGEN_DATA_DIR/runs`` (or ``name`` itself if it is a run folder), or
    None when it is not on this machine."""
    try:
        return str(RunDir.find(name).path)
    except FileNotFoundError:
        return None
