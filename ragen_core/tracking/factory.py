"""Build the metric logger a run's config asks for, with the run's params and tags.

    logger = open_logger(cfg, run_dir, flow_run_id=..., experiment_file="experiments/smoke.yaml")
    # MLflowLogger (NullLogger when tracking.backend is none) in experiment ragen-<env family>

The outbox lives in the run directory, so resuming a run (same directory) continues the
same MLflow run. The logger joins the innermost :func:`~ragen_core.tracking.run_end.run_scope`
(the train flow's), which closes it FINISHED, FAILED or KILLED as the run ends.
"""

from __future__ import annotations

from pathlib import Path

from ragen_core.config import ExperimentConfig
from ragen_core.tracking.logger import MetricLogger, NullLogger
from ragen_core.tracking.mlflow_logger import MLflowLogger, default_tracking_uri
from ragen_core.tracking.run_end import adopt
from ragen_core.tracking.run_meta import experiment_name, git_commit, log_config, run_tags, source_tags


def tracking_uri(cfg: ExperimentConfig) -> str:
    return cfg.tracking.uri or default_tracking_uri()


def open_logger(
    cfg: ExperimentConfig,
    run_dir: Path,
    *,
    flow_run_id: str | None = None,
    parent_run_id: str | None = None,
    extra_tags: dict[str, str] | None = None,
    experiment_file: str | Path | None = None,
) -> MetricLogger:
    """The run's logger with the resolved config logged as params + YAML and the standard tags.

    Tags: ragen's own (algo, env, estimator, preset, model, seed, name: the experiment's ``name``) and MLflow's
    standard ones a client-made run otherwise lacks (user, source, and ``experiment_file``'s header comment as the
    run's description: :func:`~ragen_core.tracking.run_meta.source_tags`).
    """
    if cfg.tracking.backend == "none":
        return NullLogger(record=False)
    tags = run_tags(cfg.algo_tag, cfg.env.label, cfg.algorithm.estimator, cfg.preset, cfg.model.name,
                    git_commit(), flow_run_id)
    tags["seed"] = str(cfg.trainer.seed)
    tags["name"] = cfg.name
    tags.update(source_tags(experiment_file))
    tags.update(extra_tags or {})
    logger = MLflowLogger(tracking_uri(cfg), experiment_name(cfg), run_name=run_dir.name,
                          parent_run_id=parent_run_id, tags=tags, outbox_dir=run_dir,
                          once_per_step=True)  # a resumed run redoes the iterations after its checkpoint
    adopt(logger)
    log_config(logger, cfg)
    return logger
