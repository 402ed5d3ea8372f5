"""Format warm-up (issue 5, issue 12 item 5): a short fine-tune that teaches the reply format, not the task
and not what to think.

    from ragen_core.trainer.warmup import warmup_model
    path = warmup_model(cfg)            # models/warmup-self_distill-<base>-<env>-<hash12>/, built once, then cached
    model, tok = load_model(str(path)), load_tokenizer(str(path))

or ``ragen model warmup EXP.yaml [--force]``, or ``model.warmup: self_distill`` in an experiment
(``none``: start from the model as it is; every experiment file says which).

Why: a small instruct model (SmolLM2-135M) almost never closes ``<think>..</think><answer>..</answer>``
even when the prompt ends with the ``<think>`` prefill (0 of 32 first Sokoban turns, measured), so every
trajectory gets the same format penalty and the in-group reward std that StarPO needs (SPEC §4) is zero:
RL has no signal.

Method ``self_distill``: the thoughts are the model's OWN. Dialogues are played by the REAL rollout loop
(``rollout.loop.run_rollouts``) on env seeds of their own, with :class:`SelfDistillGenerator` wrapping the
model's hf generator. For every reply the model samples its continuation of the real prompt (which ends with
the ``<think>`` prefill) at temperature 1.0; the reply kept is

- the thought: the model's sampled token ids, up to where the model closed the block itself (``</think>``,
  or any other tag it wrote first), else cut at its last sentence end (``. ! ?`` or a line break) within
  :func:`thought_cap` tokens (half the reply budget, at most :data:`THOUGHT_TOKENS`), else at a word
  boundary there: nothing of the model's text is rewritten, only cut;
- then ``</think><answer>ACTIONS</answer>`` and the stop token. ACTIONS are the model's own answer when its
  reply parsed and named only valid actions (fixed-vocabulary envs), else 1..max_actions_per_turn
  uniformly random valid ones (``env.sample_action``), so the fine-tune carries no task knowledge beyond
  the model's own.

Each reply is stepped in a shadow env exactly as the loop will step it, so every action runs; the loop
then shows the real next state and reward, and :func:`rollout.batch.build_token_batch` builds rows whose
loss mask is exactly the reply tokens (the prompt and the prefilled tag are context). All data is sampled
from the base model before training (a fixed target: training on its own samples leaves the thoughts'
distribution where it was, in expectation; what it learns is where a thought ends and what follows).
The loss is on every reply token, thought included: with the thought masked out the model learned to
close ``</think>`` at once (0.3 think tokens, entropy 0.1 after 30 steps on Bandit, measured), since
nothing then told it to keep thinking before a cut point. The warm-up plays first turns only
(:data:`DIALOGUE_TURNS`), four replies per state (:data:`_GROUP`), ``model.warmup_steps`` x 8 replies.
In NoThink mode there are no thoughts: the replies are the model's own valid answers, else random ones.

The old warm-up (one of 20 canned content-free thoughts with random actions) is gone: it made every
thought the same few sentences, so reasoning started RL collapsed (first-turn Sokoban thoughts carried
I(X;Z) = 0.006 nats of a possible 2.08, measured). :class:`RandomFormatGenerator` remains for the
random-policy level (:func:`random_policy_stats`), with an empty thought: it is never trained on.

The warmed model is cached under ``models_dir()`` with a key over everything that changes what it learns
(method, base model and its fingerprint, env, format switches, prompt budgets, steps, lr, format version),
written to a staging directory and renamed into place with the ``ragen-model.json`` marker written last
(the public API of ``ragen_core/models/cache.py``), so a second call returns at once. The marker holds the facts of the
build (:func:`warmup_facts`: method, steps, format validity of the base model's own replies and of the
warmed model's, shares of own thoughts and answers, seconds); a training run prints them in one line and
logs them as ``warmup.*`` params.

Run its tests: ``.venv/bin/python -m pytest tests/unit/trainer/test_warmup.py -q``; the effect on the
default model: ``.venv/bin/python bench/warmup.py`` (or ``-m slow tests/integration/test_warmup_default_model.py``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

from ragen_core.models import load_model, load_tokenizer, resolve_model
from ragen_core.models.cache import (
    MARKER,
    check_model_dir,
    clean_leftovers,
    models_dir,
    models_lock,
    publish,
    say,
    staging_dir,
)
from ragen_core.rollout.generators.base import FINISH_STOP, STAT_KEYS, Generation, SamplingParams
from ragen_core.rollout.parse import ACTION_SEP, parse_response
from ragen_core.rollout.prompts import reply_prefill

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from ragen_core.config import EnvConfig, ExperimentConfig, RolloutConfig
    from ragen_core.envs.base import TextEnv
    from ragen_core.rollout.generators.base import Generator
    from ragen_core.types import TokenBatch, Trajectory

__all__ = [
    "FORMAT_VERSION", "METHODS", "THOUGHT_TOKENS", "RandomFormatGenerator", "SelfDistillGenerator", "cut_thought",
    "format_reply", "format_stats", "measure_format", "prefix_detached_backward", "random_policy_stats",
    "reply_entropy", "reply_stats", "sample_episodes", "self_distill_dialogues", "supervised_loss",
    "synthetic_dialogues", "thought_cap", "train_format", "warmup_dir", "warmup_facts", "warmup_key", "warmup_model",
]

FORMAT_VERSION = 4
"""Bumped whenever the training data or recipe changes, so old caches are not reused
(2: linear learning-rate decay; 3: self-distillation of the model's own thoughts replaces canned ones;
4: first turns only, four replies per state)."""

METHODS = ("none", "self_distill")
"""Values of ``model.warmup``."""

THOUGHT_TOKENS = 48
"""Most sampled tokens kept as one thought (see :func:`thought_cap`)."""
ANSWER_ROOM = 32
"""Tokens sampled beyond the thought cap, so that an answer the model writes after closing its thought is seen."""

WARMUP_SEED = 0
"""The warm-up's own seed (data and order); fixed so runs with different trainer seeds share one cache."""
_SEED_START = 2_000_000
"""First env seed of the warm-up's dialogues: far from evaluation (123..) and training (1_000_000..,
session.TRAIN_SEED_OFFSET) seeds, so RL never starts on a state the warm-up has played."""
_BATCH = 8
"""Dialogues (replies) per supervised step."""
_GROUP = 4
"""Replies sampled per state: a batch is two states x four of the model's own thoughts. A state's replies
share one prompt, so it is prefilled once when sampling and its prefix runs once per step when training
(a quarter of the cost of 8 distinct states, whose ~300-token prompts dominate both)."""
DIALOGUE_TURNS = 1
"""Turns the warm-up plays per dialogue: first turns only. Later turns come out in the format without
being trained on (their context shows the model's own formatted earlier replies): after a first-turn-only
warm-up on Sokoban, validity by turn was 0.84 / 0.83 / 0.85 / 0.76 / 0.80 over 32 five-turn episodes
(measured), while whole 5-turn dialogues cost ~4x to sample and ~3x per step to train (27 min on 2 cores)."""
_SAMPLE_CHUNK = 64
"""Dialogues sampled together (one ``run_rollouts`` call): bounds the KV cache of a batch."""
_CHECK_EPISODES = 32
"""First turns sampled from the warmed model to record its format validity in the marker."""
_CHECK_MAX_NEW_TOKENS = 128
"""Reply budget of that check: a warmed reply closes its answer within ~thought cap + 30 tokens, and one
run-away row would otherwise keep the whole batch decoding to a GPU-sized budget (400 on Sokoban)."""

