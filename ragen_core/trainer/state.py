"""TrainState: everything a run carries from one iteration to the next, and how it is created.

    state = init_state(cfg)          # seeds python/numpy/torch from cfg.trainer.seed, builds models + engines
    stats = update(state, batch, cfg)
    state.iteration += 1

Checkpoints (``ragen_core.trainer.checkpoint``) save and restore exactly this
record plus the global RNG states, so that a resumed run makes the same next
update as one that never stopped.

Run the tests with ``python -m pytest tests/unit/trainer -q``.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from ragen_core.config import ExperimentConfig
from ragen_core.trainer.engine import Engine, make_engines
from ragen_core.trainer.models import PolicyModels, build_policy_models

__all__ = ["TrainState", "init_state", "seed_everything"]


@dataclass
class TrainState:
    """The live training state (mutable on purpose: modules and optimizers change in place)."""

    cfg: ExperimentConfig
    models: PolicyModels
    actor_engine: Engine
    """Backward/step of the actor (and of a value head on it)."""
    critic_engine: Engine | None
    """Backward/step of the separate critic; None without one."""
    iteration: int = 0
    """Completed training iterations (rollout + update)."""
    env_seed_counter: int = 0
    """Next env seed to hand out for training rollouts (the flow advances it)."""

    @contextlib.contextmanager
    def full_weights(self, modify: bool = False) -> Iterator[None]:
        """Inside, every model parameter holds its whole value, for code that reads (``modify``: writes) weights
        outside a forward: checkpoints, ``save_pretrained``, a weight sync. Only DeepSpeed ZeRO-3 partitions
        them; then this gathers them on every rank (a collective) and partitions them again on exit."""
        with contextlib.ExitStack() as stack:
            for engine in (self.actor_engine, self.critic_engine):
                if engine is not None:
                    stack.enter_context(engine.full_weights(modify))
            yield

    def generation_weights(self) -> contextlib.AbstractContextManager[None]:
        """Inside, the actor's own forwards (the hf generator's, the collapse diagnostics') run on its whole
        weights with nothing gathered per layer (:meth:`Engine.generation_weights`): under ZeRO-3 a collective
        on entry, so every rank enters it; a no-op otherwise."""
        return self.actor_engine.generation_weights()


def seed_everything(seed: int) -> None:
    """Seed python ``random``, numpy's global RNG and torch (CPU and every CUDA device)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def init_state(cfg: ExperimentConfig, base: nn.Module | None = None) -> TrainState:
    """A fresh TrainState for ``cfg``: models and engines built, every global RNG seeded from ``cfg.trainer.seed``.

    ``base``: an already loaded causal LM to start from (copied, not modified);
    None loads ``cfg.model.name``.
    """
    if cfg.trainer.threads is not None:
        torch.set_num_threads(cfg.trainer.threads)
    # New heads are initialised from their own seeded torch stream; the global RNGs are seeded after
    # building, because loading a model may draw from them (only the first time in a process, e.g.
    # tokenizer training), and the run's stream must not depend on that.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.trainer.seed)
        models = build_policy_models(cfg, base)
    actor_engine, critic_engine = make_engines(models, cfg)
    seed_everything(cfg.trainer.seed)
    return TrainState(cfg=cfg, models=models, actor_engine=actor_engine, critic_engine=critic_engine)
