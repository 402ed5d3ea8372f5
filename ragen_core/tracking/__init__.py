"""Tracking: where a training run reports what it does, and the Echo-Trap health monitor.

- :class:`MetricLogger` (protocol), :class:`NullLogger` (records in memory, sends nothing),
  :class:`MLflowLogger` (one MLflow run per training run, delivered through a local outbox
  so an unreachable server never stops training or loses a metric).
- :func:`flatten_config`, :func:`log_config`, :func:`run_tags`, :func:`trajectories_text`:
  params, tags and readable artifacts of a run; ``run_meta`` also names runs (``<preset>-<env>-s<seed>-<time>``),
  picks their experiment (one per env family), their standard tags and description, and the replies table.
- ``run_end``: a run ends FINISHED, FAILED or KILLED as it really ended (exceptions, Ctrl-C, SIGTERM).
- ``model_registry``: the final model as an MLflow logged model, loaded back and registered
  (``ragen model register RUN``).
- :class:`CollapseMonitor`: ``health/*`` metrics, warning and clean stop (RAGEN §4).
- :class:`EarlyStopRules`: RAGEN-2's early-stop rules and the template-collapse rule (SPEC §8).
- :func:`plot_curves`: PNG curves for the end of a run and ``ragen compare``.

Only this package imports mlflow, and only when an MLflowLogger is used; importing it is
cheap. Tests: ``.venv/bin/python -m pytest tests/unit/tracking -q``.
"""

from ragen_core.tracking.early_stop import EarlyStopRules, RulesReport
from ragen_core.tracking.health import CollapseMonitor, HealthReport, MonitorState
from ragen_core.tracking.logger import NAMESPACES, MetricLogger, NullLogger, check_metric_names
from ragen_core.tracking.mlflow_logger import MLflowLogger, default_tracking_uri, deliver_pending
from ragen_core.tracking.plots import plot_curves
from ragen_core.tracking.run_meta import (
    config_yaml,
    flatten_config,
    git_commit,
    log_config,
    run_tags,
    trajectories_text,
)

__all__ = [
    "NAMESPACES",
    "CollapseMonitor",
    "EarlyStopRules",
    "HealthReport",
    "MLflowLogger",
    "MetricLogger",
    "MonitorState",
    "NullLogger",
    "RulesReport",
    "check_metric_names",
    "config_yaml",
    "default_tracking_uri",
    "deliver_pending",
    "flatten_config",
    "git_commit",
    "log_config",
    "plot_curves",
    "run_tags",
    "trajectories_text",
]
