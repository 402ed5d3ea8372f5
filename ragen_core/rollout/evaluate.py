"""Held-out evaluation (SPEC §5): fixed seeds, temperature 0.5, success and pass@N per env tag.

    from ragen_core.rollout.evaluate import evaluate, heldout_seeds
    result = evaluate(cfg.eval_envs, generator, tokenizer, cfg.rollout, heldout_seeds(256, 123), n_per_seed=4)
    result.metrics["val/Bandit/success"], result.metrics["val/Bandit/pass_at_4"]

Every seed is one group of ``n_per_seed`` trajectories (members draw their own env luck, as in
training). ``success`` is the mean over all trajectories (pass@1 estimated with all N samples);
``pass@N`` is the share of seeds where any of the N succeeded. Sampling is seeded
(``sampling_seed``), so evaluating the same weights twice gives the same numbers.

Run its tests: ``.venv/bin/python -m pytest tests/unit/rollout/test_rollout_metrics.py -q``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ragen_core import distributed
from ragen_core.rollout.loop import Progress, run_rollouts
from ragen_core.rollout.metrics import pass_at_n
from ragen_core.rollout.prompts import make_renderer
from ragen_core.types import Trajectory

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from ragen_core.config import EnvConfig, RolloutConfig
    from ragen_core.rollout.generators.base import Generator

__all__ = ["EVAL_TEMPERATURE", "EvalResult", "evaluate", "heldout_seeds"]

EVAL_TEMPERATURE = 0.5
"""Sampling temperature of evaluation (SPEC §5)."""


@dataclass(frozen=True)
class EvalResult:
    """Metrics and the trajectories they were computed from."""

    metrics: dict[str, float]
    """``<prefix>/<tag>/success``, ``/return``, ``/total_return``, ``/pass_at_N`` per env, and ``<prefix>/success``
    overall."""
    trajectories: tuple[Trajectory, ...]


def heldout_seeds(n: int = 256, start: int = 123) -> tuple[int, ...]:
    """The fixed evaluation seeds: ``start, start + 1, ..., start + n - 1`` (reference: 256 from 123)."""
    if n < 1 or start < 0:
        raise ValueError(f"need n >= 1 and start >= 0, got n={n}, start={start}")
    return tuple(range(start, start + n))


def evaluate(
    env_cfgs: Sequence[EnvConfig],
    generator: Generator,
    tokenizer: PreTrainedTokenizerBase,
    rollout_cfg: RolloutConfig,
    seeds: Sequence[int],
    n_per_seed: int = 1,
    *,
    temperature: float = EVAL_TEMPERATURE,
    sampling_seed: int | None = 0,
    model_max_length: int | None = None,
    prefix: str = "val",
    progress: Progress | None = None,
    split: bool = False,
) -> EvalResult:
    """Roll out every env on ``seeds`` with ``n_per_seed`` samples each and summarise per env tag.

    ``split``: in a multi-process run, this process plays only its share of the seeds and the processes gather
    the rest (every one must call; :func:`ragen_core.distributed.split_map`); the result is the one-process one.
    """
    renderer = make_renderer(tokenizer, rollout_cfg)
    metrics: dict[str, float] = {}
    trajectories: list[Trajectory] = []
    for env_cfg in env_cfgs:

        def play(part: range, env_cfg: EnvConfig = env_cfg) -> list[Trajectory]:  # seeds keep their global index
            return run_rollouts(env_cfg, generator, tokenizer, rollout_cfg, seeds[part.start:part.stop], n_per_seed,
                                temperature, group_offset=part.start, sampling_seed=sampling_seed,
                                model_max_length=model_max_length, renderer=renderer, progress=progress)

        trajs = distributed.split_map(len(seeds), play, split)
        tag = env_cfg.label
        metrics[f"{prefix}/{tag}/success"] = sum(t.success for t in trajs) / len(trajs)
        metrics[f"{prefix}/{tag}/return"] = sum(t.env_return for t in trajs) / len(trajs)
        metrics[f"{prefix}/{tag}/total_return"] = sum(t.total_return for t in trajs) / len(trajs)
        metrics[f"{prefix}/{tag}/pass_at_{n_per_seed}"] = pass_at_n(trajs)
        trajectories += trajs
    if trajectories:
        metrics[f"{prefix}/success"] = sum(t.success for t in trajectories) / len(trajectories)
    return EvalResult(metrics=metrics, trajectories=tuple(trajectories))
