"""Format warm-up (ragen_core/trainer/warmup.py) on the tiny model: data, loss, training, cache.

The synthetic dialogues are checked against the rollout loop replaying the same replies with the
scripted generator, and their rewards and next states against a fresh env stepped by hand; the
effect on the real default model is tests/integration/test_warmup_default_model.py (slow).

Run: .venv/bin/python -m pytest tests/unit/trainer/test_warmup.py -q
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedTokenizerBase

from ragen_core.config import ExperimentConfig, apply_overrides, build_config
from ragen_core.envs import list_envs, make
from ragen_core.models import MARKER, check_model_dir, load_model, load_tokenizer, tiny_random
from ragen_core.rollout.batch import build_token_batch, mask_problems
from ragen_core.rollout.chat import ChatRenderer
from ragen_core.rollout.loop import run_rollouts
from ragen_core.rollout.parse import parse_response
from ragen_core.rollout.prompts import fmt_reward
from ragen_core.rollout.scripted import ScriptedGenerator
from ragen_core.trainer import warmup as W

TINY = "tiny-random:0"


def _cfg(*overrides: str) -> ExperimentConfig:
    return build_config(ExperimentConfig, apply_overrides({}, ["model.name=" + TINY, "model.device=cpu", *overrides]))


BANDIT = ("env.name=Bandit", "rollout.max_turns=1", "rollout.max_actions_per_turn=1",
          "rollout.max_actions_per_episode=1", "rollout.max_new_tokens=48")
SOKOBAN = ("env.name=Sokoban", "rollout.max_turns=3", "rollout.max_actions_per_turn=3",
           "rollout.max_actions_per_episode=6")


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


# ----------------------------------------------------------------------------- dialogues


@pytest.mark.parametrize("overrides", [SOKOBAN, ("env.name=FrozenLake", "rollout.max_turns=4"), BANDIT,
                                       (*SOKOBAN, "rollout.think=false")])
def test_dialogues_are_exactly_what_a_rollout_of_the_same_replies_shows(tok: PreTrainedTokenizerBase,
                                                                        overrides: tuple[str, ...]) -> None:
    cfg = _cfg(*overrides)
    trajs = W.synthetic_dialogues(cfg.env, cfg.rollout, tok, 4, seed_start=5)
    assert [t.seed for t in trajs] == [5, 6, 7, 8]
    for t in trajs:
        replies = [turn.response_text for turn in t.turns]
        gen = ScriptedGenerator(tok, lambda call, row, prompt, replies=replies: replies[call])
        (replay,) = run_rollouts(cfg.env, gen, tok, cfg.rollout, seeds=[t.seed], n_per_group=1)
        # identical turns (prompt ids, reply ids, rewards, actions), except the scripted made-up log-probs
        assert [dataclasses.replace(x, logprobs=()) for x in replay.turns] == \
               [dataclasses.replace(x, logprobs=()) for x in t.turns]
        assert replay.meta["user_texts"] == t.meta["user_texts"] and replay.meta["instruction"] == t.meta["instruction"]
        assert (replay.success, replay.terminated, replay.truncated) == (t.success, t.terminated, t.truncated)


@pytest.mark.parametrize("overrides", [SOKOBAN, ("env.name=FrozenLake", "rollout.max_turns=4")])
def test_every_action_runs_and_the_next_message_shows_the_real_next_state(tok: PreTrainedTokenizerBase,
                                                                          overrides: tuple[str, ...]) -> None:
    cfg = _cfg(*overrides)
    trajs = W.synthetic_dialogues(cfg.env, cfg.rollout, tok, 8, seed_start=20)
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


@pytest.mark.parametrize("overrides", [SOKOBAN, BANDIT, (*SOKOBAN, "rollout.think=false")])
def test_masked_tokens_are_exactly_the_replies(tok: PreTrainedTokenizerBase, overrides: tuple[str, ...]) -> None:
    cfg = _cfg(*overrides)
    trajs = W.synthetic_dialogues(cfg.env, cfg.rollout, tok, 6)
    batch = build_token_batch(trajs, tok, cfg.rollout)
    assert mask_problems(batch, trajs, tok) == []
    for b, t in enumerate(trajs):
        for k, turn in enumerate(t.turns):
            sel = batch.loss_mask[b] & (batch.turn_ids[b] == k)
            sampled = turn.response_text[len(t.meta["prefill"]):]  # the prefilled tag is context
            assert tok.decode(batch.input_ids[b][sel].tolist()) == sampled + "<|im_end|>"


@pytest.mark.parametrize("env_name", ["Sokoban", "FrozenLake", "Bandit", "Countdown"])
@pytest.mark.parametrize("think", [True, False])
def test_replies_follow_the_format_with_random_valid_actions(tok: PreTrainedTokenizerBase, env_name: str,
                                                             think: bool) -> None:
    cfg = _cfg(f"env.name={env_name}", f"rollout.think={str(think).lower()}", "rollout.max_actions_per_turn=3")
    trajs = W.synthetic_dialogues(cfg.env, cfg.rollout, tok, 48)
    turns = [turn for t in trajs for turn in t.turns]
    env = make(env_name)
    counts = set()
    for turn in turns:
        parsed = parse_response(turn.response_text, think=think, max_actions=3)
        assert turn.parse_ok and parsed.ok and parsed.n_cut == 0
        counts.add(len(parsed.actions))
        if think:
            assert parsed.think in W.GENERIC_THOUGHTS
            assert re.fullmatch(r"<think>[^<>]+</think><answer>[^<>]+</answer>", turn.response_text)
        else:
            assert re.fullmatch(r"<answer>[^<>]+</answer>", turn.response_text)
        if not env.free_form_actions:
            assert set(parsed.actions) <= set(env.action_names)
    if env.free_form_actions:
        assert counts == {1}  # one action per reply: the valid actions change with the state
    elif env_name != "Bandit":  # (Bandit allows one pull per episode)
        assert counts == {1, 2, 3}
        used = {a for turn in turns for a in turn.actions}
        assert used == set(env.action_names)  # uniform random actions reach every action


def test_generic_thoughts_name_no_action_of_any_env() -> None:
    names = set()
    for name in list_envs():
        env = make(name)
        if not env.free_form_actions:
            names |= {a.casefold() for a in env.action_names}
    for thought in W.GENERIC_THOUGHTS:
        words = {w.casefold() for w in re.findall(r"[A-Za-z]+", thought)}
        assert not words & names, thought
        assert "||" not in thought and "<" not in thought


def test_short_reply_budget_picks_a_thought_that_fits_or_says_why(tok: PreTrainedTokenizerBase) -> None:
    def n_ids(thought: str) -> int:  # the longer of the two arms' replies after the <think> prefill, + 1 for the stop
        return 1 + max(len(tok(W.format_reply(thought, [arm], True)[len("<think>"):],
                               add_special_tokens=False)["input_ids"])
                       for arm in ("Phoenix", "Dragon"))

    budget = min(n_ids(th) for th in W.GENERIC_THOUGHTS)
    assert budget < max(n_ids(th) for th in W.GENERIC_THOUGHTS)  # most drawn thoughts do not fit
    cfg = _cfg(*BANDIT[:-1], f"rollout.max_new_tokens={budget}")
    trajs = W.synthetic_dialogues(cfg.env, cfg.rollout, tok, 16)
    assert all(t.turns[0].parse_ok and t.turns[0].finish_reason == "stop" for t in trajs)
    assert all(n_ids(parse_response(t.turns[0].response_text).think) == budget for t in trajs)
    with pytest.raises(ValueError, match="too small"):
        W.synthetic_dialogues(cfg.env, dataclasses.replace(cfg.rollout, max_new_tokens=4), tok, 1)


def test_random_policy_level_of_bandit_is_one_half(tok: PreTrainedTokenizerBase) -> None:
    # Success = pulling the high-risk arm (higher expected value); a uniform random pull does it
    # with probability 1/2, so 256 episodes give 0.5 +- 0.031 (one binomial std).
    stats = W.random_policy_stats(_cfg(*BANDIT).env, _cfg(*BANDIT).rollout, tok, 256)
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
    batch = build_token_batch(W.synthetic_dialogues(cfg.env, cfg.rollout, tok, 3), tok, cfg.rollout)
    loss = W.supervised_loss(model, batch.input_ids, batch.attention_mask, batch.loss_mask)
    assert loss.item() == pytest.approx(math.log(model.config.vocab_size), abs=1e-5)


def test_loss_equals_transformers_masked_label_loss_and_prefix_pass_is_exact(tok: PreTrainedTokenizerBase) -> None:
    model, _ = tiny_random(1)
    cfg = _cfg(*SOKOBAN)
    trajs = W.synthetic_dialogues(cfg.env, cfg.rollout, tok, 5)
    batch = build_token_batch(trajs, tok, cfg.rollout)
    ids, att, lm = batch.input_ids, batch.attention_mask, batch.loss_mask
    labels = torch.where(lm, ids, torch.full_like(ids, -100))  # transformers' own token-mean over labels != -100
    reference = model(input_ids=ids, attention_mask=att.long(), labels=labels).loss
    ours = W.supervised_loss(model, ids, att, lm)
    assert ours.item() == pytest.approx(reference.item(), abs=1e-5)
    model.zero_grad()
    ours.backward()
    exact = {n: p.grad.clone() for n, p in model.named_parameters()}
    # margin beyond every row: nothing is detached, so value and gradient are the full ones
    model.zero_grad()
    value = W.prefix_detached_backward(model, ids, att, lm, grad_margin=10_000)
    assert value == pytest.approx(reference.item(), abs=1e-5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, exact[n], atol=1e-5, rtol=1e-4)
    # the default margin: the same value (the forward is exact), a gradient without the prefix paths
    model.zero_grad()
    value = W.prefix_detached_backward(model, ids, att, lm)
    assert value == pytest.approx(reference.item(), abs=1e-5)
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert any(not torch.allclose(grads[n], exact[n], atol=1e-6) for n in exact)


def test_rows_sharing_a_prefix_share_one_prefix_pass(tok: PreTrainedTokenizerBase) -> None:
    # Bandit prompts differ only by the arms' order: 16 rows, at most two distinct prefixes, and the
    # shared pass gives the same loss as one pass per row (the loss is a token-mean over the batch).
    model, _ = tiny_random(2)
    cfg = _cfg(*BANDIT)
    batch = build_token_batch(W.synthetic_dialogues(cfg.env, cfg.rollout, tok, 16), tok, cfg.rollout)
    calls = []
    decoder = model.get_decoder()
    hook = decoder.register_forward_pre_hook(lambda mod, args, kwargs: calls.append(kwargs["input_ids"].shape),
                                             with_kwargs=True)
    value = W.prefix_detached_backward(model, batch.input_ids, batch.attention_mask, batch.loss_mask)
    hook.remove()
    assert len(calls) <= 4 and sum(shape[0] for shape in calls[1::2]) == 16
    reference = W.supervised_loss(model, batch.input_ids, batch.attention_mask, batch.loss_mask)
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
    real = W.train_format

    def counting(*args: object, **kwargs: object) -> list[float]:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(W, "train_format", counting)
    return calls


def test_warmup_trains_once_then_hits_the_cache_and_force_rebuilds(data_dir: Path, trainings: list[int]) -> None:
    cfg = _cfg(*BANDIT, "model.warmup_steps=3")
    rng_before = torch.random.get_rng_state()
    path = W.warmup_model(cfg)
    assert torch.equal(torch.random.get_rng_state(), rng_before)  # the caller's RNG stream is untouched
    assert path.parent == data_dir / "models" and path.name.startswith("warmup-tiny-random-0-Bandit-")
    assert check_model_dir(path) is None and trainings == [1]
    marker = json.loads((path / MARKER).read_text())
    assert (marker["steps"], marker["lr"], marker["env"], marker["base"]) == (3, 1e-4, "Bandit", TINY)
    assert W.warmup_model(cfg) == path and trainings == [1]  # cache hit: no training
    assert W.warmup_model(cfg, force=True) == path and trainings == [1, 1]
    assert json.loads((path / MARKER).read_text())["created"] >= marker["created"]
    # an interrupted build (no marker) is not trusted
    (path / MARKER).unlink()
    assert W.warmup_model(cfg) == path and trainings == [1, 1, 1]
    # another format is another model
    other = W.warmup_model(_cfg(*BANDIT, "model.warmup_steps=3", "rollout.think=false"))
    assert other != path and trainings == [1, 1, 1, 1]
    assert sorted(p.name for p in (data_dir / "models").iterdir() if p.name.startswith(".tmp")) == []


def test_warmup_key_covers_what_changes_the_training_and_nothing_else(data_dir: Path) -> None:
    base = _cfg(*BANDIT)
    key = W.warmup_key(base, "fp")
    same = [_cfg(*BANDIT, "trainer.seed=7"), _cfg(*BANDIT, "trainer.iterations=3"), _cfg(*BANDIT, "trainer.actor_lr=0.1"),
            _cfg(*BANDIT, "rollout.temperature=0.5"), _cfg(*BANDIT, "model.warmup=true")]
    assert all(W.warmup_key(c, "fp") == key for c in same)
    different = [_cfg(*BANDIT, "rollout.think=false"), _cfg(*BANDIT, "env.name=BanditRev"),
                 _cfg(*BANDIT, "model.warmup_steps=5"), _cfg(*BANDIT, "model.warmup_lr=0.001"),
                 _cfg(*BANDIT, "rollout.max_new_tokens=64"), _cfg(*BANDIT, "rollout.system_prompt=Hi"),
                 _cfg(*BANDIT, "env.params={high_risk_prob: 0.5}"), _cfg(*BANDIT, "model.name=tiny-random:1")]
    keys = {W.warmup_key(c, "fp") for c in different} | {W.warmup_key(base, "other weights")}
    assert key not in keys and len(keys) == len(different) + 1


def test_warmed_tiny_model_learns_the_format(data_dir: Path, tok: PreTrainedTokenizerBase) -> None:
    # The tiny model starts from random weights, so it needs more steps and a higher lr than the real
    # one (which reaches >= 90% validity within ten steps at 1e-4, bench/warmup.py). Calibrated on
    # this seed: validity 0/16 before, 14/16 after 150 steps decaying from 1e-2 (loss 6.78 -> 0.54);
    # the bounds leave room.
    cfg = _cfg(*BANDIT, "model.warmup_steps=150", "model.warmup_lr=0.01")
    before = W.measure_format(load_model(TINY), tok, cfg, 16)
    path = W.warmup_model(cfg)
    marker = json.loads((path / MARKER).read_text())
    assert marker["loss_last"] < 0.2 * marker["loss_first"]
    warmed, warmed_tok = load_model(str(path)), load_tokenizer(str(path))
    assert warmed_tok.get_vocab() == tok.get_vocab()
    system = cfg.rollout.system_prompt  # the saved tokenizer renders dialogues exactly as the base one
    assert ChatRenderer(warmed_tok, system).head_ids("Turn 1") == ChatRenderer(tok, system).head_ids("Turn 1")
    base_weights = load_model(TINY).state_dict()
    assert any(not torch.equal(v, base_weights[k]) for k, v in warmed.state_dict().items())
    after = W.measure_format(warmed, warmed_tok, cfg, 16)
    assert before["validity"] <= 0.1 and after["validity"] >= 0.6, (before, after)
