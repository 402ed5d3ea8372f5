"""RAGEN-2's gradient analysis (trainer.update.grad_buckets): groups bucketed by in-group reward std, and each
loss term's gradient norm over a bucket's rows, against the terms computed one by one on the tiny model."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from ragen_core.algos import advantages as adv_fns
from ragen_core.algos import losses
from ragen_core.config import ConfigError
from ragen_core.trainer import init_state
from ragen_core.trainer.engine import trainable_parameters
from ragen_core.trainer.forward import policy_forward
from ragen_core.trainer.update import bucket_names, grad_buckets, group_buckets
from ragen_core.types import TokenBatch
from tests.unit.trainer.conftest import make_batch, make_cfg


def _batch() -> TokenBatch:
    """Three groups of four: returns equal (std 0), a small spread (0.1, 0.1, 0.1, 0.3: unbiased std 0.1) and a
    large one (0, 0, 1, 1: std 0.577)."""
    batch = make_batch(n_groups=3, group_size=4, seed=5)
    returns = torch.tensor([0.5, 0.5, 0.5, 0.5, 0.1, 0.1, 0.1, 0.3, 0.0, 0.0, 1.0, 1.0])
    return dataclasses.replace(batch, returns=returns)


def test_groups_fall_in_the_buckets_of_their_reward_std() -> None:
    assert bucket_names((0.2,)) == ["zero", "le_0.2", "gt_0.2"]
    assert bucket_names((0.05, 0.5)) == ["zero", "le_0.05", "le_0.5", "gt_0.5"]
    assert group_buckets(_batch(), (0.2,)) == {"zero": [0, 1, 2, 3], "le_0.2": [4, 5, 6, 7],
                                                "gt_0.2": [8, 9, 10, 11]}
    # edges 0.05 and 0.5: std 0.1 is in (0.05, 0.5], 0.577 above 0.5, nothing at or under 0.05 but the zero group
    assert group_buckets(_batch(), (0.05, 0.5)) == {"zero": [0, 1, 2, 3], "le_0.05": [], "le_0.5": [4, 5, 6, 7],
                                                     "gt_0.5": [8, 9, 10, 11]}


def _term_grads(state, cfg, batch, rows: list[int]) -> dict[str, float]:
    """Each term's gradient norm over ``rows``, written out: GRPO advantages of those whole groups, the PPO loss,
    −entropy_coef·entropy and kl_coef·k1, each aggregated over the rows alone."""
    algo = cfg.algorithm
    micro = batch.select(torch.tensor(rows))
    adv = adv_fns.grpo(micro.returns, micro.group_ids)[:, None] * micro.loss_mask
    norm = losses.aggregation_normaliser(micro.loss_mask, algo.loss_agg)
    agg = losses.AGGREGATIONS[algo.loss_agg]
    out = policy_forward(state.models.actor, micro.input_ids, micro.attention_mask, cfg.rollout.temperature,
                         cfg.trainer.logprob_chunk, entropy_grad=True, scored=micro.loss_mask)
    with torch.no_grad():
        ref = policy_forward(state.models.ref, micro.input_ids, micro.attention_mask, cfg.rollout.temperature,
                             cfg.trainer.logprob_chunk, scored=micro.loss_mask).logprobs
    terms = {
        "task": losses.policy_loss(out.logprobs, micro.old_logprobs, adv, micro.loss_mask, clip_low=algo.clip_low,
                                   clip_high=algo.clip_high, dual_clip=algo.dual_clip, agg=algo.loss_agg,
                                   normaliser=norm)[0],
        "entropy": -algo.entropy_coef * agg(out.entropy, micro.loss_mask, norm),
        "kl": algo.kl_coef * agg(losses.kl_penalty(out.logprobs, ref, "k1"), micro.loss_mask, norm),
    }
    params = trainable_parameters(state.models.actor)
    norms = {}
    for name, term in terms.items():
        grads = torch.autograd.grad(term, params, retain_graph=True, allow_unused=True)
        norms[name] = math.sqrt(sum(float(g.pow(2).sum()) for g in grads if g is not None))
    return norms


@pytest.mark.parametrize("micro", [8, 2], ids=["one-forward-a-bucket", "a-forward-a-row"])
def test_each_terms_gradient_norm_per_bucket_is_the_terms_own_and_nothing_steps(micro: int) -> None:
    """Against each term's gradient over the bucket's rows at once, whether the analysis runs them in one forward
    (half of micro-batch 8) or one row a forward (half of 2), its gradients added up."""
    cfg = make_cfg("grpo", "algorithm.entropy_coef=0.01", "algorithm.kl_coef=0.05", "trainer.precision=fp32",
                   "diagnostics.grad_bucket_rows=4", f"trainer.micro_batch_size={micro}")
    state = init_state(cfg)
    batch = _batch()
    before = [p.detach().clone() for p in trainable_parameters(state.models.actor)]
    got = grad_buckets(state, batch, cfg)
    for p, b in zip(trainable_parameters(state.models.actor), before, strict=True):
        assert torch.equal(p, b) and p.grad is None  # nothing stepped, nothing accumulated
    assert {got[f"grad/{b}/rows"] for b in ("zero", "le_0.2", "gt_0.2")} == {4.0}
    assert "grad/zero/value" not in got  # GRPO: no critic
    for bucket, rows in (("le_0.2", [4, 5, 6, 7]), ("gt_0.2", [8, 9, 10, 11]), ("zero", [0, 1, 2, 3])):
        want = _term_grads(state, cfg, batch, rows)
        for term in ("task", "entropy", "kl"):
            assert got[f"grad/{bucket}/{term}"] == pytest.approx(want[term], rel=1e-4), (bucket, term)
    # a zero-std group's GRPO advantages are all 0: its task gradient vanishes while the regularisers' do not
    # (RAGEN-2's low-SNR regime)
    assert got["grad/zero/task"] == pytest.approx(0.0, abs=1e-9)
    assert got["grad/zero/entropy"] > 0 and got["grad/zero/kl"] > 0
    assert got["grad/le_0.2/task"] > 0 and got["grad/gt_0.2/task"] > 0


def test_a_value_head_and_a_separate_critic_log_the_value_term_and_the_row_cap_takes_whole_groups() -> None:
    batch = _batch()
    for critic in ("head", "separate"):
        cfg = make_cfg("starpo", f"algorithm.critic={critic}", "diagnostics.grad_bucket_rows=6")
        got = grad_buckets(init_state(cfg), batch, cfg)
        assert got["grad/gt_0.2/value"] > 0 and got["grad/gt_0.2/task"] > 0
        assert got["grad/zero/rows"] == 4.0  # one group of 4 fits in 6 rows, a second would not


def test_the_analysis_needs_the_torch_engine() -> None:
    with pytest.raises(ConfigError, match="grad_buckets_every"):
        make_cfg("starpo", "diagnostics.grad_buckets_every=5", "trainer.backend=deepspeed")
    with pytest.raises(ConfigError, match="grad_bucket_edges"):
        make_cfg("starpo", "diagnostics.grad_bucket_edges=[0.3, 0.1]")
