"""The evaluation flow: a run or checkpoint on held-out seeds of its env and the generalisation variants.

    ragen eval smoke-20260101-120000 --seeds 64            # a run: its latest checkpoint (else final-model)
    ragen eval data/runs/<run>/checkpoints/iter=000010      # one checkpoint
    python -c "from flows.evaluate import evaluate; print(evaluate('data/runs/<run>'))"

Bandit runs are also tested on BanditTest, Sokoban runs on SokobanNewVocab, LargerSokoban and,
zero-shot, FrozenLake (SPEC §2; ragen_core.evaluation.generalisation_variants). Success and pass@N per
env come back as a table, are written to ``eval.json``/``eval.md`` in the run directory, and are
added to the run's own MLflow run (metrics ``val/final/<env>/...`` at step = updates behind the
weights, as the run's own ``val/...``; files under ``eval/``); no second MLflow run is created.
"""

from __future__ import annotations

from prefect import flow

from flows._ui import Reporter, publish_markdown
from ragen_core import evaluation, gpus
from ragen_core.config import load_experiment
from ragen_core.store.run_dir import RunDir
from ragen_core.tracking.factory import tracking_uri
from ragen_core.tracking.history import run_id_of
from tasks import eval_steps as steps


@flow(name="ragen-evaluate")
def evaluate(target: str, seeds: int | None = None, overrides: list[str] | None = None) -> str:
    """Evaluate ``target`` (run name, run dir, checkpoint dir or final-model dir) on ``seeds`` held-out
    seeds per env (default: the run's ``eval.seeds``); ``overrides`` change the run's saved config
    (e.g. ``eval.samples=4`` for pass@4). Returns the table as text."""
    target_ = evaluation.resolve_target(target)
    cfg = load_experiment(RunDir(target_.run_dir).config_path, list(overrides or []))
    envs = evaluation.evaluation_envs(cfg)
    with gpus.holding(1) as held, Reporter(1) as ui:  # one GPU of the machine's, none another run holds
        ui.say(f"evaluating {target_.weights} on {', '.join(e.label for e in envs)}"
               + (f" (GPU {','.join(held)})" if held else ""))
        report = steps.evaluate_weights(cfg, target_, envs, seeds,
                                        progress=lambda done, total: ui.progress("evaluate", done, total))
    files = list(evaluation.write_report(report, target_.run_dir))
    uri = tracking_uri(cfg) if cfg.tracking.backend == "mlflow" else None
    where = steps.log_evaluation(uri, run_id_of(target_.run_dir), report, files, target_.iteration)
    table = evaluation.format_table(report)
    publish_markdown(f"evaluation-{target_.run_dir.name}-it{target_.iteration}", f"{table}\n{where}",
                     f"held-out evaluation of {target_.run_dir.name} after {target_.iteration} iterations")
    return f"{table}\nwritten to {files[0]} and {files[1]}; {where}"
