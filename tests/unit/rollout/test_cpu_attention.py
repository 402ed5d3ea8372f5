"""The fused CPU decode attention kernel (cpu_attention.py) against torch's own attention."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ragen_core.rollout.generators import cpu_attention
from ragen_core.rollout.generators.cpu_attention import Shared, decode_attention
from tests.conftest import require


@pytest.fixture()
def needs_compiler() -> None:
    """The kernel's compiler ($CXX, else c++): missing, the test skips, and fails under CI=true."""
    cxx = os.environ.get("CXX", "c++")
    require(cpu_attention.compiler() is not None, f"no C++ compiler ({cxx}) to build the kernel")


def _reference(q, k, v, mask, scale):
    """softmax(q kᵀ·scale + mask) v and its log-sum-exp, in float64."""
    s = torch.einsum("bhgd,bhwd->bhgw", q.double(), k.double()) * scale + mask.double()[:, None, None, :]
    lse = torch.logsumexp(s, -1)
    return torch.einsum("bhgw,bhwd->bhgd", (s - lse[..., None]).exp(), v.double()), lse


@pytest.mark.usefixtures("needs_compiler")
def test_the_kernel_builds_here():
    """Where a compiler is, the kernel must build (a silent fallback would hide a broken source)."""
    assert cpu_attention.kernel_available()


@pytest.mark.usefixtures("needs_compiler")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("group", "head"), [(1, 32), (2, 32), (3, 64), (4, 64), (7, 64), (8, 128)])
def test_matches_attention_over_padded_strided_caches(group, head, dtype):
    """Left padding, holes, cache views with room after them (as kv.growing_cache makes), every group size
    and head size built, an fp32 or a bf16 cache: out within 1e-5 and log-sum-exp within 1e-5 of float64
    attention over the same keys and values, and torch's SDPA. 37 columns: two whole blocks of 16 keys (the
    AVX512 path), or four of 8 (AVX2), and a rest; masked keys NaN (never used)."""
    gen = torch.Generator().manual_seed(group * head)
    b, h, w, room = 5, 2, 37, 11
    q = torch.randn(b, h, group, head, generator=gen)
    k = torch.randn(b, h, w + room, head, generator=gen).to(dtype)[:, :, :w]  # views: rows strided by w + room
    v = torch.randn(b, h, w + room, head, generator=gen).to(dtype)[:, :, :w]
    real = torch.ones(b, w, dtype=torch.bool)
    real[1, :9] = False  # left padding
    real[2, 4:7] = False  # holes (cache reuse)
    real[3, :-1] = False  # one real column
    mask = torch.zeros(b, w).masked_fill_(~real, float("-inf"))
    unread = torch.empty(b, h, w + room, head, dtype=dtype)[:, :, :w].copy_(k)  # a masked key is never used: NaN
    unread.masked_fill_(~real[:, None, :, None], float("nan"))
    got = decode_attention(q, unread, v, mask, head**-0.5)
    assert got is not None
    out, lse = got
    assert out.dtype == lse.dtype == torch.float32
    want, want_lse = _reference(q, k, v, mask, head**-0.5)
    assert (out.double() - want).abs().max() <= 1e-5
    assert (lse.double() - want_lse).abs().max() <= 1e-5
    sdpa = F.scaled_dot_product_attention(q, k.float(), v.float(), attn_mask=real[:, None, None, :], scale=head**-0.5)
    assert (out - sdpa).abs().max() <= 1e-5


