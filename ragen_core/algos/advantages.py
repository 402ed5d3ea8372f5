"""Advantage estimators for StarPO (SPEC §4): token GAE, GRPO, bi-level (turn then token) GAE, and GiGPO.

Pure tensor functions (STYLE rule 1), computed under ``torch.no_grad``: they
return new tensors and never touch their arguments (STYLE rule 3). Whitening is
a separate step (``whiten``, re-exported from :mod:`ragen_core.algos.masked`);
nothing here whitens.

Shapes: B rows (trajectories), T token positions aligned with ``input_ids``
(see ``ragen_core.types``). ``mask`` is the ``loss_mask``: True exactly on the
tokens the model generated. A multi-turn row interleaves generated turns with
env text; GAE treats the masked-out env text as absent, so it neither
discounts nor bootstraps (the value "after" a generated token is the value at
the next generated token of the row).

Run the tests with ``python -m pytest tests/unit/algos -q``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import torch

from ragen_core.algos.masked import masked_whiten as whiten

__all__ = ["bilevel_gae", "gae", "gigpo", "grpo", "step_groups", "whiten"]


def _check_discounts(**factors: float) -> None:
    for name, value in factors.items():
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {value}")


def _gae_scan(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    resets: torch.Tensor,
    gamma: float,
    lam: float,
) -> torch.Tensor:
    """The GAE recursion A_t = δ_t + γλ·A_next, δ_t = r_t + γ·V_next − V_t, run backwards over dim 1.

    rewards, values: [B, T] float; mask, resets: [B, T] bool -> advantages [B, T], 0 where mask is False.
    "next" is the next position of the row whose mask is True; past the last
    one, or when ``resets[b, t]`` (t closes a segment, e.g. a turn), V_next and
    A_next are 0. Masked-out positions leave the carried state untouched, so
    they are skipped entirely (their rewards and values are never read).
    A Python loop over T, vectorised over B (as in CleanRL's ``ppo.py``).
    """
    zero = rewards.new_zeros(rewards.shape[0])  # [B]
    next_value, next_adv = zero, zero  # [B] value and advantage at the next True position
    columns = []
    for t in range(rewards.shape[1] - 1, -1, -1):
        m, reset = mask[:, t], resets[:, t]  # [B]
        v_next = torch.where(reset, zero, next_value)  # [B]
        a_next = torch.where(reset, zero, next_adv)  # [B]
        adv_t = rewards[:, t] + gamma * v_next - values[:, t] + gamma * lam * a_next  # [B]
        next_value = torch.where(m, values[:, t], next_value)
        next_adv = torch.where(m, adv_t, next_adv)
        columns.append(torch.where(m, adv_t, zero))
    if not columns:
        return rewards.new_zeros(rewards.shape)
    return torch.stack(columns[::-1], dim=1)  # [B, T]


def _as_float(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
    if not rewards.shape == values.shape == mask.shape or rewards.dim() != 2:
        raise ValueError(
            f"rewards, values and mask must all be [B, T]; got {tuple(rewards.shape)}, "
            f"{tuple(values.shape)}, {tuple(mask.shape)}"
        )
    dtype = torch.promote_types(torch.promote_types(rewards.dtype, values.dtype), torch.float32)
    return rewards.to(dtype), values.to(dtype), mask.bool()


@torch.no_grad()
def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, lam: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the generated tokens of each row (PPO, SPEC §4).

    rewards: [B, T] float, values: [B, T] float (critic values, detached),
    mask: [B, T] bool (True = generated token that takes part)
    -> (advantages [B, T], returns [B, T]), both 0 where mask is False.

    Only the True positions of a row form the time axis: for True positions
    t_1 < … < t_k, δ_i = r(t_i) + γ·V(t_{i+1}) − V(t_i) with V(t_{k+1}) = 0, and
    A_i = δ_i + γλ·A_{i+1}; returns = A + V (the critic's target). So env text
    between turns neither discounts nor bootstraps. Rewards at False positions
    are ignored (the trainer only places rewards on generated tokens). With
    γ = λ = 1 the last generated token gets A = r − V, and every token gets
    (sum of rewards from it on) − V. No whitening here: call ``whiten``.
    """
    _check_discounts(gamma=gamma, lam=lam)
    rewards, values, mask = _as_float(rewards, values, mask)
    advantages = _gae_scan(rewards, values, mask, torch.zeros_like(mask), gamma, lam)  # [B, T]
    returns = torch.where(mask, advantages + values, torch.zeros_like(values))  # [B, T]
    return advantages, returns


@torch.no_grad()
def grpo(
    returns: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6, zero_std: float = 1e-6
) -> torch.Tensor:
    """GRPO advantage: each return normalised within its group, (R − mean) / (std + eps) (SPEC §4).

    returns: [B] float (trajectory total returns), group_ids: [B] long (any
    ids; rows sharing an id share an initial state) -> advantages [B] float
    (the trainer broadcasts them over each row's tokens).
    std is the unbiased (n − 1) group std, as ``torch.std``. A group whose std is
    below ``zero_std`` has nothing to learn from (all its rewards are equal), and a
    group of one has no defined std: both get advantage 0 rather than noise
    amplified by 1/eps.
    """
    if returns.dim() != 1 or returns.shape != group_ids.shape:
        raise ValueError(
            f"returns and group_ids must both be [B]; got {tuple(returns.shape)}, {tuple(group_ids.shape)}"
        )
    out_dtype = returns.dtype if returns.is_floating_point() else torch.get_default_dtype()
    x = returns.to(torch.float64)  # [B]; B is small and float64 makes the ~0 std test reliable
    _, group, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)  # [B], [G]
    n = counts.to(torch.float64)  # [G]
    mean = x.new_zeros(n.shape).index_add(0, group, x) / n  # [G]
    dev = x - mean[group]  # [B]
    var = x.new_zeros(n.shape).index_add(0, group, dev**2) / (n - 1.0).clamp(min=1.0)  # [G]
    std = var.sqrt()  # [G]
    usable = (counts > 1) & (std >= zero_std)  # [G]
    adv = torch.where(usable[group], dev / (std[group] + eps), torch.zeros_like(x))  # [B]
    return adv.to(out_dtype)


