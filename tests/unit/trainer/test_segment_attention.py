"""The bf16 training attention: cpu_attention's segment kernel and trainer/attention.py against torch's attention."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from ragen_core.rollout.generators import cpu_attention
from ragen_core.trainer import attention, forward
from tests.conftest import require


@pytest.fixture(params=["vdpbf16ps", "amx"])
def kernel(request: pytest.FixtureRequest) -> Iterator[object]:
    """The segment ops, their products on vdpbf16ps, then on AMX tiles (cpu_attention.segment_amx). Without a
    compiler the test skips (fails under CI); on a CPU without AVX512-BF16, or without AMX for the second, it skips
    (hardware, as a GPU test does): there the update keeps torch's kernels (the fallback tests below), or the
    vdpbf16ps products."""
    require(cpu_attention.compiler() is not None, "no C++ compiler to build the kernel")
    assert cpu_attention.kernel_available()
    ops = torch.ops.ragen_cpu_attention
    if not ops.segment_attention_available():
        pytest.skip("this CPU has no AVX512-BF16: the segment kernel does not run here")
    cpu_attention.segment_ops()  # its first call sets the process's default, which the test then overrides
    amx = request.param == "amx"
    try:
        if cpu_attention.segment_amx(amx) != amx:
            pytest.skip("oneDNN has no AMX on this CPU: the segment kernel's products run on vdpbf16ps")
        yield ops
    finally:
        cpu_attention.segment_amx()  # back to the process's default


def _dense(bounds: torch.Tensor, lk: int) -> torch.Tensor:
    """The boolean mask [B, 1, Lq, Lk] of bounds [B, Lq, 3]."""
    j = torch.arange(lk)
    a, b, c = (bounds[..., i : i + 1] for i in range(3))
    return ((j < a) | ((j >= b) & (j <= c)))[:, None]


def _attend(q, k, v, mask, scale):
    """torch's attention with the key heads repeated, out as [B, Lq, Hq, D]."""
    g = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), attn_mask=mask,
                                         scale=scale)
    return out.transpose(1, 2)


