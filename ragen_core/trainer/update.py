"""One StarPO update: all optimizer steps made from one fresh rollout batch (SPEC §4, §5).

    stats = update(state, batch, cfg, think_tokens=[t.turns[0].think_tokens for t in trajs])
    stats.metrics["actor/grad_norm"], stats.optimizer_steps

Steps (the math is ``ragen_core.algos``; this module only orchestrates):

1. Under no_grad: old values from the critic and, only when KL is on,
   reference log-probs. The rollout's sampling log-probs are the old log-probs.
2. Token rewards (+ the KL penalty when ``kl_in_reward``), then advantages
   from the estimator picked in :data:`ESTIMATORS`, whitened over the loss mask
   for the GAE estimators (GRPO and GiGPO are already normalised within groups).
3. PPO mini-batches (SPEC §4): the rows, in batch order, are cut into mini-batches
   of ``trainer.mini_batch_rows`` trajectories (the reference's 32), each one
   optimizer step, the whole pass repeated ``ppo_epochs`` times: vanilla StarPO
   at 8×16 takes 4 steps per iteration (the last 3 off-policy), StarPO-S with 32
   kept rows 1. Online-k needs nothing more: its rollout has k·P groups, so k
   times the rows and k times the steps. ``mini_batch_rows: None`` splits the
   rows into ``online_k`` equal mini-batches instead (one step per k). Each
   mini-batch is split into micro-batches of consecutive rows, at most
   ``trainer.micro_batch_size`` rows and ``trainer.micro_batch_tokens`` token positions
   as the backbone runs them (:func:`micro_blocks`), whose losses are normalised by the
   whole mini-batch's count (rows with loss tokens for the seq-mean aggregations, loss
   tokens for token-mean), so the accumulated gradient is exactly the mini-batch's.
   The token budget bounds the update's memory whatever the rows' lengths: a prompt
   group of short replies (its prompt run once) stays in one micro-batch, 384-token
   rows go one by one.
4. Actor loss = policy loss − entropy_coef·entropy (+ kl_coef·KL in the loss);
   critic loss = clipped value loss. The gradient norm is taken over each
   mini-batch's accumulated gradient (the whole update, not one micro-batch).
   Every forward runs as ``engine.forward(fn, ...)`` of the engine that trains
   the module (DeepSpeed's ZeRO-3 needs its own forward).
5. Data parallel (an engine with ``data_parallel == (rank, W)``, W > 1, e.g.
   DeepSpeed under torchrun): every process gets the same full batch and does
   steps 1-2 on all of it; in step 3 it trains only its share of each
   mini-batch's rows (:func:`rank_micro_rows`), still normalised by the whole
   mini-batch's count, and the engine sums the ranks' gradients. At the end the
   ranks add up their metric sums (token-weighted stats, per-step losses), so
   every rank reports the whole batch's metrics, as one process would (the health
   monitor reads them). With the torch engine (W = 1) nothing changes.

The update mutates ``state.models`` and the engines' optimizers in place (it
is a training step); it never modifies ``batch``.

Run the tests with ``python -m pytest tests/unit/trainer -q``.
"""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ragen_core import distributed
from ragen_core.algos import advantages as adv_fns
from ragen_core.algos import losses
from ragen_core.algos.masked import masked_mean, masked_var, masked_whiten
from ragen_core.config import AlgorithmConfig, ExperimentConfig
from ragen_core.trainer.engine import trainable_parameters
from ragen_core.trainer.forward import (
    backbone_tokens,
    can_pack,
    can_share,
    decoder_and_head,
    logits_gradient_in_place,
    policy_forward,
    shared_prefix_groups,
)
from ragen_core.trainer.models import PolicyModels, critic_values, reference_logprobs
from ragen_core.trainer.state import TrainState
from ragen_core.types import TokenBatch, UpdateStats

__all__ = ["ESTIMATORS", "GRAD_TERMS", "bucket_names", "compute_advantages", "grad_buckets", "group_buckets",
           "micro_blocks", "micro_slices", "mini_batch_rows", "rank_micro_rows", "update"]

Estimator = Callable[[TokenBatch, torch.Tensor, "torch.Tensor | None", AlgorithmConfig],
                     tuple[torch.Tensor, "torch.Tensor | None"]]


def _gae(batch: TokenBatch, rewards: torch.Tensor, values: torch.Tensor | None,
         algo: AlgorithmConfig) -> tuple[torch.Tensor, torch.Tensor | None]:
    return adv_fns.gae(rewards, _need(values), batch.loss_mask, gamma=algo.gamma, lam=algo.lam)


def _bilevel_gae(batch: TokenBatch, rewards: torch.Tensor, values: torch.Tensor | None,
                 algo: AlgorithmConfig) -> tuple[torch.Tensor, torch.Tensor | None]:
    return adv_fns.bilevel_gae(rewards, _need(values), batch.loss_mask, batch.turn_ends, gamma=algo.gamma,
                               lam=algo.lam, turn_gamma=algo.turn_gamma, turn_lam=algo.turn_lambda)


