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
