"""Tests for ragen_core.algos.advantages: hand-derived golden values, plain-loop equivalence, edge cases.

Run: python -m pytest tests/unit/algos -q
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ragen_core.algos import advantages

F64 = torch.float64


def t(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64)


def b(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.bool)


# ---------------------------------------------------------------- plain-loop references (the definitions)


def gae_loop(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float):
    """GAE over each row's True positions only, written as plain Python."""
    adv = [[0.0] * rewards.shape[1] for _ in range(rewards.shape[0])]
    for row in range(rewards.shape[0]):
        pos = [i for i in range(rewards.shape[1]) if mask[row, i]]
        last = 0.0
        for k in reversed(range(len(pos))):
            v_next = values[row, pos[k + 1]].item() if k + 1 < len(pos) else 0.0
            delta = rewards[row, pos[k]].item() + gamma * v_next - values[row, pos[k]].item()
            last = delta + gamma * lam * last
            adv[row][pos[k]] = last
    adv_t = torch.tensor(adv, dtype=F64)
    return adv_t, torch.where(mask, adv_t + values, 0.0)


def bilevel_loop(rewards, values, mask, turn_ends, gamma, lam, turn_gamma, turn_lam):
    """Bi-level GAE as plain Python: split each row into turns, GAE over turns, then GAE inside each turn."""
    adv = [[0.0] * rewards.shape[1] for _ in range(rewards.shape[0])]
    for row in range(rewards.shape[0]):
        pos = [i for i in range(rewards.shape[1]) if mask[row, i]]
        turns, current = [], []
        for k, p in enumerate(pos):
            current.append(p)
            if turn_ends[row, p] or k == len(pos) - 1:
                turns.append(current)
                current = []
        r_turn = [sum(rewards[row, p].item() for p in turn) for turn in turns]
        v_turn = [values[row, turn[-1]].item() for turn in turns]
        a_turn, last = [0.0] * len(turns), 0.0
        for k in reversed(range(len(turns))):
            v_next = v_turn[k + 1] if k + 1 < len(turns) else 0.0
            last = r_turn[k] + turn_gamma * v_next - v_turn[k] + turn_gamma * turn_lam * last
            a_turn[k] = last
        for k, turn in enumerate(turns):
            g = a_turn[k] + v_turn[k]
            last = 0.0
            for j in reversed(range(len(turn))):
                v = values[row, turn[j]].item()
                if j == len(turn) - 1:
                    last = g - v
                else:
                    last = gamma * values[row, turn[j + 1]].item() - v + gamma * lam * last
                adv[row][turn[j]] = last
    adv_t = torch.tensor(adv, dtype=F64)
    return adv_t, torch.where(mask, adv_t + values, 0.0)


def grpo_loop(returns: list[float], group_ids: list[int]) -> list[float]:
    out = []
    for r, g in zip(returns, group_ids, strict=True):
        members = [x for x, h in zip(returns, group_ids, strict=True) if h == g]
        if len(members) < 2 or statistics.stdev(members) < 1e-6:
            out.append(0.0)
        else:
            out.append((r - statistics.mean(members)) / (statistics.stdev(members) + 1e-6))
    return out


# ---------------------------------------------------------------- gae golden values

# One row, T = 4, position 2 is env text (mask False) holding junk reward 7 and value 9.
# Generated positions 0, 1, 3 have r = [0, 0, 1], V = [0.5, 0.4, 0.6].
R1 = t([[0.0, 0.0, 7.0, 1.0]])
V1 = t([[0.5, 0.4, 9.0, 0.6]])
M1 = b([[1, 1, 0, 1]])

