"""The multi-turn rollout loop (SPEC §3, §5): P prompt groups × N responses, all live episodes in lock-step.

    from ragen_core.rollout import run_rollouts
    trajs = run_rollouts(cfg.env, generator, tokenizer, cfg.rollout, seeds=[11, 12], n_per_group=4)

Each of the P seeds is a prompt group; its N members reset their own env instance with that seed,
so they share the initial state (layout). With ``rollout.group_dynamics: shared`` (the default, as
the reference) they also share the env's random draws (bandit payouts, ice slips): every member
resets with ``dynamics_seed`` 0, so in-group reward differences come from the policy alone. With
``independent`` member m draws its own stream (``reset(seed=seed, options={"dynamics_seed": m})``),
deterministic given (seed, m).

Each episode's env gets ``max_steps = max_actions_per_episode`` (unless ``env.params`` set it, or the
env is a one-action game): the env's own budget follows the config (SPEC §5, Table 3).

Every turn, the contexts of all live episodes go to ONE ``generator.generate`` call (with one
session id per episode, so a backend can keep each episode's KV cache; sessions end with their
episodes). Per reply (SPEC §3):

* parse it (``parse.parse_response``), match each action with ``env.match_action``
  (case-insensitive; free-form envs judge their own text);
* run the recognised actions in order until the episode ends; unknown ones are skipped;
  the turn's reward is the sum of the env rewards. An action the env rejects when stepping
  (``info["invalid_action"]``, e.g. Countdown text that is no expression) counts as unknown:
  it spends budget but is not in ``Turn.actions``;
* format penalty (``format_penalty``, −0.1) when the reply does not parse, has no valid
  action, or names an unknown action (the valid ones still run); otherwise the optional
  ``format_reward`` credit. It is stored in ``Turn.penalty`` and adds to ``Trajectory.total_return``;
* the episode ends when the env is done (terminated or its own truncation), when
  ``max_actions_per_episode`` actions have run, or after ``max_turns`` turns (truncated).
  If even the instruction and the newest turn no longer fit the context, it ends truncated
  with ``meta["context_overflow"] = True`` (never a crash).

Each Turn stores its prompt delta, the exact sampled ids and log-probs, and the key of the state it acted
on (``Turn.state_key``, the env's ``info["state_key"]`` before the turn's actions: GiGPO's step groups), and
``Trajectory.meta`` holds the texts the renderer needs to re-render a head (``instruction``, ``user_texts``), so
``batch.build_token_batch`` rebuilds the training row exactly, also after a Parquet round trip.
``meta`` keys (:class:`ragen_core.types.TrajectoryMeta`): ``env_name``, ``member`` (index in the group),
``dynamics_seed``, ``system_prompt``, ``prefill``, ``instruction`` (the instruction block), ``user_texts``
(one user message per turn), ``named_actions`` / ``unknown_actions`` (counts per turn), ``context_overflow``.

Run its tests: ``.venv/bin/python -m pytest tests/unit/rollout/test_rollout_loop.py -q``.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ragen_core.envs import make
from ragen_core.rollout.chat import ChatRenderer, RenderedSequence
from ragen_core.rollout.context import HeadCache, render_dialogue
from ragen_core.rollout.generators.base import SamplingParams
from ragen_core.rollout.parse import match_actions, parse_response
from ragen_core.rollout.prompts import first_user_text, instruction_block, make_renderer, turn_text
from ragen_core.types import Trajectory, TrajectoryMeta, Turn

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from ragen_core.config import EnvConfig, RolloutConfig
    from ragen_core.envs.base import TextEnv
    from ragen_core.rollout.generators.base import Generation, Generator

__all__ = ["Progress", "context_limit", "dynamics_seed", "episode_env", "run_rollouts"]

Progress = Callable[[int, int], None]
"""Called after every turn with (finished episodes, all episodes)."""

# tokenizer.model_max_length is a huge sentinel (1e30) when a tokenizer does not know its model's limit.
_NO_LIMIT = 1_000_000


def context_limit(rollout_cfg: RolloutConfig, model_max_length: int | None = None,
                  tokenizer: PreTrainedTokenizerBase | None = None) -> int | None:
    """Most tokens a context may hold: rollout.max_context_tokens, else the model's limit, else None.

    Pass ``model.config.max_position_embeddings`` as ``model_max_length``; the tokenizer's
    ``model_max_length`` is the fallback when it is a real number.
    """
    if rollout_cfg.max_context_tokens is not None:
        return int(rollout_cfg.max_context_tokens)
    if model_max_length is not None:
        return int(model_max_length)
    tok_max = getattr(tokenizer, "model_max_length", None)
    return int(tok_max) if isinstance(tok_max, int) and 0 < tok_max < _NO_LIMIT else None


@dataclass
class _Episode:
    """Mutable per-episode state while the loop runs (private; the result is a frozen Trajectory)."""

    group_id: int
    member: int
    seed: int
    env: TextEnv
    block: str
    session: Hashable
    obs: str
    state_key: str
    """``info["state_key"]`` of the env's current state (after reset, then after each action)."""
    turns: list[Turn] = field(default_factory=list)
    prompts: list[tuple[int, ...]] = field(default_factory=list)
    user_texts: list[str] = field(default_factory=list)
    named: list[int] = field(default_factory=list)
    unknown: list[int] = field(default_factory=list)
    heads: HeadCache = field(default_factory=dict)
    actions_used: int = 0
    start: int = 0
    success: bool = False
    terminated: bool = False
    truncated: bool = False
    overflow: bool = False
    done: bool = False