@pytest.mark.usefixtures("needs_compiler")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_wholly_masked_column_chunks_are_not_read(dtype):
    """A row's own columns go 64 at a time: a chunk with every column masked (a long left padding) is neither
    scored nor read, so NaN keys and values there change nothing; a chunk with one real column is read."""
    gen = torch.Generator().manual_seed(5)
    b, h, g, d, w = 3, 2, 3, 64, 150
    q = torch.randn(b, h, g, d, generator=gen)
    k, v = (torch.randn(b, h, w, d, generator=gen).to(dtype) for _ in range(2))
    real = torch.ones(b, w, dtype=torch.bool)
    real[0, :128] = False  # columns 0-63 and 64-127: two wholly masked chunks
    real[1, :127] = False  # the second chunk has one real column
    real[1, 5] = True
    mask = torch.zeros(b, w).masked_fill_(~real, float("-inf"))
    nan_k, nan_v = k.clone(), v.clone()
    nan_k[0, :, :128], nan_v[0, :, :128] = float("nan"), float("nan")
    got = decode_attention(q, nan_k, nan_v, mask, d**-0.5)
    assert got is not None
    want, want_lse = _reference(q, k, v, mask, d**-0.5)
    assert (got[0].double() - want).abs().max() <= 1e-5
    assert (got[1].double() - want_lse).abs().max() <= 1e-5


@pytest.mark.usefixtures("needs_compiler")
def test_a_row_with_no_real_column_gets_zero_output_and_minus_infinity_lse():
    """A finished row under cascade attention may have all its own columns masked: its part then weighs 0
    in the merge (lse -inf), where torch's flash kernel reports lse 0. Such a row's keys and values are not read
    (NaN there changes nothing): the decode step masks a finished row wholly so that its cache is skipped."""
    q, k, v = torch.randn(2, 1, 3, 64), torch.randn(2, 1, 5, 64), torch.randn(2, 1, 5, 64)
    k[0], v[0] = float("nan"), float("nan")
    mask = torch.zeros(2, 5)
    mask[0] = float("-inf")
    got = decode_attention(q, k, v, mask, 0.125)
    assert got is not None
    out, lse = got
    assert torch.equal(out[0], torch.zeros(1, 3, 64)) and bool(torch.isneginf(lse[0]).all())
    assert torch.isfinite(out[1]).all() and torch.isfinite(lse[1]).all()


@pytest.mark.usefixtures("needs_compiler")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("group", "head", "p"), [(3, 64, 13), (3, 64, 75), (1, 32, 64), (8, 128, 40)])
def test_shared_columns_then_own_columns_in_one_softmax(group, head, p, dtype):
    """Cascade attention in one call: row b attends to its group's shared columns (left-padded, as a prompt
    group's prefill makes them) and then to its own (views with room after them, one row with none real, as a
    finished row has). Equal to attention over each row's shared and own columns concatenated (float64
    reference, 1e-5), rows of a group in any order and groups of any size; shared widths below one block of
    keys (32), whole blocks, and whole blocks with a part left; own columns in fp32 or bf16 (shared ones fp32)."""
    gen = torch.Generator().manual_seed(group + head + p)
    b, h, w, room = 7, 2, 6, 4
    groups = torch.tensor([2, 0, 2, 2, 0, 1, 2])  # uneven, interleaved
    q = torch.randn(b, h, group, head, generator=gen)
    sk = torch.randn(3, h, p + room, head, generator=gen)[:, :, :p]
    sv = torch.randn(3, h, p + room, head, generator=gen)[:, :, :p]
    shared_mask = torch.zeros(3, p)
    shared_mask[1, :5] = float("-inf")  # a shorter prompt, left-padded
    k = torch.randn(b, h, w + room, head, generator=gen).to(dtype)[:, :, :w]
    v = torch.randn(b, h, w + room, head, generator=gen).to(dtype)[:, :, :w]
    mask = torch.zeros(b, w)
    mask[3] = float("-inf")  # a finished row: no own column
    mask[4, :2] = float("-inf")
    got = decode_attention(q, k, v, mask, head**-0.5, shared=Shared(sk.transpose(2, 3).contiguous(), sv, shared_mask,
                                                                   groups))
    assert got is not None
    whole_k, whole_v = torch.cat([sk[groups], k.float()], 2), torch.cat([sv[groups], v.float()], 2)
    want, want_lse = _reference(q, whole_k, whole_v, torch.cat([shared_mask[groups], mask], 1), head**-0.5)
    assert (got[0].double() - want).abs().max() <= 1e-5
    assert (got[1].double() - want_lse).abs().max() <= 1e-5