GAE_GOLDEN = [
    # gamma=0.9, lam=0.8 (γλ = 0.72):
    #   pos3: δ = 1 + 0.9·0 − 0.6 = 0.4;                 A = 0.4
    #   pos1: δ = 0 + 0.9·0.6 − 0.4 = 0.14 (V_next is pos3's, the gap is skipped); A = 0.14 + 0.72·0.4 = 0.428
    #   pos0: δ = 0 + 0.9·0.4 − 0.5 = −0.14;            A = −0.14 + 0.72·0.428 = 0.16816
    (0.9, 0.8, [0.16816, 0.428, 0.0, 0.4], [0.66816, 0.828, 0.0, 1.0]),
    # gamma=lam=1: A = (sum of later rewards) − V: [1 − 0.5, 1 − 0.4, ·, 1 − 0.6]; returns all 1
    (1.0, 1.0, [0.5, 0.6, 0.0, 0.4], [1.0, 1.0, 0.0, 1.0]),
    # gamma=1, lam=0 (TD(0)): A = δ: pos3 1 − 0.6 = 0.4, pos1 0.6 − 0.4 = 0.2, pos0 0.4 − 0.5 = −0.1
    (1.0, 0.0, [-0.1, 0.2, 0.0, 0.4], [0.4, 0.6, 0.0, 1.0]),
    # gamma=0.5, lam=1 (discounted Monte Carlo): A = 0.5^k·1 − V with k generated steps to the reward:
    #   pos3: 1 − 0.6 = 0.4; pos1: 0.5 − 0.4 = 0.1; pos0: 0.25 − 0.5 = −0.25 (the gap costs no discount)
    (0.5, 1.0, [-0.25, 0.1, 0.0, 0.4], [0.25, 0.5, 0.0, 1.0]),
]


@pytest.mark.parametrize(("gamma", "lam", "adv", "ret"), GAE_GOLDEN)
def test_gae_golden(gamma: float, lam: float, adv: list[float], ret: list[float]) -> None:
    a, r = advantages.gae(R1, V1, M1, gamma=gamma, lam=lam)
    torch.testing.assert_close(a, t([adv]))
    torch.testing.assert_close(r, t([ret]))


def test_gae_multi_turn_row_with_prompt_env_gap_and_padding() -> None:
    # Row 0: prompt(0) | turn 0: 1,2 | env text: 3,4 | turn 1: 5 | padding: 6,7 (junk reward on padding ignored)
    # rewards: turn 0 reward 0.5 on pos 2, final reward 1 on pos 5; gamma=0.9, lam=1.
    # Generated positions 1, 2, 5 with V = 0.1, 0.2, 0.3:
    #   pos5: 1 − 0.3 = 0.7
    #   pos2: δ = 0.5 + 0.9·0.3 − 0.2 = 0.57; A = 0.57 + 0.9·0.7 = 1.2  (= 0.5 + 0.9·1 − 0.2)
    #   pos1: δ = 0 + 0.9·0.2 − 0.1 = 0.08;  A = 0.08 + 0.9·1.2 = 1.16 (= 0.9·0.5 + 0.81·1 − 0.1)
    # Row 1 is all masked out (e.g. a trajectory whose turns were all dropped): all zeros.
    rewards = t([[0, 0, 0.5, 0, 0, 1.0, 3.0, 3.0], [1, 1, 1, 1, 1, 1, 1, 1]])
    values = t([[5, 0.1, 0.2, 5, 5, 0.3, 5, 5], [1, 2, 3, 4, 5, 6, 7, 8]])
    mask = b([[0, 1, 1, 0, 0, 1, 0, 0], [0] * 8])
    a, r = advantages.gae(rewards, values, mask, gamma=0.9, lam=1.0)
    torch.testing.assert_close(a, t([[0, 1.16, 1.2, 0, 0, 0.7, 0, 0], [0] * 8]))
    torch.testing.assert_close(r, t([[0, 1.26, 1.4, 0, 0, 1.0, 0, 0], [0] * 8]))


def test_gae_does_not_whiten_and_has_no_grad() -> None:
    values = V1.clone().requires_grad_(True)
    a, r = advantages.gae(R1, values, M1)
    assert not a.requires_grad and not r.requires_grad
    assert a.sum().item() == pytest.approx(1.5)  # raw, not whitened (whitened would sum to 0)


