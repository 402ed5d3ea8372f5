"""Model side of the template-collapse diagnostics (ragen_core/trainer/collapse.py) on the tiny random model.

The shared-prefix matrix is checked against a naive pair-at-a-time forward; the (X, Z) extraction
against rollouts of scripted replies. The math itself is tests/unit/algos/test_algos_collapse.py.

Run: .venv/bin/python -m pytest tests/unit/trainer/test_trainer_collapse.py -q
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ragen_core.algos.collapse import collapse_metrics
from ragen_core.config import ExperimentConfig, apply_overrides, build_config
from ragen_core.models import tiny_random
from ragen_core.rollout.loop import run_rollouts
from ragen_core.rollout.scripted import ScriptedGenerator
from ragen_core.trainer import collapse


@pytest.fixture(scope="module")
def tiny() -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    return tiny_random(3)


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _naive(model: PreTrainedModel, prompts: list[list[int]], reasonings: list[list[int]]) -> torch.Tensor:
    """One full forward per (reasoning, prompt) pair: the definition, written as plainly as possible."""
    out = torch.zeros(len(reasonings), len(prompts))
    with torch.no_grad():
        for i, z in enumerate(reasonings):
            for j, x in enumerate(prompts):
                logp = model(input_ids=torch.tensor([x + z])).logits[0].float().log_softmax(-1)  # [P+L, V]
                out[i, j] = sum(logp[len(x) - 1 + t, tok] for t, tok in enumerate(z))
    return out


def _random_ids(gen: torch.Generator, n: int, lo: int, hi: int, vocab: int) -> list[list[int]]:
    return [torch.randint(3, vocab, (int(torch.randint(lo, hi + 1, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(n)]


@pytest.mark.parametrize("logits_bytes", [collapse.ONE_PIECE_LOGITS_BYTES, 1])  # all rows in one pass; one row per pass
def test_cache_reuse_equals_the_naive_pairwise_forward(tiny: tuple[PreTrainedModel, PreTrainedTokenizerBase],
                                                       logits_bytes: int) -> None:
    model, _ = tiny
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompts = _random_ids(gen, 3, 15, 40, vocab)  # different lengths
    reasonings = _random_ids(gen, 7, 1, 12, vocab) + [[17]]  # ragged, with a one-token reasoning
    calls: list[tuple[tuple[int, ...], int]] = []  # (input shape, cached tokens before the pass)

    def record(mod, args, kwargs) -> None:
        cache = kwargs.get("past_key_values")
        calls.append((tuple(kwargs["input_ids"].shape), 0 if cache is None else cache.get_seq_length()))

    hook = model.get_decoder().register_forward_pre_hook(record, with_kwargs=True)
    try:
        fast = collapse.cross_logprobs(model, prompts, reasonings, logits_bytes=logits_bytes)
    finally:
        hook.remove()
    torch.testing.assert_close(fast, _naive(model, prompts, reasonings), atol=1e-4, rtol=0)
    # one pass per distinct prompt, each prompt alone; every other pass runs reasoning tokens only, on its cache
    assert [shape for shape, cached in calls if cached == 0] == [(1, len(x)) for x in prompts]
    continued = [(shape, cached) for shape, cached in calls if cached > 0]
    assert {cached for _, cached in continued} == {len(x) for x in prompts}
    own = sum(len(z) - 1 for z in reasonings)  # tokens run after the prompt (a last token predicts nothing)
    if logits_bytes == 1:
        assert len(calls) == 3 + 3 * 7  # one row per pass (the one-token reasoning needs no pass of its own)
        assert all(shape[0] == 1 for shape, _ in continued) and sum(s[1] for s, _ in continued) == 3 * own
    else:  # all reasonings in one pass, short and uneven: packed into one row of exactly their tokens
        assert [shape for shape, _ in continued] == [(1, own)] * 3


def test_whole_row_fallback_matches_too(tiny: tuple[PreTrainedModel, PreTrainedTokenizerBase],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # Models with sliding-window layers cannot reuse a repeated prompt cache: they run [x ; z] rows.
    model, _ = tiny
    gen = torch.Generator().manual_seed(1)
    prompts = _random_ids(gen, 2, 5, 30, model.config.vocab_size)
    reasonings = _random_ids(gen, 5, 1, 10, model.config.vocab_size)
    monkeypatch.setattr(collapse, "can_share", lambda decoder: False)
    fast = collapse.cross_logprobs(model, prompts, reasonings, logits_bytes=1)
    torch.testing.assert_close(fast, _naive(model, prompts, reasonings), atol=1e-4, rtol=0)


def test_mode_is_restored_and_empty_inputs_are_refused(tiny: tuple[PreTrainedModel, PreTrainedTokenizerBase]) -> None:
    model, _ = tiny
    model.train()
    collapse.cross_logprobs(model, [[5, 6, 7]], [[8, 9]])
    assert model.training
    model.eval()
    for prompts, reasonings in (([], [[1]]), ([[1]], []), ([[1]], [[]]), ([[]], [[1]])):
        with pytest.raises(ValueError, match="none of them empty"):
            collapse.cross_logprobs(model, prompts, reasonings)


def _cfg(*overrides: str) -> ExperimentConfig:
    base = ["model.name=tiny-random:3", "env.name=Sokoban", "rollout.max_turns=1", "rollout.max_actions_per_turn=2"]
    return build_config(ExperimentConfig, apply_overrides({}, [*base, *overrides]))


REPLIES = [  # (group, member) -> reply; groups 0 and 1 are seeds 0 and 1
    "<think>go up first</think><answer>Up</answer>",
    "<think>never closed <answer>Up</answer>",  # left out: no closed think block
    "<think></think><answer>Down</answer>",  # left out: empty reasoning
    # kept: the think block is closed (the answer is not ours to judge)
    "<think>the box is left\nso push</think>nonsense",
]


@pytest.mark.parametrize("prefill", [True, False])
def test_first_turn_pairs_take_the_prompt_through_think_and_the_content_between_the_tags(
        tiny: tuple[PreTrainedModel, PreTrainedTokenizerBase], prefill: bool) -> None:
    model, tok = tiny
    cfg = _cfg(f"rollout.prefill={str(prefill).lower()}")
    gen = ScriptedGenerator(tok, lambda call, row, prompt: REPLIES[row % 4])
    trajs = run_rollouts(cfg.env, gen, tok, cfg.rollout, seeds=[0, 1, 0], n_per_group=4)  # seed 0 twice
    pairs = collapse.first_turn_pairs(trajs, tok)
    assert pairs.n_first_turns == 12
    assert pairs.texts == ("go up first", "the box is left\nso push") * 3
    assert pairs.reasonings[0] == tuple(tok("go up first", add_special_tokens=False)["input_ids"])
    assert len(pairs.prompts) == 2 and pairs.prompt_col == (0, 0, 1, 1, 0, 0)  # the repeated seed shares column 0
    think = tuple(tok("<think>", add_special_tokens=False)["input_ids"])
    first = trajs[0].turns[0].prompt_ids
    assert pairs.prompts[0] == (tuple(first) if prefill else tuple(first) + think)
    assert pairs.prompts[0][-len(think):] == think
    # measure_collapse is collapse_metrics of exactly that matrix, plus counts
    m = collapse.measure_collapse(model, tok, trajs)
    naive = _naive(model, [list(x) for x in pairs.prompts], [list(z) for z in pairs.reasonings])
    expected = collapse_metrics(naive, torch.tensor(pairs.prompt_col))
    assert {k: m[k] for k in expected} == pytest.approx(expected, abs=1e-4)
    assert (m["n_first_turns"], m["n_reasonings"], m["distinct_reasonings"]) == (12.0, 6.0, 2.0)
    assert m["seconds"] >= 0.0 and m["reasoning_tokens"] == pytest.approx(
        sum(len(z) for z in pairs.reasonings) / 6)


def test_no_usable_reasoning_gives_counts_only(tiny: tuple[PreTrainedModel, PreTrainedTokenizerBase]) -> None:
    model, tok = tiny
    cfg = _cfg()
    trajs = run_rollouts(cfg.env, ScriptedGenerator(tok, "<answer>Up</answer>"), tok, cfg.rollout, [0], 2)
    assert collapse.measure_collapse(model, tok, trajs) == {"n_first_turns": 2.0, "n_reasonings": 0.0,
                                                     "valid_share": 0.0, "distinct_reasonings": 0.0}


def test_later_turn_pairs_draw_one_turn_per_trajectory_with_its_whole_context(
        tiny: tuple[PreTrainedModel, PreTrainedTokenizerBase]) -> None:
    import numpy as np

    model, tok = tiny
    cfg = _cfg("rollout.max_turns=4")
    # replies name their call and row, so each Z tells which turn of which trajectory was drawn
    gen = ScriptedGenerator(tok, lambda call, row, prompt: f"<think>turn {call} row {row}</think><answer>Left</answer>")
    trajs = run_rollouts(cfg.env, gen, tok, cfg.rollout, seeds=[0, 1, 2], n_per_group=2)
    assert all(len(t.turns) > 1 for t in trajs)
    where = {turn.response_text: (t, k) for t in trajs for k, turn in enumerate(t.turns)}  # texts are unique
    pairs = collapse.later_turn_pairs(trajs, tok, 4, np.random.default_rng(0))
    assert pairs.n_first_turns == 4 and len(pairs.reasonings) == 4
    for x, text in zip(pairs.prompts, pairs.texts, strict=True):
        t, turn = where[f"<think>{text}</think><answer>Left</answer>"]
        assert turn >= 1  # a later turn
        context = [i for k in range(turn) for i in (*t.turns[k].prompt_ids, *t.turns[k].response_ids)]
        assert list(x) == context + list(t.turns[turn].prompt_ids)  # everything before the reasoning, <think> last
        assert tok.decode(list(x)).endswith("<think>")
    # the same generator state draws the same pairs; the metrics are the matrix's
    again = collapse.later_turn_pairs(trajs, tok, 4, np.random.default_rng(0))
    assert again == pairs
    m = collapse.measure_later_turns(model, tok, trajs, 4, np.random.default_rng(0))
    assert m["n_prompts"] == 4.0 and m["valid_share"] == 1.0 and m["mi"] <= m["mi_upper_bound"] + 1e-6