def _grpo(batch: TokenBatch, rewards: torch.Tensor, values: torch.Tensor | None,
          algo: AlgorithmConfig) -> tuple[torch.Tensor, torch.Tensor | None]:
    # A trajectory's return is the sum of its token rewards: batch.returns plus any KL placed in the reward.
    traj_returns = batch.returns + (rewards - batch.rewards).sum(dim=1)  # [B]
    advantages = _row_grpo(traj_returns, batch)[:, None] * batch.loss_mask  # [B, T]
    # An optional critic next to GRPO learns discounted returns-to-go (a diagnostic; λ = 1 makes them MC returns).
    returns = None if values is None else adv_fns.gae(rewards, values, batch.loss_mask, algo.gamma, 1.0)[1]
    return advantages, returns


def _row_grpo(scores: torch.Tensor, batch: TokenBatch) -> torch.Tensor:
    """GRPO advantage of each row [B] from each row's return ``scores`` [B] (``batch.returns`` plus the KL its tokens
    added to the reward).

    Rows of per-turn batches (``batch.episode_ids``) are one trajectory's turns: the group statistics count each
    trajectory once, its return plus the KL of all its rows (what its one row would sum under context_window full),
    and every row gets its trajectory's advantage, as RAGEN-2 counts each (group, episode) once.
    """
    if batch.episode_ids is None:
        return adv_fns.grpo(scores, batch.group_ids)
    _, row_of = torch.unique(batch.episode_ids, return_inverse=True)  # [B] -> episode 0..E-1
    n = int(row_of.max()) + 1 if row_of.numel() else 0
    ep_return = scores.new_zeros(n).scatter(0, row_of, batch.returns.to(scores.dtype))  # [E], equal on its rows
    ep_added = scores.new_zeros(n).index_add(0, row_of, scores - batch.returns.to(scores.dtype))  # [E]
    ep_group = batch.group_ids.new_zeros(n).scatter(0, row_of, batch.group_ids)  # [E]
    return adv_fns.grpo(ep_return + ep_added, ep_group)[row_of]  # [B]


def _gigpo(batch: TokenBatch, rewards: torch.Tensor, values: torch.Tensor | None,
           algo: AlgorithmConfig) -> tuple[torch.Tensor, torch.Tensor | None]:
    if batch.episode_ids is not None:
        raise ValueError("the gigpo estimator needs whole trajectories as rows, not per-turn rows "
                         "(rollout.context_window K)")
    if batch.turn_rewards is None or batch.turn_states is None:
        raise ValueError("the gigpo estimator needs each turn's reward and state key: TokenBatch.turn_rewards and "
                         "turn_states, as rollout.batch.build_token_batch fills them")
    # What the update added to the rollout's rewards (a KL in the reward) counts in the return of the turn it sits in,
    # so each row's turn rewards still sum to the return grpo normalises.
    added = torch.where(batch.loss_mask, rewards - batch.rewards, 0.0)  # [B, T]
    traj_returns = batch.returns + (rewards - batch.rewards).sum(dim=1)  # [B], exactly _grpo's
    k = batch.turn_rewards.shape[1]
    turn_of = batch.turn_ids.clamp(0, k - 1)  # [B, T]; padding (-1) and env text are outside the loss mask
    step_rewards = batch.turn_rewards.to(added.dtype).scatter_add(1, turn_of, added)  # [B, K]
    lengths = (batch.turn_states >= 0).sum(dim=1).tolist()  # [B] turns per trajectory
    turn_adv = adv_fns.gigpo(
        traj_returns, [step_rewards[b, :n] for b, n in enumerate(lengths)],
        [batch.turn_states[b, :n].tolist() for b, n in enumerate(lengths)], batch.group_ids,
        gamma=algo.gigpo_gamma, omega=algo.gigpo_omega, step_norm=algo.gigpo_step_norm)  # [B, K'], K' <= K
    turn_adv = torch.nn.functional.pad(turn_adv, (0, k - turn_adv.shape[1]))  # [B, K]
    advantages = turn_adv.gather(1, turn_of) * batch.loss_mask  # [B, T]: each reply token gets its turn's value
    returns = None if values is None else adv_fns.gae(rewards, values, batch.loss_mask, algo.gamma, 1.0)[1]
    return advantages, returns


def _need(values: torch.Tensor | None) -> torch.Tensor:
    if values is None:
        raise ValueError("the gae estimators need a critic; set algorithm.critic to 'separate' or 'head'")
    return values


ESTIMATORS: dict[str, Estimator] = {"gae": _gae, "bilevel_gae": _bilevel_gae, "grpo": _grpo, "gigpo": _gigpo}
"""algorithm.estimator -> (batch, token rewards, old values or None, algo) -> (advantages [B, T], returns [B, T] or
None)."""

_WHITENED = {"gae", "bilevel_gae"}  # GRPO and GiGPO advantages are already group-normalised (SPEC §4)