Progress = Callable[[str], None]
_TAGS = ("<think>", "</think>", "<answer>", "</answer>")
_SENTENCE_END = re.compile(r"(?:[.!?][\"')\]]*|\n)\s*$")


# --------------------------------------------------------------------------- replies in the format


def format_reply(thought: str, actions: Sequence[str], think: bool) -> str:
    """The reply text of the required format (SPEC §3), actions joined by `` || ``."""
    answer = f"<answer>{f' {ACTION_SEP} '.join(actions)}</answer>"
    return f"<think>{thought}</think>{answer}" if think else answer


def thought_cap(rollout_cfg: RolloutConfig) -> int:
    """Most sampled tokens a warm-up thought keeps: half the reply budget, at most :data:`THOUGHT_TOKENS`
    (so the answer always fits, and RL starts from thoughts it can still lengthen)."""
    return max(1, min(THOUGHT_TOKENS, rollout_cfg.max_new_tokens // 2))


def cut_thought(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int], cap: int, stopped: bool) -> tuple[int, str]:
    """How many of the sampled ``ids`` (stop token removed) make the thought, and why it ends there.

    Returns (k, how): ``closed`` the model wrote a tag (``</think>``, or ``<answer>`` etc. first) within
    ``cap`` tokens, and the thought is everything before it; ``stopped`` it ended its reply (``stopped``)
    within ``cap`` tokens without one; ``sentence`` the last sentence end within ``cap`` tokens;
    ``length`` the last word boundary within ``cap`` tokens (or ``cap`` itself). Cuts fall between sampled
    tokens and never split a character (byte-level tokens can); a character the tokenizer merged into the
    tag's first token (SmolLM2's ``' </'``) goes with the tag.
    """
    texts = [tokenizer.decode(list(ids[:k]), skip_special_tokens=True) for k in range(len(ids) + 1)]
    full = texts[-1]
    whole = [k for k in range(len(ids) + 1) if full.startswith(texts[k])]  # cuts between characters
    tag = min((full.find(t) for t in _TAGS if t in full), default=-1)
    if tag >= 0:
        k = max(k for k in whole if len(texts[k]) <= tag)
        if k <= cap:
            return k, "closed"
    elif stopped and len(ids) <= cap:
        return len(ids), "stopped"
    within = [k for k in whole if 0 < k <= cap]
    ends = [k for k in within if _SENTENCE_END.search(texts[k])]
    if ends:
        return ends[-1], "sentence"
    words = [k for k in within if k == len(ids) or full[len(texts[k]):len(texts[k]) + 1].isspace()]
    return (words or within or [0])[-1], "length"


class _Shadow:
    """One episode's shadow env and the action budget it has used (mutable, private)."""

    def __init__(self, env: TextEnv) -> None:
        self.env = env
        self.used = 0
        self.done = False

    def play(self, texts: Sequence[str], episode_budget: int) -> list[str]:
        """Step the actions ``texts`` in order, stopping where the loop stops; the ones that ran."""
        actions: list[str] = []
        for text in texts:
            action = self.env.match_action(text)
            if action is None:
                raise RuntimeError(f"{self.env.name}: {text!r} is not an action match_action accepts")
            _, _, terminated, truncated, info = self.env.step(action)
            if info.get("invalid_action", False):
                raise RuntimeError(f"{self.env.name} rejected the action {text!r}")
            actions.append(text)
            self.used += 1
            if terminated or truncated or self.used >= episode_budget:
                self.done = True
                break
        return actions

    def play_random(self, k: int, rng: np.random.Generator, episode_budget: int) -> list[str]:
        """Sample and step up to ``k`` valid actions (each drawn in the state it runs in)."""
        actions: list[str] = []
        for _ in range(k):
            if self.done:
                break
            actions += self.play([self.env.sample_action(rng)], episode_budget)
        return actions


class _ShadowEpisodes:
    """The shadow envs of one ``run_rollouts`` call, bound to its session ids on the first ``generate``.

    The loop makes episode (group g, member m) with ``reset(seed=seeds[g], options={"dynamics_seed": m})``
    and sends all episodes, in (group, member) order, to the first ``generate`` call.
    """

    def __init__(self, env_cfg: EnvConfig, seeds: Sequence[int], n_per_group: int) -> None:
        self.env_cfg = env_cfg
        self.seeds = [int(s) for s in seeds]
        self.n_per_group = int(n_per_group)
        self._shadows: dict[Hashable, _Shadow] = {}

    def get(self, session_ids: Sequence[Hashable] | None, n_prompts: int) -> list[_Shadow]:
        if session_ids is None or len(session_ids) != n_prompts:
            raise ValueError("the warm-up generators need one session id per prompt (run_rollouts passes them)")
        if not self._shadows:
            self._bind(session_ids)
        return [self._shadows[sid] for sid in session_ids]

    def _bind(self, session_ids: Sequence[Hashable]) -> None:
        from ragen_core.envs import make

        expected = len(self.seeds) * self.n_per_group
        if len(session_ids) != expected:
            raise RuntimeError(f"the first generate call has {len(session_ids)} rows, expected every one of the "
                               f"{expected} episodes: the rollout loop no longer starts all episodes together")
        for i, sid in enumerate(session_ids):
            env = make(self.env_cfg.name, **dict(self.env_cfg.params))
            env.reset(seed=self.seeds[i // self.n_per_group], options={"dynamics_seed": i % self.n_per_group})
            self._shadows[sid] = _Shadow(env)


def _random_count(shadow: _Shadow, cfg: RolloutConfig, rng: np.random.Generator) -> int:
    """1..the turn's action budget, uniformly; 1 in free-form envs (the loop matches all actions of a
    reply against the state before the turn, and their valid actions change with the state)."""
    if shadow.done:
        raise RuntimeError("the rollout loop asked for a reply after the shadow episode ended: they drifted apart")
    most = 1 if shadow.env.free_form_actions else min(cfg.max_actions_per_turn, cfg.max_actions_per_episode - shadow.used)
    return int(rng.integers(1, most + 1))


def _encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]] if text else []


class RandomFormatGenerator:
    """A ``Generator`` (generators/base.py) that plays uniformly random valid actions in the required format,
    with an empty thought: the random-policy level (:func:`random_policy_stats`); never trained on.

    Each reply's actions are sampled in a shadow env of its episode and stepped there exactly as the loop
    will step them (up to the turn's and the episode's action budgets, stopping at the end of the episode),
    so every action is valid when the loop runs it. Reply ids are the tokenizer's ids of the text after the
    prefill plus the first stop token (as ``ScriptedGenerator``); log-probs are 0.0.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, env_cfg: EnvConfig, rollout_cfg: RolloutConfig,
                 seeds: Sequence[int], n_per_group: int, rng: np.random.Generator) -> None:
        self.tokenizer = tokenizer
        self.rollout_cfg = rollout_cfg
        self.rng = rng
        self.replies: list[str] = []
        """Every reply text, in the order generated (for tests and reading)."""
        self._episodes = _ShadowEpisodes(env_cfg, seeds, n_per_group)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 session_ids: Sequence[Hashable] | None = None) -> list[Generation]:
        return [self._reply(shadow, params) for shadow in self._episodes.get(session_ids, len(prompts))]

    def end_sessions(self, session_ids: Iterable[Hashable]) -> None:
        return None  # shadows are kept: they are small, and a late reply for an ended session is a bug to surface

    def update_weights(self, model: Any) -> None:
        return None

    @property
    def stats(self) -> dict[str, float]:
        return dict.fromkeys(STAT_KEYS, 0.0)

    def _reply(self, shadow: _Shadow, params: SamplingParams) -> Generation:
        cfg = self.rollout_cfg
        actions = shadow.play_random(_random_count(shadow, cfg, self.rng), self.rng, cfg.max_actions_per_episode)
        text = format_reply("", actions, cfg.think)
        prefill = reply_prefill(cfg.think, cfg.prefill)
        ids = _encode(self.tokenizer, text[len(prefill):]) + list(params.stop_token_ids[:1])
        if len(ids) > params.max_new_tokens:
            raise ValueError(f"rollout.max_new_tokens={params.max_new_tokens} is too small for a reply in the "
                             f"required format ({len(ids)} tokens: {text!r})")
        self.replies.append(text)
        return Generation(token_ids=tuple(ids), logprobs=(0.0,) * len(ids), finish_reason=FINISH_STOP)


class SelfDistillGenerator:
    """A ``Generator`` whose replies are the model's own thoughts put in the required format (module docstring).

    ``inner`` samples the model's continuation of each prompt (at most ``thought_cap + ANSWER_ROOM`` tokens;
    when the config does not prefill, this generator opens the tag itself); the reply keeps the sampled ids
    of the thought (:func:`cut_thought`), then the ids of ``</think><answer>ACTIONS</answer>`` and the first
    stop token. ACTIONS: the model's own when its reply parsed and every named action exists (envs with a
    fixed action list), else random valid ones; either way stepped in the episode's shadow env first.
    Log-probs are 0.0 (the warm-up is supervised). ``records`` has one dict per reply: its turn index,
    how its thought ended, the thought and its token count, whether the actions were the model's own, and whether the reply as sampled
    was already valid (parsed, only existing actions; in free-form envs, whose actions are judged by
    stepping, this and own answers are not used: always False, random actions).
    """

    def __init__(self, inner: Generator, tokenizer: PreTrainedTokenizerBase, env_cfg: EnvConfig,
                 rollout_cfg: RolloutConfig, seeds: Sequence[int], n_per_group: int, rng: np.random.Generator) -> None:
        self.inner = inner
        self.tokenizer = tokenizer
        self.rollout_cfg = rollout_cfg
        self.rng = rng
        self.cap = thought_cap(rollout_cfg)
        self.records: list[dict[str, Any]] = []
        self._episodes = _ShadowEpisodes(env_cfg, seeds, n_per_group)
        tag = reply_prefill(rollout_cfg.think, True)
        self._prefill = reply_prefill(rollout_cfg.think, rollout_cfg.prefill)  # what the prompt already ends with
        self._open_ids = [] if rollout_cfg.prefill else _encode(tokenizer, tag)  # the tag this generator opens
        self._tag = tag
        self._turns: dict[Hashable, int] = {}

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 session_ids: Sequence[Hashable] | None = None) -> list[Generation]:
        shadows = self._episodes.get(session_ids, len(prompts))
        inner_params = dataclasses.replace(params, max_new_tokens=min(params.max_new_tokens, self.cap + ANSWER_ROOM))
        samples = self.inner.generate([list(p) + self._open_ids for p in prompts], inner_params, session_ids)
        turns = [self._turns.get(sid, 0) for sid in session_ids or ()]
        self._turns.update({sid: t + 1 for sid, t in zip(session_ids or (), turns)})
        return [self._reply(shadow, sample, params, turn) for shadow, sample, turn in zip(shadows, samples, turns)]

    def end_sessions(self, session_ids: Iterable[Hashable]) -> None:
        self.inner.end_sessions(session_ids)

    def update_weights(self, model: Any) -> None:
        self.inner.update_weights(model)

    @property
    def stats(self) -> dict[str, float]:
        return self.inner.stats

    def _reply(self, shadow: _Shadow, sample: Generation, params: SamplingParams, turn: int) -> Generation:
        cfg, stops = self.rollout_cfg, set(params.stop_token_ids)
        ids = list(sample.token_ids)
        stopped = bool(ids) and ids[-1] in stops
        ids = ids[:-1] if stopped else ids
        text = self._tag + self.tokenizer.decode(ids, skip_special_tokens=True)  # the reply as the model wrote it
        k, how = cut_thought(self.tokenizer, ids, self.cap, stopped) if cfg.think else (0, "none")
        valid = self._own_actions(text, shadow)  # the reply as sampled was valid (the loop would accept it)
        own = valid if how in ("closed", "none") else None  # its answer follows the thought we keep
        count = _random_count(shadow, cfg, self.rng)
        actions = (shadow.play(own, cfg.max_actions_per_episode) if own
                   else shadow.play_random(count, self.rng, cfg.max_actions_per_episode))
        answer = format_reply("", actions, cfg.think)[len(self._tag):]  # '</think><answer>..</answer>' (think)
        suffix = _encode(self.tokenizer, answer) + list(params.stop_token_ids[:1])
        room = params.max_new_tokens - len(self._open_ids) - len(suffix)
        if room < 0:
            raise ValueError(f"rollout.max_new_tokens={params.max_new_tokens} is too small for a reply in the "
                             f"required format ({self._tag + answer!r})")
        if k > room:  # rare: a long answer after a long thought; keep what fits
            k, how = cut_thought(self.tokenizer, ids[:room], room, False)[0], "length"
        self.records.append({"turn": turn, "how": how, "thought_tokens": k, "own_actions": bool(own),
                             "valid_as_sampled": bool(valid),
                             "thought": self.tokenizer.decode(ids[:k], skip_special_tokens=True)})
        reply = self._open_ids + ids[:k] + suffix
        return Generation(token_ids=tuple(reply), logprobs=(0.0,) * len(reply), finish_reason=FINISH_STOP)

    def _own_actions(self, text: str, shadow: _Shadow) -> list[str] | None:
        """The model's own answer when it parsed and names only existing actions (fixed-vocabulary envs)."""
        cfg = self.rollout_cfg
        parsed = parse_response(text, think=cfg.think, max_actions=cfg.max_actions_per_turn)
        if not parsed.ok or shadow.env.free_form_actions:
            return None
        if any(shadow.env.match_action(a) is None for a in parsed.actions):
            return None
        return parsed.actions[: cfg.max_actions_per_episode - shadow.used]



