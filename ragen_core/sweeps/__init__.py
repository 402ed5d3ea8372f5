"""Optuna ablation studies over rollout-design knobs (RAGEN §5, Tables 2 and 3, Online-k).

    ragen sweep sweeps/smoke.yaml [--workers N]      # flows/sweep.py drives these pieces

- :mod:`.space`: knobs and search space -> one trial's ``--set`` overrides of the base experiment.
- :mod:`.objective`: final / best / area-under-curve of validation success; token or time cost.
- :mod:`.study`: storage (sqlite or any SQLAlchemy URL), heartbeat, sampler/pruner, the
  per-evaluation reporter the train flow calls, when workers stop, and waiting for running
  trials; Optuna's public API only (trials are named by study and number).
- :mod:`.results`: the paper-style table (rows = knob values, columns = success per env) as
  CSV, Markdown and PNG.
- :mod:`.trials`: the trials' life: rounds, a worker's loop, one trial (ask, train, tell), the study's
  parent MLflow run, lost runs, the trials' histories; refusing a pool launch that workers could not serve.
- :mod:`.report`: what a finished sweep publishes (results table, best params, a study's aggregate).
- :mod:`.carry`: a study's finished trials and their runs in a file, so the study goes on on another machine.

Optuna is imported inside functions, so importing this package is cheap. No Prefect here: how a trial
runs (a sub-flow or a deployment run) and how worker processes start are passed in by flows/sweep.py;
MLflow only through ragen_core.tracking. Tests: ``.venv/bin/python -m pytest tests/flows -k sweep -q``.
"""

from ragen_core.sweeps.objective import objective_value, run_cost
from ragen_core.sweeps.results import Table, markdown_table, table_rows, write_table
from ragen_core.sweeps.space import (
    BASE_PARAM,
    KNOBS,
    SweepPlan,
    base_files,
    check_sweep,
    grid_space,
    knob_overrides,
    plan_sweep,
    suggest_params,
    trial_experiment,
    trial_overrides,
    yaml_value,
)
from ragen_core.sweeps.study import (
    PRUNED_REASON,
    RESULT_ATTRS,
    DuplicateTrial,
    dashboard_command,
    duplicate_of,
    fail_stale,
    finished_count,
    make_pruner,
    make_sampler,
    open_storage,
    open_study,
    redact,
    remaining_trials,
    requeue_interrupted,
    requeue_lost,
    running_trials,
    settle,
    stop_when_done,
    storage_url,
    trial_record,
    trial_reporter,
    trial_spec,
    worker_name,
)

__all__ = [
    "BASE_PARAM",
    "KNOBS",
    "PRUNED_REASON",
    "RESULT_ATTRS",
    "DuplicateTrial",
    "SweepPlan",
    "Table",
    "base_files",
    "check_sweep",
    "dashboard_command",
    "duplicate_of",
    "fail_stale",
    "finished_count",
    "grid_space",
    "knob_overrides",
    "make_pruner",
    "make_sampler",
    "markdown_table",
    "objective_value",
    "open_storage",
    "open_study",
    "plan_sweep",
    "redact",
    "remaining_trials",
    "requeue_interrupted",
    "requeue_lost",
    "run_cost",
    "running_trials",
    "settle",
    "stop_when_done",
    "storage_url",
    "suggest_params",
    "table_rows",
    "trial_experiment",
    "trial_overrides",
    "trial_record",
    "trial_reporter",
    "trial_spec",
    "worker_name",
    "write_table",
    "yaml_value",
]
