"""Format warm-up on the tiny model: data (ragen_core/rollout/format_generators.py), loss and training
(ragen_core/trainer/supervised.py), cache and build (ragen_core/trainer/warmup.py).

Both kinds of dialogue (self-distilled from the model's own samples, and the random-policy ones) are
checked against the rollout loop replaying the same reply ids, and their rewards and next states
against a fresh env stepped by hand; the self-distilled thoughts against the ids the model sampled.
The effect on the real default model is tests/integration/test_warmup_default_model.py and
test_warmup_sokoban_default_model.py (slow).

Run: .venv/bin/python -m pytest tests/unit/trainer/test_warmup.py -q
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Hashable, Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from transformers import PreTrainedTokenizerBase

from ragen_core.config import ConfigError, ExperimentConfig, apply_overrides, build_config, load_experiment
from ragen_core.envs import make
from ragen_core.models import MARKER, check_model_dir, load_model, load_tokenizer, tiny_random
from ragen_core.rollout.batch import build_token_batch, mask_problems
from ragen_core.rollout.chat import ChatRenderer
from ragen_core.rollout.format_generators import (
    ANSWER_ROOM,
    SelfDistillGenerator,
    cut_thought,
    format_reply,
    thought_cap,
)
from ragen_core.rollout.generators import make_generator
from ragen_core.rollout.generators.base import Generation, SamplingParams
from ragen_core.rollout.loop import run_rollouts
from ragen_core.rollout.parse import parse_response
from ragen_core.rollout.prompts import fmt_reward
from ragen_core.rollout.scripted import ScriptedGenerator
from ragen_core.trainer import warmup
from ragen_core.trainer.supervised import prefix_detached_backward, supervised_loss
from ragen_core.types import Trajectory

TINY = "tiny-random:0"
EXPERIMENTS = Path(__file__).resolve().parents[3] / "experiments"


def _cfg(*overrides: str) -> ExperimentConfig:
    return build_config(ExperimentConfig, apply_overrides({}, ["model.name=" + TINY, "model.device=cpu",
                                                               "model.warmup=self_distill", *overrides]))


BANDIT = ("env.name=Bandit", "rollout.max_turns=1", "rollout.max_actions_per_turn=1",
          "rollout.max_actions_per_episode=1", "rollout.max_new_tokens=48")
SOKOBAN = ("env.name=Sokoban", "rollout.max_turns=3", "rollout.max_actions_per_turn=3",
           "rollout.max_actions_per_episode=6")
KINDS = ("self_distill", "random")


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerBase:
    return load_tokenizer(TINY)


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """The tiny model's ops are too small for two threads to help, and on a busy machine the second
    thread's spin-waits make a step ~40x slower (measured); one thread keeps these tests fast anywhere."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _dialogues(kind: str, cfg: ExperimentConfig, tok: PreTrainedTokenizerBase, n: int,
               seed_start: int = 5) -> list[Trajectory]:
    if kind == "random":
        return warmup.synthetic_dialogues(cfg.env, cfg.rollout, tok, n, seed_start=seed_start)
    return warmup.self_distill_dialogues(tiny_random(0)[0], tok, cfg, n, seed_start=seed_start)[0]


class _ReplayIds:
    """Replies with recorded ids, turn by turn (call k gets every live episode's k-th reply, in row order)."""

    def __init__(self, replies: Sequence[Sequence[int]]) -> None:
        self.replies = list(replies)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 session_ids: Sequence[Hashable] | None = None) -> list[Generation]:
        ids = tuple(self.replies.pop(0))
        return [Generation(token_ids=ids, logprobs=(0.0,) * len(ids), finish_reason="stop")]

    def end_sessions(self, session_ids: object) -> None:
        return None

    def update_weights(self, model: object) -> None:
        return None

    @property
    def stats(self) -> dict[str, float]:
        return {}


# ----------------------------------------------------------------------------- dialogues


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("overrides", [SOKOBAN, ("env.name=FrozenLake", "rollout.max_turns=4"), BANDIT,
                                       (*SOKOBAN, "rollout.think=false"), (*SOKOBAN, "rollout.prefill=false")])