def test_gae_rejects_bad_shapes_and_factors() -> None:
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        advantages.gae(R1, V1[:, :3], M1)
    with pytest.raises(ValueError, match="gamma"):
        advantages.gae(R1, V1, M1, gamma=1.5)


def _random_batch(draw, max_b: int = 4, max_t: int = 10):
    bsz = draw(st.integers(1, max_b))
    length = draw(st.integers(1, max_t))
    floats = st.floats(-2, 2, allow_nan=False, width=32)
    rewards = t([[draw(floats) for _ in range(length)] for _ in range(bsz)])
    values = t([[draw(floats) for _ in range(length)] for _ in range(bsz)])
    mask = b([[draw(st.integers(0, 1)) for _ in range(length)] for _ in range(bsz)])
    return rewards, values, mask


@st.composite
def gae_inputs(draw):
    rewards, values, mask = _random_batch(draw)
    gamma = draw(st.sampled_from([0.0, 0.5, 0.9, 0.99, 1.0]))
    lam = draw(st.sampled_from([0.0, 0.8, 0.95, 1.0]))
    return rewards, values, mask, gamma, lam


@settings(max_examples=60, deadline=None)
@given(gae_inputs())
def test_gae_matches_plain_loop(inputs) -> None:
    rewards, values, mask, gamma, lam = inputs
    a, r = advantages.gae(rewards, values, mask, gamma=gamma, lam=lam)
    a_ref, r_ref = gae_loop(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(a, a_ref)
    torch.testing.assert_close(r, r_ref)


@settings(max_examples=30, deadline=None)
@given(gae_inputs())
def test_gae_ignores_everything_outside_the_mask(inputs) -> None:
    rewards, values, mask, gamma, lam = inputs
    junk_r = torch.where(mask, rewards, 123.0)
    junk_v = torch.where(mask, values, -77.0)
    a, r = advantages.gae(rewards, values, mask, gamma=gamma, lam=lam)
    a2, r2 = advantages.gae(junk_r, junk_v, mask, gamma=gamma, lam=lam)
    torch.testing.assert_close(a, a2)
    torch.testing.assert_close(r, r2)


# ---------------------------------------------------------------- grpo


def test_grpo_golden_with_zero_std_singleton_and_interleaved_groups() -> None:
    # ids are arbitrary and interleaved: group 5 = {1, 0, 0, 1}, 9 = {2, 2}, 7 = {3}, 2 = {0.5, 1.5}
    returns = torch.tensor([1.0, 2.0, 0.0, 0.5, 0.0, 2.0, 3.0, 1.0, 1.5])
    ids = torch.tensor([5, 9, 5, 2, 5, 9, 7, 5, 2])
    # group 5: mean 0.5, unbiased var (4·0.25)/3 = 1/3, std 0.57735 -> ±0.5/(0.57735 + 1e-6) ≈ ±0.86602
    g5 = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    # group 2: mean 1, var (0.25 + 0.25)/1, std 0.70711 -> ±0.5/(0.70711 + 1e-6) ≈ ±0.70710
    g2 = 0.5 / (math.sqrt(0.5) + 1e-6)
    # group 9 has std 0 -> zeros; group 7 has one member, std undefined -> zero
    expected = torch.tensor([g5, 0.0, -g5, -g2, -g5, 0.0, 0.0, g5, g2])
    torch.testing.assert_close(advantages.grpo(returns, ids), expected)
    assert g5 == pytest.approx(0.866024, abs=1e-6)


def test_grpo_near_zero_std_group_is_zero_and_dtype_kept() -> None:
    returns = torch.tensor([0.1, 0.1 + 1e-9, 0.1, 0.3, 0.1], dtype=F64)
    adv = advantages.grpo(returns, torch.tensor([0, 0, 0, 1, 1]))
    assert adv[:3].tolist() == [0.0, 0.0, 0.0]  # std ~6e-10 < 1e-6: no signal, not noise × 1e6
    assert adv.dtype == F64
    assert adv[3].item() == pytest.approx(0.1 / (math.sqrt(0.02) + 1e-6))


def test_grpo_rejects_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match=r"\[B\]"):
        advantages.grpo(torch.zeros(3), torch.zeros(4, dtype=torch.long))


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.sampled_from([0.0, 0.25, 1.0, -0.1, 10.0])), min_size=1, max_size=12
    )
)
def test_grpo_matches_plain_loop(pairs) -> None:
    ids = [g * 7 for g, _ in pairs]  # non-contiguous ids
    rets = [r for _, r in pairs]
    adv = advantages.grpo(torch.tensor(rets, dtype=F64), torch.tensor(ids))
    torch.testing.assert_close(adv, torch.tensor(grpo_loop(rets, ids), dtype=F64))


