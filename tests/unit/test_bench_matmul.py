"""bench/matmul.py's ProductRecorder: which products it records (backward passes and in-place ones included), their
FLOPs by hand, and a replay that runs the same ops on operands of the recorded layouts; model_flop_mapping's counts
of the in-place product and of attention (torch's CPU kernel and the segment kernel), by hand.

Run: .venv/bin/python -m pytest tests/unit/test_bench_matmul.py -q
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from ragen_core.rollout.generators import cpu_attention
from tests.conftest import require

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from matmul import ATTENTION_OPS, ProductRecorder, _segment_pairs, model_flop_mapping

aten = torch.ops.aten


def test_records_forward_backward_and_in_place_products_with_their_flops() -> None:
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 5)  # a bias: addmm forward
    x = torch.randn(3, 4, 8, requires_grad=True)
    out = torch.zeros(3, 5)
    with ProductRecorder() as products:
        layer(x).sum().backward()  # forward addmm [12, 8] x [8, 5]; backward mm for x's and the weight's gradients
        torch.bmm(torch.randn(2, 3, 4), torch.randn(2, 4, 6))
        out.addmm_(torch.ones(3, 2), torch.ones(2, 5), beta=0.5)
        torch.relu(torch.randn(4))  # not a product: not recorded
    ops = [func for func, _, _ in products.calls]
    assert ops[0] == aten.addmm.default and ops[-2:] == [aten.bmm.default, aten.addmm_.default]
    assert sorted(map(str, ops[1:3])) == ["aten.mm.default", "aten.mm.default"]
    # 2mkn: forward 2*12*8*5, the two backward products the same count each, bmm 2 * 2*3*4*6, addmm_ 2*3*2*5
    assert products.flops() == 3 * 960 + 288 + 60
    # the in-place product ran (beta kept) and its call keeps beta for the replay
    assert torch.equal(out, torch.full((3, 5), 2.0))
    assert products.calls[-1][2] == {"beta": 0.5}
    shapes = [[a.shape for a in args if hasattr(a, "shape")] for _, args, _ in products.calls]
    assert shapes[0] == [(5,), (12, 8), (8, 5)] and shapes[3] == [(2, 3, 4), (2, 4, 6)]
    assert products.seconds > 0


def test_replay_runs_every_product_on_operands_of_the_recorded_layouts() -> None:
    a = torch.randn(6, 10)[:, ::2]  # strided: (10, 2)
    b = torch.randn(4, 7).t()  # transposed: [7, 4] with strides (1, 7)
    expanded = torch.ones(1, 4).expand(5, 4)  # stride 0
    with ProductRecorder() as products:
        torch.mm(a, torch.randn(5, 3))
        torch.mm(b, torch.randn(4, 2))
        torch.mm(expanded, torch.randn(4, 2))
    layouts = [args[0] for _, args, _ in products.calls]
    assert [(tuple(x.shape), x.stride) for x in layouts] == [((6, 5), (10, 2)), ((7, 4), (1, 7)), ((5, 4), (0, 1))]
    seen: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    with ProductRecorder() as again:  # the replay's own products, recorded: the same ops on the same layouts
        assert products.replay_seconds(repeats=2) > 0
    for _, args, _ in again.calls:
        seen.append((args[0].shape, args[0].stride))
    assert seen == [(x.shape, x.stride) for x in layouts] * 3  # the warm-up and 2 timed runs


def _counted(run: Callable[[], object]) -> dict[str, int]:
    counter = FlopCounterMode(display=False, custom_mapping=model_flop_mapping())
    with counter:
        run()
    return {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}


def test_in_place_product_and_cpu_attention_are_counted_on_the_pairs_the_mask_allows() -> None:
    out = torch.zeros(3, 5)
    assert _counted(lambda: out.addmm_(torch.ones(3, 2), torch.ones(2, 5))) == {"aten.addmm_": 2 * 3 * 2 * 5}
    q, k, v = (torch.randn(1, 2, 5, 8, requires_grad=True) for _ in range(3))
    # causal over 5 positions: 1 + 2 + 3 + 4 + 5 = 15 pairs a head, 2 heads; a pair is 2 x 8 FLOPs a product:
    # q kᵀ and p v forward (2 products), their 4 gradient products backward
    causal = {"aten._scaled_dot_product_flash_attention_for_cpu": 2 * 16 * 30,
              "aten._scaled_dot_product_flash_attention_for_cpu_backward": 4 * 16 * 30}
    assert _counted(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()) == causal
    tril = torch.ones(5, 5, dtype=torch.bool).tril()
    assert _counted(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=tril).sum().backward()) == causal
    # a float mask: -inf where masked; here query 4 sees 3 keys of 5, the rest all 5: 23 pairs a head
    mask = torch.zeros(5, 5)
    mask[4, :2] = float("-inf")
    assert _counted(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)) == {
        "aten._scaled_dot_product_flash_attention_for_cpu": 2 * 16 * 46}
    assert all(any(op.endswith(name) for name in ATTENTION_OPS) for op in causal)


def test_segment_pairs_count_both_ranges_and_the_flagged_keys() -> None:
    # query i sees [0, a) and [b, c]: a causal row (0, 0, i), a packed reply over a 3-token prefix (3, 3, 4),
    # an empty second range (b > c), and overlapping ranges counted once ([0, 4) ∪ [2, 5] and [0, 4) ∪ [1, 5]: 6 keys)
    bounds = torch.tensor([[[0, 0, 2], [3, 3, 4], [2, 5, 4], [4, 2, 5], [4, 1, 5]]], dtype=torch.int32)
    assert _segment_pairs(bounds) == 3 + 5 + 2 + 6 + 6
    # key 1 a hole, which only the first range reads; row by row: [0, 2]; {0, 2} ∪ [3, 4]; {0}; {0, 2, 3} ∪ [2, 5];
    # {0, 2, 3} ∪ [1, 5], whose second range sees key 1
    valid = torch.tensor([[True, False, True, True, True, True]])
    assert _segment_pairs(bounds, valid) == 3 + 4 + 1 + 5 + 6


def test_the_segment_kernel_is_counted_on_its_bounds() -> None:
    require(cpu_attention.compiler() is not None, "no C++ compiler to build the kernel")
    assert cpu_attention.kernel_available()
    if not torch.ops.ragen_cpu_attention.segment_attention_available():
        pytest.skip("this CPU has no AVX512-BF16: the segment kernel does not run here")
    from ragen_core.trainer.attention import SegmentAttention, packed_bounds

    bounds = packed_bounds(3, [2, 1])  # the prefix causally (6 pairs), then 3 + 1, 3 + 2 and 3 + 1: 19 pairs
    q = torch.randn(1, 6, 6, 64).bfloat16().requires_grad_()
    k, v = (torch.randn(1, 2, 6, 64).bfloat16().requires_grad_() for _ in range(2))
    counted = _counted(lambda: SegmentAttention.apply(q, k, v, bounds, 0.125).float().sum().backward())
    pair = 2 * 64 * 6  # a pair's product over the head size, for each of the 6 query heads
    assert counted == {"ragen_cpu_attention.segment_attention_fwd": 2 * pair * 19,
                       "ragen_cpu_attention.segment_attention_bwd": 4 * pair * 19}