def test_dialogues_are_exactly_what_a_rollout_of_the_same_replies_shows(tok: PreTrainedTokenizerBase,
                                                                        overrides: tuple[str, ...], kind: str) -> None:
    cfg = _cfg(*overrides)
    trajs = _dialogues(kind, cfg, tok, 4)
    assert [t.seed for t in trajs] == [5, 6, 7, 8]
    for t in trajs:
        gen = _ReplayIds([turn.response_ids for turn in t.turns])
        (replay,) = run_rollouts(cfg.env, gen, tok, cfg.rollout, seeds=[t.seed], n_per_group=1)
        # identical turns (prompt ids, reply ids, texts, rewards, actions); log-probs are 0.0 in both
        assert replay.turns == t.turns
        assert replay.meta["user_texts"] == t.meta["user_texts"] and replay.meta["instruction"] == t.meta["instruction"]
        assert (replay.success, replay.terminated, replay.truncated) == (t.success, t.terminated, t.truncated)
        assert all(turn.parse_ok for turn in t.turns)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("overrides", [SOKOBAN, ("env.name=FrozenLake", "rollout.max_turns=4")])
def test_every_action_runs_and_the_next_message_shows_the_real_next_state(
        tok: PreTrainedTokenizerBase, overrides: tuple[str, ...], kind: str) -> None:
    cfg = _cfg(*overrides)
    trajs = _dialogues(kind, cfg, tok, 8, seed_start=20)
    assert any(len(t.turns) > 1 for t in trajs)  # multi-turn dialogues are there
    for t in trajs:
        env = make(cfg.env.name)  # an independent replay: the loop's member 0 uses dynamics_seed 0
        env.reset(seed=t.seed, options={"dynamics_seed": 0})
        for k, turn in enumerate(t.turns):
            named = parse_response(turn.response_text, think=True, max_actions=cfg.rollout.max_actions_per_turn).actions
            assert list(turn.actions) == named  # the shadow env stopped exactly where the loop stops
            assert turn.observation == env.render()
            reward = sum(env.step(a)[1] for a in named)
            assert turn.reward == pytest.approx(reward)
            if k + 1 < len(t.turns):
                assert f"Reward:\n{fmt_reward(reward)}\n" in t.meta["user_texts"][k + 1]
                assert env.render() in t.meta["user_texts"][k + 1]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("overrides", [SOKOBAN, BANDIT, (*SOKOBAN, "rollout.think=false"),
                                       (*SOKOBAN, "rollout.prefill=false")])
def test_masked_tokens_are_exactly_the_replies(tok: PreTrainedTokenizerBase, overrides: tuple[str, ...],
                                               kind: str) -> None:
    cfg = _cfg(*overrides)
    trajs = _dialogues(kind, cfg, tok, 6)
    batch = build_token_batch(trajs, tok, cfg.rollout)
    assert mask_problems(batch, trajs, tok) == []
    for b, t in enumerate(trajs):
        for k, turn in enumerate(t.turns):
            sel = batch.loss_mask[b] & (batch.turn_ids[b] == k)
            ids = batch.input_ids[b][sel].tolist()
            assert ids == list(turn.response_ids)  # exactly the reply's ids, the stop token last
            sampled = turn.response_text[len(t.meta["prefill"]):]  # the prefilled tag is context
            assert tok.decode(ids, skip_special_tokens=True) == sampled and ids[-1] == tok.eos_token_id


class _Recording:
    """Wraps a generator and keeps every sample it returned, in call and row order."""

    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.samples: list[Generation] = []

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 session_ids: Sequence[Hashable] | None = None) -> list[Generation]:
        out = self.inner.generate(prompts, params, session_ids)
        self.samples += out
        return out

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


@pytest.mark.parametrize("overrides", [SOKOBAN, BANDIT])
def test_self_distilled_thoughts_are_the_ids_the_model_sampled(tok: PreTrainedTokenizerBase,
                                                               overrides: tuple[str, ...]) -> None:
    cfg = _cfg(*overrides)
    model, _ = tiny_random(0)
    inner = _Recording(make_generator("hf", model, tok))
    seeds = list(range(30, 38))
    gen = SelfDistillGenerator(inner, tok, cfg.env, cfg.rollout, seeds, 1, np.random.default_rng(0))
    trajs = run_rollouts(cfg.env, gen, tok, cfg.rollout, seeds, 1, 1.0, sampling_seed=3)
    replies = [turn for k in range(cfg.rollout.max_turns) for t in trajs if len(t.turns) > k
               for turn in (t.turns[k],)]  # call order: turn by turn, episodes in order
    assert len(replies) == len(inner.samples) == len(gen.records)
    cap = thought_cap(cfg.rollout)
    for turn, sample, rec in zip(replies, inner.samples, gen.records, strict=True):
        k = rec["thought_tokens"]
        assert 0 <= k <= cap
        assert turn.response_ids[:k] == sample.token_ids[:k]  # the thought: the model's own ids, only cut
        answer = format_reply("", list(turn.actions), True)[len("<think>"):]
        assert list(turn.response_ids[k:]) == tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        assert parse_response(turn.response_text).think == rec["thought"].strip()
        assert turn.parse_ok
    # the sampling budget: the thought cap plus room for an answer, never more than the reply budget
    assert max(len(s.token_ids) for s in inner.samples) <= min(cfg.rollout.max_new_tokens, cap + ANSWER_ROOM)
    assert len({rec["thought"] for rec in gen.records}) >= 0.9 * len(gen.records)  # random weights: varied


