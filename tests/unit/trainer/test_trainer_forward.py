"""Chunked log-probs/entropy equal the full-logits computation, in value and gradient.

Run with ``python -m pytest tests/unit/trainer/test_trainer_forward.py -q``.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from ragen_core.models import tiny_random
from ragen_core.rollout.generators import cpu_attention
from ragen_core.trainer import forward
from ragen_core.trainer.forward import (
    ONE_PIECE_LOGITS_BYTES,
    PackedRows,
    backbone_tokens,
    chunked_logprobs,
    decoder_and_head,
    first_scored,
    group_batches,
    hidden_states,
    pack_pays,
    packed_group,
    packed_groups,
    policy_forward,
    shared_prefix_groups,
    shift_values,
    split_attention,
    split_pays,
)
from tests.conftest import require


def _full_reference(model, ids, attn, temperature):
    """The plain way: the whole [B, T, V] logits from model(), then log_softmax and entropy."""
    logits = model(input_ids=ids, attention_mask=attn.long()).logits.float() / temperature  # [B, T, V]
    logp_all = torch.log_softmax(logits[:, :-1], dim=-1)  # [B, T-1, V]
    lp = logp_all.gather(-1, ids[:, 1:, None]).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    zero = torch.zeros(ids.shape[0], 1)
    return torch.cat([zero, lp], 1), torch.cat([zero, ent], 1)


@pytest.fixture(params=["fused", "torch"])
def loss_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The output layer's loss on cpu_attention's fused kernel (where it builds: else the test skips, and fails
    under CI) or on losses.logprobs_and_entropy; returns the list that records the kernel's calls."""
    calls: list[int] = []
    if request.param == "torch":
        monkeypatch.setattr(cpu_attention, "loss_ops", lambda: None)
        return calls
    require(cpu_attention.loss_ops() is not None, "no C++ compiler to build the fused loss kernel")
    apply = forward._FusedLogprobsEntropy.apply
    monkeypatch.setattr(forward._FusedLogprobsEntropy, "apply", lambda *a: calls.append(1) or apply(*a))
    return calls