def compute_advantages(
    batch: TokenBatch, rewards: torch.Tensor, values: torch.Tensor | None, algo: AlgorithmConfig
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Advantages [B, T] (whitened over the loss mask when configured) and critic targets [B, T] or None."""
    advantages, returns = ESTIMATORS[algo.estimator](batch, rewards, values, algo)
    if algo.whiten_advantages and algo.estimator in _WHITENED:
        advantages = masked_whiten(advantages, batch.loss_mask)
    return advantages, returns


def mini_batch_rows(n_rows: int, rows_per_mini_batch: int | None, online_k: int = 1) -> list[torch.Tensor]:
    """Row indices of each PPO mini-batch of an update of ``n_rows`` rows, in batch order (module step 3).

    Consecutive blocks of ``rows_per_mini_batch`` rows (the last one may be shorter); with None,
    ``online_k`` near-equal blocks.
    """
    rows = torch.arange(n_rows)
    if rows_per_mini_batch is None:
        if n_rows < online_k:
            raise ValueError(f"{n_rows} rows cannot make trainer.online_k={online_k} mini-batches")
        return list(torch.tensor_split(rows, online_k))
    return list(torch.split(rows, rows_per_mini_batch))


def micro_slices(n_rows: int, micro_batch_size: int) -> list[slice]:
    """Consecutive row slices of at most ``micro_batch_size`` rows covering ``n_rows`` (deterministic order)."""
    return [slice(s, min(s + micro_batch_size, n_rows)) for s in range(0, n_rows, micro_batch_size)]


def micro_blocks(input_ids: torch.Tensor, attention_mask: torch.Tensor, max_rows: int, max_tokens: int | None = None,
                 share: bool = True, pack: bool = True) -> list[slice]:
    """Consecutive row slices covering a right-padded batch (input_ids, attention_mask: [B, T]): each at
    most ``max_rows`` rows and, with ``max_tokens``, at most that many token positions as the backbone
    runs them (:func:`forward.backbone_tokens`: padding counted, a prompt group's shared prefix once),
    except a single row longer than the budget, which goes alone. share / pack: whether the actor's
    backbone shares prefixes / packs tails (``forward.can_share``, ``forward.can_pack``). Deterministic:
    the same batch gives the same slices on every rank.

    A slice's cost is what ``forward.hidden_states`` will run for exactly those rows (their own prefix
    groups), so a slice holding part of a prompt group counts the prefix its rows share.
    """
    n = input_ids.shape[0]
    if max_tokens is None:
        return micro_slices(n, max_rows)
    lengths = [int(x) for x in attention_mask.sum(dim=1).tolist()]

    def cost(start: int, stop: int) -> int:
        groups = shared_prefix_groups(input_ids[start:stop], attention_mask[start:stop]) if share else []
        return backbone_tokens(lengths[start:stop], groups, pack)

    slices, start = [], 0
    while start < n:
        stop = start + 1  # a row always goes, even one over the budget
        while stop < n and stop - start < max_rows and cost(start, stop + 1) <= max_tokens:
            stop += 1
        slices.append(slice(start, stop))
        start = stop
    return slices


def rank_micro_rows(n_rows: int, micro_batch_size: int, rank: int = 0, world_size: int = 1,
                    blocks: list[slice] | None = None) -> list[torch.Tensor]:
    """One rank's micro-batches of a mini-batch of ``n_rows`` rows, as row indices; as many on every rank.

    The rows go in consecutive blocks (``blocks``, as :func:`micro_blocks` cuts them for
    ``world_size`` ranks; by default :func:`micro_slices` of ``micro_batch_size × world_size``),
    each cut into ``world_size`` near-equal contiguous parts; rank r takes part r of every
    block. With world_size 1 these are exactly the blocks. A part can be
    empty (a last block shorter than world_size): the caller still makes a backward
    for it, because ZeRO-2 reduces gradients inside every backward and the ranks'
    collectives must pair up.
    """
    if blocks is None:
        blocks = micro_slices(n_rows, micro_batch_size * world_size)
    return [torch.tensor_split(torch.arange(s.start, s.stop), world_size)[rank] for s in blocks]


def _take(x: torch.Tensor, rows: torch.Tensor, width: int) -> torch.Tensor:
    """Rows of a per-token [B, T] tensor, cut to ``width`` columns like ``TokenBatch.select`` cuts padding."""
    return x.index_select(0, rows)[:, :width]


def _on(batch: TokenBatch, device: torch.device) -> TokenBatch:
    """The batch's tensors on ``device`` (the batch itself stays where it is: selection runs on CPU)."""
    if batch.input_ids.device == device:
        return batch
    moved: dict[str, Any] = {k: None if v is None else v.to(device, non_blocking=True) for k, v in vars(batch).items()}
    return TokenBatch(**moved)


def _pad_to(x: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, width - x.shape[1]))


@torch.no_grad()
def _recompute_logprobs(state: TrainState, batch: TokenBatch, cfg: ExperimentConfig) -> torch.Tensor:
    """The trainer's log-probs [B, T] of the batch's tokens under the weights that sampled them (before any step
    of this update), micro-batched, no gradients; 0 where the loss mask is off."""
    out, width, device = [], batch.input_ids.shape[1], state.models.device
    for s in micro_slices(batch.batch_size, cfg.trainer.micro_batch_size):
        micro = _on(batch.select(torch.arange(s.start, s.stop)), device)
        lp = state.actor_engine.forward(policy_forward, state.models.actor, micro.input_ids, micro.attention_mask,
                                        cfg.rollout.temperature, cfg.trainer.logprob_chunk, entropy_grad=False,
                                        scored=micro.loss_mask).logprobs
        out.append(_pad_to(torch.where(micro.loss_mask, lp.float(), 0.0).cpu(), width))
    return torch.cat(out)