SCRIPT = {  # what the "model" continues with after the <think> prefill -> (thought kept, how, own actions?)
    0: ("I see the box left of me. Push it.</think><answer>Left || Up</answer>", "I see the box left of me. Push it.",
        "closed", ["Left", "Up"]),
    1: ("box first</think><answer>Jump</answer>", "box first", "closed", None),  # no such action: random ones
    2: ("A short plan. Then a very long rambling sentence that goes on and on and on and never ever ends at all " +
        "because it keeps going on and on and on and on and on and on and on and on and on and on and on and on",
        "A short plan.", "sentence", None),  # cut at its last sentence end within the cap
    3: ("just this", "just this", "stopped", None),  # it ended its reply without closing the block
    4: ("Think again<think>nested</think><answer>Up</answer>", "Think again", "closed", None),  # nested: not valid
    5: ("Up</answer>", "Up", "closed", None),  # '</answer>' is a tag too: the thought ends before it; no answer
}


def test_self_distill_keeps_own_thought_ends_and_own_valid_answers(tok: PreTrainedTokenizerBase) -> None:
    cfg = _cfg(*SOKOBAN[:-1], "rollout.max_actions_per_episode=9", "rollout.max_turns=1")
    inner = ScriptedGenerator(tok, lambda call, row, prompt: SCRIPT[row][0])
    seeds = list(range(6))
    gen = SelfDistillGenerator(inner, tok, cfg.env, cfg.rollout, seeds, 1, np.random.default_rng(0))
    trajs = run_rollouts(cfg.env, gen, tok, cfg.rollout, seeds, 1)
    for row, (traj, rec) in enumerate(zip(trajs, gen.records, strict=True)):
        _, thought, how, own = SCRIPT[row]
        (turn,) = traj.turns
        assert turn.parse_ok
        # a cut is between sampled tokens: a space or a '.' merged into the tag's first token ('.</' in the
        # tiny tokenizer; SmolLM2 merges only ' </') stays with the tag
        assert rec["how"] == how and rec["thought"].rstrip() in (thought, thought.rstrip(".")), row
        assert turn.response_text.startswith(f"<think>{rec['thought']}</think><answer>")
        assert rec["own_actions"] == (own is not None)
        if own is not None:
            assert list(turn.actions) == own and rec["valid_as_sampled"]
        else:
            assert 1 <= len(turn.actions) <= 3
    assert [r["valid_as_sampled"] for r in gen.records] == [True, False, False, False, False, False]


COPIES = ("[your thoughts]</think><answer>Up</answer>",  # the placeholder alone
          "Your thoughts: push the box.</think><answer>Left</answer>")  # any case, without its brackets
OWN = "The box is left of me</think><answer>Left</answer>"