# --------------------------------------------------------------------------- dialogues


def synthetic_dialogues(
    env_cfg: EnvConfig,
    rollout_cfg: RolloutConfig,
    tokenizer: PreTrainedTokenizerBase,
    n: int,
    *,
    seed: int = WARMUP_SEED,
    seed_start: int = _SEED_START,
    model_max_length: int | None = None,
) -> list[Trajectory]:
    """``n`` episodes (env seeds ``seed_start..``) played by :class:`RandomFormatGenerator` in the real loop.

    ``seed`` drives the actions. Every turn of the result parses and names only valid actions (checked:
    a failure means the shadow envs drifted from the loop, and raises).
    """
    from ragen_core.rollout.loop import run_rollouts

    seeds = list(range(seed_start, seed_start + n))
    gen = RandomFormatGenerator(tokenizer, env_cfg, rollout_cfg, seeds, 1, np.random.default_rng(seed))
    trajs = run_rollouts(env_cfg, gen, tokenizer, rollout_cfg, seeds, 1, model_max_length=model_max_length)
    _check_parsed(trajs)
    return trajs


def _check_parsed(trajs: Sequence[Trajectory]) -> None:
    bad = [(t.seed, i, turn.response_text) for t in trajs for i, turn in enumerate(t.turns) if not turn.parse_ok]
    if bad:
        raise RuntimeError(f"warm-up replies that the rollout loop rejected (seed, turn, reply): {bad[:3]}")