def run_rollouts(
    env_cfg: EnvConfig,
    generator: Generator,
    tokenizer: PreTrainedTokenizerBase,
    rollout_cfg: RolloutConfig,
    seeds: Sequence[int],
    n_per_group: int,
    temperature: float | None = None,
    *,
    group_offset: int = 0,
    sampling_seed: int | None = None,
    model_max_length: int | None = None,
    renderer: ChatRenderer | None = None,
    progress: Progress | None = None,
) -> list[Trajectory]:
    """Play ``len(seeds)`` groups × ``n_per_group`` episodes; trajectories in (group, member) order.

    ``temperature`` defaults to ``rollout_cfg.temperature``; ``group_id`` of seed i is
    ``group_offset + i``; ``sampling_seed`` makes sampling reproducible (per-turn seeds are derived
    from it, so give each iteration its own, e.g. ``trainer.seed * 100_003 + iteration``). Episode
    (group g, member m) samples from its own stream ``group_id · n_per_group + m`` of the turn's seed
    (``SamplingParams.streams``), so a call on groups ``a..b`` with ``group_offset=a`` plays them exactly
    as a call on all groups does (how a multi-process run splits its rollouts);
    ``model_max_length`` (``model.config.max_position_embeddings``) feeds :func:`context_limit`.
    """
    if n_per_group < 1:
        raise ValueError(f"n_per_group must be >= 1, got {n_per_group}")
    renderer = renderer or make_renderer(tokenizer, rollout_cfg)
    limit = context_limit(rollout_cfg, model_max_length, tokenizer)
    budget = None if limit is None else limit - rollout_cfg.max_new_tokens
    if budget is not None and budget <= 0:
        raise ValueError(f"context limit {limit} leaves no room for prompts after max_new_tokens="
                         f"{rollout_cfg.max_new_tokens}; raise rollout.max_context_tokens or lower max_new_tokens")
    run_id = uuid.uuid4().hex
    episodes = [
        _new_episode(env_cfg, rollout_cfg, seed, group_offset + g, m, (run_id, g, m))
        for g, seed in enumerate(seeds) for m in range(n_per_group)
    ]
    temp = rollout_cfg.temperature if temperature is None else float(temperature)
    try:
        for turn in range(rollout_cfg.max_turns):
            live = [ep for ep in episodes if not ep.done]
            contexts = [_next_context(ep, renderer, rollout_cfg, budget) for ep in live]
            rows = [(ep, ctx) for ep, ctx in zip(live, contexts, strict=True) if ctx is not None]
            _end_sessions(generator, [ep for ep, ctx in zip(live, contexts, strict=True) if ctx is None])
            if rows:
                params = SamplingParams(temperature=temp, top_p=rollout_cfg.top_p,
                                        max_new_tokens=rollout_cfg.max_new_tokens,
                                        stop_token_ids=renderer.stop_token_ids, seed=_turn_seed(sampling_seed, turn),
                                        streams=tuple(ep.group_id * n_per_group + ep.member for ep, _ in rows),
                                        last_turn=turn == rollout_cfg.max_turns - 1)
                gens = generator.generate([ctx.input_ids for _, ctx in rows], params,
                                          session_ids=[ep.session for ep, _ in rows])
                for (ep, _), gen in zip(rows, gens, strict=True):
                    _apply_reply(ep, gen, renderer, rollout_cfg)
                _end_sessions(generator, [ep for ep, _ in rows if ep.done])
            if progress is not None:
                progress(sum(ep.done for ep in episodes), len(episodes))
    except BaseException:
        _end_sessions(generator, [ep for ep in episodes if not ep.done])  # free the backend's caches
        raise
    return [_finish(ep, env_cfg, rollout_cfg, renderer.prefill) for ep in episodes]