CASES = {  # name: (bounds [B, Lq, 3], Lk, query heads, key heads)
    "causal": (attention.causal_bounds(1, 37), 37, 3, 1),
    "packed": (attention.packed_bounds(10, [5, 7]), 22, 9, 3),
    "packed-long": (attention.packed_bounds(70, [1, 64, 23, 130]), 288, 9, 3),
    "bandit-group": (attention.packed_bounds(187, [26] * 8), 395, 4, 4),
    # three rows continuing a cache of 30: right padding, a row with 12 real tokens of 20, a row whose cache has a
    # hole (keys 5-8 left out)
    "cache": (torch.stack([torch.tensor([(0, 0, 30 + i) for i in range(20)]),
                           torch.tensor([(0, 0, 30 + min(i, 11)) if i < 12 else (42, 1, 0) for i in range(20)]),
                           torch.tensor([(5, 9, 30 + i) for i in range(20)])]).to(torch.int32), 50, 6, 2),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_forward_and_backward_match_float64_attention_as_closely_as_torchs_bf16(kernel, case):
    """Out, log-sum-exp and the three gradients against float64 attention on the same bf16 inputs: each within
    1.5 times torch's own bf16 attention's error (plus 1e-3 of the largest value), and the log-sum-exp within
    1e-5. Queries strided as transformers hands them over ([B, Lq, H, D] storage seen as [B, H, Lq, D])."""
    bounds, lk, hq, hkv = CASES[case]
    gen = torch.Generator().manual_seed(len(case))
    b, lq = bounds.shape[:2]
    q = torch.randn(b, lq, hq, 64, generator=gen).bfloat16().transpose(1, 2)
    k = torch.randn(b, hkv, lk, 64, generator=gen).bfloat16()
    v = torch.randn(b, hkv, lk, 64, generator=gen).bfloat16()
    grad = torch.randn(b, lq, hq, 64, generator=gen).bfloat16()
    mask, scale = _dense(bounds, lk), 0.125

    out, lse = kernel.segment_attention_fwd(q, k, v, bounds, scale)
    dq, dk, dv = kernel.segment_attention_bwd(q, k, v, out, lse, grad, bounds, scale)

    exact = [t.double().detach().requires_grad_() for t in (q, k, v)]
    ref = _attend(*exact, mask, scale)
    ref.backward(grad.double())
    scores = (exact[0] @ exact[1].repeat_interleave(hq // hkv, 1).transpose(-1, -2)).detach() * scale
    ref_lse = torch.logsumexp(scores.masked_fill(~mask, float("-inf")), dim=-1)
    low = [t.detach().requires_grad_() for t in (q, k, v)]
    theirs = _attend(*low, mask, scale)
    theirs.backward(grad)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)
    for name, mine, torchs, truth in (("out", out, theirs, ref), ("dq", dq, low[0].grad, exact[0].grad),
                                      ("dk", dk, low[1].grad, exact[1].grad), ("dv", dv, low[2].grad, exact[2].grad)):
        assert mine.shape == truth.shape and mine.dtype == torch.bfloat16, name
        truth = truth.detach()
        err = float((mine.double() - truth).abs().max())
        allowed = 1.5 * float((torchs.detach().double() - truth).abs().max()) + 1e-3 * float(truth.abs().max())
        assert err <= allowed, (name, err, allowed)


def test_amx_and_vdpbf16ps_products_agree_within_their_rounding():
    """Where oneDNN has AMX, a packed Bandit group's out and gradients with the products on AMX tiles against
    vdpbf16ps: the same sums of the same bf16 products in fp32, in another order, so within one bf16 ulp of the
    largest value (measured: at most 0.17% of it), and the log-sum-exp within 1e-5. The switch really changes the
    path: the two results are not bit for bit the same."""
    require(cpu_attention.compiler() is not None, "no C++ compiler to build the kernel")
    ops = torch.ops.ragen_cpu_attention
    cpu_attention.segment_ops()
    if not (ops.segment_attention_available() and cpu_attention.segment_amx(True)):
        pytest.skip("oneDNN has no AMX on this CPU")
    bounds = attention.packed_bounds(187, [26] * 8)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, h, 395, 64, generator=gen).bfloat16() for h in (9, 3, 3))
    grad = torch.randn(1, 395, 9, 64, generator=gen).bfloat16()
    results = {}
    try:
        for amx in (True, False):
            assert cpu_attention.segment_amx(amx) == amx
            out, lse = ops.segment_attention_fwd(q, k, v, bounds, 0.125)
            results[amx] = (out, lse, *ops.segment_attention_bwd(q, k, v, out, lse, grad, bounds, 0.125))
    finally:
        cpu_attention.segment_amx()
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), results[True], results[False], strict=True):
        ulp = 1e-5 if name == "lse" else 2.0**-8 * float(b.float().abs().max())
        torch.testing.assert_close(a.float(), b.float(), rtol=0.0, atol=ulp, msg=name)
    assert not all(torch.equal(a, b) for a, b in zip(results[True], results[False], strict=True))


def test_a_query_with_no_key_gets_zero_output_and_no_gradient(kernel):
    bounds = torch.tensor([[(0, 0, 0), (0, 1, 0), (0, 0, 2)]], dtype=torch.int32)  # the middle query sees nothing
    q, k, v = (torch.randn(1, 2, 3, 64).bfloat16() for _ in range(3))
    out, lse = kernel.segment_attention_fwd(q, k, v, bounds, 0.125)
    assert bool((out[0, 1] == 0).all()) and bool(torch.isinf(lse[0, :, 1]).all())
    dq, _, _ = kernel.segment_attention_bwd(q, k, v, out, lse, torch.ones_like(out), bounds, 0.125)
    assert bool((dq[0, :, 1] == 0).all()) and bool(torch.isfinite(dq).all())


def test_the_backward_is_the_same_bit_for_bit_every_run(kernel):
    """The query gradient adds up per thread over the key blocks it is given: the same blocks every run."""
    bounds = attention.packed_bounds(100, [40, 200, 90])
    q, k, v = (torch.randn(1, 3, 430, 64).bfloat16() for _ in range(3))
    out, lse = kernel.segment_attention_fwd(q, k, v, bounds, 0.125)
    grad = torch.randn_like(out)
    first = kernel.segment_attention_bwd(q, k, v, out, lse, grad, bounds, 0.125)
    for _ in range(3):
        for a, b in zip(first, kernel.segment_attention_bwd(q, k, v, out, lse, grad, bounds, 0.125), strict=True):
            assert torch.equal(a, b)


def test_bad_inputs_get_a_clear_error(kernel):
    q, k, v = (torch.randn(1, 2, 8, 64).bfloat16() for _ in range(3))
    bounds = attention.causal_bounds(1, 8)
    bad = {
        "must be bf16": (q.float(), k, v, bounds),
        "head size must be 64": (q[..., :32], k[..., :32], v[..., :32], bounds),
        "bounds must be contiguous int32": (q, k, v, bounds.long()),
        "multiple of key heads": (torch.randn(1, 3, 8, 64).bfloat16(), k, v, bounds),
        "k and v differ": (q, k, v[:, :, :4], bounds),
    }
    for message, args in bad.items():
        with pytest.raises(RuntimeError, match=message):
            kernel.segment_attention_fwd(*args, 0.125)