@pytest.mark.usefixtures("needs_compiler")
def test_bad_shared_columns_get_a_clear_error():
    """A group index out of range, part of the shared arguments only, or keys and values of two dtypes given
    to the op itself: an error that names the problem."""
    q, k, v, mask = torch.randn(2, 1, 3, 64), torch.randn(2, 1, 4, 64), torch.randn(2, 1, 4, 64), torch.zeros(2, 4)
    sk, sv, sm = torch.randn(2, 1, 64, 5), torch.randn(2, 1, 5, 64), torch.zeros(2, 5)  # keys transposed
    with pytest.raises(RuntimeError, match="source must index the shared groups"):
        decode_attention(q, k, v, mask, 0.1, shared=Shared(sk, sv, sm, torch.tensor([0, 2])))
    with pytest.raises(RuntimeError, match="shared shapes do not match"):
        decode_attention(q, k, v, mask, 0.1, shared=Shared(sk, sv, torch.zeros(2, 4), torch.tensor([0, 1])))
    op = cpu_attention._op()
    assert op is not None
    with pytest.raises(RuntimeError, match="go together"):
        op(q, k, v, mask, 0.1, sk, sv, None, None)
    with pytest.raises(RuntimeError, match="float32 or bfloat16 k and v"):
        op(q, k.bfloat16(), v, mask, 0.1)


@pytest.mark.usefixtures("needs_compiler")
@pytest.mark.parametrize(("m", "n", "k"), [(1, 960, 576), (5, 17, 3), (6, 32, 64), (13, 100, 33), (64, 3072, 576),
                                           (97, 576, 1536), (200, 40, 8)])
@pytest.mark.parametrize("bias", [False, True])
def test_panel_linear_matches_f_linear(m, n, k, bias):
    """The decode step's fp32 weight matmul on panels: rows in whole tiles of 6 and a rest, row chunks of 96,
    output columns past the last whole panel, with and without a bias."""
    torch.manual_seed(m * n + k)
    w, x, b = torch.randn(n, k), torch.randn(m, k), torch.randn(n) if bias else None
    packed = cpu_attention.pack_panels(w)
    assert packed is not None and packed.n == n and packed.data.shape[1] == k
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    got = cpu_attention.panel_linear(x, packed, b)
    assert got.shape == (m, n) and got.dtype == torch.float32
    assert (got.double() - want).abs().max() <= 1e-5 * max(1.0, want.abs().max().item())


@pytest.mark.usefixtures("needs_compiler")
def test_panel_linear_matches_on_leading_dimensions_and_strided_inputs_and_weights():
    w = torch.randn(50, 24)
    packed = cpu_attention.pack_panels(w)
    assert packed is not None
    x = torch.randn(2, 3, 48)[..., ::2]  # [2, 3, 24], not contiguous
    torch.testing.assert_close(cpu_attention.panel_linear(x, packed), F.linear(x, w), rtol=0, atol=1e-5)
    wt = torch.randn(24, 64).t()  # [64, 24], not contiguous, whole panels
    packed_t = cpu_attention.pack_panels(wt)
    assert packed_t is not None
    torch.testing.assert_close(cpu_attention.panel_linear(x, packed_t), F.linear(x, wt), rtol=0, atol=1e-5)


@pytest.mark.usefixtures("needs_compiler")
def test_panel_linear_refuses_bad_inputs_with_a_clear_error():
    w = torch.randn(20, 8)
    packed = cpu_attention.pack_panels(w)
    assert packed is not None
    op = torch.ops.ragen_cpu_attention.panel_linear
    with pytest.raises(RuntimeError, match="panels"):  # K of x differs from the weight's
        op(torch.randn(3, 9), packed.data, 20, None)
    with pytest.raises(RuntimeError, match="panels"):  # more outputs than the panels hold
        op(torch.randn(3, 8), packed.data, packed.data.shape[0] * packed.data.shape[2] + 1, None)
    with pytest.raises(RuntimeError, match="float32"):
        op(torch.randn(3, 8).double(), packed.data, 20, None)
    with pytest.raises(RuntimeError, match="bias"):
        op(torch.randn(3, 8), packed.data, 20, torch.randn(19))
    assert cpu_attention.pack_panels(w.double()) is None  # not float32: the caller keeps its own matmul