@pytest.mark.parametrize("chunk,one_piece_bytes", [(1, 0), (3, 0), (7, 0), (64, 0), (3, ONE_PIECE_LOGITS_BYTES)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_equals_full_logits_values_and_grads(chunk: int, one_piece_bytes: int, temperature: float,
                                                     loss_path: list[int], request: pytest.FixtureRequest) -> None:
    # one_piece_bytes=0 forces the chunks (and their recompute); the default takes these small logits whole.
    model, _ = tiny_random(0)
    model.train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 500, (3, 11), generator=g)
    attn = torch.ones(3, 11, dtype=torch.bool)
    attn[1, 8:] = False  # a right-padded row
    weights = torch.randn(3, 11, generator=g)  # an arbitrary downstream loss mixing both outputs

    lp_ref, ent_ref = _full_reference(model, ids, attn, temperature)
    ((lp_ref * weights).sum() + (ent_ref * weights).sum()).backward()
    grads_ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    out = policy_forward(model, ids, attn, temperature=temperature, chunk=chunk, one_piece_bytes=one_piece_bytes)
    ((out.logprobs * weights).sum() + (out.entropy * weights).sum()).backward()
    torch.testing.assert_close(out.logprobs, lp_ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out.entropy, ent_ref, atol=1e-6, rtol=1e-6)
    for p, g_ref in zip(model.parameters(), grads_ref, strict=True):
        # Values agree to 1e-6; gradients to float32 summation noise: the chunked backward sums the
        # output-layer gradient chunk by chunk, the plain one in one matmul (~1e-7 relative per term).
        scale = float(g_ref.abs().max()) + 1e-12
        assert float((p.grad - g_ref).abs().max()) <= 1e-5 * scale
    assert bool(loss_path) == ("fused" in request.node.callspec.id)  # the kernel ran exactly where it was on


def test_fused_loss_in_place_gradient_equals_the_fresh_one_and_a_second_use_fails_loudly() -> None:
    # The trainer's call writes the logits' gradient over its own logits: the same gradient as a fresh tensor,
    # and where something else saved those logits for its backward, autograd refuses instead of reading the
    # overwritten values.
    require(cpu_attention.loss_ops() is not None, "no C++ compiler to build the fused loss kernel")
    ops = cpu_attention.loss_ops()
    g = torch.Generator().manual_seed(0)
    source = torch.randn(5, 300, generator=g)
    labels = torch.randint(0, 300, (5,), generator=g)
    w_lp, w_ent = torch.randn(5, generator=g), torch.randn(5, generator=g)
    grads = []
    for in_place in (False, True):
        x = source.clone().requires_grad_(True)
        logits = x * 1.0  # a fresh tensor, as the output layer's
        lp, ent = forward._FusedLogprobsEntropy.apply(logits, labels, 0.7, ops, in_place)
        ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
        grads.append(x.grad)
    assert torch.equal(grads[0], grads[1])
    x = source.clone().requires_grad_(True)
    logits = x * 1.0
    square = logits.pow(2).sum()  # pow saves the logits too; its backward runs after the loss's
    lp, _ = forward._FusedLogprobsEntropy.apply(logits, labels, 0.7, ops, True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (lp.sum() + square).backward()


def test_the_logits_gradient_goes_in_place_only_inside_its_block(monkeypatch: pytest.MonkeyPatch) -> None:
    # The update's micro-batches run backward once (forward.logits_gradient_in_place); everywhere else (the
    # gradient-bucket analysis runs one backward per loss term through a retained graph) a fresh tensor.
    require(cpu_attention.loss_ops() is not None, "no C++ compiler to build the fused loss kernel")
    flags: list[bool] = []
    apply = forward._FusedLogprobsEntropy.apply
    monkeypatch.setattr(forward._FusedLogprobsEntropy, "apply", lambda *a: flags.append(a[4]) or apply(*a))
    model, _ = tiny_random(0)
    ids = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    attn = torch.ones_like(ids)
    decoder, head = decoder_and_head(model)
    for inside in (False, True, False):
        with forward.logits_gradient_in_place() if inside else contextlib.nullcontext():
            hidden = hidden_states(decoder, ids, attn)
            lp, ent = chunked_logprobs(hidden, ids, head)
            terms = [lp.sum(), ent.sum()]
            if inside:
                (terms[0] + terms[1]).backward()
            else:  # one backward per term through the retained graph, as the gradient-bucket analysis runs them
                torch.autograd.grad(terms[0], list(model.parameters()), retain_graph=True, allow_unused=True)
                torch.autograd.grad(terms[1], list(model.parameters()), allow_unused=True)
    assert flags == [False, True, False]


def test_alignment_position_zero_and_next_token() -> None:
    # logprobs[:, t] must score input_ids[:, t] from position t-1 (ragen_core.types convention).
    model, _ = tiny_random(0)
    ids = torch.tensor([[5, 9, 13, 2]])
    attn = torch.ones_like(ids, dtype=torch.bool)
    with torch.no_grad():
        out = policy_forward(model, ids, attn, chunk=2, one_piece_bytes=0)
        logits = model(input_ids=ids).logits
    assert out.logprobs[0, 0] == 0 and out.entropy[0, 0] == 0
    expected = torch.log_softmax(logits[0, 1], -1)[13]  # token at t=2 predicted from t=1
    torch.testing.assert_close(out.logprobs[0, 2], expected, atol=1e-6, rtol=0)


def test_entropy_grad_false_detaches_entropy_only() -> None:
    model, _ = tiny_random(0)
    ids = torch.randint(0, 300, (2, 6))
    out = policy_forward(model, ids, torch.ones_like(ids, dtype=torch.bool), chunk=2, entropy_grad=False,
                         one_piece_bytes=0)
    assert out.logprobs.requires_grad and not out.entropy.requires_grad


def test_no_grad_pass_has_no_graph_and_same_values() -> None:
    model, _ = tiny_random(0)
    ids = torch.randint(0, 300, (2, 9))
    attn = torch.ones_like(ids, dtype=torch.bool)
    with torch.no_grad():
        a = policy_forward(model, ids, attn, chunk=3, one_piece_bytes=0)
    b = policy_forward(model, ids, attn, chunk=3, one_piece_bytes=0)
    assert not a.logprobs.requires_grad
    assert torch.equal(a.logprobs, b.logprobs.detach())


def test_decoder_and_head_see_through_lora() -> None:
    from peft import LoraConfig, get_peft_model

    model, _ = tiny_random(0)
    decoder, head = decoder_and_head(model)
    ids = torch.randint(0, 300, (1, 5))
    attn = torch.ones_like(ids, dtype=torch.bool)
    h0 = hidden_states(decoder, ids, attn)
    peft_model = get_peft_model(model, LoraConfig(r=2, lora_alpha=2, target_modules="all-linear"))
    d2, h2 = decoder_and_head(peft_model)
    assert h2 is head  # the output layer is not adapted; the decoder carries the adapters
    # LoRA B starts at zero, so the adapted decoder gives the same hidden states at first.
    torch.testing.assert_close(hidden_states(d2, ids, attn), h0)


def test_shift_values() -> None:
    per_state = torch.tensor([[1.0, 2.0, 3.0]])
    assert torch.equal(shift_values(per_state), torch.tensor([[0.0, 1.0, 2.0]]))


def test_chunked_logprobs_uses_one_chunk_without_checkpoint_when_it_fits() -> None:
    # With a single chunk nothing is recomputed; the result still matches the multi-chunk path.
    model, _ = tiny_random(0)
    ids = torch.randint(0, 300, (2, 7))
    decoder, head = decoder_and_head(model)
    hidden = hidden_states(decoder, ids, torch.ones_like(ids, dtype=torch.bool))
    one = chunked_logprobs(hidden, ids, head, chunk=100)
    many = chunked_logprobs(hidden, ids, head, chunk=2, one_piece_bytes=0)
    torch.testing.assert_close(one[0], many[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(one[1], many[1], atol=1e-6, rtol=0)


def _grouped_batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Six right-padded rows: three share a 20-token prompt, two are identical (22 tokens), one shares nothing."""
    p1, p2 = torch.randint(0, 500, (20,), generator=g), torch.randint(0, 500, (18,), generator=g)
    rows = [torch.cat([p1, torch.randint(0, 500, (k,), generator=g)]) for k in (3, 5, 1)]
    rows += ([torch.cat([p2, torch.randint(0, 500, (4,), generator=g)])] * 2
             + [torch.randint(600, 700, (9,), generator=g)])
    order = [3, 0, 5, 1, 4, 2]  # groups interleaved, as data-parallel slicing may leave them
    rows = [rows[i] for i in order]
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    attn = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, : len(r)], attn[i, : len(r)] = r, True
    return ids, attn


def test_shared_prefix_groups_golden() -> None:
    ids, attn = _grouped_batch(torch.Generator().manual_seed(0))
    # Rows (after the shuffle): 0 and 4 are the identical 22-token rows: they share 21 tokens (each keeps
    # one of its own). Rows 1, 3, 5 share p1 (20 tokens); row 5 has 21 tokens, so the cap is 20 anyway.
    # Row 2 shares nothing (its tokens are drawn from 600-699): a group of one with prefix 0.
    assert shared_prefix_groups(ids, attn) == [([0, 4], 21), ([1, 3, 5], 20), ([2], 0)]
    # Below the minimum share nothing is grouped.
    assert all(p == 0 for _, p in shared_prefix_groups(ids, attn, min_shared=22))


def test_shared_prefix_groups_keep_two_prompts_apart() -> None:
    # Two prompt groups whose 30-token prompts share their first 20 tokens (a common system prompt), three
    # replies each. Row 3 shares 20 tokens with group [0, 1, 2] (prefix 30): joining would make those three
    # rows run 3 x 10 more tokens to save row 3 twenty, so it starts its own group.
    system, tails = list(range(1, 21)), [[500 + r, 600 + r, 700 + r] for r in range(6)]
    prompt_a, prompt_b = system + list(range(100, 110)), system + list(range(200, 210))
    rows = [prompt_a + t for t in tails[:3]] + [prompt_b + t for t in tails[3:]]
    ids, attn = torch.tensor(rows), torch.ones(6, 33, dtype=torch.bool)
    assert shared_prefix_groups(ids, attn) == [([0, 1, 2], 30), ([3, 4, 5], 30)]
    # A third row sharing 25 of a two-row group's 30 tokens joins it: the two rows run 2 x 5 more, it saves 25.
    near = prompt_a[:25] + list(range(300, 308))
    ids = torch.tensor([prompt_a + tails[0], prompt_a + tails[1], near])
    assert shared_prefix_groups(ids, torch.ones(3, 33, dtype=torch.bool)) == [([0, 1, 2], 25)]


def test_pack_pays_golden() -> None:
    # Costs in token units, a (query, key) pair costing 1/3000 of a token.
    # Tails 3, 5, 1 on a 20-token prefix: padded 3 x 5 x (1 + 25/3000) = 15.125, packed 9 x (1 + 29/3000)
    # = 9.087 < 0.9 x 15.125: pack.
    assert pack_pays([3, 5, 1], 20)
    # Equal tails: packing removes no padding and adds attention across rows.
    assert not pack_pays([4, 4], 18)
    assert not pack_pays([7], 20)  # one row: nothing to pack
    # A Bandit-like group: 8 replies of 10..48 tokens on a 190-token prefix (sum 208):
    # padded 8 x 48 x (1 + 238/3000) = 414.5, packed 208 x (1 + 398/3000) = 235.6: pack.
    assert pack_pays([48, 10, 20, 30, 25, 25, 30, 20], 190)
    # Multi-turn rows of 500..700 tokens on a 300-token prefix (sum 4900): padded 8 x 700 x (1 + 1000/3000)
    # = 7466.7; packed on the block mask 4900 x (1 + 5200/3000) = 13393, but its attention splits
    # (split_pays): 4900 + (sum t(300 + t) = 4,500,000 + 8 x 15,000) / 3000 = 6440 < 0.9 x 7466.7: pack.
    assert pack_pays([700, 500, 600, 600, 600, 600, 600, 700], 300)
    # Rows of nearly one length, 400..500 on 300 (sum 3650): padded 8 x 500 x (1 + 800/3000) = 5066.7, packed
    # and split 3650 + (2,769,500 + 120,000) / 3000 = 4613.2, over 0.9 x 5066.7 = 4560: padded.
    assert not pack_pays([400, 500, 450, 500, 420, 480, 460, 440], 300)


def _training_model(lora: bool) -> torch.nn.Module:
    """tiny_random(0) in training mode; with ``lora``, rank-2 adapters on every linear, B not zero (so they count)."""
    model, _ = tiny_random(0)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=2, lora_alpha=4, target_modules="all-linear",
                                                 init_lora_weights=False))
    return model.train()


@pytest.mark.parametrize("pack,split", [(True, False), (True, True), (False, False)])
@pytest.mark.parametrize("lora", [False, True])
def test_shared_prefix_forward_equals_plain_forward_values_and_grads(
    lora: bool, pack: bool, split: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Packed: the group [1, 3, 5] (tails 3, 5, 1) runs as one row, its prefix then its 9 own tokens (its attention
    # in one block-mask call, or split into the prefix's and each row's: free extra calls make the split pay);
    # the group of two equal tails stays padded. Not packed: every group's tails run padded on a repeated prefix.
    if not pack:
        monkeypatch.setattr(forward, "pack_pays", lambda tails, prefix: False)
    monkeypatch.setattr(forward, "SPLIT_CALL_PAIRS", 0 if split else 10**9)
    shapes: list[tuple[int, ...]] = []
    model = _training_model(lora)
    decoder, _ = decoder_and_head(model)
    decoder.register_forward_pre_hook(
        lambda mod, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    g = torch.Generator().manual_seed(0)
    ids, attn = _grouped_batch(g)
    weights = torch.randn(*ids.shape, decoder.config.hidden_size, generator=g) * attn[..., None]

    def run(shared: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad()
        if shared:
            hidden = hidden_states(decoder, ids, attn)
        else:
            hidden = decoder(input_ids=ids, attention_mask=attn.long(), use_cache=False).last_hidden_state
        (hidden * weights).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return (hidden * attn[..., None]).detach(), grads

    h_shared, g_shared = run(True)
    assert ((1, 20 + 9) in shapes) == pack  # the packed row: the 20-token prefix, then 3 + 5 + 1 own tokens
    assert forward.split_pays([3, 5, 1], 20) == split
    h_plain, g_plain = run(False)
    torch.testing.assert_close(h_shared, h_plain, atol=1e-5, rtol=1e-5)
    assert g_shared.keys() == g_plain.keys() and g_plain
    for name in g_plain:  # float rounding only: within 1e-5 of each gradient's own scale
        scale = float(g_plain[name].abs().max())
        assert float((g_shared[name] - g_plain[name]).abs().max()) <= 1e-5 * scale + 1e-7, name


def test_packed_rows_golden() -> None:
    # Tails 2 and 1 on a 2-token prefix: each row sees the whole prefix and its own earlier tokens.
    rows = PackedRows.of([2, 1], 2, torch.device("cpu"))
    assert rows.prefix == 2 and rows.lengths == (2, 1)
    assert rows.masks[0].tolist() == [[True, True, True, False], [True, True, True, True]]
    assert rows.masks[1].tolist() == [[True, True, True]]


@pytest.mark.parametrize("kv_heads", [1, 3])
def test_split_attention_equals_one_call_on_the_block_mask(kv_heads: int) -> None:
    # A packed row of a 5-token prefix and rows of 3, 1 and 4 own tokens; 3 query heads over 1 or 3 key/value
    # heads. Against one SDPA call on the whole [12, 12] block mask: outputs and the gradients of q, k, v.
    g = torch.Generator().manual_seed(0)
    prefix, tails, heads, d = 5, [3, 1, 4], 3, 8
    length = prefix + sum(tails)
    q = torch.randn(1, heads, length, d, generator=g, requires_grad=True)
    k = torch.randn(1, kv_heads, length, d, generator=g, requires_grad=True)
    v = torch.randn(1, kv_heads, length, d, generator=g, requires_grad=True)
    out_grad = torch.randn(1, length, heads, d, generator=g)
    segment = torch.repeat_interleave(torch.arange(len(tails)), torch.tensor(tails))  # [S] each token's row
    own = (segment[:, None] == segment[None, :]) & torch.ones(len(segment), len(segment), dtype=torch.bool).tril()
    mask = torch.zeros(length, length, dtype=torch.bool)
    mask[:prefix, :prefix] = torch.ones(prefix, prefix, dtype=torch.bool).tril()
    mask[prefix:, :prefix] = True
    mask[prefix:, prefix:] = own
    module = torch.nn.Module()
    module.num_key_value_groups = heads // kv_heads  # type: ignore[assignment]  # as transformers' attention has

    def run(split: bool) -> tuple[torch.Tensor, ...]:
        for t in (q, k, v):
            t.grad = None
        if split:
            out, _ = split_attention(module, q, k, v, None, packed_rows=PackedRows.of(tails, prefix, q.device))
        else:
            rep = heads // kv_heads
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1), attn_mask=mask).transpose(1, 2)
        (out * out_grad).sum().backward()
        return out.detach(), *(t.grad.clone() for t in (q, k, v))  # type: ignore[union-attr]

    for split, whole in zip(run(True), run(False), strict=True):
        torch.testing.assert_close(split, whole, atol=1e-5, rtol=1e-5)


def test_split_pays_golden() -> None:
    # A Bandit group, replies 26, 20, 30, 48, 15, 26, 22, 30 on a 187-token prompt: split 187²/2 + Σ t(187 + t)
    # = 17,484 + 47,144 + 8 × 15,000 = 184,628 pairs against 0.9 × 404² = 146,894: one call.
    assert not split_pays([26, 20, 30, 48, 15, 26, 22, 30], 187)
    # A FrozenLake group, rows 46, 505, 472, 172 on 196: 19,208 + 743,729 + 60,000 = 822,937 against
    # 0.9 × 1391² = 1,741,393: split.
    assert split_pays([46, 505, 472, 172], 196)
    # One row on its prefix: 50 + 600 + 15,000 = 15,650 against 0.9 × 30² = 810: the causal call's 900 pairs are
    # cheaper than another call.
    assert not split_pays([20], 10)


@pytest.mark.parametrize("split", [True, False])
def test_packed_group_runs_the_split_attention_and_restores_the_config(
    split: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The group [1, 3, 5] of _grouped_batch (prefix 20, tails 3, 5, 1). Split: per layer one causal call on the
    # prefix and one call a row on the prefix and its own tokens; else one call on the whole 29-token row.
    monkeypatch.setattr(forward, "split_pays", lambda tails, prefix: split)
    model, _ = tiny_random(0)
    decoder, _ = decoder_and_head(model)
    ids, attn = _grouped_batch(torch.Generator().manual_seed(0))
    calls: list[tuple[int, int, bool]] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counting(query: torch.Tensor, key: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        calls.append((query.shape[2], key.shape[2], bool(kwargs.get("is_causal", False))))
        return sdpa(query, key, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting)
    rows = torch.tensor([1, 3, 5])
    tails = attn[rows].sum(dim=1) - 20
    forward.packed_group(decoder, ids[rows], tails, 20)
    per_layer = [(20, 20, True), (3, 23, False), (5, 25, False), (1, 21, False)] if split else [(29, 29, False)]
    assert calls == per_layer * decoder.config.num_hidden_layers
    assert decoder.config._attn_implementation == "sdpa"
    with pytest.raises(RuntimeError, match="boom"):  # restored after a failing forward too
        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                            lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
        forward.packed_group(decoder, ids[rows], tails, 20)
    assert decoder.config._attn_implementation == "sdpa"


def test_shared_prefix_is_off_under_gradient_checkpointing() -> None:
    # Gradient checkpointing switches the KV cache off, so the rows must run whole.
    model, _ = tiny_random(0)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    decoder, _ = decoder_and_head(model)
    ids, attn = _grouped_batch(torch.Generator().manual_seed(0))
    plain = decoder(input_ids=ids, attention_mask=attn.long(), use_cache=False).last_hidden_state
    torch.testing.assert_close(hidden_states(decoder, ids, attn) * attn[..., None], plain * attn[..., None])


def test_chunked_logprobs_start_skips_the_prompt() -> None:
    model, _ = tiny_random(0)
    ids = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(2))
    decoder, head = decoder_and_head(model)
    hidden = hidden_states(decoder, ids, torch.ones_like(ids, dtype=torch.bool))
    full_lp, full_ent = chunked_logprobs(hidden, ids, head, chunk=2, one_piece_bytes=0)
    lp, ent = chunked_logprobs(hidden, ids, head, chunk=2, start=5, one_piece_bytes=0)
    assert torch.equal(lp[:, :5], torch.zeros(2, 5)) and torch.equal(ent[:, :5], torch.zeros(2, 5))
    torch.testing.assert_close(lp[:, 5:], full_lp[:, 5:], atol=1e-6, rtol=0)
    torch.testing.assert_close(ent[:, 5:], full_ent[:, 5:], atol=1e-6, rtol=0)


@pytest.mark.parametrize("one_piece_bytes", [ONE_PIECE_LOGITS_BYTES, 0])  # one piece; pieces, recomputed
def test_scored_positions_only_give_the_same_values_and_gradients(one_piece_bytes: int) -> None:
    # The loss mask of two multi-turn rows with padding: only its positions run the output layer. Values and
    # gradients (through the hidden states and the head) equal the full computation's on them; 0 elsewhere.
    model, _ = tiny_random(0)
    decoder, head = decoder_and_head(model)
    ids = torch.randint(0, 300, (2, 10), generator=torch.Generator().manual_seed(3))
    scored = torch.tensor([[0, 0, 1, 1, 0, 0, 1, 1, 1, 0], [1, 0, 0, 1, 1, 1, 0, 0, 0, 0]], dtype=torch.bool)
    weights = torch.randn(2, 10, generator=torch.Generator().manual_seed(4))
    results = []
    for only in (False, True):
        model.zero_grad()
        hidden = hidden_states(decoder, ids, torch.ones_like(ids, dtype=torch.bool))
        lp, ent = chunked_logprobs(hidden, ids, head, chunk=2, one_piece_bytes=one_piece_bytes,
                                   scored=scored if only else None)
        keep = scored.clone()
        keep[:, 0] = False  # position 0 is never scored
        ((lp + ent) * weights * keep).sum().backward()
        results.append((lp.detach(), ent.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    (full_lp, full_ent, full_grads), (lp, ent, grads) = results
    torch.testing.assert_close(lp * keep, full_lp * keep, atol=1e-6, rtol=0)
    torch.testing.assert_close(ent * keep, full_ent * keep, atol=1e-6, rtol=0)
    assert not lp[~keep].any() and not ent[~keep].any()
    assert len(grads) == len(full_grads) > 0
    for a, b in zip(grads, full_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_scored_positions_none_at_all() -> None:  # all zeros, and a graph that reaches the parameters
    model, _ = tiny_random(0)
    decoder, head = decoder_and_head(model)
    ids = torch.randint(0, 300, (2, 4))
    hidden = hidden_states(decoder, ids, torch.ones_like(ids, dtype=torch.bool))
    lp, ent = chunked_logprobs(hidden, ids, head, scored=torch.zeros(2, 4, dtype=torch.bool))
    assert torch.equal(lp, torch.zeros(2, 4)) and torch.equal(ent, torch.zeros(2, 4))
    (lp.sum() + ent.sum()).backward()  # a zero-weighted micro-batch still backpropagates (ZeRO pairs backwards)
    assert all(p.grad is not None and not p.grad.any() for p in head.parameters())


def test_first_scored() -> None:
    mask = torch.tensor([[False, False, False, True, True], [False, False, True, True, False]])
    assert first_scored(mask) == 2  # the earliest trained position over the rows
    assert first_scored(torch.zeros(2, 5, dtype=torch.bool)) == 1  # nothing trained: score everything
    assert first_scored(torch.ones(1, 3, dtype=torch.bool)) == 1  # position 0 is never scored


def test_shared_prefix_only_with_full_attention_everywhere() -> None:
    # A sliding-window cache crops what it keeps, so a repeated prefix would not be the full one.
    from ragen_core.trainer.forward import can_share

    model, _ = tiny_random(0)
    decoder, _ = decoder_and_head(model)
    assert can_share(decoder)
    n = decoder.config.num_hidden_layers
    decoder.config.layer_types = ["full_attention"] * (n - 1) + ["sliding_attention"]
    assert not can_share(decoder)
    decoder.config.layer_types = None
    decoder.config.sliding_window = 64
    assert not can_share(decoder)


def test_packing_only_with_attention_that_takes_a_4d_mask() -> None:
    # The packed row needs its block-diagonal mask applied as given; flash-attention kernels only read padding.
    from ragen_core.trainer.forward import can_pack

    model, _ = tiny_random(0)
    decoder, _ = decoder_and_head(model)
    assert decoder.config._attn_implementation == "sdpa" and can_pack(decoder)
    decoder.config._attn_implementation = "flash_attention_2"
    assert not can_pack(decoder)


def test_backbone_tokens_golden() -> None:
    # Three rows of 10, 12 and 8 tokens, padded to W = 12; rows 0 and 1 share a 6-token prefix (tails 4, 6).
    # Padded tails: the prefix once, then 2 x (12 - 6) = 12, and row 2 whole, padded: 6 + 12 + 12 = 30.
    assert backbone_tokens([10, 12, 8], [([0, 1], 6), ([2], 0)], pack=False) == 30
    # Packed: padded 2 x 6 x (1 + 12/3000) = 12.02, packed 10 x (1 + 16/3000) = 10.05 < 0.9 x 12.02, so the
    # tails run as one 4 + 6 row: 6 + 10 + 12 = 28.
    assert backbone_tokens([10, 12, 8], [([0, 1], 6), ([2], 0)], pack=True) == 28
    # No groups (the decoder cannot share): every row padded to W: 3 x 12.
    assert backbone_tokens([10, 12, 8], [], pack=True) == 36
    # A group with one row present (the rest of its group in another micro-batch) runs whole.
    assert backbone_tokens([10, 8], [([0], 6)], pack=True) == 20
    assert backbone_tokens([], [], pack=True) == 0


def test_group_batches_golden() -> None:
    # Longest first: 700 (0), 690 (3), 630 (1), 100 (2), 95 (4). 690 joins 700: 2 x 700 = 1400 <= 1.125 x 1390
    # = 1563.75; 630 too: 3 x 700 = 2100 <= 1.125 x 2020 = 2272.5; 100 does not: 4 x 700 = 2800 > 1.125 x 2120
    # = 2385, so it starts a batch, and 95 joins it: 2 x 100 = 200 <= 1.125 x 195 = 219.4.
    assert group_batches([700, 630, 100, 690, 95]) == [[0, 3, 1], [2, 4]]
    # No padding allowed: only equal lengths go together, ties in index order.
    assert group_batches([5, 4, 5], padding=0.0) == [[0, 2], [1]]
    assert group_batches([7]) == [[0]]
    assert group_batches([]) == []


def test_backbone_tokens_counts_packed_groups_as_they_run_together() -> None:
    # Two prompt groups on different 4-token prefixes, each packed (short uneven tails under a long budget of
    # padding): rows 0-2 (lengths 10, 6, 5: tails 6, 2, 1, packed 4 + 9 = 13) and rows 3-5 (lengths 9, 8, 5:
    # tails 5, 4, 1, packed 4 + 10 = 14). group_batches runs them together padded to 14: 2 x 14 = 28, within
    # 1/8 of their 27 real positions.
    lengths = [10, 6, 5, 9, 8, 5]
    groups = [([0, 1, 2], 4), ([3, 4, 5], 4)]
    assert pack_pays([6, 2, 1], 4) and pack_pays([5, 4, 1], 4)
    assert group_batches([13, 14]) == [[1, 0]]
    assert backbone_tokens(lengths, groups, pack=True) == 28
    # Padded instead: each prefix once, then 3 x (W - 4) = 18: 2 x 22 = 44.
    assert backbone_tokens(lengths, groups, pack=False) == 44


def _two_packed_groups(g: torch.Generator) -> tuple[list[tuple[torch.Tensor, torch.Tensor, int]], int]:
    """Two prompt groups as hidden_states hands them to packed_group: (ids [n, T], tails [n], prefix), one width T."""
    width = 30
    groups = []
    for prefix, tails in ((12, (3, 9, 1, 5)), (17, (13, 2, 6))):
        ids = torch.randint(0, 500, (len(tails), width), generator=g)
        ids[:, :prefix] = ids[0, :prefix]
        groups.append((ids, torch.tensor(tails), prefix))
    return groups, width


@pytest.mark.parametrize("lora", [False, True])
def test_packed_groups_run_together_equal_each_group_alone(lora: bool) -> None:
    # Two packed rows (12 + 18 and 17 + 21 tokens) as one batch of 2 padded to 38, on torch's sdpa with the
    # dense mask: each group's hidden states and every gradient equal the group's own packed_group call within
    # float rounding, and the padding changes nothing.
    model = _training_model(lora)
    decoder, _ = decoder_and_head(model)
    g = torch.Generator().manual_seed(0)
    groups, width = _two_packed_groups(g)
    weights = [torch.randn(ids.shape[0], width, decoder.config.hidden_size, generator=g) for ids, _, _ in groups]
    shapes: list[tuple[int, ...]] = []
    decoder.register_forward_pre_hook(lambda mod, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)),
                                      with_kwargs=True)

    def run(together: bool) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
        model.zero_grad()
        outs = packed_groups(decoder, groups) if together else [packed_group(decoder, *job) for job in groups]
        sum((out * w).sum() for out, w in zip(outs, weights, strict=True)).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return [out.detach() for out in outs], grads

    together, g_together = run(True)
    assert shapes == [(2, 38)]
    alone, g_alone = run(False)
    assert shapes[1:] == [(1, 30), (1, 38)]
    for (ids, tails, prefix), a, b in zip(groups, together, alone, strict=True):
        assert a.shape == b.shape == (ids.shape[0], width, decoder.config.hidden_size)
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        assert not a[torch.arange(width)[None, :] >= prefix + tails[:, None]].any()  # zeros at padding
    assert g_together.keys() == g_alone.keys() and g_alone
    for name in g_alone:
        scale = float(g_alone[name].abs().max())
        assert float((g_together[name] - g_alone[name]).abs().max()) <= 1e-5 * scale + 1e-7, name
    assert len(packed_groups(decoder, groups[:1])) == 1 and shapes[-1] == (1, 30)  # one group: packed_group


@pytest.mark.parametrize("pack", [True, False])
def test_backbone_tokens_counts_what_hidden_states_runs(pack: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # The micro-batch budget (trainer.micro_batch_tokens) counts tokens with backbone_tokens: it must be the
    # token positions hidden_states really feeds the decoder. _grouped_batch, W = 25: group [0, 4] (prefix 21,
    # tails 1, 1: padded) 21 + 2 x 4 = 29; group [1, 3, 5] (prefix 20, tails 3, 5, 1) 20 + 9 = 29 packed or
    # 20 + 3 x 5 = 35 padded; row 2 whole: 25. So 83 packed, 89 padded.
    if not pack:
        monkeypatch.setattr(forward, "pack_pays", lambda tails, prefix: False)
    model, _ = tiny_random(0)
    decoder, _ = decoder_and_head(model)
    fed: list[int] = []
    decoder.register_forward_pre_hook(lambda mod, args, kwargs: fed.append(kwargs["input_ids"].numel()),
                                      with_kwargs=True)
    ids, attn = _grouped_batch(torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden_states(decoder, ids, attn)
    lengths = attn.sum(dim=1).tolist()
    expected = backbone_tokens(lengths, shared_prefix_groups(ids, attn), pack=forward.can_pack(decoder))
    assert sum(fed) == expected == (83 if pack else 89)