# ---------------------------------------------------------------- bi-level gae


def test_bilevel_golden_three_turns_with_a_zero_reward_turn() -> None:
    # pos: 0 prompt | 1, 2 turn 0 (end 2, reward 0.5) | 3 env | 4 turn 1 (end 4, reward 0) | 5 env
    #      | 6, 7 turn 2 (end 7, reward 1) | 8 padding.  Junk 9 everywhere outside the mask.
    rewards = t([[9, 0, 0.5, 9, 0, 9, 0, 1.0, 9]])
    values = t([[9, 0.2, 0.3, 9, 0.4, 9, 0.5, 0.6, 9]])
    mask = b([[0, 1, 1, 0, 1, 0, 1, 1, 0]])
    ends = b([[0, 0, 1, 0, 1, 0, 0, 1, 0]])
    # Turn level, turn_gamma 0.5, turn_lam 0.6 (product 0.3), V_k = V(end) = [0.3, 0.4, 0.6], R = [0.5, 0, 1]:
    #   k2: δ = 1 − 0.6 = 0.4;                  A2 = 0.4
    #   k1: δ = 0 + 0.5·0.6 − 0.4 = −0.1;       A1 = −0.1 + 0.3·0.4 = 0.02   (zero-reward turn, still a turn)
    #   k0: δ = 0.5 + 0.5·0.4 − 0.3 = 0.4;      A0 = 0.4 + 0.3·0.02 = 0.406
    #   G = A + V = [0.706, 0.42, 1.0]
    # Token level, gamma 0.9, lam 0.8 (product 0.72); each turn ends with reward G_k and no bootstrap:
    #   pos7: 1.0 − 0.6 = 0.4;  pos6: δ = 0.9·0.6 − 0.5 = 0.04, A = 0.04 + 0.72·0.4 = 0.328
    #   pos4: 0.42 − 0.4 = 0.02
    #   pos2: 0.706 − 0.3 = 0.406; pos1: δ = 0.9·0.3 − 0.2 = 0.07, A = 0.07 + 0.72·0.406 = 0.36232
    a, r = advantages.bilevel_gae(
        rewards, values, mask, ends, gamma=0.9, lam=0.8, turn_gamma=0.5, turn_lam=0.6
    )
    torch.testing.assert_close(a, t([[0, 0.36232, 0.406, 0, 0.02, 0, 0.328, 0.4, 0]]))
    torch.testing.assert_close(r, t([[0, 0.56232, 0.706, 0, 0.42, 0, 0.828, 1.0, 0]]))


