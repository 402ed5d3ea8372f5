"""What describes a run besides its metrics: its name and experiment, config params, the config YAML, tags,
sample text and the table of sampled replies.

    from ragen_core.tracking import log_config, run_tags, trajectories_text
    default_run_name(cfg)                         # 'starpo-s-Bandit-s0-20261125-120000'
    experiment_name(cfg)                          # 'ragen-Bandit' unless tracking.experiment names one
    log_config(logger, cfg)                       # params (dotted keys) + config.yaml artifact
    logger.set_tags(run_tags(algo=cfg.algo_tag, env="Bandit", estimator="gae",
                             preset=cfg.preset, model=cfg.model.name, git_commit=git_commit()))
    logger.set_tags(source_tags("experiments/smoke.yaml"))   # user, source, the file's header as the description
    logger.log_text(trajectories_text(trajs[:4]), "samples/iter_0010.txt")
    logger.log_table(replies_table(10, trajs[:4], kept[:4]), REPLIES_TABLE)

Pure functions over plain data (plus ``git_commit``, which asks git, and ``source_tags``, which reads the
experiment file), no MLflow.
"""

from __future__ import annotations

import dataclasses
import enum
import getpass
import re
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:
    from ragen_core.config import ExperimentConfig
    from ragen_core.tracking.logger import MetricLogger
    from ragen_core.types import Trajectory

__all__ = [
    "ALGOS",
    "MAX_PARAM_LENGTH",
    "REPLIES_TABLE",
    "config_yaml",
    "default_run_name",
    "env_family",
    "experiment_name",
    "flatten_config",
    "git_commit",
    "header_comment",
    "log_config",
    "replies_table",
    "run_tags",
    "source_tags",
    "trajectories_text",
]

ALGOS = ("starpo", "starpo-s", "grpo", "gigpo")
MAX_PARAM_LENGTH = 6000  # mlflow.utils.validation.MAX_PARAM_VAL_LENGTH: longer values are refused
MAX_TAG_LENGTH = 8000  # mlflow.utils.validation.MAX_TAG_VAL_LENGTH
REPLIES_TABLE = "replies.json"
"""The run's table of sampled replies (one file, rows appended per artifact step: see :func:`replies_table`)."""


def default_run_name(cfg: ExperimentConfig, when: float | None = None) -> str:
    """``<preset>-<env>-s<seed>-<time>``, e.g. ``starpo-s-Bandit-s0-20261125-120000``: what a run list needs to
    tell runs apart at a glance. A ``custom`` preset is named by what the config does (``cfg.algo_tag``).

    The same name is the run's folder and its MLflow run name, so ``ragen eval/compare RUN`` take either.
    """
    preset = cfg.algo_tag if cfg.preset == "custom" else cfg.preset
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(when))
    return _safe(f"{preset}-{cfg.env.label}-s{cfg.trainer.seed}-{stamp}")


def env_family(env_name: str) -> str:
    """The game an env variant belongs to (``BanditRev`` -> ``Bandit``); an unknown name is its own family."""
    from ragen_core.envs.registry import env_spec  # the registry imports no game code: cheap

    try:
        return env_spec(env_name).family
    except KeyError:
        return env_name


def experiment_name(cfg: ExperimentConfig) -> str:
    """``tracking.experiment`` when set, else one experiment per env family: ``ragen-Bandit``, ``ragen-Sokoban``.

    Why per family: MLflow's chart and table views compare the runs of one experiment, and runs of one game
    are the ones worth comparing (StarPO vs StarPO-S, seeds); Sokoban curves beside Bandit ones are noise.
    """
    return cfg.tracking.experiment or f"ragen-{_safe(env_family(cfg.env.name))}"


def _safe(text: str) -> str:
    """``text`` as a plain folder and run name: anything but letters, digits, '.', '_' and '-' becomes '_'."""
    return re.sub(r"[^\w.\-]+", "_", text)


def header_comment(path: str | Path) -> str:
    """The leading ``#`` lines of a YAML file, without the ``#`` (and one space): the experiment's own description.

    Every experiment file starts by saying what it runs and why (its size, what the paper reports); that text is
    the run's description in MLflow (``mlflow.note.content``). Empty when the file has no header or is unreadable.
    """
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError:
        return ""
    out = []
    for line in lines:
        if not line.startswith("#"):
            break
        text = line[1:]
        out.append(text[1:] if text.startswith(" ") else text)
    return "\n".join(out).strip("\n")[:MAX_TAG_LENGTH]


def source_tags(experiment_file: str | Path | None = None) -> dict[str, str]:
    """MLflow's standard tags that a client-created run lacks: who ran it, from what, and its description.

    ``MlflowClient.create_run`` sets none of them (only the fluent ``mlflow.start_run`` does), so the UI's
    User and Source columns would be empty. The source is the experiment file (relative to the working
    directory when inside it): that file, not a script, is what a ragen run is made from.
    """
    tags = {"mlflow.source.type": "LOCAL"}
    try:
        tags["mlflow.user"] = getpass.getuser()
    except (KeyError, OSError):  # no user name in the environment or the password database (some containers)
        pass
    if experiment_file is not None:
        path = Path(experiment_file)
        try:
            shown = path.resolve().relative_to(Path.cwd().resolve())
        except ValueError:
            shown = path
        tags["mlflow.source.name"] = str(shown)
        note = header_comment(path)
        if note:
            tags["mlflow.note.content"] = note
    return tags


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


def replies_table(iteration: int, trajectories: Sequence[Trajectory], kept: Sequence[bool] | None = None,
                  ) -> dict[str, list[Any]]:
    """Sampled replies as table columns, one row per turn, for ``MetricLogger.log_table``.

    Columns: iteration, env_seed (the seed of the initial state), group, member, turn, state (the text the
    model saw), reply, actions, reward (the turn's env reward plus format penalty), return (the trajectory's),
    success, kept (the StarPO-S filter kept its group). Why a table and not text: MLflow's artifact view lines
    up the same table of several runs by its columns, so a StarPO and a StarPO-S run started from the same
    seed (training seeds depend on the iteration, not the preset) show their replies to the same states side
    by side.
    """
    cols: dict[str, list[Any]] = {k: [] for k in ("iteration", "env_seed", "group", "member", "turn", "state",
                                                   "reply", "actions", "reward", "return", "success", "kept")}
    for n, traj in enumerate(trajectories):
        member = traj.meta.get("member", n)
        for k, turn in enumerate(traj.turns, start=1):
            row = {"iteration": int(iteration), "env_seed": int(traj.seed), "group": int(traj.group_id),
                   "member": int(member), "turn": k, "state": turn.observation, "reply": turn.response_text,
                   "actions": " || ".join(turn.actions), "reward": float(turn.reward + turn.penalty),
                   "return": float(traj.total_return), "success": bool(traj.success),
                   "kept": bool(kept[n]) if kept is not None and n < len(kept) else None}
            for key, value in row.items():
                cols[key].append(value)
    return cols


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