def episode_env(env_cfg: EnvConfig, cfg: RolloutConfig) -> TextEnv:
    """A fresh env for one episode, its step limit following ``max_actions_per_episode`` (module docstring)."""
    env = make(env_cfg.name, **dict(env_cfg.params))
    if env.budget_from_rollout and "max_steps" not in env_cfg.params:
        env.max_steps = cfg.max_actions_per_episode
    return env


def dynamics_seed(cfg: RolloutConfig, member: int) -> int:
    """The env's dynamics stream of group member ``member``: 0 for all when shared, else its own."""
    return 0 if cfg.group_dynamics == "shared" else member


def _new_episode(env_cfg: EnvConfig, cfg: RolloutConfig, seed: int, group_id: int, member: int,
                 session: Hashable) -> _Episode:
    env = episode_env(env_cfg, cfg)
    # Same layout for the whole group; shared or own luck per member (module docstring).
    obs, info = env.reset(seed=int(seed), options={"dynamics_seed": dynamics_seed(cfg, member)})
    block = instruction_block(env.instruction, env.legend, env.action_names, cfg.max_actions_per_turn,
                              free_form=env.free_form_actions)
    return _Episode(group_id=group_id, member=member, seed=int(seed), env=env, block=block, session=session, obs=obs,
                    state_key=str(info["state_key"]))


def _turn_seed(sampling_seed: int | None, turn: int) -> int | None:
    if sampling_seed is None:
        return None
    return int(np.random.SeedSequence([int(sampling_seed), turn]).generate_state(1)[0])


def _next_context(ep: _Episode, renderer: ChatRenderer, cfg: RolloutConfig,
                  budget: int | None) -> RenderedSequence | None:
    """Append this turn's user message and return the guarded context, or None (episode ends)."""
    j = len(ep.turns)
    prev = ep.turns[-1] if ep.turns else None
    text = turn_text(
        j, ep.obs, cfg.max_actions_per_episode - ep.actions_used, think=cfg.think,
        max_new_tokens=cfg.max_new_tokens,
        prev_reward=None if prev is None else prev.reward,
        prev_penalty=0.0 if prev is None or prev.parse_ok else prev.penalty,
    )
    prompt = (renderer.head_ids(first_user_text(ep.block, text)) if prev is None
              else renderer.transition_ids(prev.response_ids, text))
    ctx = render_dialogue(
        renderer, ep.prompts + [prompt], [t.response_ids for t in ep.turns], [t.logprobs for t in ep.turns],
        block=ep.block, user_texts=ep.user_texts + [text], budget=budget,
        window_turns=cfg.generation_window, min_start=ep.start, heads=ep.heads,
    )
    if ctx is None:
        if j == 0:
            raise ValueError(
                f"the first prompt ({len(prompt)} tokens) does not fit the context budget {budget} "
                f"(context limit minus max_new_tokens={cfg.max_new_tokens}); raise rollout.max_context_tokens "
                "or lower rollout.max_new_tokens"
            )
        ep.overflow = ep.truncated = ep.done = True
        return None
    ep.prompts.append(prompt)
    ep.user_texts.append(text)
    ep.start = ctx.start_turn
    return ctx