def test_bilevel_zero_reward_last_turn_never_reads_past_the_end() -> None:
    # The reference inferred turn ends from non-zero rewards, so a zero-reward last turn made it index
    # past the row. Here: turn 0 = pos 0, 1 (reward 1 on pos 1), env at pos 2, turn 1 = pos 3, 4 (reward 0).
    # All factors 1: turn 1: A = 0 − V(4) = −0.4, G1 = 0; turn 0: A = 1 + 0.4 − 0.2 + (−0.4) = 0.8, G0 = 1.
    # Tokens: pos4 = 0 − 0.4, pos3 = 0 − 0.3, pos1 = 1 − 0.2, pos0 = 1 − 0.1.
    rewards = t([[0, 1.0, 0, 0, 0]])
    values = t([[0.1, 0.2, 9, 0.3, 0.4]])
    mask = b([[1, 1, 0, 1, 1]])
    expected = t([[0.9, 0.8, 0, -0.3, -0.4]])
    a, _ = advantages.bilevel_gae(rewards, values, mask, b([[0, 1, 0, 0, 1]]))
    torch.testing.assert_close(a, expected)
    # the last turn's end marker missing: the row's last generated token still closes the turn
    a_missing, _ = advantages.bilevel_gae(rewards, values, mask, b([[0, 1, 0, 0, 0]]))
    torch.testing.assert_close(a_missing, expected)
    # and with every factor 1 and rewards on turn ends, it is plain GAE
    torch.testing.assert_close(advantages.gae(rewards, values, mask)[0], expected)


def test_bilevel_turn_factors_act_between_turns_only() -> None:
    # Two one-token turns, rewards [0, 1], V = [0.5, 0.6], turn_gamma 0.5, token factors 0.9/0.8 irrelevant
    # (a one-token turn has no inner step): turn 1 A = 1 − 0.6 = 0.4; turn 0 δ = 0 + 0.5·0.6 − 0.5 = −0.2,
    # A = −0.2 + 0.5·1·0.4 = 0.0.
    a, r = advantages.bilevel_gae(
        t([[0, 1.0]]), t([[0.5, 0.6]]), b([[1, 1]]), b([[1, 1]]), gamma=0.9, lam=0.8, turn_gamma=0.5
    )
    torch.testing.assert_close(a, t([[0.0, 0.4]]))
    torch.testing.assert_close(r, t([[0.5, 1.0]]))


def test_bilevel_rejects_turn_end_outside_mask() -> None:
    with pytest.raises(ValueError, match="turn_ends"):
        advantages.bilevel_gae(R1, V1, M1, b([[0, 0, 1, 1]]))


@st.composite
def bilevel_inputs(draw):
    rewards, values, mask = _random_batch(draw)
    ends = mask & b([[draw(st.integers(0, 1)) for _ in range(mask.shape[1])] for _ in range(mask.shape[0])])
    factors = [draw(st.sampled_from([0.0, 0.5, 0.9, 1.0])) for _ in range(4)]
    return rewards, values, mask, ends, factors


@settings(max_examples=60, deadline=None)
@given(bilevel_inputs())
def test_bilevel_matches_plain_loop(inputs) -> None:
    rewards, values, mask, ends, (gamma, lam, turn_gamma, turn_lam) = inputs
    a, r = advantages.bilevel_gae(
        rewards, values, mask, ends, gamma=gamma, lam=lam, turn_gamma=turn_gamma, turn_lam=turn_lam
    )
    a_ref, r_ref = bilevel_loop(rewards, values, mask, ends, gamma, lam, turn_gamma, turn_lam)
    torch.testing.assert_close(a, a_ref)
    torch.testing.assert_close(r, r_ref)


@settings(max_examples=30, deadline=None)
@given(bilevel_inputs())
def test_bilevel_with_unit_factors_equals_gae_when_rewards_sit_on_turn_ends(inputs) -> None:
    rewards, values, mask, ends, _ = inputs
    last = mask & (mask.flip(1).long().cumsum(1).flip(1) == 1)
    on_ends = torch.where(ends | last, rewards, 0.0)
    a, r = advantages.bilevel_gae(on_ends, values, mask, ends)
    a_ref, r_ref = advantages.gae(on_ends, values, mask)
    torch.testing.assert_close(a, a_ref)
    torch.testing.assert_close(r, r_ref)


# ---------------------------------------------------------------- purity


