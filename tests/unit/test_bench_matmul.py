"""bench/matmul.py's ProductRecorder: which products it records (backward passes and in-place ones included), their
FLOPs by hand, and a replay that runs the same ops on operands of the recorded layouts.

Run: .venv/bin/python -m pytest tests/unit/test_bench_matmul.py -q
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from matmul import ProductRecorder

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