def _gap_metrics(gap: _Gap) -> dict[str, float]:
    """``rollout/logprob_gap_mean`` and ``_max``: |trainer − rollout| log-prob over the generated tokens (of every
    rank, under data parallel)."""
    total, count, top = gap.total, gap.count, gap.top
    if distributed.world_size() > 1:
        parts = distributed.all_gather((total, count, top))
        total, count, top = sum(p[0] for p in parts), sum(p[1] for p in parts), max(p[2] for p in parts)
    if count == 0:
        return {}
    return {"rollout/logprob_gap_mean": total / count, "rollout/logprob_gap_max": top}


class _Gap:
    """Running sum, count and max of |trainer − rollout| log-probs over generated tokens."""

    def __init__(self) -> None:
        self.total, self.count, self.top = 0.0, 0, 0.0

    def add(self, trainer: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> None:
        diff = (trainer.detach().float() - rollout.float()).abs()[mask]
        if diff.numel():
            self.total += float(diff.sum())
            self.count += int(diff.numel())
            self.top = max(self.top, float(diff.max()))


@torch.no_grad()
def _rollout_side(
    state: TrainState, batch: TokenBatch, cfg: ExperimentConfig, reference: bool = True
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(old values [B, T] or None, reference log-probs [B, T] or None), micro-batched, no gradients.

    A value head's old values come from the rollout when the generator recorded them (``batch.old_values``:
    the head on the hidden states the sampled tokens came from, the same weights and positions as this
    forward, equal within float rounding); then no forward runs for them. ``reference`` False: no reference
    forward either (the gradient does not read it, :attr:`AlgorithmConfig.gradient_reads_reference`)."""
    models = state.models
    values: list[torch.Tensor] = []
    ref: list[torch.Tensor] = []
    has_critic = models.critic is not None or models.value_head is not None
    if has_critic and models.critic is None and batch.old_values is not None:
        values.append(batch.old_values.float())
        has_critic = False  # nothing left to run for them
    reference = reference and models.use_reference
    if not has_critic and not reference:
        return (values[0] if values else None), None
    # Each forward runs through the engine of the module it reads (ZeRO-3 gathers weights only there).
    critic_engine = state.critic_engine or state.actor_engine  # a value head is trained by the actor's engine
    width, device = batch.input_ids.shape[1], models.device
    for s in micro_slices(batch.batch_size, cfg.trainer.micro_batch_size):
        micro = _on(batch.select(torch.arange(s.start, s.stop)), device)
        if has_critic:
            v = critic_engine.forward(critic_values, models, micro.input_ids, micro.attention_mask)
            values.append(_pad_to(v.float().cpu(), width))
        if reference:  # a frozen copy outside the engine, or the actor with its adapters off
            lp = state.actor_engine.forward(reference_logprobs, models, micro.input_ids, micro.attention_mask,
                                            cfg.rollout.temperature, cfg.trainer.logprob_chunk,
                                            scored=micro.loss_mask)
            ref.append(_pad_to(lp.cpu(), width))
    return (torch.cat(values) if values else None), (torch.cat(ref) if ref else None)


def _token_rewards(batch: TokenBatch, ref_logprobs: torch.Tensor | None, algo: AlgorithmConfig) -> torch.Tensor:
    """Rewards [B, T]; with ``kl_in_reward`` minus kl_coef·KL(rollout ‖ ref) on every generated token."""
    if not (algo.kl_in_reward and ref_logprobs is not None):
        return batch.rewards.float()
    kl = losses.kl_penalty(batch.old_logprobs, ref_logprobs, algo.kl_estimator)  # [B, T]
    return batch.rewards.float() - algo.kl_coef * torch.where(batch.loss_mask, kl, 0.0)


class _Meter:
    """Token-weighted means of per-micro-batch stats, plus per-step values (grad norms, losses)."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = defaultdict(float)
        self.weights: dict[str, float] = defaultdict(float)
        self.steps: dict[str, list[float]] = defaultdict(list)

    def add(self, prefix: str, stats: dict[str, torch.Tensor], weight: float) -> None:
        for k, v in stats.items():
            if k != "n_tokens":
                self.sums[prefix + k] += float(v) * weight
                self.weights[prefix + k] += weight

    def means(self) -> dict[str, float]:
        return {k: self.sums[k] / self.weights[k] for k in self.sums if self.weights[k] > 0}

    def add_up_ranks(self) -> None:
        """Data parallel: every rank's sums, weights and per-step losses added up (a collective), so the means
        describe the whole batch on every rank. Grad norms are already the global ones: left as they are."""
        parts = distributed.all_gather((dict(self.sums), dict(self.weights),
                                        {k: v for k, v in self.steps.items() if not k.endswith("grad_norm")}))
        self.sums, self.weights = defaultdict(float), defaultdict(float)
        losses_by_step: dict[str, list[float]] = {}
        for sums, weights, steps in parts:
            for k, v in sums.items():
                self.sums[k] += v
            for k, v in weights.items():
                self.weights[k] += v
            for k, values in steps.items():
                total = losses_by_step.setdefault(k, [0.0] * len(values))
                losses_by_step[k] = [a + b for a, b in zip(total, values, strict=True)]
        self.steps.update(losses_by_step)


def update(
    state: TrainState, batch: TokenBatch, cfg: ExperimentConfig, think_tokens: Sequence[float] | None = None,
    advantage_scale: float = 1.0, kl_metric: bool = True,
) -> UpdateStats:
    """All optimizer steps of one rollout batch: one per mini-batch (module step 3), × ``ppo_epochs``.

    batch: the (already filtered) rows to train on; think_tokens: optional
    ``<think>`` length per row (summed over its turns) for the response/
    metrics; advantage_scale: multiplies the advantages (the filter's ``advantage_scale``);
    kl_metric: whether to log ``actor/kl_ref`` when the gradient does not read the reference (k1 in the loss):
    the reference forward then runs for that metric alone, so False skips it and the steps are the same.
    Returns namespaced metrics (actor/, critic/, response/, timing/, perf/).
    """
    started = time.perf_counter()
    algo, tr = cfg.algorithm, cfg.trainer
    models = state.models
    mini_batches = mini_batch_rows(batch.batch_size, tr.mini_batch_rows, tr.online_k)
    models.train()
    batch = _on(batch, torch.device("cpu"))  # bookkeeping on CPU; micro-batches go to the model's device
    gap, tis = _Gap(), None
    if algo.old_logprobs == "recompute":  # PPO's ratio against the trainer's own old policy
        trainer_lp = _recompute_logprobs(state, batch, cfg)
        gap.add(trainer_lp, batch.old_logprobs, batch.loss_mask)
        if algo.tis_cap is not None:
            tis = losses.truncated_is_weights(trainer_lp, batch.old_logprobs.float(), algo.tis_cap)
        batch = dataclasses.replace(batch, old_logprobs=trainer_lp)
    reference = algo.gradient_reads_reference or (algo.uses_reference and kl_metric)
    prepass_started = time.perf_counter()  # the recompute above, if any, ran before this
    old_values, ref_logprobs = _rollout_side(state, batch, cfg, reference)
    prepass_s = time.perf_counter() - prepass_started
    rewards = _token_rewards(batch, ref_logprobs, algo)
    advantages, returns = compute_advantages(batch, rewards, old_values, algo)
    advantages = advantages * advantage_scale
    train_critic = returns is not None and old_values is not None

    meter = _Meter()
    steps = 0
    for _ in range(tr.ppo_epochs):
        for mb_rows in mini_batches:
            # the first mini-batch's forward runs on the weights that sampled: it measures the rollout gap
            _mini_batch_step(state, batch, mb_rows, advantages, returns if train_critic else None,
                             old_values, ref_logprobs, cfg, meter, tis,
                             gap if steps == 0 and algo.old_logprobs == "rollout" else None)
            steps += 1
    if state.actor_engine.data_parallel[1] > 1:
        meter.add_up_ranks()

    seconds = time.perf_counter() - started
    metrics = meter.means()
    for key, values in meter.steps.items():
        metrics[key] = sum(values) / len(values)
        if key.endswith("grad_norm"):
            metrics[key + "_max"] = max(values)
    metrics.update(_batch_metrics(batch, advantages, returns, old_values, think_tokens))
    metrics.update(_gap_metrics(gap))
    if tis is not None:
        metrics["actor/tis_weight_mean"] = float(masked_mean(tis, batch.loss_mask))
    if ref_logprobs is not None and algo.kl_in_reward:  # KL of the rollout policy to the reference
        kl = losses.kl_penalty(batch.old_logprobs, ref_logprobs, algo.kl_estimator)
        metrics["actor/kl_ref"] = float(masked_mean(kl, batch.loss_mask))
    metrics["actor/lr"] = state.actor_engine.lr
    if state.critic_engine is not None:
        metrics["critic/lr"] = state.critic_engine.lr
    n_tokens = float(batch.attention_mask.sum())
    metrics.update({"timing/update_s": seconds, "timing/update_recompute_s": prepass_started - started,
                    "timing/update_prepass_s": prepass_s, "perf/update_tokens": n_tokens,
                    "perf/update_tokens_per_s": n_tokens * tr.ppo_epochs / max(seconds, 1e-9)})
    return UpdateStats(metrics=metrics, optimizer_steps=steps)


GRAD_TERMS = ("task", "entropy", "kl", "value")
"""The loss terms :func:`grad_buckets` takes apart (:func:`_actor_loss`'s ``terms``)."""


def bucket_names(edges: Sequence[float]) -> list[str]:
    """The buckets of in-group reward std for ``edges`` (e1 < e2 < ...): zero, then le_<e1>, ..., gt_<e_last>."""
    return ["zero", *(f"le_{e:g}" for e in edges), f"gt_{edges[-1]:g}" if edges else "gt_0"]


def group_buckets(batch: TokenBatch, edges: Sequence[float]) -> dict[str, list[int]]:
    """Bucket name -> the rows of the groups whose in-group std of the trajectory returns (``batch.returns``,
    unbiased; a group of one row has std 0) falls in it, in batch order. A std within 1e-8 of 0 is zero."""
    names = bucket_names(edges)
    out: dict[str, list[int]] = {name: [] for name in names}
    groups = batch.group_ids.tolist()
    returns = batch.returns.double()
    for g in dict.fromkeys(groups):
        rows = [r for r, x in enumerate(groups) if x == g]
        std = float(returns[rows].std()) if len(rows) > 1 else 0.0
        if std <= 1e-8:
            name = "zero"
        else:
            k = next((i for i, e in enumerate(edges) if std <= e), len(edges))
            name = names[1 + k]
        out[name].extend(rows)
    return out


def grad_buckets(state: TrainState, batch: TokenBatch, cfg: ExperimentConfig) -> dict[str, float]:
    """RAGEN-2's gradient analysis on a rollout batch (before any filter): per reward-std bucket
    (:func:`group_buckets`, ``diagnostics.grad_bucket_edges``), the norm of the gradient of each loss term
    (task = the PPO policy loss, entropy, kl in the loss, value of a value head or a separate critic) over the
    bucket's rows, as if they were the whole mini-batch, at the weights that sampled them. Nothing is stepped.

    At most ``diagnostics.grad_bucket_rows`` rows per bucket, whole groups in batch order, half a micro-batch
    (``trainer.micro_batch_size``) a forward: one forward and one backward per term each (about the cost of
    updating on those rows once per term). The advantages are
    computed over the whole batch, as an unfiltered update would. Metrics: ``grad/<bucket>/<term>`` (the norm,
    over the actor's trained parameters and a value head's; a separate critic's over its own), and
    ``grad/<bucket>/rows``; a term the configuration does not have is left out, an empty bucket logs rows 0.
    """
    started = time.perf_counter()
    algo, d = cfg.algorithm, cfg.diagnostics
    models, device = state.models, state.models.device
    batch = _on(batch, torch.device("cpu"))
    models.train()
    old_values, ref_logprobs = _rollout_side(state, batch, cfg, algo.uses_reference)
    advantages, returns = compute_advantages(batch, _token_rewards(batch, ref_logprobs, algo), old_values, algo)
    actor_params = trainable_parameters(models.actor, models.value_head)
    # A forward's graph is kept through one backward per term, so its activations and each backward's transients
    # are resident together: forwards of half a micro-batch peak near the update's full micro-batches (FrozenLake
    # study setting: 11.0 GiB at 8 rows a forward, 7.3 at 4, against the update's 5.8). The gradients add up exactly.
    rows_per_forward = max(1, cfg.trainer.micro_batch_size // 2)
    out: dict[str, float] = {}
    for name, rows in group_buckets(batch, d.grad_bucket_edges).items():
        taken: list[int] = []
        for g in dict.fromkeys(batch.group_ids[rows].tolist()):
            members = [r for r in rows if int(batch.group_ids[r]) == g]
            if taken and len(taken) + len(members) > d.grad_bucket_rows:
                break
            taken.extend(members[: d.grad_bucket_rows])
        out[f"grad/{name}/rows"] = float(len(taken))
        if not taken:
            continue
        index = torch.tensor(taken)
        # over the bucket's rows: the terms of its forwards add up to the bucket's as if it were one mini-batch
        norm = losses.aggregation_normaliser(batch.select(index).loss_mask, algo.loss_agg)
        sums: dict[str, list[torch.Tensor | None]] = {}
        for part in micro_slices(len(taken), rows_per_forward):
            rows_here = index[part.start:part.stop]
            micro = _on(batch.select(rows_here), device)
            w = micro.input_ids.shape[1]
            head_targets = None
            if returns is not None and old_values is not None and models.value_head is not None:
                head_targets = (_take(old_values, rows_here, w).to(device), _take(returns, rows_here, w).to(device),
                                norm)
            terms: dict[str, torch.Tensor] = {}
            state.actor_engine.forward(
                _actor_loss, models, micro, _take(advantages, rows_here, w).to(device),
                None if ref_logprobs is None else _take(ref_logprobs, rows_here, w).to(device), cfg, norm, _Meter(),
                head_targets, terms=terms)
            present = [t for t in GRAD_TERMS if t in terms and terms[t].requires_grad]
            for i, term in enumerate(present):
                grads = torch.autograd.grad(terms[term], actor_params, retain_graph=i < len(present) - 1,
                                            allow_unused=True)
                sums[term] = _add_grads(sums.get(term), grads)
            if (returns is not None and old_values is not None and models.critic is not None
                    and state.critic_engine is not None):
                v_loss, _ = state.critic_engine.forward(_critic_loss, models.critic, micro,
                                                        _take(old_values, rows_here, w).to(device),
                                                        _take(returns, rows_here, w).to(device), algo, norm)
                sums["value"] = _add_grads(sums.get("value"), torch.autograd.grad(
                    v_loss, trainable_parameters(models.critic), allow_unused=True))
        out.update({f"grad/{name}/{term}": _norm(grads) for term, grads in sums.items()})
    out["timing/grad_buckets_s"] = time.perf_counter() - started
    return out


def _add_grads(total: list[torch.Tensor | None] | None,
               grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """Per-parameter sum of two gradient lists (None: a parameter the term does not reach)."""
    if total is None:
        return list(grads)
    return [b if a is None else a if b is None else a + b for a, b in zip(total, grads, strict=True)]


def _norm(grads: Sequence[torch.Tensor | None]) -> float:
    """The L2 norm of a list of gradients (None: a parameter the term does not reach)."""
    return float(torch.sqrt(sum((g.float().pow(2).sum() for g in grads if g is not None), torch.zeros(()))))


def _mini_batch_step(
    state: TrainState,
    batch: TokenBatch,
    rows: torch.Tensor,
    advantages: torch.Tensor,
    returns: torch.Tensor | None,
    old_values: torch.Tensor | None,
    ref_logprobs: torch.Tensor | None,
    cfg: ExperimentConfig,
    meter: _Meter,
    tis: torch.Tensor | None = None,
    gap: _Gap | None = None,
) -> None:
    """One optimizer step on ``rows``: accumulate micro-batch gradients, then clip and step once. ``tis``: the
    batch's truncated importance weights [B, T]; ``gap``: measures |forward − old| log-probs (before the step)."""
    algo, models, device = cfg.algorithm, state.models, state.models.device
    mb = batch.select(rows)
    width = mb.input_ids.shape[1]
    mb_adv = _take(advantages, rows, width).to(device)
    mb_ref = None if ref_logprobs is None else _take(ref_logprobs, rows, width).to(device)
    mb_tis = None if tis is None else _take(tis, rows, width).to(device)
    mb_critic = None  # (old values, returns) of the rows when the critic trains
    if returns is not None:
        assert old_values is not None, "update() passes returns only together with old values (train_critic)"
        mb_critic = (_take(old_values, rows, width).to(device), _take(returns, rows, width).to(device))
    # Exact aggregation across micro-batches: every micro-batch divides by the mini-batch's count.
    # The policy, entropy and value losses are all aggregated by algo.loss_agg (SPEC §4).
    norm = losses.aggregation_normaliser(mb.loss_mask, algo.loss_agg)
    totals: dict[str, float] = defaultdict(float)
    rank, world_size = state.actor_engine.data_parallel  # (0, 1) unless data parallel: then this rank's rows only
    tr = cfg.trainer
    decoder = decoder_and_head(models.actor)[0]
    blocks = micro_blocks(mb.input_ids, mb.attention_mask, tr.micro_batch_size * world_size,
                          None if tr.micro_batch_tokens is None else tr.micro_batch_tokens * world_size,
                          share=can_share(decoder), pack=can_pack(decoder))
    for idx in rank_micro_rows(mb.batch_size, tr.micro_batch_size, rank, world_size, blocks):
        weight, micro_meter = 1.0, meter  # the meter this micro-batch's losses log their stats into
        if idx.numel() == 0:  # no row left for this rank: a zero-weighted stand-in keeps its backwards paired
            idx, weight, micro_meter = torch.zeros(1, dtype=torch.long), 0.0, _Meter()  # stats thrown away
        micro = _on(mb.select(idx), device)
        w, n_tok = micro.input_ids.shape[1], float(micro.loss_mask.sum())
        head_targets = None  # value head: one forward and one backward for both losses
        if mb_critic is not None and models.value_head is not None:
            mb_values, mb_ret = mb_critic
            head_targets = (mb_values[idx, :w], mb_ret[idx, :w], norm)
        with logits_gradient_in_place():  # this graph runs backward once, just below
            loss, pg_loss, head = state.actor_engine.forward(
                _actor_loss, models, micro, mb_adv[idx, :w], None if mb_ref is None else mb_ref[idx, :w], cfg,
                norm, micro_meter, head_targets, None if mb_tis is None else mb_tis[idx, :w], gap if weight else None)
        totals["actor/pg_loss"] += float(pg_loss) * weight
        if head is not None:
            totals["critic/value_loss"] += float(head[0]) * weight
            micro_meter.add("critic/", head[1], n_tok)
        state.actor_engine.backward(loss * weight)  # × 1.0 is exact: W = 1 is unchanged
        if mb_critic is not None and models.critic is not None and state.critic_engine is not None:
            mb_values, mb_ret = mb_critic
            v_loss, v_stats = state.critic_engine.forward(_critic_loss, models.critic, micro, mb_values[idx, :w],
                                                          mb_ret[idx, :w], algo, norm)
            state.critic_engine.backward(v_loss * weight)
            totals["critic/value_loss"] += float(v_loss.detach()) * weight
            micro_meter.add("critic/", v_stats, n_tok)

    meter.steps["actor/grad_norm"].append(state.actor_engine.step())
    if mb_critic is not None and state.critic_engine is not None:
        meter.steps["critic/grad_norm"].append(state.critic_engine.step())
    for key, value in totals.items():  # micro-batch losses sum to the mini-batch loss
        meter.steps[key].append(value)


def _actor_loss(
    models: PolicyModels,
    micro: TokenBatch,
    advantages: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
    cfg: ExperimentConfig,
    normaliser: float,
    meter: _Meter,
    head_targets: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    tis: torch.Tensor | None = None,
    gap: _Gap | None = None,
    terms: dict[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, dict[str, torch.Tensor]] | None]:
    """Policy loss − entropy_coef·entropy (+ kl_coef·KL) of one micro-batch, as its share of the mini-batch.

    head_targets: (old values, returns, normaliser) to add value_coef × the value head's loss on the
    actor's hidden states. Returns (loss with grad, policy loss detached, (value loss detached, its
    stats) or None). ``terms``, when given, receives the loss's terms as they enter the sum (with grad):
    task, entropy (−entropy_coef·entropy), kl and value where present; they add up to the loss.
    """
    algo, mask = cfg.algorithm, micro.loss_mask
    out = policy_forward(models.actor, micro.input_ids, micro.attention_mask, cfg.rollout.temperature,
                         cfg.trainer.logprob_chunk, entropy_grad=algo.entropy_coef > 0, scored=mask)
    pg_loss, pg_stats = losses.policy_loss(
        out.logprobs, micro.old_logprobs, advantages, mask, clip_low=algo.clip_low, clip_high=algo.clip_high,
        dual_clip=algo.dual_clip, agg=algo.loss_agg, normaliser=normaliser, token_weights=tis)
    if gap is not None:
        gap.add(out.logprobs, micro.old_logprobs, mask)
    aggregate = losses.AGGREGATIONS[algo.loss_agg]
    entropy_term = -algo.entropy_coef * aggregate(out.entropy, mask, normaliser)
    loss = pg_loss + entropy_term
    if terms is not None:
        terms.update(task=pg_loss, entropy=entropy_term)
    n_tok = float(mask.sum())
    meter.add("actor/", {**pg_stats, "entropy": losses.token_mean(out.entropy.detach(), mask)}, n_tok)
    if algo.uses_reference and not algo.kl_in_reward:
        # Without reference log-probs (the k1 estimator, on an iteration that does not log the KL) the current
        # log-probs stand in, detached: the term's value is then 0 but its gradient, kl_coef·∇log π, is the same.
        ref = ref_logprobs if ref_logprobs is not None else out.logprobs.detach()
        kl = losses.kl_penalty(out.logprobs, ref, algo.kl_estimator)  # [b, w]
        kl_term = algo.kl_coef * aggregate(kl, mask, normaliser)
        loss = loss + kl_term
        if terms is not None:
            terms["kl"] = kl_term
        if ref_logprobs is not None:
            meter.add("actor/", {"kl_ref": losses.token_mean(kl.detach(), mask)}, n_tok)
    if head_targets is None:
        return loss, pg_loss.detach(), None
    old_values, returns, value_norm = head_targets
    v_loss, v_stats = _value_loss(critic_values(models, micro.input_ids, micro.attention_mask, out.hidden),
                                  old_values, returns, mask, algo, value_norm)
    if terms is not None:
        terms["value"] = algo.value_coef * v_loss
    return loss + algo.value_coef * v_loss, pg_loss.detach(), (v_loss.detach(), v_stats)


def _critic_loss(critic: torch.nn.Module, micro: TokenBatch, old_values: torch.Tensor, returns: torch.Tensor,
                 algo: AlgorithmConfig, normaliser: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The separate critic's clipped value loss on one micro-batch (its share of the mini-batch)."""
    return _value_loss(critic(micro.input_ids, micro.attention_mask), old_values, returns, micro.loss_mask, algo,
                       normaliser)


def _value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
                algo: AlgorithmConfig, normaliser: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss, stats = losses.value_loss(values, old_values, returns, mask, clip_range=algo.value_clip,
                                    agg=algo.loss_agg, normaliser=normaliser)
    return loss, {"vf_clipfrac": stats["value_clipfrac"], "n_tokens": stats["n_tokens"]}


def _batch_metrics(
    batch: TokenBatch,
    advantages: torch.Tensor,
    returns: torch.Tensor | None,
    values: torch.Tensor | None,
    think_tokens: Sequence[float] | None,
) -> dict[str, float]:
    """Advantage, return, value and length statistics of the whole update batch (SPEC §6)."""
    mask = batch.loss_mask
    picked = advantages[mask]
    lengths = mask.sum(dim=1).float()  # [B] generated tokens per trajectory
    out = {
        "actor/advantages_mean": float(picked.mean()) if picked.numel() else 0.0,
        "actor/advantages_std": float(picked.std()) if picked.numel() > 1 else 0.0,
        "actor/advantages_max": float(picked.max()) if picked.numel() else 0.0,
        "actor/advantages_min": float(picked.min()) if picked.numel() else 0.0,
        "response/length_mean": float(lengths.mean()),
        "response/length_max": float(lengths.max()),
        "perf/update_rows": float(batch.batch_size),
    }
    if think_tokens is not None:
        if len(think_tokens) != batch.batch_size:
            raise ValueError(f"think_tokens has {len(think_tokens)} entries for {batch.batch_size} rows")
        out["response/think_length_mean"] = float(sum(think_tokens)) / max(len(think_tokens), 1)
    if returns is not None and values is not None:
        ret_var = masked_var(returns, mask)
        # Explained variance of the critic's (pre-update) values, as veRL logs it: 1 − Var(R − V)/Var(R).
        # Undefined when every return is the same (e.g. all episodes failed alike): NaN, not -1e7.
        ev = 1.0 - masked_var(returns - values, mask) / ret_var if float(ret_var) > 1e-8 else float("nan")
        out["critic/explained_var"] = float(ev)
        out["critic/returns_mean"] = float(masked_mean(returns, mask))
        out["critic/values_mean"] = float(masked_mean(values, mask))
    return out