def test_no_argument_mutated() -> None:
    rewards, values, mask, ends = R1.clone(), V1.clone(), M1.clone(), b([[0, 1, 0, 1]])
    copies = [x.clone() for x in (rewards, values, mask, ends)]
    advantages.gae(rewards, values, mask, gamma=0.9, lam=0.8)
    advantages.bilevel_gae(rewards, values, mask, ends, gamma=0.9, lam=0.8, turn_gamma=0.5)
    advantages.whiten(values, mask)
    for x, c in zip((rewards, values, mask, ends), copies, strict=True):
        assert torch.equal(x, c)
    returns, ids = torch.tensor([1.0, 0.0, 3.0]), torch.tensor([4, 4, 1])
    advantages.grpo(returns, ids)
    assert torch.equal(returns, torch.tensor([1.0, 0.0, 3.0])) and torch.equal(ids, torch.tensor([4, 4, 1]))


# ---------------------------------------------------------------- gigpo


def gigpo_loop(returns, step_rewards, state_keys, group_ids, gamma, omega, step_norm):
    """GiGPO as plain Python: GRPO per trajectory, return-to-go per turn, normalised over same-state turns."""
    episode = grpo_loop(returns, group_ids)
    to_go = [[sum(gamma ** (k - t) * r[k] for k in range(t, len(r))) for t in range(len(r))] for r in step_rewards]
    out = []
    for b, keys in enumerate(state_keys):
        row = []
        for t, key in enumerate(keys):
            peers = [to_go[c][u] for c, ks in enumerate(state_keys) for u, k in enumerate(ks)
                     if group_ids[c] == group_ids[b] and k == key]
            if len(peers) < 2:
                step = 0.0
            elif step_norm == "mean":
                step = to_go[b][t] - statistics.mean(peers)
            else:
                sd = statistics.stdev(peers)
                step = 0.0 if sd < 1e-6 else (to_go[b][t] - statistics.mean(peers)) / (sd + 1e-6)
            row.append(episode[b] + omega * step)
        out.append(row)
    return out


# The golden case (γ = 0.5 so that the returns-to-go are exact binary fractions). Two prompt groups:
#   group 0: A keys [a, b, a] rewards [-0.25, 0, 1]   (A comes back to state a: FrozenLake's Left, Right)
#            B keys [a, c]    rewards [0, 0]
#            C keys [a, b]    rewards [0.5, 1]
#   group 1: D keys [a, d]    rewards [0, 1]           (its a is another group's: never pooled with group 0's)
#            E keys [a]       rewards [0]
# Returns (sums): A 0.75, B 0, C 1.5 | D 1, E 0.
# Episode (grpo): group 0 mean 0.75, devs [0, -0.75, 0.75], unbiased std sqrt(2·0.5625/2) = 0.75
#   -> A 0, B -0.75/(0.75 + 1e-6) ≈ -1, C ≈ +1; group 1 mean 0.5, std sqrt(0.5) -> D ≈ +0.70711, E ≈ -0.70711.
# Returns-to-go R_t = r_t + 0.5·R_{t+1}: A [-0.25 + 0.5·0.5, 0 + 0.5·1, 1] = [0, 0.5, 1]; B [0, 0];
#   C [0.5 + 0.5·1, 1] = [1, 1]; D [0 + 0.5·1, 1] = [0.5, 1]; E [0].
# Step groups: group 0 a = {A0 0, A2 1, B0 0, C0 1} (across trajectories and twice within A): mean 0.5,
#   devs ±0.5, std sqrt(4·0.25/3) = 0.57735 -> ±0.5/0.57735 = ±0.86603 (std), ±0.5 (mean);
#   b = {A1 0.5, C1 1}: mean 0.75, devs ∓0.25, std sqrt(2·0.0625) = 0.35355 -> ∓0.70711 (std), ∓0.25 (mean);
#   c = {B1} and d = {D1}: one turn each -> 0; group 1 a = {D0 0.5, E0 0}: mean 0.25, devs ±0.25, std 0.35355
#   -> ±0.70711 (std), ±0.25 (mean).
G_RETURNS = [0.75, 0.0, 1.5, 1.0, 0.0]
G_REWARDS = [[-0.25, 0.0, 1.0], [0.0, 0.0], [0.5, 1.0], [0.0, 1.0], [0.0]]
G_KEYS = [["a", "b", "a"], ["a", "c"], ["a", "b"], ["a", "d"], ["a"]]
G_GROUPS = [0, 0, 0, 1, 1]
_E0, _E1 = 0.75 / (0.75 + 1e-6), 0.5 / (math.sqrt(0.5) + 1e-6)  # episode advantages ≈ 1 and ≈ 0.70711
_SA, _SB = 0.5 / (math.sqrt(1 / 3) + 1e-6), 0.25 / (math.sqrt(0.125) + 1e-6)  # step, std: ≈ 0.86603, ≈ 0.70711
_S1 = 0.25 / (math.sqrt(0.125) + 1e-6)  # group 1's state a, std ≈ 0.70711


