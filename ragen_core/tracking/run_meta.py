"""What describes a run besides its metrics: config params, the config YAML, tags, sample text.

    from ragen_core.tracking import log_config, run_tags, trajectories_text
    log_config(logger, cfg)                       # params (dotted keys) + config.yaml artifact
    logger.set_tags(run_tags(algo=cfg.algo_tag, env="Bandit", estimator="gae",
                             preset=cfg.preset, model=cfg.model.name, git_commit=git_commit()))
    logger.log_text(trajectories_text(trajs[:4]), "samples/iter_0010.txt")

Pure functions over plain data (plus ``git_commit``, which asks git), no MLflow.
"""

from __future__ import annotations

import dataclasses
import enum
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:
    from ragen_core.tracking.logger import MetricLogger
    from ragen_core.types import Trajectory

__all__ = [
    "ALGOS",
    "MAX_PARAM_LENGTH",
    "config_yaml",
    "flatten_config",
    "git_commit",
    "log_config",
    "run_tags",
    "trajectories_text",
]

ALGOS = ("starpo", "starpo-s", "grpo")
MAX_PARAM_LENGTH = 6000  # mlflow.utils.validation.MAX_PARAM_VAL_LENGTH: longer values are refused


def _plain(value: Any) -> Any:
    """Dataclasses and mappings to dicts, sequences to lists, paths and enums to their text."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, enum.Enum):
        return _plain(value.value)
    return value


def flatten_config(cfg: Any) -> dict[str, str]:
    """A dataclass or nested dict as ``{"a.b.c": "value"}`` for MLflow params.

    Nested sections become dotted keys; a list stays one value (its repr). Strings are
    kept as they are, other values become their repr, cut to MLflow's param length limit.
    The argument is not modified.
    """
    out: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            for k, v in value.items():
                walk(f"{prefix}.{k}", v)
            return
        text = value if isinstance(value, str) else repr(value)
        if len(text) > MAX_PARAM_LENGTH:
            text = text[: MAX_PARAM_LENGTH - 3] + "..."
        out[prefix] = text

    plain = _plain(cfg)
    if not isinstance(plain, dict):
        raise TypeError(f"flatten_config needs a dataclass or a mapping, got {type(cfg).__name__}")
    for key, value in plain.items():
        walk(key, value)
    return out


def config_yaml(cfg: Any) -> str:
    """The resolved config as YAML text, fields in declaration order."""
    return yaml.safe_dump(_plain(cfg), sort_keys=False, allow_unicode=True)


def log_config(logger: MetricLogger, cfg: Any, artifact_file: str = "config.yaml") -> None:
    """Record the resolved config both as params (searchable) and as a YAML artifact (re-runnable)."""
    logger.log_params(flatten_config(cfg))
    logger.log_text(config_yaml(cfg), artifact_file)


def run_tags(
    algo: str,
    env: str,
    estimator: str,
    preset: str,
    model: str,
    git_commit: str | None = None,
    flow_run_id: str | None = None,
) -> dict[str, str]:
    """The tags every training run carries; commit and flow-run id only when known.

    The commit goes under MLflow's own key, so the UI shows it as the run's source version.
    """
    if algo not in ALGOS:
        raise ValueError(f"algo {algo!r} must be one of {', '.join(ALGOS)}")
    tags = {"algo": algo, "env": env, "estimator": estimator, "preset": preset, "model": model}
    if git_commit:
        tags["mlflow.source.git.commit"] = git_commit
    if flow_run_id:
        tags["prefect.flow_run_id"] = flow_run_id
    return tags


def git_commit(repo_dir: Path | None = None) -> str | None:
    """HEAD's commit hash of the repository at ``repo_dir`` (default: this package's), or None."""
    where = repo_dir or Path(__file__).resolve().parent
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, timeout=5, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def trajectories_text(trajectories: Sequence[Trajectory]) -> str:
    """Sample trajectories as text a person can read: each turn's state, reply, actions and reward."""
    blocks = []
    for n, traj in enumerate(trajectories):
        head = (
            f"=== trajectory {n}: env={traj.env_tag} seed={traj.seed} group={traj.group_id} "
            f"success={traj.success} return={traj.total_return:.3f} (env {traj.env_return:.3f}) "
            f"terminated={traj.terminated} truncated={traj.truncated}"
        )
        lines = [head]
        for k, turn in enumerate(traj.turns, start=1):
            lines += [
                f"--- turn {k}",
                "state:",
                turn.observation,
                "reply:",
                turn.response_text,
                (
                    f"actions: {' || '.join(turn.actions) or '(none)'}  reward: {turn.reward:g}  "
                    f"penalty: {turn.penalty:g}  parsed: {turn.parse_ok}  finish: {turn.finish_reason}"
                ),
            ]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n"
