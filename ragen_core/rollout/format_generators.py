"""Generators that reply in the required format without a model of their own: the format warm-up's data.

    gen = SelfDistillGenerator(inner, tokenizer, env_cfg, rollout_cfg, seeds, n_per_group, rng)
    gen = RandomFormatGenerator(tokenizer, env_cfg, rollout_cfg, seeds, n_per_group, rng)
    trajs = run_rollouts(env_cfg, gen, tokenizer, rollout_cfg, seeds, n_per_group)

Siblings of ``ScriptedGenerator`` (scripted.py), behind the same ``Generator`` protocol
(generators/base.py); the format warm-up (``ragen_core/trainer/warmup.py``) plays its dialogues with them.

:class:`SelfDistillGenerator` keeps the model's OWN thoughts: ``inner`` (the model's hf generator) samples
the model's continuation of the real prompt (which ends with the ``<think>`` prefill); the reply kept is

- the thought: the model's sampled token ids, up to where the model closed the block itself (``</think>``,
  or any other tag it wrote first), else cut at its last sentence end (``. ! ?`` or a line break) within
  :func:`thought_cap` tokens (half the reply budget, at most :data:`THOUGHT_TOKENS`), else at a word
  boundary there: nothing of the model's text is rewritten, only cut (:func:`cut_thought`);
- then ``</think><answer>ACTIONS</answer>`` and the stop token. ACTIONS are the model's own answer when its
  reply parsed and named only valid actions (fixed-vocabulary envs), else 1..max_actions_per_turn
  uniformly random valid ones (``env.sample_action``), so the fine-tune carries no task knowledge beyond
  the model's own.

:class:`RandomFormatGenerator` plays random valid actions with an empty thought: the random-policy level
(``warmup.random_policy_stats``); it is never trained on.

Each reply is stepped in a shadow env of its episode exactly as the loop will step it, so every action runs;
the loop then shows the real next state and reward.

Run its tests: ``.venv/bin/python -m pytest tests/unit/trainer/test_warmup.py -q``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Hashable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ragen_core.envs import make
from ragen_core.rollout.chat import decode_text
from ragen_core.rollout.generators.base import FINISH_STOP, STAT_KEYS, Generation, SamplingParams
from ragen_core.rollout.parse import ACTION_SEP, parse_response
from ragen_core.rollout.prompts import reply_prefill

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from ragen_core.config import EnvConfig, RolloutConfig
    from ragen_core.envs.base import TextEnv
    from ragen_core.rollout.generators.base import Generator

__all__ = [
    "ANSWER_ROOM", "THOUGHT_TOKENS", "RandomFormatGenerator", "SelfDistillGenerator", "cut_thought", "format_reply",
    "text_ids", "thought_cap",
]

THOUGHT_TOKENS = 48
"""Most sampled tokens kept as one thought (see :func:`thought_cap`)."""
ANSWER_ROOM = 32
"""Tokens sampled beyond the thought cap, so that an answer the model writes after closing its thought is seen."""
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
    texts = [decode_text(tokenizer, ids[:k], skip_special_tokens=True) for k in range(len(ids) + 1)]
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
    most = (1 if shadow.env.free_form_actions
            else min(cfg.max_actions_per_turn, cfg.max_actions_per_episode - shadow.used))
    return int(rng.integers(1, most + 1))


def text_ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """The tokenizer's ids of ``text`` alone (no special tokens added); [] for ''."""
    return [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]] if text else []


class RandomFormatGenerator:
    """A ``Generator`` (generators/base.py) that plays uniformly random valid actions in the required format,
    with an empty thought: the random-policy level (``warmup.random_policy_stats``); never trained on.

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
        ids = text_ids(self.tokenizer, text[len(prefill):]) + list(params.stop_token_ids[:1])
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
    how its thought ended, the thought and its token count, whether the actions were the model's own, and whether
    the reply as sampled was already valid (parsed, only existing actions; in free-form envs, whose actions are
    judged by stepping, this and own answers are not used: always False, random actions).
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
        self._open_ids = [] if rollout_cfg.prefill else text_ids(tokenizer, tag)  # the tag this generator opens
        self._tag = tag
        self._turns: dict[Hashable, int] = {}

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 session_ids: Sequence[Hashable] | None = None) -> list[Generation]:
        shadows = self._episodes.get(session_ids, len(prompts))
        inner_params = dataclasses.replace(params, max_new_tokens=min(params.max_new_tokens, self.cap + ANSWER_ROOM))
        samples = self.inner.generate([list(p) + self._open_ids for p in prompts], inner_params, session_ids)
        turns = [self._turns.get(sid, 0) for sid in session_ids or ()]
        self._turns.update({sid: t + 1 for sid, t in zip(session_ids or (), turns, strict=True)})
        return [self._reply(shadow, sample, params, turn)
                for shadow, sample, turn in zip(shadows, samples, turns, strict=True)]

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
        text = self._tag + decode_text(self.tokenizer, ids, skip_special_tokens=True)  # the reply as the model wrote it
        k, how = cut_thought(self.tokenizer, ids, self.cap, stopped) if cfg.think else (0, "none")
        valid = self._own_actions(text, shadow)  # the reply as sampled was valid (the loop would accept it)
        own = valid if how in ("closed", "none") else None  # its answer follows the thought we keep
        count = _random_count(shadow, cfg, self.rng)
        actions = (shadow.play(own, cfg.max_actions_per_episode) if own
                   else shadow.play_random(count, self.rng, cfg.max_actions_per_episode))
        answer = format_reply("", actions, cfg.think)[len(self._tag):]  # '</think><answer>..</answer>' (think)
        suffix = text_ids(self.tokenizer, answer) + list(params.stop_token_ids[:1])
        room = params.max_new_tokens - len(self._open_ids) - len(suffix)
        if room < 0:
            raise ValueError(f"rollout.max_new_tokens={params.max_new_tokens} is too small for a reply in the "
                             f"required format ({self._tag + answer!r})")
        if k > room:  # rare: a long answer after a long thought; keep what fits
            k, how = cut_thought(self.tokenizer, ids[:room], room, False)[0], "length"
        self.records.append({"turn": turn, "how": how, "thought_tokens": k, "own_actions": bool(own),
                             "valid_as_sampled": bool(valid),
                             "thought": decode_text(self.tokenizer, ids[:k], skip_special_tokens=True)})
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