def test_mask_bounds_read_the_masks_the_update_makes() -> None:
    """Causal (no mask), a packed row's block mask, right padding and a cache continuation read as bounds that
    give the same mask back; masks of another form (a second hole, a row with no key, a float mask, one mask a
    head) read as None, so the update keeps torch's attention for them."""
    assert torch.equal(attention.mask_bounds(None, 2, 5, 5), attention.causal_bounds(2, 5))
    assert attention.mask_bounds(None, 1, 3, 5) is None
    for bounds, lk in ((attention.packed_bounds(6, [3, 1, 4]), 14), (CASES["cache"][0], 50)):
        mask = _dense(bounds, lk)
        got = attention.mask_bounds(mask, bounds.shape[0], bounds.shape[1], lk)
        assert got is not None and torch.equal(_dense(got, lk), mask)
        assert attention.mask_bounds(mask, bounds.shape[0], bounds.shape[1], lk) is got  # kept for the next layer
    holes = _dense(attention.causal_bounds(1, 6), 6).clone()
    holes[0, 0, 5, 1] = holes[0, 0, 5, 3] = False
    nothing = _dense(attention.causal_bounds(1, 6), 6).clone()
    nothing[0, 0, 2] = False
    causal = _dense(attention.causal_bounds(1, 6), 6)
    for mask in (holes, nothing, causal.float(), causal.expand(1, 3, 6, 6)):
        assert attention.mask_bounds(mask, 1, 6, 6) is None


def _tiny_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaModel

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=192, intermediate_size=256, num_attention_heads=3, num_key_value_heads=1,
                         head_dim=64, num_hidden_layers=2, vocab_size=100, attn_implementation="sdpa")
    return LlamaModel(config).train()


def _batch(tails: tuple[int, ...] = (5, 17, 9, 40)) -> tuple[torch.Tensor, torch.Tensor]:
    """A prompt group (a 30-token prompt, then replies of ``tails`` tokens: packed) and two rows alone, right-padded.
    The default replies are short (one call on the block mask); (150, 300, 20, 240) are long enough for
    forward.split_pays."""
    gen = torch.Generator().manual_seed(1)
    prompt = 30
    width = prompt + max(tails)
    ids = torch.randint(10, 100, (6, width), generator=gen)
    ids[:4, :prompt] = ids[0, :prompt]
    ids[4:, :3] = torch.tensor([1, 2, 3])
    mask = torch.zeros(6, width, dtype=torch.long)
    for row, tail in enumerate(tails):
        mask[row, : prompt + tail] = 1
    mask[4, :50] = 1
    mask[5] = 1
    return ids, mask


def _run(model: torch.nn.Module, autocast: bool,
         tails: tuple[int, ...] = (5, 17, 9, 40)) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    ids, mask = _batch(tails)
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        hidden = forward.hidden_states(model, ids, mask)
    (hidden.float() * mask[..., None]).pow(2).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return hidden.detach().float() * mask[..., None], grads


def test_the_update_runs_the_kernel_and_gets_torchs_result_within_bf16_rounding(kernel, monkeypatch):
    """Through forward.hidden_states under bf16 autocast, a packed prompt group and right-padded rows alone run
    every attention call on the kernel; hidden states and every parameter's gradient agree with the same run on
    torch's attention within bf16 rounding (the two bf16 runs differ by 0.3-0.7% of a gradient's norm)."""
    model = _tiny_llama()
    shapes: list[tuple[int, ...]] = []
    apply = attention.SegmentAttention.apply
    def counted(*args: object) -> torch.Tensor:
        shapes.append(tuple(args[0].shape))  # type: ignore[attr-defined]
        return apply(*args)

    monkeypatch.setattr(attention.SegmentAttention, "apply", counted)
    hidden, grads = _run(model, autocast=True)
    assert shapes == [(1, 3, 101, 64), (1, 3, 101, 64), (2, 3, 70, 64), (2, 3, 70, 64)]  # 2 layers, 2 calls each
    assert model.config._attn_implementation == "sdpa"  # switched back after the forward
    monkeypatch.setattr(attention, "_kernel", lambda: False)
    hidden_torch, grads_torch = _run(model, autocast=True)
    assert len(shapes) == 4
    assert float((hidden - hidden_torch).abs().max()) <= 0.02 * float(hidden_torch.abs().max())
    assert grads.keys() == grads_torch.keys()
    for name, grad in grads.items():
        assert float((grad - grads_torch[name]).norm()) <= 0.02 * float(grads_torch[name].norm()), name