def _gigpo_golden(**kwargs) -> torch.Tensor:
    return advantages.gigpo(torch.tensor(G_RETURNS, dtype=F64), G_REWARDS, G_KEYS, torch.tensor(G_GROUPS),
                            gamma=0.5, **kwargs)


def test_gigpo_golden_std() -> None:
    # A = A^E + 1·A^S, padded with 0 past each trajectory's last turn
    expected = t([
        [0.0 - _SA, 0.0 - _SB, 0.0 + _SA],  # A: ≈ [-0.86603, -0.70711, 0.86603]
        [-_E0 - _SA, -_E0 + 0.0, 0.0],  # B: ≈ [-1.86603, -1.0]; c is a step group of one
        [_E0 + _SA, _E0 + _SB, 0.0],  # C: ≈ [1.86603, 1.70711]
        [_E1 + _S1, _E1 + 0.0, 0.0],  # D: ≈ [1.41421, 0.70711]
        [-_E1 - _S1, 0.0, 0.0],  # E: ≈ [-1.41421]
    ])
    adv = _gigpo_golden()
    torch.testing.assert_close(adv, expected)
    assert adv[1, 0].item() == pytest.approx(-1.86603, abs=1e-5)
    assert adv[3, 0].item() == pytest.approx(1.41421, abs=1e-5)


def test_gigpo_golden_mean() -> None:
    expected = t([
        [-0.5, -0.25, 0.5],  # A: episode 0, step devs of a, b, a
        [-_E0 - 0.5, -_E0, 0.0],  # B: ≈ [-1.5, -1.0]
        [_E0 + 0.5, _E0 + 0.25, 0.0],  # C: ≈ [1.5, 1.25]
        [_E1 + 0.25, _E1, 0.0],  # D: ≈ [0.95711, 0.70711]
        [-_E1 - 0.25, 0.0, 0.0],  # E: ≈ [-0.95711]
    ])
    torch.testing.assert_close(_gigpo_golden(step_norm="mean"), expected)


def test_gigpo_omega_scales_the_step_part_and_omega_zero_is_grpo_exactly() -> None:
    episode = advantages.grpo(torch.tensor(G_RETURNS), torch.tensor(G_GROUPS))  # float32, as the trainer's
    lengths = torch.tensor([len(k) for k in G_KEYS])
    turn_mask = torch.arange(3)[None, :] < lengths[:, None]  # [5, 3]
    for norm in ("std", "mean"):
        adv = advantages.gigpo(torch.tensor(G_RETURNS), G_REWARDS, G_KEYS, torch.tensor(G_GROUPS), omega=0.0,
                               step_norm=norm)
        assert adv.dtype == torch.float32
        assert torch.equal(adv, torch.where(turn_mask, episode[:, None], 0.0))  # bit for bit
    half, full = _gigpo_golden(omega=0.5), _gigpo_golden()
    grpo64 = advantages.grpo(torch.tensor(G_RETURNS, dtype=F64), torch.tensor(G_GROUPS))
    episode64 = torch.where(turn_mask, grpo64[:, None], 0.0)
    torch.testing.assert_close(half - episode64, 0.5 * (full - episode64))


