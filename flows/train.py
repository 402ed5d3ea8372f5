"""The training flow: per iteration (evaluate ->) rollout -> filter -> update -> record (-> checkpoint).

    ragen train experiments/bandit-starpo-s.yaml --set trainer.iterations=20
    python -c "from flows.train import train; train('experiments/smoke.yaml')"

Runs in Prefect's ephemeral mode with nothing to start; with PREFECT_API_URL set it reports
to that server. Every run is one MLflow run (a resumed run continues it), which ends FINISHED,
FAILED (an exception) or KILLED (Ctrl-C, SIGTERM: a cancelled flow run) as the flow ends
(``closes_runs``, ragen_core/tracking/run_end.py). The same flow is the `ragen-train` deployment
of prefect.yaml and the body of every sweep trial.
"""

from __future__ import annotations

from typing import Any

from prefect import flow
from prefect.runtime import flow_run

from flows._ui import Reporter
from ragen_core import session
from ragen_core.config import load_experiment
from ragen_core.store.run_dir import RunDir
from ragen_core.tracking.factory import open_logger, tracking_uri
from ragen_core.tracking.run_end import closes_runs
from tasks import train_steps as steps


@flow(name="ragen-train")
@closes_runs  # the logger opened below ends FINISHED, FAILED or KILLED as this flow does
def train(
    experiment: str,
    overrides: list[str] | None = None,
    resume: str | None = None,
    run_name: str | None = None,
    parent_run_id: str | None = None,
    tags: dict[str, str] | None = None,
    trial: dict[str, Any] | None = None,
) -> session.TrainResult:
    """Train one experiment; ``resume`` continues a run (its saved config plus ``overrides``).

    ``parent_run_id``/``tags``/``trial`` are set by sweeps: a nested MLflow run, and an Optuna
    trial to report validation success to (and be pruned by).
    """
    overrides = list(overrides or [])
    if resume:
        cfg, folder = session.resume_config(resume, overrides)
    else:
        cfg = load_experiment(experiment, overrides)
        folder = RunDir.named(run_name or session.new_run_name(cfg))
    folder.create()
    logger = open_logger(cfg, folder.path, flow_run_id=flow_run.id, parent_run_id=parent_run_id, extra_tags=tags,
                         experiment_file=experiment)
    pruner = _trial_reporter(trial) if trial else None
    with Reporter(cfg.trainer.iterations) as ui:
        sess = session.open_session(cfg, logger, folder, say=ui.say, progress=ui.progress)
        while not sess.done:
            val = steps.evaluate(sess) if session.eval_due(sess) else None  # the policy after `iteration` updates
            if pruner and val:
                pruner(sess, val)  # may set sess.stop_reason: keep this evaluation as the last one
                if sess.done:
                    session.record_final_eval(sess, val)
                    break
            rollouts = steps.rollout(sess)
            diagnostics = steps.diagnose(sess, rollouts) if session.collapse_due(sess) else None
            selection = steps.filter_groups(sess, rollouts)
            stats = steps.update(sess, selection)
            steps.record(sess, rollouts, selection, stats, val, diagnostics)
            if session.checkpoint_due(sess):
                steps.checkpoint(sess)
        if session.final_eval_due(sess):
            val = steps.evaluate(sess)
            session.record_final_eval(sess, val)
            if pruner:
                pruner(sess, val)
    return session.finish(sess, tracking_uri(cfg))


def _trial_reporter(trial: dict[str, Any]) -> Any:
    from ragen_core.sweeps import trial_reporter  # optuna only for sweep trials

    return trial_reporter(trial)