def _effective_turn_ends(mask: torch.Tensor, turn_ends: torch.Tensor) -> torch.Tensor:
    """turn_ends, plus the last generated token of each row (a row always closes its last turn).

    mask, turn_ends: [B, T] bool -> [B, T] bool. Marking the last True position
    means a row whose final turn lacks an end marker can never make the scan
    look past the end of the row.
    """
    if bool((turn_ends & ~mask).any()):
        raise ValueError("turn_ends is True on a position outside mask; turn ends must be generated tokens")
    generated_from_here = mask.flip(1).long().cumsum(1).flip(1)  # [B, T] True positions at or after t
    return turn_ends | (mask & (generated_from_here == 1))


@torch.no_grad()
def bilevel_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    turn_ends: torch.Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
    turn_gamma: float = 1.0,
    turn_lam: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Bi-level GAE: GAE across turns, then GAE across the tokens of each turn (SPEC §4, turn-level credit).

    rewards, values: [B, T] float; mask, turn_ends: [B, T] bool
    (turn_ends True on the last generated token of each turn, a subset of mask)
    -> (advantages [B, T], returns [B, T]), both 0 where mask is False.

    1. Turns. Turn k of a row is its generated tokens after turn k−1's end up to
       and including its end e_k. R_k = sum of rewards on turn k's tokens (the
       trainer puts a turn's reward on e_k; any other placement is pooled into
       the turn), V_k = V(e_k) (as in the reference RAGEN). Turn-level GAE with
       (turn_gamma, turn_lam) over the turns gives A_k; the turn return is G_k = A_k + V_k.
    2. Tokens. Each turn is then an episode of its own that ends at e_k with
       reward G_k: δ(e_k) = G_k − V(e_k) = A_k, and earlier tokens t of the turn get
       δ(t) = γ·V(t') − V(t) (t' the next token of the turn), combined with (gamma, lam).
    Turn boundaries come only from ``turn_ends`` (never from non-zero rewards), so
    a zero-reward turn is a turn like any other; the last generated token of a row
    always ends a turn, so nothing is ever read past the end. With all four
    factors 1 and rewards on turn ends, this equals ``gae``: every token gets
    (sum of the rewards of its turn and all later turns) − V.
    """
    _check_discounts(gamma=gamma, lam=lam, turn_gamma=turn_gamma, turn_lam=turn_lam)
    rewards, values, mask = _as_float(rewards, values, mask)
    ends = _effective_turn_ends(mask, turn_ends.bool())  # [B, T]
    turn_of = ends.long().cumsum(1) - ends.long()  # [B, T] index of the turn a position belongs to
    n_turns = ends.sum(1)  # [B]
    k_max = max(int(n_turns.max()), 1) if n_turns.numel() else 1
    idx = turn_of.clamp(max=k_max - 1)  # [B, T]; positions after the last end are masked out anyway
    per_turn = rewards.new_zeros(rewards.shape[0], k_max)  # [B, K]
    turn_rewards = per_turn.scatter_add(1, idx, torch.where(mask, rewards, 0.0))  # [B, K]
    turn_values = per_turn.scatter_add(1, idx, torch.where(ends, values, 0.0))  # [B, K], one end per turn
    turn_mask = torch.arange(k_max, device=mask.device) < n_turns[:, None]  # [B, K]
    turn_adv = _gae_scan(
        turn_rewards, turn_values, turn_mask, torch.zeros_like(turn_mask), turn_gamma, turn_lam
    )
    turn_returns = turn_adv + turn_values  # [B, K]
    end_rewards = torch.where(ends, turn_returns.gather(1, idx), 0.0)  # [B, T] G_k on e_k
    advantages = _gae_scan(end_rewards, values, mask, ends, gamma, lam)  # [B, T]
    returns = torch.where(mask, advantages + values, torch.zeros_like(values))  # [B, T]
    return advantages, returns


def _group_centred(x: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """x minus its group's mean: x: [n] float, group_ids: [n] long -> [n] (0 for a group of one)."""
    _, group, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)  # [n], [G]
    mean = x.new_zeros(counts.shape).index_add(0, group, x) / counts.to(x.dtype)  # [G]
    return x - mean[group]


