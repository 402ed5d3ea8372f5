"""The comparison flow: runs side by side from MLflow, as a table and paper-style PNG curves.

    ragen compare bandit-starpo-20260101-120000 bandit-starpo-s-20260101-130000 --out compare-out
    ragen compare --parent echo-trap-bandit --group-by preset --out compare-out   # a study's runs, by preset
    ragen compare --tag study=echo-trap-bandit --tag env=Bandit --group-by preset
    python -c "from flows.compare import compare; print(compare(['<run id>', '<run name>']))"

Each run is an MLflow run id or run name (a run's name is its run directory's name). Writes
``table.md``, ``table.csv``, ``curves.png`` (success, in-group reward std, entropy, grad norm,
response and think length, update seconds over iterations) and one PNG per curve into
``out_dir``. The pure part (rows, table, plots) is ragen_core/compare.py.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from prefect import flow

from flows._ui import publish_markdown
from ragen_core import compare as cmp
from ragen_core.sweeps.aggregate import STUDY_PREFIXES, study_metrics, write_study
from ragen_core.sweeps.shards import local_run_dir, with_shard_metrics
from ragen_core.tracking.history import find_group, tracking_uri_for
from tasks import compare_steps as steps


@flow(name="ragen-compare")
def compare(runs: list[str], out_dir: str = "compare-out", tracking_uri: str | None = None,
            tags: dict[str, str] | None = None, parent: str | None = None, group_by: str | None = None,
            drop: float = 0.15) -> str:
    """Compare ``runs`` (MLflow run ids or names; LookupError for an unknown one); returns the table.

    Groups of runs as well: ``tags`` (every run carrying all of them) and ``parent`` (every run nested
    under that run, e.g. a study's or sweep's parent) add their runs to ``runs``. With ``group_by`` (a tag:
    ``preset``, ``algo``) the runs are also aggregated by its value (ragen_core/sweeps/aggregate.py): curves
    with a band over seeds, a table per group (final and peak success mean ± std, collapsed seeds at a
    success ``drop``), and the monitor's hits and misses, as ``study/`` in ``out_dir``; a run whose folder is
    on this machine gets the metrics read from its replies and states where its tracking lacks them
    (``ragen_core.sweeps.shards.with_shard_metrics``).

    ``tracking_uri`` defaults to the one recorded in the first run given by a local run name or
    directory, else ``$MLFLOW_TRACKING_URI`` or ``sqlite:///$RAGEN_DATA_DIR/mlflow.db``.

    The table and PNGs are also logged to MLflow as artifacts of a new small run
    ``compare-<timestamp>`` (tags ``kind=compare``, ``compared_runs``) in the experiment of the first
    run: a training run is the record of that training, so a comparison gets its own record next to it
    rather than being attached to one of the runs it compares.
    """
    refs = list(runs)
    if not refs and not tags and parent is None:
        raise LookupError("ragen compare needs at least one run id or run name, a --tag or a --parent")
    uri = tracking_uri or tracking_uri_for(refs)
    if tags or parent is not None:
        refs += [r for r in find_group(uri, tags, parent) if r not in refs]
    fetched = steps.fetch_runs(uri, refs, study_metrics() if group_by else (), STUDY_PREFIXES if group_by else ())
    histories = [f.history for f in fetched]
    if group_by:  # the metrics read from the replies and states, for runs whose tracking lacks them
        histories = [dataclasses.replace(h, histories=with_shard_metrics(h.histories, local_run_dir(h.name)))
                     for h in histories]
    files = cmp.write_outputs(histories, Path(out_dir))
    study_md = ""
    if group_by:
        paths = write_study(histories, Path(out_dir) / "study", group_by=group_by, drop=drop,
                            title=f"{len(histories)} runs by {group_by}")
        files += list(paths.values())
        study_md = "\n" + paths["md"].read_text()
    name = f"compare-{time.strftime('%Y%m%d-%H%M%S')}"
    record_tags = {"kind": "compare", "compared_runs": ",".join(h.run_id for h in histories)}
    run_id = steps.log_comparison(uri, fetched[0].experiment_id, name, record_tags, files)
    table = cmp.table_markdown([cmp.summarize(h) for h in histories]) + study_md
    where = f"logged as MLflow run {name} ({run_id}) at {uri}"
    publish_markdown(name, f"{table}\n{where}", f"comparison of {len(histories)} runs"
                     + (f" by {group_by}" if group_by else ""))
    return table + f"\nwritten to {Path(out_dir).resolve()}: {', '.join(f.name for f in files)}\n{where}"