def self_distill_dialogues(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    cfg: ExperimentConfig,
    n: int,
    *,
    seed: int = WARMUP_SEED,
    seed_start: int = _SEED_START,
    n_per_group: int = 1,
    progress: Progress | None = None,
) -> tuple[list[Trajectory], list[dict[str, Any]]]:
    """``n`` groups of ``n_per_group`` episodes (env seeds ``seed_start..``) played by :class:`SelfDistillGenerator`
    over ``model`` in the real loop, sampled at temperature 1.0 in chunks of about :data:`_SAMPLE_CHUNK` episodes;
    and the generator's per-reply records, in reply order. Every turn parses and names only valid actions (checked).
    """
    from ragen_core.rollout.generators import make_generator
    from ragen_core.rollout.loop import run_rollouts

    max_len = _max_length(cfg, model)
    rng = np.random.default_rng(seed)
    trajs: list[Trajectory] = []
    records: list[dict[str, Any]] = []
    chunk = max(1, _SAMPLE_CHUNK // n_per_group)
    for c, start in enumerate(range(seed_start, seed_start + n, chunk)):
        seeds = list(range(start, min(start + chunk, seed_start + n)))
        inner = make_generator("hf", model, tokenizer, max_length=max_len)
        gen = SelfDistillGenerator(inner, tokenizer, cfg.env, cfg.rollout, seeds, n_per_group, rng)
        trajs += run_rollouts(cfg.env, gen, tokenizer, cfg.rollout, seeds, n_per_group, 1.0, group_offset=start - seed_start,
                              sampling_seed=seed * 1_000_003 + c, model_max_length=max_len)
        records += gen.records
        if progress is not None:
            progress(f"format warm-up: sampled {len(trajs)}/{n * n_per_group} dialogues of the model's own thoughts")
    _check_parsed(trajs)
    return trajs, records


# --------------------------------------------------------------------------- measuring


def format_stats(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """Format validity (share of turns with ``parse_ok``), success rate and turn count of rollouts."""
    turns = [turn for t in trajectories for turn in t.turns]
    n = max(len(trajectories), 1)
    return {
        "validity": sum(turn.parse_ok for turn in turns) / max(len(turns), 1),
        "success": sum(t.success for t in trajectories) / n,
        "env_return": sum(t.env_return for t in trajectories) / n,
        "turns": float(len(turns)),
        "episodes": float(len(trajectories)),
    }


def random_policy_stats(env_cfg: EnvConfig, rollout_cfg: RolloutConfig, tokenizer: PreTrainedTokenizerBase,
                        n: int = 256, seed: int = 1) -> dict[str, float]:
    """The random-policy level: :func:`format_stats` of ``n`` synthetic episodes on seeds 0..n-1 (those of measurements)."""
    return format_stats(synthetic_dialogues(env_cfg, rollout_cfg, tokenizer, n, seed=seed, seed_start=0))


def sample_episodes(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, cfg: ExperimentConfig,
                    n: int = 64, *, temperature: float = 1.0, sampling_seed: int = 0, n_per_group: int = 1,
                    seed_start: int = 0) -> list[Trajectory]:
    """``n`` groups of ``n_per_group`` episodes (env seeds ``seed_start..``) sampled from ``model`` by the real
    rollout loop (hf backend)."""
    from ragen_core.rollout.generators import make_generator
    from ragen_core.rollout.loop import run_rollouts

    max_len = _max_length(cfg, model)
    gen = make_generator("hf", model, tokenizer, max_length=max_len)
    return run_rollouts(cfg.env, gen, tokenizer, cfg.rollout, list(range(seed_start, seed_start + n)), n_per_group,
                        temperature, sampling_seed=sampling_seed, model_max_length=max_len)


def measure_format(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, cfg: ExperimentConfig,
                   n: int = 64, *, temperature: float = 1.0, sampling_seed: int = 0) -> dict[str, float]:
    """:func:`format_stats` of :func:`sample_episodes`: format validity and success of ``model`` on ``cfg``'s env."""
    return format_stats(sample_episodes(model, tokenizer, cfg, n, temperature=temperature, sampling_seed=sampling_seed))


def reply_entropy(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, cfg: ExperimentConfig,
                  trajectories: Sequence[Trajectory], temperature: float = 1.0, rows_per_pass: int = 4) -> float:
    """Mean per-token entropy of the policy over every reply token of ``trajectories`` (the loss-mask tokens
    of their training rows, the end-of-turn token included), from a forward pass at ``temperature``."""
    from ragen_core.rollout.batch import build_token_batch
    from ragen_core.trainer.forward import first_scored, policy_forward

    batch = build_token_batch(list(trajectories), tokenizer, cfg.rollout, _max_length(cfg, model))
    device = next(model.parameters()).device
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, batch.batch_size, rows_per_pass):
            part = batch.select(list(range(start, min(start + rows_per_pass, batch.batch_size))))
            mask = part.loss_mask.to(device)  # [b, T]
            out = policy_forward(model, part.input_ids.to(device), part.attention_mask.to(device), temperature,
                                 entropy_grad=False, start=first_scored(mask))
            total += float(out.entropy[mask].sum())
            count += int(mask.sum())
    return total / max(count, 1)


def reply_stats(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, cfg: ExperimentConfig,
                trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """:func:`format_stats` plus ``entropy`` (:func:`reply_entropy`), ``closed_think`` (share of turns whose
    reply closes a think block), ``think_tokens`` (mean tokens inside it, over those turns) and
    ``response_tokens`` (mean sampled tokens per turn)."""
    turns = [turn for t in trajectories for turn in t.turns]
    blocks = [m.group(1) for m in (re.search(r"<think>(.*?)</think>", turn.response_text, re.DOTALL) for turn in turns)
              if m is not None]
    lengths = [len(_encode(tokenizer, b)) for b in blocks]
    return {
        **format_stats(trajectories),
        "entropy": reply_entropy(model, tokenizer, cfg, trajectories),
        "closed_think": len(blocks) / max(len(turns), 1),
        "think_tokens": sum(lengths) / max(len(lengths), 1),
        "response_tokens": sum(len(turn.response_ids) for turn in turns) / max(len(turns), 1),
    }


# --------------------------------------------------------------------------- training


def supervised_loss(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    loss_mask: torch.Tensor) -> torch.Tensor:
    """Token-mean negative log-likelihood of the ``loss_mask`` tokens. [B, T] inputs -> scalar.

    The output layer runs only on the states that predict a masked token (the replies are a small
    share of each row), which saves most of the [B, T, V] logits.
    """
    from ragen_core.trainer.forward import decoder_and_head, hidden_states

    decoder, head = decoder_and_head(model)
    hidden = hidden_states(decoder, input_ids, attention_mask)  # [B, T, H]
    targets = loss_mask[:, 1:]  # [B, T-1] position t-1 predicts token t
    logits = head(hidden[:, :-1][targets]).float()  # [N, V]
    return F.cross_entropy(logits, input_ids[:, 1:][targets])


def prefix_detached_backward(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                             loss_mask: torch.Tensor, grad_margin: int = 8) -> float:
    """Backpropagate :func:`supervised_loss` with each row's prompt prefix computed under ``no_grad``; its value.

    [B, T] inputs. The forward is exact (same loss value as :func:`supervised_loss`); the gradient
    leaves out the paths through the keys/values of each row's prefix: every token before the first
    reply token except the last ``grad_margin`` ones. Those, the generation prompt and the end of
    the last user message, run with gradients, so the choice of the reply's first token (``<think>``)
    is trained through every layer. Why: the replies are ~10% of a row and the instruction prompt
    the rest; backward through the prompt would triple its cost, and rows with the same prefix
    (Bandit has two) share one prefix pass. ``grad_margin`` >= the row length gives the exact gradient.
    """
    from ragen_core.trainer.forward import decoder_and_head

    decoder, head = decoder_and_head(model)
    device = input_ids.device
    n_targets = int(loss_mask[:, 1:].sum())
    if n_targets == 0:
        raise ValueError("no token of the batch is under the loss mask")
    groups: dict[tuple[int, ...], list[int]] = {}
    for b in range(input_ids.shape[0]):
        first = int(loss_mask[b].nonzero()[0]) if loss_mask[b].any() else int(attention_mask[b].sum())
        split = max(first - max(grad_margin, 1), 0)
        groups.setdefault(tuple(input_ids[b, :split].tolist()), []).append(b)
    total = 0.0
    for prefix, rows in groups.items():
        p, k = len(prefix), len(rows)
        end = int(attention_mask[rows].sum(1).max())
        ids = input_ids[rows, p:end]  # [k, S] suffixes, right-padded
        cache = None
        if p:
            with torch.no_grad():
                cache = decoder(input_ids=torch.tensor([prefix], device=device), use_cache=True).past_key_values
            cache.batch_repeat_interleave(k)
        mask = torch.cat([attention_mask.new_ones(k, p), attention_mask[rows, p:end]], dim=1).long()  # [k, P+S]
        positions = torch.arange(p, end, device=device).expand(k, -1)  # [k, S]
        hidden = decoder(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                         use_cache=cache is not None).last_hidden_state  # [k, S, H]
        targets = loss_mask[rows, p + 1:end]  # [k, S-1] suffix position j predicts suffix token j+1
        logits = head(hidden[:, :-1][targets]).float()  # [N_g, V]
        loss = F.cross_entropy(logits, ids[:, 1:][targets], reduction="sum") / n_targets
        loss.backward()
        total += float(loss.detach())
    return total


def train_format(model: torch.nn.Module, batches: Iterable[TokenBatch], lr: float, *,
                 grad_clip: float = 1.0, grad_margin: int = 8, progress: Progress | None = None) -> list[float]:
    """One AdamW step per batch on :func:`supervised_loss` (via :func:`prefix_detached_backward`), lr decayed
    linearly from ``lr`` towards 0 over the batches; returns the losses.

    Trains ``model`` in place: the caller owns it (``warmup_model`` loads a fresh copy); it is left in eval mode.
    """
    batches = list(batches)
    device = next(model.parameters()).device
    # fused: one kernel over all parameters (on CPU ~3-8x cheaper than the per-tensor loop, measured)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0,
                                  fused=True)
    # Linear decay to ~0: with a constant lr the arm preference of the last few batches of 8 random
    # actions sticks (Bandit success swung 0.28-0.77 between checkpoints, measured); decaying averages
    # the action preference over the whole run, so it stays near the data's uniform one.
    n = len(batches)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 - step / n)
    losses: list[float] = []
    model.train()
    for step, batch in enumerate(batches):
        optimizer.zero_grad(set_to_none=True)
        loss = prefix_detached_backward(model, batch.input_ids.to(device), batch.attention_mask.to(device),
                                        batch.loss_mask.to(device), grad_margin)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        schedule.step()
        losses.append(loss)
        if progress is not None and (step % 10 == 9 or step == len(batches) - 1):
            progress(f"format warm-up: step {step + 1}/{len(batches)}, loss {loss:.3f}")
    model.eval()
    return losses


