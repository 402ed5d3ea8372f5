"""The real update() on the tiny model: presets, LoRA, value head, reference only with KL,
micro-batch invariance, exact whole-mini-batch gradients, Online-k, and filter_batch.

Run with ``python -m pytest tests/unit/trainer/test_trainer_update.py -q``.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import make_batch, make_cfg

from ragen_core.algos import losses
from ragen_core.trainer import filter_batch, init_state, update
from ragen_core.trainer.forward import decoder_and_head, policy_forward
from ragen_core.trainer.update import micro_blocks

EXPECTED_KEYS = {
    "actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/clipfrac_upper", "actor/clipfrac_lower",
    "actor/approx_kl", "actor/lr", "actor/advantages_mean", "actor/advantages_std", "actor/advantages_max",
    "actor/advantages_min", "response/length_mean", "timing/update_s", "perf/update_tokens_per_s",
}
CRITIC_KEYS = {"critic/value_loss", "critic/explained_var", "critic/vf_clipfrac", "critic/values_mean",
               "critic/returns_mean"}


def _params(*modules) -> list[torch.Tensor]:
    return [p.detach().clone() for m in modules if m is not None for p in m.parameters() if p.requires_grad]


def _capture_grads(engine) -> list[list[torch.Tensor]]:
    """Record the accumulated gradients each time ``engine.step()`` is called (before it clips and steps)."""
    seen: list[list[torch.Tensor]] = []
    original = engine.step

    def step() -> float:
        seen.append([p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in engine.params])
        return original()

    engine.step = step
    return seen


def _count_calls(module: torch.nn.Module) -> list[int]:
    calls = [0]
    module.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize(
    ("preset", "overrides", "critic_kind", "has_ref"),
    [
        ("starpo", [], "separate", True),
        ("starpo-s", [], "separate", False),
        ("grpo", [], None, True),
        ("starpo", ["model.lora_rank=4"], "separate", False),  # LoRA: reference = adapters disabled, no copy
        ("starpo", ["algorithm.critic=head"], "head", True),
        ("starpo-s", ["model.gradient_checkpointing=true"], "separate", False),
        ("starpo", ["algorithm.estimator=bilevel_gae", "algorithm.kl_in_reward=true"], "separate", True),
    ],
)
def test_update_runs_for_each_configuration(preset, overrides, critic_kind, has_ref) -> None:
    cfg = make_cfg(preset, *overrides)
    state = init_state(cfg)
    assert (state.models.ref is not None) == has_ref
    assert (state.models.critic is not None) == (critic_kind == "separate")
    assert (state.models.value_head is not None) == (critic_kind == "head")
    before = _params(state.models.actor, state.models.critic, state.models.value_head)
    stats = update(state, make_batch(), cfg, think_tokens=[3.0] * 8)
    after = _params(state.models.actor, state.models.critic, state.models.value_head)
    assert stats.optimizer_steps == 1
    assert EXPECTED_KEYS <= stats.metrics.keys()
    if critic_kind is not None:
        assert CRITIC_KEYS <= stats.metrics.keys()
    assert stats.metrics["response/think_length_mean"] == 3.0
    assert all(math.isfinite(v) for v in stats.metrics.values())
    assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))  # something was trained
    if "model.lora_rank=4" in overrides:
        assert stats.metrics["actor/lr"] == pytest.approx(cfg.trainer.actor_lr * cfg.trainer.lora_lr_multiplier)


def test_no_reference_model_and_no_reference_pass_when_kl_is_zero() -> None:
    # starpo-s: kl_coef 0 -> no reference copy, and the actor's decoder runs exactly once per
    # micro-batch (the update's own forward), never for reference log-probs.
    cfg = make_cfg("starpo-s", "trainer.micro_batch_size=2")
    state = init_state(cfg)
    assert state.models.ref is None and not state.models.use_reference
    calls = _count_calls(decoder_and_head(state.models.actor)[0])
    update(state, make_batch(), cfg)
    assert calls[0] == 8 // 2


def test_reference_pass_is_counted_when_kl_is_on_with_lora() -> None:
    # The control for the test above: with KL on under LoRA, the same decoder also runs (adapters
    # disabled) once per micro-batch for the reference log-probs.
    cfg = make_cfg("starpo", "model.lora_rank=4", "trainer.micro_batch_size=2")
    state = init_state(cfg)
    assert state.models.ref is None and state.models.use_reference
    calls = _count_calls(decoder_and_head(state.models.actor)[0])
    update(state, make_batch(), cfg)
    assert calls[0] == 2 * (8 // 2)


@pytest.mark.parametrize("lora", [False, True])
def test_k1_kl_in_the_loss_trains_the_same_without_the_reference_pass(lora: bool) -> None:
    """kl_coef·(log π − log π_ref) differentiates to kl_coef·∇log π: the reference log-prob is a constant. So
    the update skips the reference forward when it would only log actor/kl_ref (kl_metric False), and its
    gradients and stepped weights equal the update that ran it. The KL itself still acts: without it
    (kl_coef 0) the gradient differs."""
    lora_args = ["model.lora_rank=4"] if lora else []
    grads, weights, metrics = {}, {}, {}
    for name, overrides, kl_metric in (("with_ref", [], True), ("without_ref", [], False),
                                       ("no_kl", ["algorithm.kl_coef=0.0"], False)):
        cfg = make_cfg("starpo", "algorithm.kl_coef=0.5", *lora_args, *overrides)
        assert cfg.algorithm.gradient_reads_reference is False
        state = init_state(cfg)
        seen = _capture_grads(state.actor_engine)
        calls = _count_calls(decoder_and_head(state.models.actor)[0])
        reference_calls = (_count_calls(decoder_and_head(state.models.ref)[0]) if state.models.ref is not None
                           else None)
        stats = update(state, make_batch(), cfg, kl_metric=kl_metric)
        grads[name], weights[name], metrics[name] = seen[0], _params(state.models.actor), stats.metrics
        runs_reference = name == "with_ref"
        if lora:  # the reference is the actor with its adapters off: its decoder runs once more per micro-batch
            assert calls[0] == (2 if runs_reference else 1) * (8 // 2)
        elif reference_calls is not None:
            assert reference_calls[0] == (8 // 2 if runs_reference else 0)
        assert ("actor/kl_ref" in stats.metrics) == runs_reference
    for a, b in zip(grads["with_ref"], grads["without_ref"], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(weights["with_ref"], weights["without_ref"], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert metrics["with_ref"]["actor/pg_loss"] == metrics["without_ref"]["actor/pg_loss"]
    assert any(not torch.allclose(a, b) for a, b in zip(grads["with_ref"], grads["no_kl"], strict=True))


@pytest.mark.parametrize("overrides", [["algorithm.kl_estimator=k3"], ["algorithm.kl_in_reward=true"]])
def test_a_kl_whose_gradient_reads_the_reference_runs_it_every_update(overrides: list[str]) -> None:
    cfg = make_cfg("starpo", "model.lora_rank=4", *overrides)
    assert cfg.algorithm.gradient_reads_reference
    state = init_state(cfg)
    calls = _count_calls(decoder_and_head(state.models.actor)[0])
    stats = update(state, make_batch(), cfg, kl_metric=False)
    assert calls[0] == 2 * (8 // 2)
    assert "actor/kl_ref" in stats.metrics


@pytest.mark.parametrize("preset", ["starpo", "grpo"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_micro_batch_invariance_one_of_eight_vs_eight_of_one(preset: str, agg: str) -> None:
    # Gradients are compared, not stepped weights: Adam's first step is lr·g/(|g| + eps), which turns
    # float noise on a near-zero gradient into a visible weight difference.
    grads, norms = {}, {}
    for micro in (8, 1):
        cfg = make_cfg(preset, f"trainer.micro_batch_size={micro}", f"algorithm.loss_agg={agg}")
        state = init_state(cfg)
        actor_grads = _capture_grads(state.actor_engine)
        critic_grads = _capture_grads(state.critic_engine) if state.critic_engine else []
        stats = update(state, make_batch(), cfg)
        grads[micro] = actor_grads[0] + (critic_grads[0] if critic_grads else [])
        norms[micro] = stats.metrics["actor/grad_norm"]
    assert len(grads[8]) == len(grads[1]) > 0
    for g8, g1 in zip(grads[8], grads[1], strict=True):
        torch.testing.assert_close(g1, g8, atol=1e-6, rtol=1e-5)
    assert norms[1] == pytest.approx(norms[8], rel=1e-5)


def test_default_gradient_weights_each_trajectory_once() -> None:
    # By default (seq-mean-token-mean) the actor's gradient is that of the policy loss
    # averaged over each row's tokens, then over rows (make_batch's rows have 4-10 loss tokens each),
    # accumulated exactly over uneven micro-batches of 3; token-mean would weight long rows more.
    cfg = make_cfg("grpo", "algorithm.kl_coef=0.0", "algorithm.entropy_coef=0.0", "trainer.micro_batch_size=3")
    assert cfg.algorithm.loss_agg == "seq-mean-token-mean"
    batch = make_batch()
    state = init_state(cfg)
    reference = init_state(cfg).models.actor
    seen = _capture_grads(state.actor_engine)
    update(state, batch, cfg)

    from ragen_core.algos.advantages import grpo

    adv = grpo(batch.returns, batch.group_ids)[:, None] * batch.loss_mask
    out = policy_forward(reference, batch.input_ids, batch.attention_mask, cfg.rollout.temperature, chunk=4)
    per_token, _ = losses.policy_loss(out.logprobs, batch.old_logprobs, adv, batch.loss_mask, clip_low=0.2,
                                      clip_high=0.2, dual_clip=3.0, agg="seq-mean-token-mean")
    per_token.backward()
    for got, want in zip(seen[0], [p.grad for p in reference.parameters() if p.requires_grad], strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    lengths = batch.loss_mask.sum(1)
    assert int(lengths.min()) < int(lengths.max())  # rows of different lengths: the two aggregations differ


def test_gradient_is_the_whole_mini_batch_token_mean() -> None:
    # GRPO without KL and with a zero entropy bonus: the actor loss is exactly policy_loss over the
    # whole batch (token-mean over all 53 loss tokens). The trainer's accumulated gradient over
    # micro-batches of 3 (uneven: 3+3+2 rows of different lengths) must equal that plain gradient.
    cfg = make_cfg("grpo", "algorithm.kl_coef=0.0", "algorithm.entropy_coef=0.0", "trainer.micro_batch_size=3",
                   "algorithm.loss_agg=token-mean")
    batch = make_batch()
    state = init_state(cfg)
    reference = init_state(cfg).models.actor  # same seed, same weights
    seen = _capture_grads(state.actor_engine)
    update(state, batch, cfg)

    from ragen_core.algos.advantages import grpo

    adv = grpo(batch.returns, batch.group_ids)[:, None] * batch.loss_mask
    out = policy_forward(reference, batch.input_ids, batch.attention_mask, cfg.rollout.temperature, chunk=4)
    loss, _ = losses.policy_loss(out.logprobs, batch.old_logprobs, adv, batch.loss_mask, clip_low=0.2,
                                 clip_high=0.2, dual_clip=3.0, agg="token-mean")
    loss.backward()
    expected = [p.grad for p in reference.parameters() if p.requires_grad]
    for got, want in zip(seen[0], expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_mini_batches_make_steps_and_report_mean_and_max_grad_norm() -> None:
    # 8 rows in mini-batches of 4 rows -> 2 steps per epoch, 2 epochs -> 4 steps
    cfg = make_cfg("starpo-s", "trainer.mini_batch_rows=4", "trainer.ppo_epochs=2")
    state = init_state(cfg)
    seen = _capture_grads(state.actor_engine)
    stats = update(state, make_batch(), cfg)
    assert stats.optimizer_steps == 4 and len(seen) == 4
    norms = [float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in gs]))) for gs in seen]
    assert stats.metrics["actor/grad_norm"] == pytest.approx(sum(norms) / 4, rel=1e-5)
    assert stats.metrics["actor/grad_norm_max"] == pytest.approx(max(norms), rel=1e-5)


def test_vanilla_takes_four_steps_and_starpo_s_one_at_8x16() -> None:
    # Reference parity (reference ppo_mini_batch_size 32): P x N = 8 x 16 = 128 rows. Vanilla StarPO trains
    # on all 128 -> 128 / 32 = 4 optimizer steps; StarPO-S keeps 25% of the groups = 2 x 16 = 32 rows -> 1.
    batch = make_batch(n_groups=8, group_size=16, max_len=12, turns=1)
    steps = {}
    for preset in ("starpo", "starpo-s"):
        cfg = make_cfg(preset, "rollout.responses_per_prompt=16", "trainer.micro_batch_size=32")
        kept = filter_batch(batch, batch.returns, cfg.algorithm).batch
        steps[preset] = (kept.batch_size, update(init_state(cfg), kept, cfg).optimizer_steps)
    assert steps == {"starpo": (128, 4), "starpo-s": (32, 1)}


def test_online_k_without_mini_batch_rows_splits_into_k_steps() -> None:
    cfg = make_cfg("starpo-s", "trainer.online_k=2", "trainer.mini_batch_rows=null")
    assert update(init_state(cfg), make_batch(), cfg).optimizer_steps == 2


def test_online_k_larger_than_batch_is_refused() -> None:
    cfg = make_cfg("starpo-s", "trainer.online_k=16", "trainer.mini_batch_rows=null")
    with pytest.raises(ValueError, match="online_k"):
        update(init_state(cfg), make_batch(), cfg)


@pytest.mark.parametrize("recorded", [False, True])  # with old values recorded at sampling (a value head's)
def test_update_does_not_modify_the_batch(recorded: bool) -> None:
    import dataclasses

    cfg = make_cfg("starpo", *(["algorithm.critic=head"] if recorded else []))
    batch = make_batch()
    if recorded:
        batch = dataclasses.replace(batch, old_values=torch.where(batch.loss_mask, 0.5, 0.0))
    copies = {k: None if v is None else v.clone() for k, v in vars(batch).items()}
    update(init_state(cfg), batch, cfg)
    for k, v in vars(batch).items():
        assert (v is None and copies[k] is None) or torch.equal(v, copies[k]), k


def test_grpo_advantages_are_not_whitened_and_follow_groups() -> None:
    # Group 0 returns [1, 0, 1, 1] (hand-made below): mean 0.75, unbiased std 0.5, so A = +0.5 or -1.5
    # on every generated token of a row. Whitening would change these values.
    from ragen_core.trainer.update import compute_advantages

    cfg = make_cfg("grpo")
    batch = make_batch()
    returns = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0])
    batch = type(batch)(**{**vars(batch), "returns": returns})
    adv, ret = compute_advantages(batch, batch.rewards, None, cfg.algorithm)
    assert ret is None
    row1 = adv[1][batch.loss_mask[1]]
    assert torch.allclose(row1, torch.full_like(row1, -1.5 / (1 + 2e-6)), atol=1e-5)
    assert torch.all(adv[~batch.loss_mask] == 0)


def test_kl_in_reward_lowers_rewards_on_generated_tokens() -> None:
    from ragen_core.trainer.update import _token_rewards

    cfg = make_cfg("starpo", "algorithm.kl_in_reward=true", "algorithm.kl_coef=0.5")
    batch = make_batch()
    ref = batch.old_logprobs - 1.0  # k1 = old - ref = +1 on every generated token
    rewards = _token_rewards(batch, ref, cfg.algorithm)
    expected = batch.rewards - 0.5 * batch.loss_mask.float()
    torch.testing.assert_close(rewards, expected)


def test_filter_batch_keeps_whole_highest_std_groups() -> None:
    # 3 groups of 4: returns by group [0,0,0,0] (std 0), [1,0,1,0] (std 0.577), [1,1,1,0] (std 0.5).
    # filter_value 0.34 keeps floor(0.34*3) = 1 group: group 1, the highest std.
    batch = make_batch(n_groups=3, group_size=4)
    returns = torch.tensor([0, 0, 0, 0, 1, 0, 1, 0, 1, 1, 1, 0], dtype=torch.float32)
    algo = make_cfg("starpo-s", "algorithm.filter_value=0.34").algorithm
    kept = filter_batch(batch, returns, algo)
    assert kept.kept_groups.tolist() == [1]
    assert kept.rows.tolist() == [4, 5, 6, 7]
    assert kept.batch.batch_size == 4 and torch.equal(kept.batch.group_ids, torch.ones(4, dtype=torch.long))
    assert kept.metrics["rollout/reward_std_kept"] == pytest.approx(math.sqrt(1 / 3))
    assert kept.metrics["rollout/reward_std_all"] == pytest.approx((0 + math.sqrt(1 / 3) + 0.5) / 3)
    # the same returns given as [P, N] select the same rows
    assert filter_batch(batch, returns.reshape(3, 4), algo).rows.tolist() == [4, 5, 6, 7]


def test_filter_batch_none_keeps_everything() -> None:
    batch = make_batch(n_groups=2, group_size=4)
    algo = make_cfg("starpo").algorithm
    kept = filter_batch(batch, torch.zeros(8), algo)
    assert kept.rows.tolist() == list(range(8)) and kept.metrics["rollout/kept_ratio"] == 1.0


def test_filter_batch_scores_entropy_and_length_from_the_rollout() -> None:
    # Two groups of two, hand-made: loss tokens with sampling log-probs.
    #   group 0: rows of 2 tokens (-1, -1) and 2 tokens (-3, -3): per-row entropy 1 and 3 -> mean 2, std 1.414
    #   group 1: rows of 1 token (-2) and 3 tokens (-2, -2, -2): entropy 2 and 2 -> mean 2, std 0; length mean 2 vs 2
    batch = make_batch(n_groups=2, group_size=2)
    mask = torch.zeros_like(batch.loss_mask)
    logp = torch.zeros_like(batch.old_logprobs)
    for row, values in enumerate([[-1, -1], [-3, -3], [-2], [-2, -2, -2]]):
        mask[row, : len(values)] = True
        logp[row, : len(values)] = torch.tensor(values, dtype=torch.float32)
    batch = type(batch)(**{**vars(batch), "loss_mask": mask, "old_logprobs": logp})
    returns = torch.zeros(4)

    def kept(*overrides: str) -> list[int]:
        algo = make_cfg("starpo-s", "rollout.responses_per_prompt=2", *overrides).algorithm
        return filter_batch(batch, returns, algo).kept_groups.tolist()

    assert kept("algorithm.filter_metric=entropy_std", "algorithm.filter_value=0.5") == [0]
    assert kept("algorithm.filter_metric=entropy_std", "algorithm.filter_value=0.5",
                "algorithm.filter_largest=false") == [1]
    assert kept("algorithm.filter_metric=length", "algorithm.filter_value=0.5") == [0]  # a tie: lower index
    # zero-std groups dropped first (RAGEN-2): all rewards equal -> nothing kept, the caller skips the update
    empty = filter_batch(batch, returns, make_cfg("starpo-s-snr", "rollout.responses_per_prompt=2").algorithm)
    assert empty.kept_groups.tolist() == [] and empty.batch.batch_size == 0 and empty.metrics["rollout/kept_ratio"] == 0


@pytest.mark.parametrize(("scale", "expected"), [("none", 1.0), ("linear", 0.25), ("sqrt", 0.5)])
def test_filter_advantage_scale_follows_the_kept_fraction(scale: str, expected: float) -> None:
    batch = make_batch(n_groups=4, group_size=2)
    returns = torch.tensor([0, 1, 0, 0, 0, 0, 0, 0], dtype=torch.float32)  # only group 0 has signal
    algo = make_cfg("starpo-s", "rollout.responses_per_prompt=2", f"algorithm.filter_adv_scale={scale}").algorithm
    result = filter_batch(batch, returns, algo)  # top_k 0.25 of 4 groups: 1 kept -> fraction 0.25
    assert result.kept_groups.tolist() == [0] and result.advantage_scale == pytest.approx(expected)


def test_advantage_scale_scales_the_policy_gradient() -> None:
    # With no entropy bonus and no KL, the clipped surrogate is linear in positively scaled advantages
    # (clipping depends only on their sign): half the advantages, half the gradient.
    cfg = make_cfg("grpo", "algorithm.kl_coef=0.0", "algorithm.entropy_coef=0.0")
    grads = {}
    for scale in (1.0, 0.5):
        state = init_state(cfg)
        seen = _capture_grads(state.actor_engine)
        update(state, make_batch(), cfg, advantage_scale=scale)
        grads[scale] = seen[0]
    for full, half in zip(grads[1.0], grads[0.5], strict=True):
        torch.testing.assert_close(half, 0.5 * full, atol=1e-7, rtol=1e-5)


def _rows(*rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    attn = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, : len(r)], attn[i, : len(r)] = torch.tensor(r), True
    return ids, attn


def test_micro_blocks_golden() -> None:
    # Rows 0-3: a group sharing a 20-token prompt, tails 2, 3, 2, 3 (lengths 22, 23, 22, 23); rows 4, 5: 30
    # tokens each, sharing nothing; row 6: 5 tokens.
    prompt = list(range(1, 21))
    ids, attn = _rows(*[prompt + [100 + r] * t for r, t in enumerate((2, 3, 2, 3))],
                      list(range(200, 230)), list(range(300, 330)), list(range(400, 405)))
    # Budget 40: rows 0-3 cost 20 + 10 packed = 30 (pack_pays: 10 x (1 + 30/3000) = 10.1 < 0.9 x 4 x 3 x
    # (1 + 23/3000) = 10.88); adding row 4 widens the micro-batch to 30: 30 + 30 = 60 > 40. Rows 4 and 5
    # together: 2 x 30 = 60 > 40, each alone; row 6 is left alone at the end.
    assert micro_blocks(ids, attn, 8, 40) == [slice(0, 4), slice(4, 5), slice(5, 6), slice(6, 7)]
    assert micro_blocks(ids, attn, 2, 40) == [slice(0, 2), slice(2, 4), slice(4, 5), slice(5, 6), slice(6, 7)]
    # A row over the budget still goes, alone (rows 4 and 5: 30 > 20); rows 0 and 1 cost 25 > 20.
    assert micro_blocks(ids, attn, 8, 20) == [slice(r, r + 1) for r in range(7)]
    # Without prefix sharing (gradient checkpointing) rows 0 and 1 cost 2 x 23 = 46 > 40.
    assert micro_blocks(ids, attn, 8, 40, share=False) == [slice(r, r + 1) for r in range(7)]
    # Padded instead of packed: rows 0-3 cost 20 + 4 x 3 = 32, still one micro-batch.
    assert micro_blocks(ids, attn, 8, 40, pack=False)[0] == slice(0, 4)
    # No token budget: rows only.
    assert micro_blocks(ids, attn, 8, None) == [slice(0, 7)]
    assert micro_blocks(ids, attn, 3, None) == [slice(0, 3), slice(3, 6), slice(6, 7)]


@pytest.mark.parametrize("preset", ["starpo", "grpo"])
def test_token_budget_micro_batches_give_the_same_gradient(preset: str) -> None:
    # make_batch's rows are 11-15 tokens (no shared prompts): a 24-token budget makes micro-batches of
    # 1, 1, 1, 1, 1, 1, 2 rows (rows 6 and 7, 12 and 11 tokens, pad to 2 x 12), None one of all 8. The
    # accumulated gradients (actor and critic) and the grad norm are the same.
    batch = make_batch()
    assert batch.attention_mask.sum(1).tolist() == [15, 11, 15, 14, 12, 15, 12, 11]
    assert [b.stop - b.start for b in micro_blocks(batch.input_ids, batch.attention_mask, 8, 24)] == [1] * 6 + [2]
    grads, norms, calls = {}, {}, {}
    for budget in ("24", "null"):
        cfg = make_cfg(preset, "trainer.micro_batch_size=8", f"trainer.micro_batch_tokens={budget}",
                       "algorithm.kl_coef=0.0")
        state = init_state(cfg)
        calls[budget] = _count_calls(decoder_and_head(state.models.actor)[0])
        actor_grads = _capture_grads(state.actor_engine)
        critic_grads = _capture_grads(state.critic_engine) if state.critic_engine else []
        stats = update(state, batch, cfg)
        grads[budget] = actor_grads[0] + (critic_grads[0] if critic_grads else [])
        norms[budget] = stats.metrics["actor/grad_norm"]
    assert (calls["24"][0], calls["null"][0]) == (7, 1)  # one actor forward per micro-batch
    for a, b in zip(grads["24"], grads["null"], strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert norms["24"] == pytest.approx(norms["null"], rel=1e-5)


def test_recorded_old_values_spare_the_critic_forward_and_give_the_same_update() -> None:
    """A value head's old values from the rollout (``TokenBatch.old_values``, the generator's head on the hidden
    states it sampled from): the decoder runs only for the update's own forwards, and the gradients equal those
    of the update that computes the old values itself."""
    import dataclasses

    from ragen_core.trainer.models import critic_values

    cfg = make_cfg("starpo-s", "algorithm.critic=head", "trainer.micro_batch_size=2")
    batch = make_batch()
    grads, calls = [], []
    for recorded in (False, True):
        state = init_state(cfg)
        with torch.no_grad():
            values = critic_values(state.models, batch.input_ids, batch.attention_mask.long())
        given = dataclasses.replace(batch, old_values=torch.where(batch.loss_mask, values, 0.0)) if recorded else batch
        seen = _capture_grads(state.actor_engine)
        count = _count_calls(decoder_and_head(state.models.actor)[0])
        stats = update(state, given, cfg)
        grads.append(seen[0])
        calls.append(count[0])
        assert CRITIC_KEYS <= stats.metrics.keys()
    assert calls == [2 * (8 // 2), 8 // 2]
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def _trainer_logprobs(state, batch, cfg) -> torch.Tensor:
    out = policy_forward(state.models.actor, batch.input_ids, batch.attention_mask, cfg.rollout.temperature,
                         cfg.trainer.logprob_chunk, entropy_grad=False, scored=batch.loss_mask)
    return torch.where(batch.loss_mask, out.logprobs.detach(), 0.0)


def test_the_rollout_gap_is_logged_in_both_old_logprob_modes_and_recompute_starts_at_ratio_one() -> None:
    # make_batch's old log-probs are random (another engine's): the gap is |trainer - rollout| over generated tokens
    batch = make_batch()
    stats = {}
    for mode in ("rollout", "recompute"):
        cfg = make_cfg("starpo-s", f"algorithm.old_logprobs={mode}")
        state = init_state(cfg)
        want = (_trainer_logprobs(state, batch, cfg) - batch.old_logprobs).abs()[batch.loss_mask]
        stats[mode] = update(state, batch, cfg).metrics
        assert stats[mode]["rollout/logprob_gap_mean"] == pytest.approx(float(want.mean()), rel=1e-4)
        assert stats[mode]["rollout/logprob_gap_max"] == pytest.approx(float(want.max()), rel=1e-4)
    # against its own log-probs the first step's ratio is 1: nothing is clipped; against random ones it is not
    assert stats["recompute"]["actor/approx_kl"] == pytest.approx(0.0, abs=1e-6)
    assert stats["rollout"]["actor/approx_kl"] > 0.01


def test_truncated_importance_sampling_weights_the_loss_by_the_capped_engine_ratio() -> None:
    batch = make_batch()
    cfg = make_cfg("starpo-s", "algorithm.old_logprobs=recompute", "algorithm.tis_cap=2.0")
    state = init_state(cfg)
    trainer = _trainer_logprobs(state, batch, cfg)
    weights = losses.truncated_is_weights(trainer, batch.old_logprobs, 2.0)
    stats = update(state, batch, cfg)
    from ragen_core.algos.masked import masked_mean

    assert stats.metrics["actor/tis_weight_mean"] == pytest.approx(float(masked_mean(weights, batch.loss_mask)),
                                                                   rel=1e-4)
    # when the engine sampled with the trainer's own log-probs every weight is 1: the same update as without TIS
    same = batch.__class__(**{**batch.__dict__, "old_logprobs": trainer})
    moved = []
    for extra in ([], ["algorithm.tis_cap=2.0"]):
        c = make_cfg("starpo-s", "algorithm.old_logprobs=recompute", *extra)
        s = init_state(c)
        update(s, same, c)
        moved.append(_params(s.models.actor))
    assert all(torch.allclose(a, b, atol=1e-7) for a, b in zip(*moved, strict=True))


def test_tis_without_recomputed_old_logprobs_is_refused() -> None:
    from ragen_core.config import ConfigError

    with pytest.raises(ConfigError, match="old_logprobs=recompute"):
        make_cfg("starpo-s", "algorithm.tis_cap=2.0")
