"""Shared helpers for the trainer tests: configs on the tiny random model and synthetic token batches.

Run with ``python -m pytest tests/unit/trainer -q``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from ragen_core.config import PRESETS, ExperimentConfig, apply_overrides, build_config
from ragen_core.types import TokenBatch

TINY = "tiny-random:0"


def make_cfg(preset: str = "starpo", *overrides: str) -> ExperimentConfig:
    """An ExperimentConfig on the tiny model: ``preset`` under the given ``a.b=c`` overrides.

    Larger learning rates than SPEC's so that one step visibly moves the tiny model.
    """
    raw: dict[str, Any] = apply_overrides(
        {}, ["model.name=" + TINY, "model.device=cpu", "trainer.actor_lr=0.001", "trainer.critic_lr=0.001",
             "rollout.responses_per_prompt=4", "trainer.micro_batch_size=2", "trainer.logprob_chunk=8",
             *overrides])
    algo = {**PRESETS[preset].get("algorithm", {}), **raw.get("algorithm", {})}
    return build_config(ExperimentConfig, {**raw, "preset": preset, "algorithm": algo})


def make_batch(n_groups: int = 2, group_size: int = 4, seed: int = 0, vocab: int = 200,
               max_len: int = 24, turns: int = 2) -> TokenBatch:
    """A right-padded batch shaped like a multi-turn rollout.

    Each row: a prompt of 4-7 tokens, then ``turns`` times (generated reply of
    2-5 tokens, then 0-2 env tokens). loss_mask marks the replies; turn_ends the
    last token of each reply; the trajectory reward sits on the last generated
    token. old_logprobs are random negatives (they are rollout values, not
    ours), so ratios differ from 1 and clipping takes part.
    """
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n_groups * group_size):
        ids, gen, ends, tid = [], [], [], []
        n_prompt = int(torch.randint(4, 8, (1,), generator=g))
        ids += torch.randint(1, vocab, (n_prompt,), generator=g).tolist()
        gen += [False] * n_prompt
        ends += [False] * n_prompt
        tid += [0] * n_prompt
        for k in range(turns):
            n_reply = int(torch.randint(2, 6, (1,), generator=g))
            ids += torch.randint(1, vocab, (n_reply,), generator=g).tolist()
            gen += [True] * n_reply
            ends += [False] * (n_reply - 1) + [True]
            tid += [k] * n_reply
            if k < turns - 1:
                n_env = int(torch.randint(0, 3, (1,), generator=g))
                ids += torch.randint(1, vocab, (n_env,), generator=g).tolist()
                gen += [False] * n_env
                ends += [False] * n_env
                tid += [k + 1] * n_env
        rows.append((ids[:max_len], gen[:max_len], ends[:max_len], tid[:max_len]))
    B, T = len(rows), max(len(r[0]) for r in rows)
    input_ids = torch.zeros(B, T, dtype=torch.long)
    attention = torch.zeros(B, T, dtype=torch.bool)
    loss_mask = torch.zeros(B, T, dtype=torch.bool)
    turn_ends = torch.zeros(B, T, dtype=torch.bool)
    turn_ids = torch.full((B, T), -1, dtype=torch.long)
    for b, (ids, gen, ends, tid) in enumerate(rows):
        n = len(ids)
        input_ids[b, :n] = torch.tensor(ids)
        attention[b, :n] = True
        loss_mask[b, :n] = torch.tensor(gen)
        turn_ends[b, :n] = torch.tensor(ends)
        turn_ids[b, :n] = torch.tensor(tid)
    returns = torch.randint(0, 2, (B,), generator=g).float()
    rewards = torch.zeros(B, T)
    for b in range(B):
        last = int(loss_mask[b].nonzero().max())
        rewards[b, last] = returns[b]
    old_logprobs = torch.where(loss_mask, -torch.rand(B, T, generator=g) * 3 - 4.0, torch.zeros(B, T))
    group_ids = torch.arange(n_groups).repeat_interleave(group_size)
    return TokenBatch(input_ids, attention, loss_mask, old_logprobs, rewards, turn_ids, turn_ends, group_ids, returns)


@pytest.fixture
def cfg_factory() -> Callable[..., ExperimentConfig]:
    return make_cfg


@pytest.fixture
def batch_factory() -> Callable[..., TokenBatch]:
    return make_batch