def test_thoughts_that_copy_the_placeholder_are_dropped_and_more_states_sampled(
        tok: PreTrainedTokenizerBase, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _cfg(*SOKOBAN, "rollout.max_turns=1")
    script = (*COPIES, OWN)  # one reply in three is the model's own thought
    monkeypatch.setattr(warmup, "make_generator",
                        lambda *a, **k: ScriptedGenerator(tok, lambda call, row, prompt: script[row % 3]))
    model = tiny_random(0)[0]
    # without dropping: 30 states x 2 replies, two in three of them copies
    trajs, records = warmup.self_distill_dialogues(model, tok, cfg, 30, seed_start=5, n_per_group=2)
    assert len(trajs) == len(records) == 60 and sum(map(warmup.echoes_placeholder, trajs)) == 40
    assert {t.seed for t in trajs} == set(range(5, 35))
    # dropping them: 30 states keep 20 replies; the next 40 at that share take 60 states, at most a chunk (32)
    # of them, which keep 21; the last 19 at 41/124 take ceil(10 / (41/124)) = 31 states, which keep 20
    trajs, records = warmup.self_distill_dialogues(model, tok, cfg, 30, seed_start=5, n_per_group=2,
                                                   drop=warmup.echoes_placeholder)
    assert len(trajs) == 60 and len(records) == 60 + 64 + 62
    assert {parse_response(t.turns[0].response_text).think for t in trajs} == {"The box is left of me"}
    # further states in place of the dropped replies: the 60th kept is row 56 of the third chunk (its state 28)
    assert max(t.seed for t in trajs) == 5 + 30 + 32 + 28
    assert [r["thought"].lower().startswith(("[your thoughts]", "your thoughts")) for r in records[:3]] == \
           [True, True, False]


def test_a_model_that_only_copies_the_placeholder_gets_a_clear_error(
        tok: PreTrainedTokenizerBase, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _cfg(*SOKOBAN, "rollout.max_turns=1")
    monkeypatch.setattr(warmup, "make_generator",
                        lambda *a, **k: ScriptedGenerator(tok, lambda call, row, prompt: COPIES[0]))
    with pytest.raises(RuntimeError, match=r"only 0 of 16 dialogues sampled from 8 states.*\[your thoughts\]"):
        warmup.self_distill_dialogues(tiny_random(0)[0], tok, cfg, 2, n_per_group=2, drop=warmup.echoes_placeholder)


@pytest.mark.parametrize("prefill", [True, False])
def test_nothink_replies_are_own_valid_answers_else_random(tok: PreTrainedTokenizerBase, prefill: bool) -> None:
    cfg = _cfg(*SOKOBAN[:-1], "rollout.max_actions_per_episode=9", "rollout.max_turns=1", "rollout.think=false",
               f"rollout.prefill={str(prefill).lower()}")
    script = ["Up || left</answer>", "Jump</answer>", "no answer at all"]
    inner = _Recording(ScriptedGenerator(tok, lambda call, row, prompt: script[row]))
    gen = SelfDistillGenerator(inner, tok, cfg.env, cfg.rollout, [0, 1, 2], 1, np.random.default_rng(0))
    trajs = run_rollouts(cfg.env, gen, tok, cfg.rollout, [0, 1, 2], 1)
    assert trajs[0].turns[0].response_text == "<answer>Up || left</answer>"  # its own spelling, matched case-blind
    assert [r["own_actions"] for r in gen.records] == [True, False, False]
    assert all(t.turns[0].parse_ok and re.fullmatch(r"<answer>[^<>]+</answer>", t.turns[0].response_text)
               for t in trajs)
    # without the prefill the generator opens <answer> itself: either way the model continues inside it, once
    for prompt in inner.inner.calls[0].prompts:
        tail = tok.decode(list(prompt[-12:]))
        assert tail.endswith("<answer>") and not tail.endswith("<answer><answer>")


def test_without_prefill_the_generator_opens_think_itself(tok: PreTrainedTokenizerBase) -> None:
    cfg = _cfg(*SOKOBAN[:-1], "rollout.max_actions_per_episode=9", "rollout.max_turns=1", "rollout.prefill=false")
    inner = ScriptedGenerator(tok, lambda call, row, prompt: SCRIPT[0][0])
    gen = SelfDistillGenerator(inner, tok, cfg.env, cfg.rollout, [0], 1, np.random.default_rng(0))
    (traj,) = run_rollouts(cfg.env, gen, tok, cfg.rollout, [0], 1)
    opened = tok("<think>", add_special_tokens=False)["input_ids"]
    assert list(inner.calls[0].prompts[0][-len(opened):]) == opened  # the model continues inside <think>
    assert traj.meta["prefill"] == ""
    assert traj.turns[0].response_text == "<think>I see the box left of me. Push it</think><answer>Left || Up</answer>"
    assert list(traj.turns[0].response_ids[:len(opened)]) == opened  # the opened tag is part of the reply
    # (the '.' went with the tiny tokenizer's '.</' token: cuts fall between sampled tokens)


def test_cut_thought_rules(tok: PreTrainedTokenizerBase) -> None:
    def cut(text: str, cap: int, stopped: bool = False) -> tuple[str, str]:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        k, how = cut_thought(tok, ids, cap, stopped)
        return tok.decode(ids[:k]), how

    text = "Hello there. How are you? I am fine and"
    n = len(tok(text, add_special_tokens=False)["input_ids"])
    assert cut(text, 100) == ("Hello there. How are you?", "sentence")  # the last sentence end within the cap
    assert cut(text, 100, stopped=True) == (text, "stopped")  # the model ended there itself
    upto_first = len(tok("Hello there.", add_special_tokens=False)["input_ids"])
    assert cut(text, upto_first) == ("Hello there.", "sentence")
    assert cut(text, upto_first + 1)[0].rstrip() == "Hello there."  # (a space after the end may come along)
    short, how = cut(text, upto_first - 1)  # no sentence end within the cap: the last word boundary
    assert how == "length" and text.startswith(short) and text[len(short)] == " " and short
    assert cut(text, n) == ("Hello there. How are you?", "sentence")
    assert cut("Plan ahead.</think><answer>Up</answer>", 100)[1] == "closed"
    assert cut("Plan ahead.</think><answer>Up</answer>", 100)[0].rstrip(".") == "Plan ahead"
    assert cut("<answer>Up</answer>", 100) == ("", "closed")
    # a tag beyond the cap does not count: cut as if there were none
    assert cut("One. Two three four five six seven eight nine ten</think>", 3)[1] in ("sentence", "length")
    # a cut never splits a character (each of these is several bytes, maybe several tokens)
    for cap in range(1, 12):
        thought, _ = cut("√√√ √√ ✓✓✓ ok", cap)
        assert "\ufffd" not in thought and "√√√ √√ ✓✓✓ ok".startswith(thought)


@pytest.mark.parametrize("env_name", ["Sokoban", "FrozenLake", "Bandit", "Countdown"])
@pytest.mark.parametrize("think", [True, False])
def test_random_policy_replies_follow_the_format_with_random_valid_actions(tok: PreTrainedTokenizerBase,
                                                                           env_name: str, think: bool) -> None:
    cfg = _cfg(f"env.name={env_name}", f"rollout.think={str(think).lower()}", "rollout.max_actions_per_turn=3")
    trajs = warmup.synthetic_dialogues(cfg.env, cfg.rollout, tok, 48)
    turns = [turn for t in trajs for turn in t.turns]
    env = make(env_name)
    counts = set()
    for turn in turns:
        parsed = parse_response(turn.response_text, think=think, max_actions=3)
        assert turn.parse_ok and parsed.ok and parsed.n_cut == 0
        counts.add(len(parsed.actions))
        pattern = r"<think></think><answer>[^<>]+</answer>" if think else r"<answer>[^<>]+</answer>"
        assert re.fullmatch(pattern, turn.response_text)  # an empty thought: this data is never trained on
        if not env.free_form_actions:
            assert set(parsed.actions) <= set(env.action_names)
    if env.free_form_actions:
        assert counts == {1}  # one action per reply: the valid actions change with the state
    elif env_name != "Bandit":  # (Bandit allows one pull per episode)
        assert counts == {1, 2, 3}
        used = {a for turn in turns for a in turn.actions}
        assert used == set(env.action_names)  # uniform random actions reach every action


@pytest.mark.parametrize("kind", KINDS)
def test_a_reply_budget_too_small_for_the_format_says_so(tok: PreTrainedTokenizerBase, kind: str) -> None:
    cfg = _cfg(*BANDIT[:-1], "rollout.max_new_tokens=4")
    with pytest.raises(ValueError, match="too small"):
        _dialogues(kind, cfg, tok, 1)


def test_random_policy_level_of_bandit_is_one_half(tok: PreTrainedTokenizerBase) -> None:
    # Success = pulling the high-risk arm (higher expected value); a uniform random pull does it
    # with probability 1/2, so 256 episodes give 0.5 +- 0.031 (one binomial std).
    stats = warmup.random_policy_stats(_cfg(*BANDIT).env, _cfg(*BANDIT).rollout, tok, 256)
    assert stats["validity"] == 1.0 and 0.4 <= stats["success"] <= 0.6


# ----------------------------------------------------------------------------- loss


def test_loss_of_a_model_with_all_zero_weights_is_log_vocab(tok: PreTrainedTokenizerBase) -> None:
    # Zero embeddings -> zero hidden states (RMSNorm of 0 is 0) -> zero logits: every next-token
    # distribution is uniform over V tokens, so the NLL of any token is ln V, whatever the mask.
    model, _ = tiny_random(0)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    cfg = _cfg(*SOKOBAN)
    batch = build_token_batch(warmup.synthetic_dialogues(cfg.env, cfg.rollout, tok, 3), tok, cfg.rollout)
    loss = supervised_loss(model, batch.input_ids, batch.attention_mask, batch.loss_mask)
    assert loss.item() == pytest.approx(math.log(model.config.vocab_size), abs=1e-5)


def test_loss_equals_transformers_masked_label_loss_and_prefix_pass_is_exact(tok: PreTrainedTokenizerBase) -> None:
    model, _ = tiny_random(1)
    cfg = _cfg(*SOKOBAN)
    trajs = warmup.synthetic_dialogues(cfg.env, cfg.rollout, tok, 5)
    batch = build_token_batch(trajs, tok, cfg.rollout)
    ids, att, lm = batch.input_ids, batch.attention_mask, batch.loss_mask
    labels = torch.where(lm, ids, torch.full_like(ids, -100))  # transformers' own token-mean over labels != -100
    reference = model(input_ids=ids, attention_mask=att.long(), labels=labels).loss
    ours = supervised_loss(model, ids, att, lm)
    assert ours.item() == pytest.approx(reference.item(), abs=1e-5)
    model.zero_grad()
    ours.backward()
    exact = {n: p.grad.clone() for n, p in model.named_parameters()}
    # margin beyond every row: nothing is detached, so value and gradient are the full ones
    model.zero_grad()
    value = prefix_detached_backward(model, ids, att, lm, grad_margin=10_000)
    assert value == pytest.approx(reference.item(), abs=1e-5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, exact[n], atol=1e-5, rtol=1e-4)
    # the default margin: the same value (the forward is exact), a gradient without the prefix paths
    model.zero_grad()
    value = prefix_detached_backward(model, ids, att, lm)
    assert value == pytest.approx(reference.item(), abs=1e-5)
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert any(not torch.allclose(grads[n], exact[n], atol=1e-6) for n in exact)


def test_rows_sharing_a_prefix_share_one_prefix_pass(tok: PreTrainedTokenizerBase) -> None:
    # Bandit prompts differ only by the arms' order: 16 rows, at most two distinct prefixes, and the
    # shared pass gives the same loss as one pass per row (the loss is a token-mean over the batch).
    model, _ = tiny_random(2)
    cfg = _cfg(*BANDIT)
    batch = build_token_batch(warmup.synthetic_dialogues(cfg.env, cfg.rollout, tok, 16), tok, cfg.rollout)
    calls = []
    decoder = model.get_decoder()
    hook = decoder.register_forward_pre_hook(lambda mod, args, kwargs: calls.append(kwargs["input_ids"].shape),
                                             with_kwargs=True)
    value = prefix_detached_backward(model, batch.input_ids, batch.attention_mask, batch.loss_mask)
    hook.remove()
    assert len(calls) <= 4 and sum(shape[0] for shape in calls[1::2]) == 16
    reference = supervised_loss(model, batch.input_ids, batch.attention_mask, batch.loss_mask)
    assert value == pytest.approx(reference.item(), abs=1e-5)


# ----------------------------------------------------------------------------- training and cache


@pytest.fixture
def data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("RAGEN_DATA_DIR", str(tmp_path))
    return tmp_path


@pytest.fixture
def trainings(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts calls of train_format (each is one warm-up training)."""
    calls: list[int] = []
    real = warmup.train_format

    def counting(*args: object, **kwargs: object) -> list[float]:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(warmup, "train_format", counting)
    return calls


def test_warmup_trains_once_then_hits_the_cache_and_force_rebuilds(data_dir: Path, trainings: list[int]) -> None:
    cfg = _cfg(*BANDIT, "model.warmup_steps=3")
    rng_before = torch.random.get_rng_state()
    path = warmup.warmup_model(cfg)
    assert torch.equal(torch.random.get_rng_state(), rng_before)  # the caller's RNG stream is untouched
    assert path.parent == data_dir / "models" and path.name.startswith("warmup-self_distill-tiny-random-0-Bandit-")
    assert check_model_dir(path) is None and trainings == [1]
    marker = json.loads((path / MARKER).read_text())
    assert (marker["method"], marker["steps"], marker["lr"], marker["env"], marker["base"]) == \
           ("self_distill", 3, 2e-4, "Bandit", TINY)
    assert marker["dialogues"] == 3 * 8 and marker["replies"] == 24
    assert marker["format_version"] == warmup.FORMAT_VERSION
    assert (marker["states"], marker["dialogue_turns"]) == (6, 1)  # first turns, four replies per state
    for key in ("validity_before", "validity_after", "own_thought_end", "own_actions", "distinct_first_thoughts",
                "placeholder_copies"):
        assert 0.0 <= marker[key] <= 1.0, key
    assert 0 <= marker["thought_tokens"] <= marker["thought_cap"] == 24  # half of the 48-token reply budget
    facts = warmup.warmup_facts(path)
    assert facts["method"] == "self_distill" and facts["dir"] == path.name and "validity_after" in facts
    assert warmup.warmup_model(cfg) == path and trainings == [1]  # cache hit: no training
    assert warmup.warmup_model(cfg, force=True) == path and trainings == [1, 1]
    assert json.loads((path / MARKER).read_text())["created"] >= marker["created"]
    # an interrupted build (no marker) is not trusted
    (path / MARKER).unlink()
    assert warmup.warmup_model(cfg) == path and trainings == [1, 1, 1]
    # another format is another model
    other = warmup.warmup_model(_cfg(*BANDIT, "model.warmup_steps=3", "rollout.think=false"))
    assert other != path and trainings == [1, 1, 1, 1]
    assert sorted(p.name for p in (data_dir / "models").iterdir() if p.name.startswith(".tmp")) == []


def test_warmup_key_covers_what_changes_the_training_and_nothing_else(data_dir: Path) -> None:
    base = _cfg(*BANDIT)
    key = warmup.warmup_key(base, "fp")
    same = [_cfg(*BANDIT, "trainer.seed=7"), _cfg(*BANDIT, "trainer.iterations=3"),
            _cfg(*BANDIT, "trainer.actor_lr=0.1"), _cfg(*BANDIT, "rollout.temperature=0.5")]
    assert all(warmup.warmup_key(c, "fp") == key for c in same)
    different = [_cfg(*BANDIT, "rollout.think=false"), _cfg(*BANDIT, "env.name=BanditRev"),
                 _cfg(*BANDIT, "model.warmup_steps=5"), _cfg(*BANDIT, "model.warmup_lr=0.001"),
                 _cfg(*BANDIT, "rollout.max_new_tokens=64"), _cfg(*BANDIT, "rollout.system_prompt=Hi"),
                 _cfg(*BANDIT, "env.params={high_risk_prob: 0.5}"), _cfg(*BANDIT, "model.name=tiny-random:1"),
                 _cfg(*BANDIT, "rollout.prefill=false"), _cfg(*BANDIT, "model.warmup=none")]
    keys = {warmup.warmup_key(c, "fp") for c in different} | {warmup.warmup_key(base, "other weights")}
    assert key not in keys and len(keys) == len(different) + 1


def test_warmup_rollout_builds_one_warmup_for_every_actions_per_turn(data_dir: Path, trainings: list[int]) -> None:
    shared = ("model.warmup_steps=2", "model.warmup_rollout={max_actions_per_turn: 3, max_actions_per_episode: 6}")
    plain = _cfg(*SOKOBAN, "model.warmup_steps=2")  # its own rollout is the one the others pin
    rows = [_cfg(*SOKOBAN, *shared, f"rollout.max_actions_per_turn={k}", f"rollout.max_actions_per_episode={5 * k}")
            for k in (1, 2, 4)]
    assert {warmup.warmup_key(c, "fp") for c in rows} == {warmup.warmup_key(plain, "fp")}
    assert warmup.warmup_key(_cfg(*SOKOBAN, "rollout.max_actions_per_turn=1"), "fp") != warmup.warmup_key(plain, "fp")
    assert rows[0].rollout.max_actions_per_turn == 1 and rows[0].warmup_rollout_config.max_actions_per_turn == 3
    path = warmup.warmup_model(rows[0])
    assert [warmup.warmup_model(c) for c in (*rows[1:], plain)] == [path] * 3 and trainings == [1]
    assert json.loads((path / MARKER).read_text())["steps"] == 2


@pytest.mark.parametrize(("value", "message"), [
    ("{max_actions_per_turns: 3}", r"model\.warmup_rollout\.max_actions_per_turns: unknown key"),
    ("{max_actions_per_turn: 0}", r"model\.warmup_rollout\.max_actions_per_turn: 0 is out of range"),
    ("{max_actions_per_turn: 9}", r"model\.warmup_rollout: max_actions_per_turn \(9\) exceeds max_actions_per_episode"),
])
def test_warmup_rollout_refuses_bad_settings_when_loaded(value: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _cfg(*SOKOBAN, f"model.warmup_rollout={value}")


def test_warmup_is_a_named_choice_and_the_old_boolean_is_refused() -> None:
    assert build_config(ExperimentConfig, {}).model.warmup == "none"
    for old in ("true", "false"):
        with pytest.raises(ConfigError,
                           match=r"model\.warmup: .* not allowed; choose one of \['none', 'self_distill'\]"):
            build_config(ExperimentConfig, apply_overrides({}, [f"model.warmup={old}"]))
    with pytest.raises(ValueError, match="nothing to warm up"):
        warmup.warmup_model(_cfg(*BANDIT, "model.warmup=none"))


def test_every_experiment_states_its_warmup() -> None:
    # The warm-up decides what RL starts from, so no experiment leaves it to a default or to a file it extends.
    files = sorted(p for p in EXPERIMENTS.glob("*.yaml") if not p.name.startswith("_"))
    assert len(files) >= 10
    for path in files:
        raw = yaml.safe_load(path.read_text())
        assert raw.get("model", {}).get("warmup") in warmup.METHODS, path.name
        assert load_experiment(path).model.warmup == raw["model"]["warmup"]


def test_a_run_from_a_warmed_model_says_so_and_logs_the_warmups_facts(data_dir: Path) -> None:
    from ragen_core.session import open_session
    from ragen_core.tracking import NullLogger

    cfg = load_experiment(EXPERIMENTS / "smoke.yaml", ["model.warmup=self_distill", "model.warmup_steps=2",
                                                       "model.device=cpu"])
    lines: list[str] = []
    logger = NullLogger()
    sess = open_session(cfg, logger, data_dir / "runs" / "r", say=lines.append)
    assert sess.cfg.model.name == "tiny-random"
    started = [line for line in lines if line.startswith("starting from the self_distill format warm-up")]
    assert len(started) == 1 and "format validity" in started[0]
    assert logger.params["warmup.method"] == "self_distill" and logger.params["warmup.steps"] == 2
    assert {"warmup.validity_before", "warmup.validity_after", "warmup.dir"} <= set(logger.params)


def test_warmed_tiny_model_learns_the_format(data_dir: Path, tok: PreTrainedTokenizerBase) -> None:
    # The tiny model starts from random weights: its own "thoughts" are random tokens, mostly cut at the
    # 24-token cap or at a stray '.' or line break, so it must learn to close a thought it cannot read.
    # It needs more steps and a higher lr than the real model (bench/warmup.py). Calibrated on this seed:
    # validity 0/16 before, 12/16 after (0.81 on the marker's 32 first turns), loss 6.78 -> 4.69 (its own
    # random thoughts stay unpredictable, as they should); the bounds leave room.
    cfg = _cfg(*BANDIT, "model.warmup_steps=150", "model.warmup_lr=0.01")
    before = warmup.measure_format(load_model(TINY), tok, cfg, 16)
    path = warmup.warmup_model(cfg)
    marker = json.loads((path / MARKER).read_text())
    # most tokens are its own random thoughts: little to learn
    assert marker["loss_last"] < marker["loss_first"], marker
    warmed, warmed_tok = load_model(str(path)), load_tokenizer(str(path))
    assert warmed_tok.get_vocab() == tok.get_vocab()
    system = cfg.rollout.system_prompt  # the saved tokenizer renders dialogues exactly as the base one
    assert ChatRenderer(warmed_tok, system).head_ids("Turn 1") == ChatRenderer(tok, system).head_ids("Turn 1")
    base_weights = load_model(TINY).state_dict()
    assert any(not torch.equal(v, base_weights[k]) for k, v in warmed.state_dict().items())
    after = warmup.measure_format(warmed, warmed_tok, cfg, 16)
    assert before["validity"] <= 0.1 and after["validity"] >= 0.6, (before, after, marker)
