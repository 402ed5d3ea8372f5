"""Format warm-up: a short fine-tune that teaches the reply format, not the task
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
(``rollout.loop.run_rollouts``) on env seeds of their own, with ``SelfDistillGenerator``
(``ragen_core/rollout/format_generators.py``, which says how a reply is cut and completed) wrapping the model's
hf generator at temperature 1.0; :func:`rollout.batch.build_token_batch` builds rows whose loss mask is exactly
the reply tokens (the prompt and the prefilled tag are context), and ``train_format``
(``ragen_core/trainer/supervised.py``) fine-tunes on them. All data is sampled from the base model before
training (a fixed target: what it should learn is where a thought ends and what follows). It does move the
thoughts a little: on Sokoban the warmed model's first thoughts carry about 0.9 of the base model's I(X;Z)
(0.48 against 0.55 nats at 30 steps, 0.51 at the Sokoban files' 45; about half when it also trains on copies of
the placeholder: docs/benchmarks.md, the Sokoban warm-up's state dependence). The loss is on every reply token, thought
included: with the thought masked out the model learned to close ``</think>`` at once (0.3 think tokens,
entropy 0.1 after 30 steps on Bandit, measured), since nothing then told it to keep thinking before a cut
point. The warm-up plays first turns only (:data:`DIALOGUE_TURNS`), four replies per state (:data:`_GROUP`),
``model.warmup_steps`` x 8 replies. Replies whose thought copies the format line's placeholder (``[your thoughts]``,
:func:`echoes_placeholder`) are dropped and more states sampled in their place: the base model
writes it in about 3 of 10 first Sokoban thoughts (71 of 240, 38 of them nothing else, measured), a thought
that reads the same in every state, and a warm-up that trained on them wrote it in 41 of 128
(docs/benchmarks.md). In NoThink mode there are no thoughts: the replies are the model's own valid answers,
else random ones.

Canned content-free thoughts (one of 20, with random actions) are not used: they make every thought the
same few sentences, so reasoning starts RL collapsed (first-turn Sokoban thoughts warmed up that way carried
I(X;Z) = 0.006 nats of a possible 2.08, measured). ``RandomFormatGenerator`` remains for the
random-policy level (:func:`random_policy_stats`), with an empty thought: it is never trained on.

The warmed model is cached under ``models_dir()`` with a key over everything that changes what it learns
(method, base model and its fingerprint, env, format switches, prompt budgets, steps, lr, format version),
written to a staging directory and renamed into place with the ``ragen-model.json`` marker written last
(the public API of ``ragen_core/models/cache.py``), so a second call returns at once. The marker holds the
facts of the build (:func:`warmup_facts`: method, steps, format validity of the base model's own replies and
of the warmed model's, shares of own thoughts and answers, seconds); a training run prints them in one line
and logs them as ``warmup.*`` params.

This module: the cache key and the build (:func:`warmup_key`, :func:`warmup_dir`, :func:`warmup_model`), the
dialogues (:func:`self_distill_dialogues`, :func:`synthetic_dialogues`) and the format measurements
(:func:`format_stats`, :func:`measure_format`, :func:`reply_stats`, ...).

Run its tests: ``.venv/bin/python -m pytest tests/unit/trainer/test_warmup.py -q``; the effect on the
default model: ``.venv/bin/python bench/warmup.py`` (or ``-m slow tests/integration/test_warmup_*default_model.py``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ragen_core.models import load_model, load_tokenizer, resolve_model
from ragen_core.models.cache import (
    MARKER,
    Progress,
    check_model_dir,
    clean_leftovers,
    models_dir,
    models_lock,
    publish,
    say,
    staging_dir,
)
from ragen_core.rollout.batch import build_token_batch
from ragen_core.rollout.format_generators import (
    RandomFormatGenerator,
    SelfDistillGenerator,
    text_ids,
    thought_cap,
)
from ragen_core.rollout.generators import make_generator
from ragen_core.rollout.loop import run_rollouts
from ragen_core.rollout.parse import parse_response
from ragen_core.rollout.prompts import THOUGHT_PLACEHOLDER
from ragen_core.trainer.forward import first_scored, policy_forward
from ragen_core.trainer.models import resolve_device
from ragen_core.trainer.supervised import train_format

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from ragen_core.config import EnvConfig, ExperimentConfig, RolloutConfig
    from ragen_core.types import Trajectory

__all__ = [
    "FORMAT_VERSION", "METHODS", "echoes_placeholder", "format_stats", "measure_format", "random_policy_stats",
    "reply_entropy", "reply_stats", "sample_episodes", "self_distill_dialogues", "synthetic_dialogues",
    "train_format", "warmup_dir", "warmup_facts", "warmup_key", "warmup_model",
]

FORMAT_VERSION = 5
"""Bumped whenever the training data or recipe changes, so old caches are not reused
(2: linear learning-rate decay; 3: self-distillation of the model's own thoughts replaces canned ones;
4: first turns only, four replies per state; 5: thoughts that copy the format line's placeholder are dropped)."""

METHODS = ("none", "self_distill")
"""Values of ``model.warmup``."""

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
(measured), while whole 5-turn dialogues cost ~4x to sample and ~3x per step to train."""
_SAMPLE_CHUNK = 64
"""Dialogues sampled together (one ``run_rollouts`` call): bounds the KV cache of a batch."""
_MOST_STATES = 4
"""States sampled at most per state wanted when thoughts that copy the prompt's placeholder are dropped."""
_CHECK_EPISODES = 32
"""First turns sampled from the warmed model to record its format validity in the marker."""
_CHECK_MAX_NEW_TOKENS = 128
"""Reply budget of that check: a warmed reply closes its answer within ~thought cap + 30 tokens, and one
run-away row would otherwise keep the whole batch decoding to a GPU-sized budget (400 on Sokoban)."""


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
    seeds = list(range(seed_start, seed_start + n))
    gen = RandomFormatGenerator(tokenizer, env_cfg, rollout_cfg, seeds, 1, np.random.default_rng(seed))
    trajs = run_rollouts(env_cfg, gen, tokenizer, rollout_cfg, seeds, 1, model_max_length=model_max_length)
    _check_parsed(trajs)
    return trajs


def _check_parsed(trajs: Sequence[Trajectory]) -> None:
    bad = [(t.seed, i, turn.response_text) for t in trajs for i, turn in enumerate(t.turns) if not turn.parse_ok]
    if bad:
        raise RuntimeError(f"warm-up replies that the rollout loop rejected (seed, turn, reply): {bad[:3]}")


def echoes_placeholder(traj: Trajectory) -> bool:
    """Whether a thought of ``traj`` copies the format line's placeholder (:data:`THOUGHT_PLACEHOLDER`, in any
    case, with or without its brackets). Such a thought is the prompt's wording, not the model's thinking: it
    reads the same in every state."""
    return any(_echoes(parse_response(turn.response_text).think) for turn in traj.turns)


def _echoes(thought: str) -> bool:
    return THOUGHT_PLACEHOLDER.strip("[]") in thought.lower()


def self_distill_dialogues(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    cfg: ExperimentConfig,
    n: int,
    *,
    seed: int = WARMUP_SEED,
    seed_start: int = _SEED_START,
    n_per_group: int = 1,
    drop: Callable[[Trajectory], bool] | None = None,
    progress: Progress | None = None,
) -> tuple[list[Trajectory], list[dict[str, Any]]]:
    """``n`` groups of ``n_per_group`` episodes (env seeds ``seed_start..``) played by :class:`SelfDistillGenerator`
    over ``model`` in the real loop, sampled at temperature 1.0 in chunks of about :data:`_SAMPLE_CHUNK` episodes;
    and the generator's per-reply records, in reply order. Every turn parses and names only valid actions (checked).

    With ``drop``, the episodes it picks are left out and further states are sampled (as many as the share kept
    so far says the rest takes) until ``n * n_per_group`` episodes are kept (the first that many); a state then
    keeps fewer than ``n_per_group``. The records are those of every reply sampled, the dropped ones included.
    Raises ``RuntimeError`` when :data:`_MOST_STATES` x ``n`` states do not give enough.
    """
    max_len = _max_length(cfg, model)
    rng = np.random.default_rng(seed)
    want = n * n_per_group
    trajs: list[Trajectory] = []
    records: list[dict[str, Any]] = []
    chunk = max(1, _SAMPLE_CHUNK // n_per_group)
    end = seed_start + (n if drop is None else _MOST_STATES * n)
    start, c, sampled = seed_start, 0, 0
    while len(trajs) < want and start < end:
        kept = len(trajs) / sampled if sampled else 1.0  # share kept so far: how many states the rest takes
        states = math.ceil(-(-(want - len(trajs)) // n_per_group) / max(kept, 1 / _MOST_STATES))
        seeds = list(range(start, min(start + chunk, start + states, end)))
        inner = make_generator("hf", model, tokenizer, max_length=max_len)
        gen = SelfDistillGenerator(inner, tokenizer, cfg.env, cfg.rollout, seeds, n_per_group, rng)
        new = run_rollouts(cfg.env, gen, tokenizer, cfg.rollout, seeds, n_per_group, 1.0,
                           group_offset=start - seed_start, sampling_seed=seed * 1_000_003 + c,
                           model_max_length=max_len)
        _check_parsed(new)
        start, c, sampled = seeds[-1] + 1, c + 1, sampled + len(new)
        trajs += new if drop is None else [t for t in new if not drop(t)]
        records += gen.records
        if progress is not None:
            progress(f"format warm-up: sampled {sampled} dialogues of the model's own thoughts, "
                     f"kept {min(len(trajs), want)}/{want}")
    if len(trajs) < want:
        raise RuntimeError(f"format warm-up: only {len(trajs)} of {sampled} dialogues sampled from "
                           f"{end - seed_start} states were kept, {want} are needed (the rest copied the "
                           f"format line's placeholder {THOUGHT_PLACEHOLDER!r} into their thoughts)")
    return trajs[:want], records


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
    """The random-policy level: :func:`format_stats` of ``n`` synthetic episodes on seeds 0..n-1 (those of
    measurements)."""
    return format_stats(synthetic_dialogues(env_cfg, rollout_cfg, tokenizer, n, seed=seed, seed_start=0))


def sample_episodes(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, cfg: ExperimentConfig,
                    n: int = 64, *, temperature: float = 1.0, sampling_seed: int = 0, n_per_group: int = 1,
                    seed_start: int = 0) -> list[Trajectory]:
    """``n`` groups of ``n_per_group`` episodes (env seeds ``seed_start..``) sampled from ``model`` by the real
    rollout loop (hf backend)."""
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
    lengths = [len(text_ids(tokenizer, b)) for b in blocks]
    return {
        **format_stats(trajectories),
        "entropy": reply_entropy(model, tokenizer, cfg, trajectories),
        "closed_think": len(blocks) / max(len(turns), 1),
        "think_tokens": sum(lengths) / max(len(lengths), 1),
        "response_tokens": sum(len(turn.response_ids) for turn in turns) / max(len(turns), 1),
    }


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
        "rollout": {**{k: getattr(r, k) for k in ("think", "prefill", "max_turns", "max_actions_per_turn",
                                                  "max_actions_per_episode", "max_new_tokens", "system_prompt",
                                                  "max_context_tokens")},
                    "window_turns": r.generation_window},  # the window its rollouts saw, by either key
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
                "own_actions", "placeholder_copies", "thought_tokens", "distinct_first_thoughts", "seconds")


def warmup_facts(path: Path) -> dict[str, Any]:
    """The facts of a warmed copy worth a run's params (method, steps, validity before -> after, ...), from its
    marker."""
    facts = json.loads((Path(path) / MARKER).read_text())
    return {"dir": Path(path).name, **{k: facts[k] for k in _PARAM_FACTS if k in facts}}


def _build(cfg: ExperimentConfig, base_path: Path, out: Path, progress: Progress | None) -> dict[str, Any]:
    """Train the warm-up from ``base_path`` and save model + tokenizer into ``out``; the marker's facts."""
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
                                                    n_per_group=_GROUP, drop=echoes_placeholder, progress=progress)
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
        # the facts below are over every reply sampled, the dropped ones (placeholder copies) included
        "replies": len(records),
        "placeholder_copies": round(_share(records)(lambda r: _echoes(r["thought"])), 4),
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
    return str(resolve_device(cfg.model.device))