def test_shapes_the_kernel_does_not_cover_fall_back():
    """Not float32 queries, a cache neither float32 nor bf16 or keys and values of two dtypes, a head size or group
    size not built, or a key layout without a contiguous last dimension: None, and the caller uses torch's
    attention."""
    q, k, v, mask = torch.randn(1, 1, 2, 64), torch.randn(1, 1, 4, 64), torch.randn(1, 1, 4, 64), torch.zeros(1, 4)
    assert decode_attention(q.double(), k.double(), v.double(), mask.double(), 0.1) is None
    assert decode_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask, 0.1) is None
    assert decode_attention(q, k.half(), v.half(), mask, 0.1) is None
    assert decode_attention(q, k.bfloat16(), v, mask, 0.1) is None
    assert decode_attention(torch.randn(1, 1, 2, 48), torch.randn(1, 1, 4, 48), torch.randn(1, 1, 4, 48), mask,
                            0.1) is None
    assert decode_attention(torch.randn(1, 1, 9, 64), k, v, mask, 0.1) is None
    assert decode_attention(q, k.transpose(-1, -2).contiguous().transpose(-1, -2), v, mask, 0.1) is None


def test_panels_pay_where_measured_and_not_when_turned_off(monkeypatch):
    """The decode step's fp32 matmuls run on panels on AVX2 (where they were measured faster than oneDNN) unless
    RAGEN_CPU_PANELS=0."""
    built = cpu_attention.kernel_available()
    assert cpu_attention.panels_pay() == (built and cpu_attention._capability() in cpu_attention.PANEL_CAPABILITIES)
    monkeypatch.setenv("RAGEN_CPU_PANELS", "0")
    assert not cpu_attention.panels_pay()


def test_turned_off_by_the_environment(monkeypatch):
    """RAGEN_CPU_ATTENTION=0: no kernel (the switch for timing with and without it)."""
    monkeypatch.setenv("RAGEN_CPU_ATTENTION", "0")
    cpu_attention._op.cache_clear()
    try:
        assert decode_attention(torch.randn(1, 1, 2, 64), torch.randn(1, 1, 4, 64), torch.randn(1, 1, 4, 64),
                                torch.zeros(1, 4), 0.1) is None
    finally:
        cpu_attention._op.cache_clear()


ROOT = Path(__file__).resolve().parents[3]
CHILD = """
import sys, pytest, torch
assert str(torch.backends.cpu.get_cpu_capability()) == sys.argv[1], torch.backends.cpu.get_cpu_capability()
chosen = ("(matches or shared or no_real or wholly or builds or panel or step_ops or segment or loss_ops) "
          "and not avx2_cpu")
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", sys.argv[2], "-k", chosen]))
"""