def _apply_reply(ep: _Episode, gen: Generation, renderer: ChatRenderer, cfg: RolloutConfig) -> None:
    """Parse one reply, run its actions, record the Turn and decide whether the episode ends."""
    text = renderer.reply_text(gen.token_ids)  # the prefilled tag, then the sampled text (SPEC §3)
    parsed = parse_response(text, think=cfg.think, max_actions=cfg.max_actions_per_turn)
    matched = match_actions(parsed.actions, ep.env.match_action)
    obs_before, key_before, reward, executed, effective, rejected = ep.obs, ep.state_key, 0.0, [], 0, 0
    for action in matched.valid:
        if ep.actions_used >= cfg.max_actions_per_episode or ep.terminated or ep.truncated:
            break
        ep.obs, r, terminated, truncated, info = ep.env.step(action)
        ep.state_key = str(info["state_key"])
        ep.actions_used += 1  # a rejected action still spends budget, as it spends the env's steps
        reward += float(r)
        if info.get("invalid_action", False):
            rejected += 1  # a free-form env judged the text (e.g. not an expression): an unknown action
        else:
            executed.append(action)
        effective += bool(info.get("action_is_effective", False))
        ep.success = ep.success or bool(info.get("success", False))
        ep.terminated, ep.truncated = bool(terminated), bool(truncated) and not terminated
    ok = parsed.ok and not matched.unknown and not rejected and bool(executed)
    ep.turns.append(Turn(
        observation=obs_before, prompt_ids=ep.prompts[-1], response_ids=tuple(int(i) for i in gen.token_ids),
        logprobs=tuple(float(x) for x in gen.logprobs), response_text=text, actions=tuple(executed),
        reward=reward, penalty=cfg.format_reward if ok else cfg.format_penalty, parse_ok=ok,
        finish_reason=gen.finish_reason, think_tokens=renderer.count_tokens(parsed.think) if cfg.think else 0,
        n_effective_actions=effective, values=tuple(gen.values) if gen.values is not None else (),
        state_key=key_before,
    ))
    ep.named.append(len(parsed.actions))
    ep.unknown.append(len(matched.unknown) + rejected)
    out_of_budget = ep.actions_used >= cfg.max_actions_per_episode or len(ep.turns) >= cfg.max_turns
    if not ep.terminated and out_of_budget:
        ep.truncated = True
    ep.done = ep.terminated or ep.truncated


def _end_sessions(generator: Generator, ended: Sequence[_Episode]) -> None:
    if ended:
        generator.end_sessions([ep.session for ep in ended])


def _finish(ep: _Episode, env_cfg: EnvConfig, cfg: RolloutConfig, prefill: str) -> Trajectory:
    meta: TrajectoryMeta = {
        "env_name": env_cfg.name,
        "member": ep.member,
        "dynamics_seed": dynamics_seed(cfg, ep.member),
        "system_prompt": cfg.system_prompt,
        "prefill": prefill,
        "instruction": ep.block,
        "user_texts": list(ep.user_texts[: len(ep.turns)]),
        "named_actions": list(ep.named),
        "unknown_actions": list(ep.unknown),
        "context_overflow": ep.overflow,
    }
    return Trajectory(
        env_tag=env_cfg.label, seed=ep.seed, group_id=ep.group_id, turns=tuple(ep.turns), success=ep.success,
        terminated=ep.terminated, truncated=ep.truncated and not ep.terminated, dropped_turns=ep.start, meta=meta,
    )
