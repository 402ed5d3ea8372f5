"""One rank of the data-parallel DeepSpeed check: the tiny-model update on a fixed batch, world size from torchrun.

Started by ``test_deepspeed_engine.py`` (not a test itself)::

    python -m torch.distributed.run --nproc_per_node 2 --master_addr 127.0.0.1 --master_port 29511 \\
        tests/unit/trainer/ds_data_parallel_worker.py OUT.pt STAGE [overrides ...]

(the overrides are ``a.b=c`` config strings, e.g. ZeRO-3's persistence threshold)

Every rank builds the same state and calls ``update`` on the same full batch
(:func:`batch` below); rank 0 saves the trained weights, the update's grad
norms and its metrics to OUT.pt.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from conftest import make_batch, make_cfg

from ragen_core.trainer import init_state, update
from ragen_core.types import TokenBatch

DS_OVERRIDES = ("trainer.online_k=2", "trainer.micro_batch_size=2")
"""Two optimizer steps of 5 rows each: with 2 ranks the last block of each mini-batch leaves rank 1 without a row."""


def batch() -> TokenBatch:
    return make_batch(n_groups=2, group_size=5)


def trained(overrides: list[str]) -> dict[str, object]:
    """Weights of actor and critic after one update, and its grad norms."""
    cfg = make_cfg("starpo", *DS_OVERRIDES, *overrides)
    state = init_state(cfg)
    stats = update(state, batch(), cfg)
    with state.full_weights():  # ZeRO-3 holds slices of the weights outside it (every rank gathers)
        return {"actor": {k: v.detach().clone() for k, v in state.models.actor.state_dict().items()},
                "critic": {k: v.detach().clone() for k, v in state.models.critic.state_dict().items()},
                "grad_norms": [stats.metrics["actor/grad_norm"], stats.metrics["critic/grad_norm"]],
                "metrics": {k: stats.metrics[k] for k in REDUCED}}


REDUCED = ("actor/entropy", "actor/pg_loss", "actor/approx_kl", "critic/value_loss", "critic/vf_clipfrac")
"""Metrics the ranks add up (token-weighted stats, per-step losses): the whole batch's, as in one process."""


def main(out: str, stage: str, *overrides: str) -> None:
    result = trained(["trainer.backend=deepspeed", f"trainer.zero_stage={stage}", *overrides])
    if torch.distributed.get_rank() == 0:
        torch.save(result, out)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