def _two_groups() -> tuple[torch.Tensor, torch.Tensor]:
    """Two prompt groups, each packed: replies of (5, 17, 9, 40) on a 30-token prompt and (20, 14, 33) on 26."""
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(10, 100, (7, 70), generator=gen)
    mask = torch.zeros(7, 70, dtype=torch.long)
    for rows, prompt, tails in (((0, 1, 2, 3), 30, (5, 17, 9, 40)), ((4, 5, 6), 26, (20, 14, 33))):
        ids[list(rows), :prompt] = ids[rows[0], :prompt]
        for row, tail in zip(rows, tails, strict=True):
            mask[row, : prompt + tail] = 1
    return ids, mask


def test_packed_groups_run_as_one_batch_on_the_kernel(kernel, monkeypatch):
    """Where the kernel runs, two packed prompt groups of one micro-batch run as one decoder call of batch 2 (101
    and 93 positions, padded to 101), as many positions as backbone_tokens counts for the micro-batch budget.
    Hidden states and gradients agree with the groups run one at a time within bf16 rounding (measured on an AMX
    CPU: the hidden states the same, the gradients within 0.29% of their norm)."""
    model = _tiny_llama()
    ids, mask = _two_groups()
    fed: list[tuple[int, ...]] = []
    model.register_forward_pre_hook(lambda mod, args, kwargs: fed.append(tuple(kwargs["input_ids"].shape)),
                                    with_kwargs=True)

    def run() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            hidden = forward.hidden_states(model, ids, mask)
        (hidden.float() * mask[..., None]).pow(2).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return hidden.detach().float() * mask[..., None], grads

    together, grads = run()
    assert fed == [(2, 101)]
    groups = forward.shared_prefix_groups(ids, mask)
    assert forward.backbone_tokens(mask.sum(dim=1).tolist(), groups, pack=True) == 2 * 101
    monkeypatch.setattr(attention, "runs_segment_kernel", lambda decoder: False)
    alone, grads_alone = run()
    assert fed[1:] == [(1, 101), (1, 93)]
    assert float((together - alone).abs().max()) <= 0.005 * float(alone.abs().max())
    assert grads.keys() == grads_alone.keys()
    for name, grad in grads.items():
        assert float((grad - grads_alone[name]).norm()) <= 0.01 * float(grads_alone[name].norm()), name


def test_runs_segment_kernel_says_where_the_kernel_runs(kernel):
    """True inside use_segment_attention under bf16 autocast; False in float32, outside the block, and with
    attention dropout in training."""
    model = _tiny_llama()
    assert not attention.runs_segment_kernel(model)
    with attention.use_segment_attention(model):
        assert not attention.runs_segment_kernel(model)  # float32
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert attention.runs_segment_kernel(model)
            model.config.attention_dropout = 0.1
            assert not attention.runs_segment_kernel(model)
            model.eval()
            assert attention.runs_segment_kernel(model)


@pytest.mark.parametrize("tails", [(5, 17, 9, 40), (150, 300, 20, 240)], ids=["one-call", "split"])
def test_without_the_kernel_or_in_float32_the_update_keeps_torchs_attention(monkeypatch, tails):
    """On a CPU without AVX512-BF16 nothing is switched; where the kernel runs but the update computes in float32,
    the attention function hands every call to torch's (split_attention: a long packed row in parts), bit for bit
    the plain sdpa result."""
    assert forward.split_pays(list(tails), 30) == (tails[1] == 300)
    model = _tiny_llama()
    monkeypatch.setattr(attention, "_kernel", lambda: False)
    with attention.use_segment_attention(model):
        assert model.config._attn_implementation == "sdpa"
    plain, plain_grads = _run(model, autocast=False, tails=tails)
    monkeypatch.setattr(attention, "_kernel", lambda: True)
    with attention.use_segment_attention(model):
        assert model.config._attn_implementation == attention.NAME
    assert model.config._attn_implementation == "sdpa"

    def never(*args: object) -> None:
        raise AssertionError("the kernel ran on float32")

    monkeypatch.setattr(attention.SegmentAttention, "apply", never)
    through, through_grads = _run(model, autocast=False, tails=tails)
    assert torch.equal(plain, through)
    for name, grad in plain_grads.items():
        assert torch.equal(grad, through_grads[name]), name
