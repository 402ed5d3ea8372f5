"""Per-turn rows in the update (rollout.context_window K): GRPO counts each trajectory once, and a FrozenLake smoke
run trains on per-turn rows with finite losses.

Run: .venv/bin/python -m pytest tests/unit/trainer/test_trainer_turn_rows.py -q
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from ragen_core.algos import advantages as adv_fns
from ragen_core.config import AlgorithmConfig, RolloutConfig, load_experiment
from ragen_core.models import load_tokenizer
from ragen_core.rollout.batch import build_turn_batch
from ragen_core.trainer.update import compute_advantages
from ragen_core.types import Trajectory, Turn

SMOKE = Path(__file__).resolve().parents[3] / "experiments" / "smoke.yaml"
GRPO = AlgorithmConfig(estimator="grpo", critic="none")


def _episode(n_turns: int, final_reward: float, group_id: int = 0) -> Trajectory:
    turns = tuple(Turn(f"s{t}", (5, 6, 7) if t == 0 else (8, 9), (10 + t, 2), (-0.5, -0.25), f"r{t}", ("Down",),
                       final_reward if t == n_turns - 1 else 0.0, 0.0, True) for t in range(n_turns))
    return Trajectory("FrozenLake", 3, group_id, turns, success=final_reward > 0, terminated=True, truncated=False)


def test_grpo_normalises_over_trajectories_not_rows() -> None:
    tok = load_tokenizer("tiny-random")
    trajs = [_episode(5, 1.0), _episode(5, 0.0), _episode(2, 0.0)]
    batch = build_turn_batch(trajs, tok, RolloutConfig(context_window=2))
    assert batch.batch_size == 12
    adv, _ = compute_advantages(batch, batch.rewards, None, GRPO)
    # Returns [1, 0, 0] in one group: mean 1/3, unbiased std sqrt(((2/3)^2 + 2 (1/3)^2) / 2) = sqrt(1/3), so the
    # first trajectory's rows get (2/3) / sqrt(1/3) = 2/sqrt(3) and the others' -(1/3) / sqrt(1/3) = -1/sqrt(3)
    # (over rows, 5 + 5 + 2 of them, the mean would be 5/12 and every value different).
    expected = [2 / math.sqrt(3)] * 5 + [-1 / math.sqrt(3)] * 7
    for b in range(batch.batch_size):
        assert adv[b][batch.loss_mask[b]].tolist() == pytest.approx([expected[b]] * 2, abs=1e-5)
        assert not adv[b][~batch.loss_mask[b]].any()


def test_grpo_of_per_turn_rows_counts_a_kl_in_the_reward_once_per_trajectory() -> None:
    tok = load_tokenizer("tiny-random")
    trajs = [_episode(3, 1.0), _episode(2, 0.0), _episode(1, 0.5, group_id=1), _episode(2, 0.0, group_id=1)]
    batch = build_turn_batch(trajs, tok, RolloutConfig(context_window=1))
    kl = torch.where(batch.loss_mask, -0.01 * torch.arange(batch.rewards.numel()).view_as(batch.rewards), 0.0)
    adv, _ = compute_advantages(batch, batch.rewards + kl, None, GRPO)
    # each trajectory's score is its return plus the KL of all its rows, as its one row under context_window full
    assert batch.episode_ids is not None
    per_episode = torch.zeros(4).index_add(0, batch.episode_ids, kl.sum(dim=1))
    scores = torch.tensor([t.total_return for t in trajs]) + per_episode
    want = adv_fns.grpo(scores, torch.tensor([0, 0, 1, 1]))[batch.episode_ids]  # [B]
    for b in range(batch.batch_size):
        assert adv[b][batch.loss_mask[b]].tolist() == pytest.approx([float(want[b])] * 2, abs=1e-5)


def test_a_frozenlake_smoke_run_trains_on_per_turn_rows(tmp_path, monkeypatch) -> None:
    from ragen_core.session import finish, open_session, run_iteration
    from ragen_core.tracking import NullLogger

    monkeypatch.setenv("RAGEN_DATA_DIR", str(tmp_path))
    cfg = load_experiment(SMOKE, ["env.name=FrozenLake", "rollout.max_turns=3", "rollout.max_actions_per_episode=3",
                                  "rollout.context_window=1", "eval.every=0", "trainer.checkpoint_every=0"])
    assert cfg.trainer.iterations == 2 and cfg.algorithm.critic == "separate"  # starpo-s: gae with a critic
    sess = open_session(cfg, NullLogger(), say=lambda line: None)
    rows = [run_iteration(sess) for _ in range(cfg.trainer.iterations)]
    finish(sess)
    for row in rows:
        assert row["rollout/update_skipped"] == 0.0
        for name in ("actor/pg_loss", "actor/grad_norm", "critic/value_loss", "critic/grad_norm"):
            assert math.isfinite(row[name]), name
        # the kept groups' trajectories, one row per turn with a reply: more rows than trajectories
        kept = row["rollout/kept_groups"] * cfg.rollout.responses_per_prompt
        assert kept < row["perf/update_rows"] <= kept * cfg.rollout.max_turns