def _max_length(cfg: ExperimentConfig, model: torch.nn.Module) -> int | None:
    return cfg.model.max_length or getattr(getattr(model, "config", None), "max_position_embeddings", None)


# --------------------------------------------------------------------------- cache


def _base_fingerprint(path: Path) -> str:
    """What identifies the base model's weights: its marker's facts, else config + weight file stats."""
    marker = path / MARKER
    if marker.is_file():
        facts = json.loads(marker.read_text())
        facts.pop("created", None)  # a rebuilt copy of the same weights is the same base
        return json.dumps(facts, sort_keys=True)
    files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in (".json", ".safetensors", ".bin"))
    stats = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    return json.dumps({"config": (path / "config.json").read_text(), "files": stats})


def warmup_key(cfg: ExperimentConfig, base_fingerprint: str) -> str:
    """sha256 (hex) over everything that changes what the warm-up trains on and how."""
    r = cfg.warmup_rollout_config
    facts = {
        "format_version": FORMAT_VERSION,
        "method": cfg.model.warmup,
        "base": cfg.model.name,
        "base_fingerprint": base_fingerprint,
        "env": {"name": cfg.env.name, "params": cfg.env.params},
        "rollout": {k: getattr(r, k) for k in ("think", "prefill", "max_turns", "max_actions_per_turn",
                                               "max_actions_per_episode", "max_new_tokens", "system_prompt",
                                               "window_turns", "max_context_tokens")},
        "max_length": cfg.model.max_length,
        "steps": cfg.model.warmup_steps,
        "lr": cfg.model.warmup_lr,
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode("utf-8")).hexdigest()


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-.") or "model"


