"""What a finished sweep publishes: the paper-style results table with the best parameters, and a study's
aggregate by ``group_by``; written under the sweep's folder and logged on the parent run (any MetricLogger).
tasks/sweep_steps.py runs each as a Prefect task."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ragen_core.config import load_experiment
from ragen_core.sweeps.aggregate import group_runs, group_table, rule_patience, summary_metrics, write_study
from ragen_core.sweeps.results import table_rows, write_table
from ragen_core.sweeps.space import SweepPlan
from ragen_core.sweeps.study import dashboard_command, redact
from ragen_core.tracking import MetricLogger
from ragen_core.tracking.run_history import RunHistory

if TYPE_CHECKING:
    from optuna import Study  # lazily: see study.py's note


def study_report(plan: SweepPlan, runs: list[RunHistory], parent: MetricLogger) -> str:
    """A study's aggregate (ragen_core/sweeps/aggregate.py) under the sweep's folder and on the parent run."""
    sweep = plan.sweep
    assert sweep.group_by is not None
    if not runs:
        return "study: no trial has a tracked run to aggregate"
    patience = rule_patience(load_experiment(sweep.base, sweep.overrides).health)
    paths = write_study(runs, plan.out_dir / "study", group_by=sweep.group_by, drop=sweep.collapse_drop,
                        patience=patience, title=f"{sweep.name}: {len(runs)} runs by {sweep.group_by}")
    for path in paths.values():
        parent.log_artifact(path, "study")
    parent.log_metrics(summary_metrics(group_table(group_runs(runs, sweep.group_by), sweep.collapse_drop)), step=0)
    parent.flush()
    return paths["md"].read_text().strip() + f"\n\nstudy files: {paths['md'].parent}"


def results_report(plan: SweepPlan, study: Study, parent: MetricLogger, url: str) -> str:
    """The paper-style table (CSV, Markdown, PNG) and the best params on the parent run; a summary."""
    from optuna.trial import TrialState  # lazily: see study.py's note

    sweep = plan.sweep
    trials = study.get_trials(deepcopy=False)
    table = table_rows(trials, plan.table_keys, maximize=sweep.direction == "maximize",
                       cost=sweep.cost_objective != "none", base_order=list(plan.bases))
    title = f"{sweep.name}: {sweep.objective} {sweep.metric}"
    paths = write_table(table, plan.out_dir, title)
    for path in paths.values():
        parent.log_artifact(path, "results")
    done = [t for t in trials if t.state == TrialState.COMPLETE]
    for t in sorted(done, key=lambda t: t.number):
        parent.log_metrics({"val/objective": t.values[0]}, step=t.number)
    best_line = "best: no completed trial"
    if done and len(study.directions) == 1:
        best = study.best_trial
        parent.log_params({f"best.{k}": v for k, v in best.params.items()})
        parent.log_metrics({"val/best_objective": float(best.values[0])}, step=best.number)
        parent.set_tags({"best_trial": str(best.number)})
        best_line = f"best: trial {best.number} {best.params} -> {sweep.objective} {sweep.metric} {best.value:.4f}"
    elif done:
        front = sorted(t.number for t in study.best_trials)
        parent.set_tags({"pareto_trials": ",".join(map(str, front))})
        best_line = f"Pareto-optimal trials ({sweep.metric} vs {sweep.cost_objective}): {front}"
    parent.flush()
    # a duplicate two workers drew at once never ran: counted apart, not as a failure
    skipped = sum(1 for t in trials if t.user_attrs.get("skipped"))
    ran = [t for t in trials if not t.user_attrs.get("skipped")]
    counts = {s.name: sum(t.state == s for t in ran) for s in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)}
    return "\n".join([
        (f"study {sweep.name}: {len(ran)} trials ({', '.join(f'{k} {v}' for k, v in counts.items())})"
         + (f" and {skipped} duplicate{'s' if skipped > 1 else ''} skipped" if skipped else "") + f" in {redact(url)}"),
        best_line,
        "",
        paths["md"].read_text().strip(),
        "",
        f"table: {paths['csv']} | {paths['md'].name} | {paths['png'].name}"
        + (f"; MLflow parent run {parent.run_id}" if parent.run_id else ""),
        f"browse the study: {dashboard_command(url)}",
    ])
