"""The training flow: per iteration (evaluate ->) rollout -> filter -> update -> record (-> checkpoint).

    ragen train experiments/bandit-starpo-s.yaml --set trainer.iterations=20
    python -c "from flows.train import train; train('experiments/smoke.yaml')"

Runs in Prefect's ephemeral mode with nothing to start; with PREFECT_API_URL set it reports
to that server. Every run is one MLflow run (a resumed run continues it). The same flow is
the `ragen-train` deployment of prefect.yaml and the body of every sweep trial.
"""

from __future__ import annotations

from typing import Any

from prefect import flow
from prefect.runtime import flow_run

from flows._ui import Reporter
from ragen_core import session as s
from ragen_core.config import load_experiment
from ragen_core.store.run_dir import RunDir
from ragen_core.tracking.factory import open_logger, tracking_uri
from tasks import train_steps as t


@flow(name="ragen-train")
def train(
    experiment: str,
    overrides: list[str] | None = None,
    resume: str | None = None,
    run_name: str | None = None,
    parent_run_id: str | None = None,
    tags: dict[str, str] | None = None,
    trial: dict[str, Any] | None = None,
) -> s.TrainResult:
    """Train one experiment; ``resume`` continues a run (its saved config plus ``overrides``).

    ``parent_run_id``/``tags``/``trial`` are set by sweeps: a nested MLflow run, and an Optuna
    trial to report validation success to (and be pruned by).
    """
    overrides = list(overrides or [])
    if resume:
        cfg, folder = s.resume_config(resume, overrides)
    else:
        cfg = load_experiment(experiment, overrides)
        folder = RunDir.named(run_name or s.new_run_name(cfg))
    folder.create()
    logger = open_logger(cfg, folder.path, flow_run_id=flow_run.id, parent_run_id=parent_run_id, extra_tags=tags)
    pruner = _trial_reporter(trial) if trial else None
    with Reporter(cfg.trainer.iterations) as ui:
        sess = s.open_session(cfg, logger, folder, say=ui.say, progress=ui.progress)
        while not sess.done:
            val = t.evaluate(sess) if s.eval_due(sess) else None  # the policy after `iteration` updates
            if pruner and val:
                pruner(sess, val)  # may set sess.stop_reason: keep this evaluation as the last one
                if sess.done:
                    s.record_final_eval(sess, val)
                    break
            rollouts = t.rollout(sess)
            diagnostics = t.diagnose(sess, rollouts) if s.collapse_due(sess) else None
            selection = t.filter_groups(sess, rollouts)
            stats = t.update(sess, selection)
            t.record(sess, rollouts, selection, stats, val, diagnostics)
            if s.checkpoint_due(sess):
                t.checkpoint(sess)
        if s.final_eval_due(sess):
            val = t.evaluate(sess)
            s.record_final_eval(sess, val)
            if pruner:
                pruner(sess, val)
    return s.finish(sess, tracking_uri(cfg))


def _trial_reporter(trial: dict[str, Any]) -> Any:
    from ragen_core.sweeps import trial_reporter  # optuna only for sweep trials

    return trial_reporter(trial)