def warmup_dir(cfg: ExperimentConfig, base_fingerprint: str) -> Path:
    """``models_dir()/warmup-<method>-<base>-<env>-<hash12>``: where the warmed copy of ``cfg``'s model is cached."""
    base = _slug(Path(cfg.model.name.rstrip("/")).name)
    key = warmup_key(cfg, base_fingerprint)[:12]
    return models_dir() / f"warmup-{cfg.model.warmup}-{base}-{_slug(cfg.env.name)}-{key}"


def warmup_model(cfg: ExperimentConfig, force: bool = False, progress: Progress | None = None) -> Path:
    """The format-warmed copy of ``cfg.model.name`` for ``cfg``'s env and format (``cfg.model.warmup``'s
    method), trained once and cached.

    Returns a directory that ``load_model(str(path))`` / ``load_tokenizer(str(path))`` load. A complete
    cached copy is returned at once; ``force=True`` trains and replaces it. ``progress`` gets one line
    per stage. Raises ValueError when ``model.warmup`` is ``none``.
    """
    if cfg.model.warmup == "none":
        raise ValueError("model.warmup is 'none': there is nothing to warm up (set model.warmup=self_distill)")
    cfg = dataclasses.replace(cfg, rollout=cfg.warmup_rollout_config)  # model.warmup_rollout, when set
    base_path = resolve_model(cfg.model.name)  # before the lock: provisioning the base takes it too
    target = warmup_dir(cfg, _base_fingerprint(base_path))
    if not force and check_model_dir(target) is None:
        return target
    with models_lock(progress):
        if not force and check_model_dir(target) is None:  # another process made it while we waited
            return target
        clean_leftovers(target.name)
        with staging_dir(target.name) as tmp:
            facts = _build(cfg, base_path, tmp, progress)
            publish(tmp, target, facts)
    say(progress, f"format-warmed model ready in {target}")
    return target