_STEP_NORMS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {"std": grpo, "mean": _group_centred}
"""GiGPO's step normalisations: (return-to-go [n], step group ids [n]) -> step advantages [n]. ``std`` is GRPO's
(R − mean) / (std + eps) with its zero-std and singleton rules; ``mean`` only subtracts the group mean."""


def step_groups(state_keys: Sequence[Sequence[Hashable]], group_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """GiGPO's step groups: one id per turn, equal exactly for turns of one prompt group with equal state keys.

    state_keys: B sequences (row b's turns, in order) of hashable keys; group_ids: [B]
    -> [n] long, n = all turns, row by row. Keys match across the trajectories of a group and within one
    (a state the trajectory comes back to); never across prompt groups.
    """
    groups = group_ids.tolist() if isinstance(group_ids, torch.Tensor) else list(group_ids)
    if len(groups) != len(state_keys):
        raise ValueError(f"state_keys has {len(state_keys)} rows for {len(groups)} group ids")
    ids: dict[tuple[int, Hashable], int] = {}
    flat = [ids.setdefault((int(g), key), len(ids)) for g, keys in zip(groups, state_keys, strict=True) for key in keys]
    return torch.tensor(flat, dtype=torch.long)  # [n]


@torch.no_grad()
def gigpo(
    returns: torch.Tensor,
    step_rewards: Sequence[Sequence[float] | torch.Tensor],
    state_keys: Sequence[Sequence[Hashable]],
    group_ids: torch.Tensor,
    gamma: float = 0.95,
    omega: float = 1.0,
    step_norm: str = "std",
) -> torch.Tensor:
    """GiGPO advantage of every turn: episode advantage + ω · step advantage (arXiv 2505.10978, Eq. 8).

    returns: [B] float (trajectory total returns), step_rewards: B sequences of per-turn rewards,
    state_keys: B sequences of per-turn keys of the state each turn acted on (as long as its rewards),
    group_ids: [B] long -> advantages [B, K] float, K the most turns of a row, 0 past a row's last turn
    (padded like the other estimators' [B, T]; the trainer gives turn k's value to the tokens of turn k's reply).

    * Episode: A^E = ``grpo(returns, group_ids)``, the same for every turn of a trajectory (paper Eq. 3).
    * Step: within a prompt group the turns whose states have equal keys form a step group
      (:func:`step_groups`; paper §3.2, anchor states). A turn's discounted return-to-go
      R_t = Σ_{k≥t} γ^(k−t)·r_k (its own trajectory's rewards, paper Eq. 6) is normalised over its step
      group: step_norm ``std``: (R_t − mean) / (std + 1e-6), the grpo rule (unbiased std; 0 when the group
      has one turn or std < 1e-6); ``mean``: R_t − mean (paper Eq. 7 with F_norm = 1). A step group of one
      turn contributes 0 either way.
    """
    _check_discounts(gamma=gamma)
    if step_norm not in _STEP_NORMS:
        raise ValueError(f"step_norm must be one of {sorted(_STEP_NORMS)}, got {step_norm!r}")
    B = returns.shape[0]
    if returns.dim() != 1 or len(step_rewards) != B or len(state_keys) != B:
        raise ValueError(f"need [B] returns and B rows of step rewards and state keys; got returns "
                         f"{tuple(returns.shape)}, {len(step_rewards)} and {len(state_keys)} rows")
    lengths = [len(keys) for keys in state_keys]
    if [len(r) for r in step_rewards] != lengths:
        raise ValueError("each row needs one step reward per state key")
    episode = grpo(returns, group_ids)  # [B]
    k_max = max(lengths, default=0)
    turn_mask = torch.arange(k_max)[None, :] < torch.tensor(lengths, dtype=torch.long)[:, None]  # [B, K]
    rewards = torch.zeros(B, k_max, dtype=torch.float64)  # [B, K], 0 past a row's last turn
    for b, row in enumerate(step_rewards):
        rewards[b, : lengths[b]] = torch.as_tensor(row, dtype=torch.float64)
    to_go = torch.zeros_like(rewards)  # [B, K] R_t; zero padding ends each row's sum at its last turn
    running = rewards.new_zeros(B)  # [B]
    for k in range(k_max - 1, -1, -1):
        running = rewards[:, k] + gamma * running
        to_go[:, k] = running
    step = torch.zeros_like(rewards)  # [B, K]
    step[turn_mask] = _STEP_NORMS[step_norm](to_go[turn_mask], step_groups(state_keys, group_ids))  # row-major
    out = torch.where(turn_mask, episode.to(torch.float64)[:, None] + omega * step, 0.0)  # [B, K]
    return out.to(episode.dtype)
