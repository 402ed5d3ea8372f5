"""The trainer: actor/critic/reference models, one StarPO update, filtering of batches, checkpoints.

    from ragen_core.trainer import init_state, update, filter_batch, save_checkpoint, load_checkpoint

    state = init_state(cfg)                                  # models + AdamW engines, RNGs seeded
    kept = filter_batch(batch, trajectories, cfg.algorithm)  # StarPO-S: whole groups by reward std
    stats = update(state, kept.batch, cfg)                   # Online-k optimizer steps, metrics
    save_checkpoint(state, run.checkpoint_path(state.iteration))  # run: a store.run_dir.RunDir

Run the tests with ``python -m pytest tests/unit/trainer -q``.
"""

from ragen_core.trainer.checkpoint import load_checkpoint, save_checkpoint
from ragen_core.trainer.engine import ENGINES, Engine, TorchEngine, make_engines
from ragen_core.trainer.filter import FilterResult, filter_batch
from ragen_core.trainer.forward import chunked_logprobs, policy_forward
from ragen_core.trainer.models import PolicyModels, build_policy_models
from ragen_core.trainer.state import TrainState, init_state, seed_everything
from ragen_core.trainer.update import ESTIMATORS, compute_advantages, update

__all__ = [
    "ENGINES", "ESTIMATORS", "Engine", "FilterResult", "PolicyModels", "TorchEngine", "TrainState",
    "build_policy_models", "chunked_logprobs", "compute_advantages", "filter_batch", "init_state",
    "load_checkpoint", "make_engines", "policy_forward", "save_checkpoint", "seed_everything", "update",
]