_PARAM_FACTS = ("method", "steps", "lr", "format_version", "validity_before", "validity_after", "own_thought_end",
                "own_actions", "thought_tokens", "distinct_first_thoughts", "seconds")


def warmup_facts(path: Path) -> dict[str, Any]:
    """The facts of a warmed copy worth a run's params (method, steps, validity before -> after, ...), from its marker."""
    facts = json.loads((Path(path) / MARKER).read_text())
    return {"dir": Path(path).name, **{k: facts[k] for k in _PARAM_FACTS if k in facts}}


def _build(cfg: ExperimentConfig, base_path: Path, out: Path, progress: Progress | None) -> dict[str, Any]:
    """Train the warm-up from ``base_path`` and save model + tokenizer into ``out``; the marker's facts."""
    from ragen_core.rollout.batch import build_token_batch

    started, cpu_started = time.perf_counter(), time.process_time()
    steps, lr = cfg.model.warmup_steps, cfg.model.warmup_lr
    threads = torch.get_num_threads()
    if cfg.trainer.threads is not None:
        torch.set_num_threads(cfg.trainer.threads)
    train_threads = torch.get_num_threads()
    try:
        with torch.random.fork_rng(devices=[]):  # the caller's global RNG stream is not disturbed
            torch.manual_seed(WARMUP_SEED)
            tokenizer = load_tokenizer(str(base_path))
            model = load_model(str(base_path), dtype=torch.float32, device=_device(cfg))
            max_len = _max_length(cfg, model)
            say(progress, f"format warm-up ({cfg.model.warmup}) of {cfg.model.name} on {cfg.env.name}: {steps} steps "
                          f"x {_BATCH} replies of the model's own thoughts ({_GROUP} per state), lr {lr:g}")
            data_cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(
                cfg.rollout, max_turns=min(cfg.rollout.max_turns, DIALOGUE_TURNS)))
            trajs, records = self_distill_dialogues(model, tokenizer, data_cfg, -(-steps * _BATCH // _GROUP),
                                                    n_per_group=_GROUP, progress=progress)
            trajs = trajs[:steps * _BATCH]
            sampled = time.perf_counter()
            batches = [build_token_batch(trajs[i:i + _BATCH], tokenizer, cfg.rollout, max_len)
                       for i in range(0, len(trajs), _BATCH)]
            losses = train_format(model, batches, lr, progress=progress)
            trained = time.perf_counter()
            check = dataclasses.replace(cfg.rollout, max_turns=1, max_new_tokens=min(cfg.rollout.max_new_tokens,
                                                                                     _CHECK_MAX_NEW_TOKENS))
            first_turn = dataclasses.replace(cfg, rollout=check)
            after = format_stats(sample_episodes(model, tokenizer, first_turn, _CHECK_EPISODES, seed_start=_SEED_START))
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    firsts = [r for r in records if r["turn"] == 0]
    share = _share(records)
    return {
        "spec": f"warmup:{cfg.model.name}",
        "method": cfg.model.warmup,
        "base": cfg.model.name,
        "base_path": str(base_path),
        "env": cfg.env.name,
        "env_params": json.loads(json.dumps(cfg.env.params, default=str)),
        "think": cfg.rollout.think,
        "prefill": cfg.rollout.prefill,
        "steps": steps,
        "lr": lr,
        "batch": _BATCH,
        "format_version": FORMAT_VERSION,
        "dialogues": len(trajs),
        "states": len({t.seed for t in trajs}),
        "dialogue_turns": data_cfg.rollout.max_turns,
        "replies": len(records),
        "thought_cap": thought_cap(cfg.rollout),
        # the base model's own first replies on the data's prompts (sampled up to thought cap + ANSWER_ROOM tokens)
        "validity_before": round(_share(firsts)(lambda r: r["valid_as_sampled"]), 4),
        # the warmed model's first replies on the same seeds (temperature 1.0, reply budget up to 128 tokens)
        "validity_after": round(after["validity"], 4),
        "after_episodes": _CHECK_EPISODES,
        "after_max_new_tokens": check.max_new_tokens,
        "own_thought_end": round(share(lambda r: r["how"] in ("closed", "stopped")), 4),
        "sentence_cut": round(share(lambda r: r["how"] == "sentence"), 4),
        "length_cut": round(share(lambda r: r["how"] == "length"), 4),
        "own_actions": round(share(lambda r: r["own_actions"]), 4),
        "thought_tokens": round(sum(r["thought_tokens"] for r in records) / max(len(records), 1), 2),
        "distinct_first_thoughts": round(len({r["thought"] for r in firsts}) / max(len(firsts), 1), 4),
        "loss_first": round(losses[0], 4),
        "loss_last": round(losses[-1], 4),
        "sample_seconds": round(sampled - started, 1),
        "train_seconds": round(trained - sampled, 1),
        "check_seconds": round(time.perf_counter() - trained, 1),
        "seconds": round(time.perf_counter() - started, 1),
        "cpu_seconds": round(time.process_time() - cpu_started, 1),
        "threads": train_threads,
    }


def _share(records: Sequence[dict[str, Any]]) -> Callable[[Callable[[dict[str, Any]], bool]], float]:
    return lambda pred: sum(bool(pred(r)) for r in records) / max(len(records), 1)


def _device(cfg: ExperimentConfig) -> str:
    from ragen_core.trainer.models import resolve_device

    return str(resolve_device(cfg.model.device))