@pytest.mark.usefixtures("needs_compiler")
def test_the_build_for_an_avx2_cpu_matches_too() -> None:
    """The kernel as built for a CPU with AVX2 only (scores 8 keys at a time), on any CPU with AVX2: torch told to run
    at that capability (ATEN_CPU_CAPABILITY, which can only lower it) in a child process, where this file's
    numerical tests pass with that build. (The plain loop of a CPU with neither is left out: one more build.)"""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    done = subprocess.run([sys.executable, "-c", CHILD, "AVX2", __file__], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout, done.stdout[-2000:]


@pytest.mark.usefixtures("needs_compiler")
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_step_ops_match_the_torch_ops_they_replace(rows):
    """The decode step's fused small ops (cpu_attention.step_ops) against the torch ops of the unfused step, at widths
    that leave a vector tail: the norm to float32 within rounding and to bf16 as the cast of torch's result (within
    one bf16 rounding), SiLU times up as torch rounds it, and the rotary embedding with the cache writes
    within float32 rounding, for every input and cache dtype, on a strided projection output."""
    from ragen_core.rollout.generators.decode_step import _rotate_half

    ops = cpu_attention.step_ops()
    assert ops is not None
    x, w = torch.randn(rows, 72) * 3, torch.randn(72)
    norm = F.rms_norm(x, (72,), w, 1e-5)
    torch.testing.assert_close(ops.rms_norm_to(x, w, 1e-5, False), norm, rtol=1e-6, atol=1e-6)
    low = ops.rms_norm_to(x, w, 1e-5, True)
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), norm.bfloat16().float(), rtol=2**-8, atol=1e-6)
    for dtype in (torch.float32, torch.bfloat16):
        gate_up = (torch.randn(rows, 2 * 45) * 4).to(dtype)
        gate, up = gate_up.chunk(2, dim=-1)
        fused, separate = ops.silu_mul(gate_up), F.silu(gate) * up
        assert fused.dtype == dtype
        # the vector tail's exp may differ from torch's in the last float32 bit, which can move a bf16 rounding
        torch.testing.assert_close(fused, separate, rtol=1e-6 if dtype == torch.float32 else 2**-7, atol=1e-7)
        assert (fused == separate).float().mean() >= 0.95
    nh, nkv, d = 6, 2, 32
    for dtype in (torch.float32, torch.bfloat16):
        for cache_dtype in (torch.float32, torch.bfloat16):
            wide = torch.randn(rows, (nh + 2 * nkv) * d + 8).to(dtype)
            qkv = wide[:, 8:]  # a row stride wider than the row
            cos, sin = torch.randn(rows, d), torch.randn(rows, d)
            k_cache = torch.zeros(rows, nkv, 5, d, dtype=cache_dtype)
            v_cache = torch.zeros(rows, nkv, 5, d, dtype=cache_dtype)
            q = ops.rotary_kv(qkv, cos, sin, k_cache, v_cache, 3, nh, nkv)
            qk = qkv[:, : (nh + nkv) * d].float().view(rows, nh + nkv, 1, d)
            rotated = qk * cos[:, None, None] + _rotate_half(qk) * sin[:, None, None]
            assert q.dtype == torch.float32 and q.shape == (rows, nkv, nh // nkv, d)
            torch.testing.assert_close(q, rotated[:, :nh].reshape(rows, nkv, nh // nkv, d), rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(k_cache[:, :, 3], rotated[:, nh:, 0].to(cache_dtype), rtol=2**-8, atol=1e-6)
            torch.testing.assert_close(v_cache[:, :, 3], qkv[:, (nh + nkv) * d :].view(rows, nkv, d).to(cache_dtype),
                                       rtol=0, atol=0)
            others = torch.cat([k_cache[:, :, :3], k_cache[:, :, 4:], v_cache[:, :, :3], v_cache[:, :, 4:]], dim=2)
            assert not others.any()  # only column 3 is written
    # a prefill's T tokens a row: row b's token t is qkv row b·T + t and goes to cache column slot + t
    t = 7
    for dtype in (torch.float32, torch.bfloat16):
        for cache_dtype in (torch.float32, torch.bfloat16):
            wide = torch.randn(rows * t, (nh + 2 * nkv) * d + 8).to(dtype)
            qkv = wide[:, 8:]
            cos, sin = torch.randn(rows * t, d), torch.randn(rows * t, d)
            k_cache = torch.zeros(rows, nkv, t + 4, d, dtype=cache_dtype)
            v_cache = torch.zeros(rows, nkv, t + 4, d, dtype=cache_dtype)
            q = ops.rotary_prefill(qkv, cos, sin, k_cache, v_cache, 2, t, nh, nkv, cache_dtype == torch.bfloat16)
            qk = qkv[:, : (nh + nkv) * d].float().view(rows, t, nh + nkv, d).transpose(1, 2)  # [B, nh + nkv, T, d]
            c, s = cos.view(rows, 1, t, d), sin.view(rows, 1, t, d)
            rotated = qk * c + _rotate_half(qk) * s
            assert q.dtype == cache_dtype and q.shape == (rows, nh, t, d) and q.is_contiguous()
            # float32 rounding apart (fused multiply-adds), which can move a bf16 rounding by one step
            tol = {"rtol": 1e-6, "atol": 1e-6} if cache_dtype == torch.float32 else {"rtol": 2**-7, "atol": 1e-6}
            torch.testing.assert_close(q, rotated[:, :nh].to(cache_dtype), **tol)
            torch.testing.assert_close(k_cache[:, :, 2 : 2 + t], rotated[:, nh:].to(cache_dtype), **tol)
            values = qkv[:, (nh + nkv) * d :].view(rows, t, nkv, d).transpose(1, 2).to(cache_dtype)
            torch.testing.assert_close(v_cache[:, :, 2 : 2 + t], values, rtol=0, atol=0)
            others = torch.cat([k_cache[:, :, :2], k_cache[:, :, 2 + t :], v_cache[:, :, :2],
                                v_cache[:, :, 2 + t :]], dim=2)
            assert not others.any()  # only columns 2 .. 2 + T - 1 are written


@pytest.mark.usefixtures("needs_compiler")
def test_step_ops_refuse_bad_inputs_with_a_clear_error():
    """Wrong shapes, dtypes or layouts: an error that names the op and what it takes, and the caches untouched."""
    ops = cpu_attention.step_ops()
    assert ops is not None
    with pytest.raises(RuntimeError, match="rms_norm_to: x \\[M, H\\] and w \\[H\\], float32"):
        ops.rms_norm_to(torch.randn(2, 8), torch.randn(7), 1e-5, True)
    with pytest.raises(RuntimeError, match="rms_norm_to"):
        ops.rms_norm_to(torch.randn(2, 8).double(), torch.randn(8).double(), 1e-5, True)
    with pytest.raises(RuntimeError, match="silu_mul: gate_up \\[M, 2I\\]"):
        ops.silu_mul(torch.randn(2, 7))
    with pytest.raises(RuntimeError, match="silu_mul: float32 or bfloat16"):
        ops.silu_mul(torch.randn(2, 8).half())
    k_cache, v_cache = torch.zeros(2, 1, 4, 8), torch.zeros(2, 1, 4, 8)
    cos, sin = torch.randn(2, 8), torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="rotary_kv: shapes do not match"):  # qkv for 2 query heads, not 1
        ops.rotary_kv(torch.randn(2, 4 * 8), cos, sin, k_cache, v_cache, 0, 1, 1)
    with pytest.raises(RuntimeError, match="rotary_kv: shapes do not match"):  # the slot past the capacity
        ops.rotary_kv(torch.randn(2, 3 * 8), cos, sin, k_cache, v_cache, 4, 1, 1)
    with pytest.raises(RuntimeError, match="rotary_kv: cos, sin \\[B, d\\] float32"):
        ops.rotary_kv(torch.randn(2, 3 * 8), cos[:1], sin, k_cache, v_cache, 0, 1, 1)
    with pytest.raises(RuntimeError, match="rotary_kv: float32 or bfloat16"):
        ops.rotary_kv(torch.randn(2, 3 * 8).half(), cos, sin, k_cache, v_cache, 0, 1, 1)
    cos2, sin2 = torch.randn(6, 8), torch.randn(6, 8)
    with pytest.raises(RuntimeError, match="rotary_prefill: shapes do not match"):  # 6 rows are not 2 rows of 2
        ops.rotary_prefill(torch.randn(6, 3 * 8), cos2, sin2, k_cache, v_cache, 0, 2, 1, 1, False)
    with pytest.raises(RuntimeError, match="rotary_prefill: shapes do not match"):  # columns 2..4 past the capacity
        ops.rotary_prefill(torch.randn(6, 3 * 8), cos2, sin2, k_cache, v_cache, 2, 3, 1, 1, False)
    with pytest.raises(RuntimeError, match="rotary_prefill: cos, sin \\[B·T, d\\] float32"):
        ops.rotary_prefill(torch.randn(6, 3 * 8), cos2[:5], sin2, k_cache, v_cache, 0, 3, 1, 1, False)
    assert not k_cache.any() and not v_cache.any()


def _loss_reference(logits, labels, scale, g_lp, g_h):
    """losses.logprobs_and_entropy of scale·logits in float64: (log-prob, entropy, d/dlogits of Σ g_lp·lp + g_h·H)."""
    from ragen_core.algos import losses

    x = logits.detach().double().requires_grad_()
    lp, ent = losses.logprobs_and_entropy((x * scale)[None], labels[None])
    (lp[0] * g_lp.double() + ent[0] * g_h.double()).sum().backward()
    return lp[0].detach(), ent[0].detach(), x.grad


@pytest.mark.usefixtures("needs_compiler")
def test_loss_ops_golden():
    """Hand-computed: logits (0, ln 3) give p = (1/4, 3/4), lse = ln 4, E = (3/4) ln 3; label 1 scores ln 3 − ln 4,
    the entropy is ln 4 − (3/4) ln 3; d log-prob/dl = (−1/4, 1/4), dH/dl = −p (l − E) = (3/16, −3/16) ln 3. At scale 2
    on logits (0, ln 3 / 2) the scores are the same and each gradient doubles."""
    ops = cpu_attention.loss_ops()
    assert ops is not None
    ln3, ln4 = math.log(3.0), math.log(4.0)
    for scale in (1.0, 2.0):
        logits = torch.tensor([[0.0, ln3 / scale]])
        lp, ent, lse, expected = ops.logprobs_entropy_fwd(logits, torch.tensor([1]), scale)
        torch.testing.assert_close(lp, torch.tensor([ln3 - ln4]))
        torch.testing.assert_close(ent, torch.tensor([ln4 - 0.75 * ln3]))
        torch.testing.assert_close(lse, torch.tensor([ln4]))
        torch.testing.assert_close(expected, torch.tensor([0.75 * ln3]))
        one, zero = torch.ones(1), torch.zeros(1)
        d_lp = ops.logprobs_entropy_bwd(logits, torch.tensor([1]), lse, expected, one, zero, scale)
        d_h = ops.logprobs_entropy_bwd(logits, torch.tensor([1]), lse, expected, zero, one, scale)
        torch.testing.assert_close(d_lp, scale * torch.tensor([[-0.25, 0.25]]))
        torch.testing.assert_close(d_h, scale * torch.tensor([[3 / 16 * ln3, -3 / 16 * ln3]]))


@pytest.mark.usefixtures("needs_compiler")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [1.0, 1 / 0.7])
def test_loss_ops_match_logprobs_and_entropy(dtype, scale):
    """The fused output-layer loss (trainer/forward.py) against losses.logprobs_and_entropy in float64, at a
    vocabulary of SmolLM2's size plus a few (vector tails), rows 2 apart (a strided input): values within float32
    summation, the gradient within the rounding of its dtype, bit for bit the same on a second run and written in
    place."""
    ops = cpu_attention.loss_ops()
    assert ops is not None
    g = torch.Generator().manual_seed(0)
    n, vocab = 7, 49152 + 13
    logits = (torch.randn(2 * n, vocab, generator=g) * 4).to(dtype)[::2]
    labels = torch.randint(0, vocab, (n,), generator=g)
    g_lp, g_h = torch.randn(n, generator=g), torch.randn(n, generator=g)
    lp, ent, lse, expected = ops.logprobs_entropy_fwd(logits, labels, scale)
    ref_lp, ref_ent, ref_grad = _loss_reference(logits, labels, scale, g_lp, g_h)
    torch.testing.assert_close(lp.double(), ref_lp, rtol=0, atol=2e-5)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=0, atol=2e-5)
    grad = ops.logprobs_entropy_bwd(logits, labels, lse, expected, g_lp, g_h, scale)
    assert grad.dtype == dtype and grad.shape == logits.shape
    step = 1e-5 if dtype == torch.float32 else 2 ** -8
    assert float((grad.double() - ref_grad).abs().max()) <= step * float(ref_grad.abs().max())
    again = ops.logprobs_entropy_bwd(logits, labels, lse, expected, g_lp, g_h, scale)
    assert torch.equal(grad, again)
    # in place: the same gradient, written over the (strided) logits' own rows, the rows between them untouched
    base = logits._base
    between = base[1::2].clone()
    over = ops.logprobs_entropy_bwd(logits, labels, lse, expected, g_lp, g_h, scale, True)
    assert over.data_ptr() == logits.data_ptr() and over.stride() == logits.stride()
    assert torch.equal(over, grad) and torch.equal(base[::2], grad) and torch.equal(base[1::2], between)


