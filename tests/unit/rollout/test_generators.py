"""Tests of the Generator protocol, the sampling functions and the hf backend on the tiny model.

Run: python -m pytest tests/unit/rollout/test_generators.py -q
The default-model versions of the cache-reuse checks are in test_generators_default_model.py (slow).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from ragen_core.models import tiny_random
from ragen_core.rollout.generators import Generation, Generator, SamplingParams, make_generator
from ragen_core.rollout.generators.hf import HFGenerator
from ragen_core.rollout.generators.sampling import row_seed, sample_from_logits


@pytest.fixture(scope="module")
def tiny():
    model, tokenizer = tiny_random(0)
    return model, tokenizer


def _prompts(tokenizer, texts):
    return [tokenizer.encode(t) for t in texts]


TEXTS = [
    "You are a helpful assistant. Turn 1: State: P _ O G",
    "short",
    "Instruction: reach the goal without falling into a hole; actions Left, Down, Right, Up",
]


def teacher_forced_logprobs(model, prompt, continuation, temperature=1.0):
    """log_softmax(logits / T) of ``continuation`` after ``prompt`` from one plain full forward."""
    ids = torch.tensor([list(prompt) + list(continuation)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1]  # [N, V] predicts continuation[i]
    logp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    return logp.gather(1, torch.tensor(continuation)[:, None]).squeeze(1)


# ---------------------------------------------------------------- records


def test_sampling_params_validate_and_normalise():
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)
    for bad in ({"temperature": -0.1}, {"top_p": 0.0}, {"top_p": 1.5}, {"max_new_tokens": 0}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_make_generator_backends(tiny):
    model, tokenizer = tiny
    gen = make_generator("hf", model, tokenizer)
    assert isinstance(gen, HFGenerator) and isinstance(gen, Generator)
    with pytest.raises(ValueError, match="unknown generation backend"):
        make_generator("nope", model, tokenizer)


# ---------------------------------------------------------------- sampling golden values


def test_sample_from_logits_inverse_cdf_golden():
    # p = [0.5, 0.3, 0.2] -> CDF [0.5, 0.8, 1.0]; u=0.1 -> id 0, u=0.6 -> id 1, u=0.85 -> id 2
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]] * 3))
    ids, lps = sample_from_logits(logits, 1.0, 1.0, torch.tensor([0.1, 0.6, 0.85]))
    assert ids.tolist() == [0, 1, 2]
    assert torch.allclose(lps, torch.log(torch.tensor([0.5, 0.3, 0.2])), atol=1e-6)


def test_sample_from_logits_top_p_not_renormalised_golden():
    # top_p=0.7 over p=[0.5, 0.3, 0.2]: mass before each sorted id is [0, 0.5, 0.8] -> keep {0, 1};
    # nucleus CDF [0.5, 0.8]; u=0.9 -> target 0.72 -> id 1, reported log 0.3 (not log 0.3/0.8)
    logits = torch.log(torch.tensor([[0.2, 0.5, 0.3]]))  # same p, shuffled ids: id 1 is 0.5, id 2 is 0.3
    ids, lps = sample_from_logits(logits, 1.0, 0.7, torch.tensor([0.9]))
    assert ids.tolist() == [2]
    assert lps.item() == pytest.approx(math.log(0.3), abs=1e-6)
    # u=0.999 still never reaches the excluded id 0 (p=0.2)
    ids, _ = sample_from_logits(logits, 1.0, 0.7, torch.tensor([0.999]))
    assert ids.tolist() == [2]


def test_sample_from_logits_temperature_and_greedy_golden():
    # T=2 over p=[0.5, 0.3, 0.2]: softmax(log p / 2) ∝ sqrt(p) = [0.70711, 0.54772, 0.44721], sum 1.70204
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    ids, lps = sample_from_logits(logits, 2.0, 1.0, torch.tensor([0.0]))
    assert ids.tolist() == [0]
    assert lps.item() == pytest.approx(math.log(0.70711 / 1.70204), abs=1e-4)
    # greedy: argmax, log-prob under the untempered softmax
    ids, lps = sample_from_logits(logits, 0.0, 1.0, torch.tensor([0.99]))
    assert ids.tolist() == [0] and lps.item() == pytest.approx(math.log(0.5), abs=1e-6)


@pytest.mark.parametrize("vocab", [3, 1024, 2500, 49152])
def test_block_inverse_cdf_picks_what_one_float64_cumsum_picks(vocab: int):
    """sampling._inverse_cdf_by_blocks against the plain lookup (float64 cumulative sum over the whole
    vocabulary, first CDF above u x total): the same id for every row and uniform, over flat, peaked and
    sparse distributions (ids of probability 0 between likely ones, a vocabulary not a multiple of the
    block), and never an id of probability 0."""
    from ragen_core.rollout.generators.sampling import _inverse_cdf_by_blocks

    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=g) * torch.tensor([0.1, 1.0, 3.0, 8.0, 1.0, 1.0])[:, None]
    logits[4, torch.randperm(vocab, generator=g)[: vocab // 2]] = float("-inf")  # half the ids impossible
    logits[5] = float("-inf")
    logits[5, torch.randperm(vocab, generator=g)[:2]] = 0.0  # two likely ids, far apart
    probs = torch.softmax(logits, dim=-1)
    for u in [0.0, 1e-9, 0.25, 0.5, 0.999999, *torch.rand(20, generator=g, dtype=torch.float64).tolist()]:
        uniforms = torch.full((6,), u, dtype=torch.float64)
        cdf = probs.double().cumsum(dim=-1)
        want = torch.searchsorted(cdf, (uniforms * cdf[:, -1])[:, None], right=True).clamp(max=vocab - 1).squeeze(1)
        got, total = _inverse_cdf_by_blocks(probs, uniforms)
        torch.testing.assert_close(total, cdf[:, -1])
        assert got.tolist() == want.tolist(), u
        assert bool((probs.gather(1, got[:, None]) > 0).all())


def test_row_seed_is_stable_and_distinct():
    assert row_seed(7, 0) == row_seed(7, 0)
    assert len({row_seed(7, i) for i in range(100)} | {row_seed(8, 0)}) == 101


# ---------------------------------------------------------------- hf backend


def test_shapes_lengths_and_logprobs_match_teacher_forcing(tiny):
    model, tokenizer = tiny
    prompts = _prompts(tokenizer, TEXTS)
    params = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=9, seed=3)
    out = HFGenerator(model, tokenizer).generate(prompts, params)
    assert len(out) == len(prompts)
    for prompt, gen in zip(prompts, out, strict=True):
        assert isinstance(gen, Generation)
        assert len(gen.token_ids) == len(gen.logprobs) == 9 and gen.finish_reason == "length"
        expected = teacher_forced_logprobs(model, prompt, gen.token_ids, temperature=0.7)
        assert torch.allclose(torch.tensor(gen.logprobs), expected, atol=1e-5)


def test_greedy_is_argmax_of_full_forward(tiny):
    model, tokenizer = tiny
    prompts = _prompts(tokenizer, TEXTS)
    out = HFGenerator(model, tokenizer).generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=6))
    for prompt, gen in zip(prompts, out, strict=True):
        ids = list(prompt)
        for tok in gen.token_ids:  # plain greedy loop without any cache
            with torch.no_grad():
                nxt = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            assert nxt == tok
            ids.append(nxt)


def test_stop_token_ends_row_and_is_included(tiny):
    model, tokenizer = tiny
    prompts = _prompts(tokenizer, TEXTS)
    params = SamplingParams(max_new_tokens=12, seed=11)
    free = HFGenerator(model, tokenizer).generate(prompts, params)
    # stop at the 4th token sampled by row 0: with the same seed the streams agree up to that point
    stop = free[0].token_ids[3]
    k = free[0].token_ids.index(stop)
    stopped = HFGenerator(model, tokenizer).generate(
        prompts, SamplingParams(max_new_tokens=12, seed=11, stop_token_ids=(stop,))
    )
    assert stopped[0].token_ids == free[0].token_ids[: k + 1]
    assert stopped[0].finish_reason == "stop"
    assert stopped[0].logprobs == pytest.approx(free[0].logprobs[: k + 1], abs=1e-5)
    for f, s in zip(free[1:], stopped[1:], strict=True):  # other rows: cut at their own first stop, if any
        cut = f.token_ids.index(stop) + 1 if stop in f.token_ids else len(f.token_ids)
        assert s.token_ids == f.token_ids[:cut]
        assert s.finish_reason == ("stop" if stop in f.token_ids else "length")


def test_seeded_reproducible_and_seed_matters(tiny):
    model, tokenizer = tiny
    prompts = _prompts(tokenizer, TEXTS)
    gen = HFGenerator(model, tokenizer)
    a = gen.generate(prompts, SamplingParams(max_new_tokens=8, seed=5))
    b = gen.generate(prompts, SamplingParams(max_new_tokens=8, seed=5))
    c = gen.generate(prompts, SamplingParams(max_new_tokens=8, seed=6))
    assert [g.token_ids for g in a] == [g.token_ids for g in b]
    assert [g.token_ids for g in a] != [g.token_ids for g in c]


def test_row_result_independent_of_batch_neighbours(tiny):
    model, tokenizer = tiny
    target = tokenizer.encode("State: _ _ P G, what do you do?")
    params = SamplingParams(max_new_tokens=10, seed=21)
    gen = HFGenerator(model, tokenizer)
    alone = gen.generate([target], params)[0]
    # row 0 keeps its stream; neighbours of other lengths change the padding of the batch
    crowded = gen.generate([target, *_prompts(tokenizer, TEXTS)], params)[0]
    assert crowded.token_ids == alone.token_ids
    assert crowded.logprobs == pytest.approx(alone.logprobs, abs=1e-5)


def test_max_length_caps_generation_and_rejects_long_prompts(tiny):
    model, tokenizer = tiny
    gen = HFGenerator(model, tokenizer, max_length=20)
    prompt = list(range(5, 5 + 16))  # 16 tokens: room for 4 more
    out = gen.generate([prompt], SamplingParams(max_new_tokens=10, seed=0))[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"
    with pytest.raises(ValueError, match="context"):
        gen.generate([list(range(5, 25))], SamplingParams(max_new_tokens=1))
    # a rejected call leaves the kept caches alone
    gen.generate([prompt[:8]], SamplingParams(max_new_tokens=2), session_ids=["kept"])
    with pytest.raises(ValueError, match="context"):
        gen.generate([prompt[:9], list(range(5, 25))], SamplingParams(max_new_tokens=1), session_ids=["kept", "x"])
    assert gen.cached_sessions == 1


def test_bad_session_ids_rejected(tiny):
    model, tokenizer = tiny
    gen = HFGenerator(model, tokenizer)
    with pytest.raises(ValueError, match="distinct"):
        gen.generate([[5, 6], [7, 8]], SamplingParams(max_new_tokens=1), session_ids=["a", "a"])
    with pytest.raises(ValueError, match="session ids"):
        gen.generate([[5, 6], [7, 8]], SamplingParams(max_new_tokens=1), session_ids=["a"])


def _multi_turn(gen, tokenizer, turns=3, seed=0, stop=None, mutate=None):
    """Run ``turns`` simulated turns: each appends the reply and a fake user message of varying length.

    Returns the generations of every turn. ``mutate(turn, contexts)`` may rewrite contexts between turns.
    """
    contexts = _prompts(tokenizer, TEXTS)
    sessions = ["ep0", "ep1", "ep2"]
    history = []
    for turn in range(turns):
        params = SamplingParams(
            temperature=1.0, max_new_tokens=7, seed=seed + turn, stop_token_ids=stop or ()
        )
        out = gen.generate(contexts, params, session_ids=sessions)
        history.append(out)
        user = tokenizer.encode(f"<|im_end|>\nTurn {turn + 2}: reward 0.0. State: P _ O G")
        contexts = [
            c + list(g.token_ids) + user[: 4 + 3 * i]
            for i, (c, g) in enumerate(zip(contexts, out, strict=True))
        ]
        if mutate is not None:
            contexts = mutate(turn, contexts)
    return history


def _assert_same(history_a, history_b, atol=1e-4):
    for turn_a, turn_b in zip(history_a, history_b, strict=True):
        for a, b in zip(turn_a, turn_b, strict=True):
            assert a.token_ids == b.token_ids
            assert a.finish_reason == b.finish_reason
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) <= atol


def test_cache_reuse_matches_full_reprefill_over_three_turns(tiny):
    model, tokenizer = tiny
    reuse = HFGenerator(model, tokenizer, cache_reuse=True)
    naive = HFGenerator(model, tokenizer, cache_reuse=False)
    _assert_same(_multi_turn(reuse, tokenizer), _multi_turn(naive, tokenizer))
    # the reuse path was really taken: turns 2 and 3 prefilled only their suffixes
    assert reuse.stats["reused_tokens"] > 0 and naive.stats["reused_tokens"] == 0
    assert reuse.stats["prefill_tokens"] < naive.stats["prefill_tokens"] / 2
    assert reuse.cached_sessions == 3
    reuse.end_sessions(["ep0", "ep1", "ep2", "unknown"])
    assert reuse.cached_sessions == 0


def test_a_last_turn_keeps_no_cache_and_still_reuses_the_kept_ones(tiny):
    """SamplingParams.last_turn (the rollout loop's last allowed turn): the call reuses the caches its sessions
    kept, samples what it would otherwise, and keeps none for a next turn (copying them out is wasted work)."""
    model, tokenizer = tiny
    gen, other = HFGenerator(model, tokenizer), HFGenerator(model, tokenizer)
    contexts, sessions = _prompts(tokenizer, TEXTS), ["ep0", "ep1", "ep2"]
    first = SamplingParams(temperature=1.0, max_new_tokens=5, seed=1)
    out = gen.generate(contexts, first, session_ids=sessions)
    assert other.generate(contexts, first, session_ids=sessions) == out
    assert gen.cached_sessions == 3
    longer = [c + list(g.token_ids) + [7, 8, 9] for c, g in zip(contexts, out, strict=True)]
    last = dataclasses.replace(first, seed=2, last_turn=True)
    got = gen.generate(longer, last, session_ids=sessions)
    assert gen.stats["reused_tokens"] > 0 and gen.cached_sessions == 0
    want = other.generate(longer, dataclasses.replace(last, last_turn=False), session_ids=sessions)
    assert [g.token_ids for g in got] == [g.token_ids for g in want] and other.cached_sessions == 3


def test_cache_reuse_logprobs_equal_a_full_prefill_by_teacher_forcing(tiny):
    # the cache-reuse criterion, independent of sampling: each turn's sampled tokens scored by one plain forward
    model, tokenizer = tiny
    gen = HFGenerator(model, tokenizer)
    contexts = _prompts(tokenizer, TEXTS)
    for turn in range(3):
        out = gen.generate(contexts, SamplingParams(max_new_tokens=7, seed=turn), session_ids=["a", "b", "c"])
        for prompt, g in zip(contexts, out, strict=True):
            full = teacher_forced_logprobs(model, prompt, g.token_ids)
            assert torch.allclose(torch.tensor(g.logprobs), full, atol=1e-5)
        user = tokenizer.encode(f"<|im_end|>\nTurn {turn + 2}: State: P _ O G")
        contexts = [
            c + list(g.token_ids) + user[: 5 + i] for i, (c, g) in enumerate(zip(contexts, out, strict=True))
        ]
    assert gen.stats["reused_tokens"] > 0


def test_cache_reuse_falls_back_when_prompt_does_not_extend_cache(tiny):
    model, tokenizer = tiny

    def drop_middle(turn, contexts):  # like the context guard dropping an old turn in row 1
        return [c if i != 1 else c[:2] + c[6:] for i, c in enumerate(contexts)]

    reuse = HFGenerator(model, tokenizer)
    naive = HFGenerator(model, tokenizer, cache_reuse=False)
    _assert_same(
        _multi_turn(reuse, tokenizer, mutate=drop_middle), _multi_turn(naive, tokenizer, mutate=drop_middle)
    )


def test_cache_reuse_with_batch_shrinking_and_chunked_prefill(tiny):
    model, tokenizer = tiny
    naive = HFGenerator(model, tokenizer, cache_reuse=False, shrink_below=0.0)
    stop = _multi_turn(naive, tokenizer)[0][0].token_ids[
        2
    ]  # a token rows really sample: they end at different steps
    naive = HFGenerator(model, tokenizer, cache_reuse=False, shrink_below=0.0)
    # shrink the batch as soon as one row is done, and prefill in tiny groups of rows
    eager = HFGenerator(model, tokenizer, shrink_below=1.0, prefill_chunk_tokens=16)
    expected = _multi_turn(naive, tokenizer, stop=(stop,))
    assert any(g.finish_reason == "stop" for turn in expected for g in turn)
    _assert_same(_multi_turn(eager, tokenizer, stop=(stop,)), expected)
    assert eager.stats["reused_tokens"] > 0


@pytest.mark.parametrize("fast", [True, False])
def test_chunked_prefill_of_prompt_groups_equals_one_chunk(tiny, fast):
    """Prompt groups (each prompt twice) over three turns, prefilled in groups of a few tokens: the prefill groups
    take the rows sorted by length, not in the call's order, and each row still gets its own replies and log-probs
    (the fast step builds each group's cache in the decode buffers; ``model.forward``'s is copied in)."""
    model, tokenizer = tiny

    def run(gen):
        contexts = [p for p in _prompts(tokenizer, TEXTS) for _ in range(2)]
        user = tokenizer.encode("<|im_end|>\nTurn 2: reward 0.0. State: P _ O G")
        history = []
        for turn in range(3):
            out = gen.generate(contexts, SamplingParams(temperature=1.0, max_new_tokens=6, seed=turn),
                               session_ids=list(range(len(contexts))))
            history.append(out)
            contexts = [c + list(g.token_ids) + user[: 2 + 5 * (i % 3)]
                        for i, (c, g) in enumerate(zip(contexts, out, strict=True))]
        return history

    chunked = HFGenerator(model, tokenizer, fast_decode=fast, prefill_chunk_tokens=16)
    _assert_same(run(chunked), run(HFGenerator(model, tokenizer, fast_decode=fast)))
    assert chunked.stats["shared_prompt_tokens"] > 0 and chunked.stats["reused_tokens"] > 0


def test_cache_eviction_keeps_outputs_equal(tiny):
    model, tokenizer = tiny
    small = HFGenerator(model, tokenizer, max_cached_bytes=1)  # every cache is evicted at once
    naive = HFGenerator(model, tokenizer, cache_reuse=False)
    _assert_same(_multi_turn(small, tokenizer), _multi_turn(naive, tokenizer))
    assert small.cached_sessions == 0 and small.stats["reused_tokens"] == 0


def test_in_place_weight_change_invalidates_caches(tiny):
    _, tokenizer = tiny
    model, _ = tiny_random(0)
    gen = HFGenerator(model, tokenizer)
    prompts = _prompts(tokenizer, TEXTS)
    params = SamplingParams(max_new_tokens=5, seed=1)
    first = gen.generate(prompts, params, session_ids=[0, 1, 2])
    with torch.no_grad():  # what an optimizer step on a shared model does
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    nxt = [p + list(g.token_ids) for p, g in zip(prompts, first, strict=True)]
    reused_before = gen.stats["reused_tokens"]
    got = gen.generate(nxt, params, session_ids=[0, 1, 2])
    assert gen.stats["reused_tokens"] == reused_before  # stale caches were not used
    fresh = HFGenerator(model, tokenizer, cache_reuse=False).generate(nxt, params)
    _assert_same([got], [fresh], atol=1e-5)


def test_update_weights_copies_another_model(tiny):
    _, tokenizer = tiny
    mine, _ = tiny_random(0)
    other, _ = tiny_random(1)
    prompts = _prompts(tokenizer, TEXTS)
    params = SamplingParams(max_new_tokens=6, seed=2)
    gen = HFGenerator(mine, tokenizer)
    before = gen.generate(prompts, params, session_ids=["a", "b", "c"])
    gen.update_weights(other)
    assert gen.cached_sessions == 0
    after = gen.generate(prompts, params)
    expected = HFGenerator(other, tokenizer).generate(prompts, params)
    _assert_same([after], [expected], atol=1e-6)
    assert [g.token_ids for g in after] != [g.token_ids for g in before]


def test_training_mode_is_restored(tiny):
    _, tokenizer = tiny
    model, _ = tiny_random(0)
    model.train()
    HFGenerator(model, tokenizer).generate([[5, 6, 7]], SamplingParams(max_new_tokens=2))
    assert model.training


def test_identical_prompts_are_prefilled_once(tiny):
    # a prompt group's N members share their first prompt: it is prefilled once, sampled N times
    model, tokenizer = tiny
    same = tokenizer.encode(TEXTS[0])
    prompts = [same, tokenizer.encode(TEXTS[1]), same, same]
    gen = HFGenerator(model, tokenizer)
    out = gen.generate(prompts, SamplingParams(max_new_tokens=6, seed=4))
    assert gen.stats["shared_prompt_tokens"] == 2 * len(same)
    assert gen.stats["prefill_tokens"] == len(same) + len(prompts[1])
    assert len({g.token_ids for g in out}) == 4  # own streams: the copies sample differently
    for prompt, g in zip(prompts, out, strict=True):
        assert torch.allclose(
            torch.tensor(g.logprobs), teacher_forced_logprobs(model, prompt, g.token_ids), atol=1e-5
        )


def _opening_alike(tokenizer):
    """Prompts as one env's first turns: a long shared opening, then different states (two of them twice, as
    prompt groups), and one unrelated prompt."""
    opening = tokenizer.encode(TEXTS[2] + ". " + TEXTS[0] + ". Answer in <answer></answer>.")
    states = [tokenizer.encode(f" Seed {s}: state {board}") for s, board in ((1, "P _ O G"), (2, "_ _ P G H H"),
                                                                             (3, "G"))]
    a, b, c = (opening + s for s in states)
    return opening, [a, b, a, tokenizer.encode(TEXTS[1]), c, b]


@pytest.mark.parametrize(("fast", "chunk"), [(True, 8192), (False, 8192), (True, 48), (False, 48)])
def test_prompts_that_open_alike_prefill_their_common_prefix_once(tiny, fast, chunk, monkeypatch):
    """Different first-turn prompts with a common opening (one env's instructions) prefill it once and reuse it
    as a kept cache: the same replies and log-probs as prefilling each prompt whole, over three turns of kept
    caches, in one prefill group or in several (``prefill_chunk_tokens``)."""
    from ragen_core.rollout.generators import hf

    model, tokenizer = tiny
    opening, prompts = _opening_alike(tokenizer)
    assert len(opening) > hf.COMMON_PREFIX_MIN

    def run(gen):
        contexts, history = [list(p) for p in prompts], []
        user = tokenizer.encode("<|im_end|>\nTurn 2: reward 0.0. State: P _ O G")
        for turn in range(3):
            out = gen.generate(contexts, SamplingParams(temperature=1.0, max_new_tokens=6, seed=turn),
                               session_ids=list(range(len(contexts))))
            history.append(out)
            contexts = [c + list(g.token_ids) + user for c, g in zip(contexts, out, strict=True)]
        return history

    shared = HFGenerator(model, tokenizer, fast_decode=fast, prefill_chunk_tokens=chunk)
    history = run(shared)
    n = len(opening) + _common_prefix_len([prompts[0][len(opening):], prompts[1][len(opening):],
                                          prompts[4][len(opening):]])
    distinct = [prompts[0], prompts[1], prompts[4]]
    assert shared.stats["common_prefix_tokens"] == 2 * n  # three distinct prompts open alike: two skip it
    first_turn = n + sum(len(p) - n for p in distinct) + len(prompts[3])
    assert shared.stats["prefill_tokens"] > first_turn  # and the later turns' suffixes
    for prompt, g in zip(prompts, history[0], strict=True):
        assert torch.allclose(torch.tensor(g.logprobs), teacher_forced_logprobs(model, prompt, g.token_ids),
                              atol=1e-5)
    monkeypatch.setattr(hf, "COMMON_PREFIX_MIN", 1 << 30)  # every prompt prefilled whole
    whole = HFGenerator(model, tokenizer, fast_decode=fast, prefill_chunk_tokens=chunk)
    _assert_same(history, run(whole), atol=1e-5)
    assert whole.stats["common_prefix_tokens"] == 0
    assert whole.stats["prefill_tokens"] == shared.stats["prefill_tokens"] + 2 * n  # n once against three times


def test_first_turn_prefill_counts_the_common_prefix_once(tiny):
    model, tokenizer = tiny
    opening, prompts = _opening_alike(tokenizer)
    gen = HFGenerator(model, tokenizer)
    gen.generate(prompts, SamplingParams(max_new_tokens=3, seed=1))
    distinct = [prompts[0], prompts[1], prompts[4]]
    n = len(opening) + _common_prefix_len([p[len(opening):] for p in distinct])
    assert gen.stats["prefill_tokens"] == n + sum(len(p) - n for p in distinct) + len(prompts[3])
    assert gen.stats["common_prefix_tokens"] == 2 * n
    assert gen.stats["shared_prompt_tokens"] == len(prompts[0]) + len(prompts[1])


def _common_prefix_len(seqs):
    n = min(len(s) for s in seqs)
    return next((i for i in range(n) if len({s[i] for s in seqs}) > 1), n)


def test_gqa_attention_matches_sdpa_on_padded_batch_and_restores_config(tiny):
    from ragen_core.rollout.generators.attention import gqa_attention

    model, _ = tiny
    ids = torch.randint(5, 800, (3, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding
    mask[1, 5:8] = 0  # a hole, as cache reuse makes
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    assert model.config._attn_implementation == "sdpa"
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        with gqa_attention(model):
            assert model.config._attn_implementation != "sdpa"
            got = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    assert model.config._attn_implementation == "sdpa"
    assert torch.allclose(got[mask.bool()], want[mask.bool()], atol=1e-6)


def test_streams_name_each_rows_random_stream():
    # a row's stream is its own key, not its place in the call: the same key gives the same uniforms
    from ragen_core.rollout.generators.sampling import row_generators

    a = row_generators(3, 2, [7, 9])
    b = row_generators(3, 1, [9])
    assert a is not None and b is not None
    assert torch.rand(4, generator=a[1]).tolist() == torch.rand(4, generator=b[0]).tolist()
    with pytest.raises(ValueError, match="2 sampling streams for 3 rows"):
        row_generators(3, 3, [1, 2])


@pytest.mark.parametrize(("fast", "kept_dtype"), [(True, torch.bfloat16), (False, torch.float32)],
                         ids=["fast-step", "model-forward"])
def test_bf16_sampling_keeps_caches_and_scores_as_autocast_does(tiny, fast, kept_dtype):
    """compute_dtype bf16 (the session's when trainer.precision resolves to bf16): over three turns with cache
    reuse, every sampled id's log-prob is what one forward under bf16 autocast gives it (within bf16 rounding),
    and the sampling really ran in bf16 (it is not the fp32 forward's, to 1e-4). The kept caches are bf16 with
    the fast step (keys and values as autocast makes them) and fp32 under ``model.forward``."""
    model, tokenizer = tiny
    gen = HFGenerator(model, tokenizer, compute_dtype=torch.bfloat16, fast_decode=fast)
    assert (gen._step is not None) == fast
    assert gen.compute_dtype == torch.bfloat16 and HFGenerator(model, tokenizer).compute_dtype is None
    contexts, sessions = _prompts(tokenizer, TEXTS), ["a", "b", "c"]
    gaps = []
    for turn in range(3):
        out = gen.generate(contexts, SamplingParams(max_new_tokens=7, seed=turn), session_ids=sessions)
        for prompt, g in zip(contexts, out, strict=True):
            ids = torch.tensor([list(prompt) + list(g.token_ids)])
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # as the update scores them
                logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
            auto = torch.log_softmax(logits, -1).gather(1, torch.tensor(g.token_ids)[:, None]).squeeze(1)
            assert torch.allclose(torch.tensor(g.logprobs), auto, atol=1e-2)  # measured: at most 2e-3
            gaps.append((torch.tensor(g.logprobs) - teacher_forced_logprobs(model, prompt, g.token_ids)).abs().max())
        if turn < 2:
            assert gen.stats["reused_tokens"] > 0 or turn == 0
            kept = [t.dtype for s in gen._sessions.values() for layer in s.layers for t in layer]
            assert set(kept) == {kept_dtype} and len(kept) > 0
        user = tokenizer.encode(f"<|im_end|>\nTurn {turn + 2}: State: P _ O G")
        contexts = [c + list(g.token_ids) + user[: 5 + i] for i, (c, g) in enumerate(zip(contexts, out, strict=True))]
    assert gen.stats["reused_tokens"] > 0
    assert max(gaps) > 1e-4