def test_gigpo_equal_returns_to_go_and_a_lone_trajectory_give_no_step_advantage() -> None:
    # group 3: both turns at state s have R = 1 (std 0 -> 0, mean 0 -> 0); group 8 has one trajectory (grpo: 0)
    adv = advantages.gigpo(torch.tensor([1.0, 1.0, 2.0]), [[1.0], [0.0, 1.0], [2.0]], [["s"], ["x", "s"], ["s"]],
                           torch.tensor([3, 3, 8]), gamma=1.0)
    assert adv.tolist() == [[0.0, 0.0], [0.0, 0.0], [0.0, 0.0]]


def test_gigpo_step_groups_are_per_prompt_group_and_key() -> None:
    ids = advantages.step_groups(G_KEYS, torch.tensor(G_GROUPS))
    # turns row by row: A0 A1 A2 B0 B1 C0 C1 | D0 D1 E0
    assert ids.tolist() == [0, 1, 0, 0, 2, 0, 1, 3, 4, 3]


def test_gigpo_rejects_bad_inputs() -> None:
    r, g = torch.tensor([0.0, 1.0]), torch.tensor([0, 0])
    with pytest.raises(ValueError, match="step_norm"):
        advantages.gigpo(r, [[0.0], [1.0]], [["a"], ["a"]], g, step_norm="max")
    with pytest.raises(ValueError, match="one step reward per state key"):
        advantages.gigpo(r, [[0.0], [1.0, 0.0]], [["a"], ["a"]], g)
    with pytest.raises(ValueError, match="rows"):
        advantages.gigpo(r, [[0.0]], [["a"]], g)
    with pytest.raises(ValueError, match="gamma"):
        advantages.gigpo(r, [[0.0], [1.0]], [["a"], ["a"]], g, gamma=1.5)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(  # trajectories: (group, [(state, reward) per turn])
        st.tuples(st.integers(0, 2),
                  st.lists(st.tuples(st.integers(0, 3), st.sampled_from([0.0, -0.1, 0.5, 1.0, 10.0])),
                           min_size=1, max_size=4)),
        min_size=1, max_size=8),
    st.sampled_from([0.0, 0.5, 0.95, 1.0]), st.sampled_from([0.0, 0.3, 1.0]), st.sampled_from(["std", "mean"]),
)
def test_gigpo_matches_plain_loop(trajs, gamma, omega, step_norm) -> None:
    groups = [g * 5 for g, _ in trajs]
    keys = [[f"s{s}" for s, _ in turns] for _, turns in trajs]
    rewards = [[r for _, r in turns] for _, turns in trajs]
    returns = [sum(r) for r in rewards]
    adv = advantages.gigpo(torch.tensor(returns, dtype=F64), rewards, keys, torch.tensor(groups), gamma=gamma,
                           omega=omega, step_norm=step_norm)
    expected = gigpo_loop(returns, rewards, keys, groups, gamma, omega, step_norm)
    k = max(len(r) for r in rewards)
    torch.testing.assert_close(adv, t([row + [0.0] * (k - len(row)) for row in expected]))


def test_gigpo_mutates_nothing() -> None:
    returns, groups = torch.tensor(G_RETURNS), torch.tensor(G_GROUPS)
    rewards = [torch.tensor(r) for r in G_REWARDS]
    copies = [r.clone() for r in rewards]
    advantages.gigpo(returns, rewards, G_KEYS, groups)
    assert torch.equal(returns, torch.tensor(G_RETURNS)) and torch.equal(groups, torch.tensor(G_GROUPS))
    assert all(torch.equal(r, c) for r, c in zip(rewards, copies, strict=True))