@pytest.mark.usefixtures("needs_compiler")
def test_loss_ops_refuse_bad_inputs_with_a_clear_error():
    """A label outside the vocabulary, logits that are not [N, V] float32 or bf16, labels of another length or
    dtype: an error that names the op and what it takes."""
    ops = cpu_attention.loss_ops()
    assert ops is not None
    logits, labels = torch.randn(3, 10), torch.tensor([0, 9, 4])
    with pytest.raises(RuntimeError, match="logprobs_entropy: label 10 at row 1 is not in \\[0, 10\\)"):
        ops.logprobs_entropy_fwd(logits, torch.tensor([0, 10, 4]), 1.0)
    with pytest.raises(RuntimeError, match="logprobs_entropy: label -1 at row 0"):
        ops.logprobs_entropy_fwd(logits, torch.tensor([-1, 0, 4]), 1.0)
    with pytest.raises(RuntimeError, match="logprobs_entropy: logits \\[N, V\\]"):
        ops.logprobs_entropy_fwd(logits[None], labels, 1.0)
    with pytest.raises(RuntimeError, match="logprobs_entropy: logits \\[N, V\\]"):
        ops.logprobs_entropy_fwd(logits.t(), labels, 1.0)
    with pytest.raises(RuntimeError, match="logprobs_entropy: logits float32 or bfloat16"):
        ops.logprobs_entropy_fwd(logits.double(), labels, 1.0)
    with pytest.raises(RuntimeError, match="logprobs_entropy: labels contiguous int64 \\[N\\]"):
        ops.logprobs_entropy_fwd(logits, labels[:2], 1.0)
    with pytest.raises(RuntimeError, match="logprobs_entropy: labels contiguous int64 \\[N\\]"):
        ops.logprobs_entropy_fwd(logits, labels.int(), 1.0)
    _, _, lse, expected = ops.logprobs_entropy_fwd(logits, labels, 1.0)
    with pytest.raises(RuntimeError, match="logprobs_entropy_bwd: lse, expected and the gradients"):
        ops.logprobs_entropy_bwd(logits, labels, lse, expected, torch.ones(2), torch.ones(3), 1.0)


@pytest.mark.usefixtures("needs_compiler")
def test_the_segment_kernel_runs_exactly_where_the_cpu_has_avx512_bf16():
    """The bf16 training attention (trainer/attention.py) is in the AVX512 build only and asks the CPU: it says it
    runs where torch runs AVX512 and /proc/cpuinfo lists avx512_bf16, and nowhere else (the AVX2 build's child
    process included); where it does not, calling it is a clear error."""
    assert cpu_attention.kernel_available()
    ops = torch.ops.ragen_cpu_attention
    flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
    expected = "avx512_bf16" in flags and str(torch.backends.cpu.get_cpu_capability()) == "AVX512"
    assert ops.segment_attention_available() == expected
    if not expected:
        q = torch.zeros(1, 1, 4, 64, dtype=torch.bfloat16)
        with pytest.raises(RuntimeError, match="no AVX512-BF16"):
            ops.segment_attention_fwd(q, q, q, torch.zeros(1, 4, 3, dtype=torch.int32), 0.125)
