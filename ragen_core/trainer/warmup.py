"""Format warm-up (issue 5): a short supervised fine-tune that teaches the reply format, not the task.

    from ragen_core.trainer.warmup import warmup_model
    path = warmup_model(cfg)            # models/warmup-<base>-<env>-<hash12>/, built once, then cached
    model, tok = load_model(str(path)), load_tokenizer(str(path))

or ``ragen model warmup EXP.yaml [--force]``, or ``model.warmup: true`` in an experiment.

Why: a small instruct model (SmolLM2-135M) almost never writes ``<think>..</think><answer>..</answer>``
unprompted, so every trajectory gets the same format penalty and the in-group reward std that
StarPO needs (SPEC §4) is zero: RL has no signal.

What it trains on: synthetic dialogues played by the REAL rollout loop (``rollout.loop.run_rollouts``)
with :class:`RandomFormatGenerator` in place of a model. It answers every turn with a short generic
thought from :data:`GENERIC_THOUGHTS` and 1..max_actions_per_turn uniformly random valid actions
(``env.sample_action``), so prompts, multi-turn transitions (the next state, the reward line) and the
chat template are byte-for-byte what rollouts show, and :func:`rollout.batch.build_token_batch` builds
the rows with the loss mask on exactly the reply tokens. Actions are random, so the fine-tune carries
no task knowledge: task success should stay at the random-policy level (the success rate of these very
dialogues, :func:`random_policy_stats`).

The warmed model is cached under ``models_dir()`` with a key over everything that changes what it
learns (base model and its fingerprint, env, format switches, prompt budgets, steps, lr, format
version), written to a staging directory and renamed into place with the ``ragen-model.json`` marker
written last (``ragen_core.models`` helpers), so a second call returns at once.

Run its tests: ``.venv/bin/python -m pytest tests/unit/trainer/test_warmup.py -q``; the effect on the
default model: ``.venv/bin/python bench/warmup.py`` (or ``-m slow tests/integration/test_warmup_default_model.py``).
"""

from __future__ import annotations

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

from ragen_core.rollout.generators.base import FINISH_STOP, STAT_KEYS, Generation, SamplingParams
from ragen_core.rollout.parse import ACTION_SEP
from ragen_core.rollout.prompts import reply_prefill

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from ragen_core.config import EnvConfig, ExperimentConfig, RolloutConfig
    from ragen_core.envs.base import TextEnv
    from ragen_core.types import TokenBatch, Trajectory

__all__ = [
    "FORMAT_VERSION", "GENERIC_THOUGHTS", "RandomFormatGenerator", "format_reply", "format_stats", "measure_format",
    "prefix_detached_backward", "random_policy_stats", "sample_episodes", "supervised_loss", "synthetic_dialogues",
    "train_format", "warmup_dir", "warmup_key", "warmup_model",
]

FORMAT_VERSION = 2
"""Bumped whenever the synthetic data or the training recipe changes, so old caches are not reused
(2: linear learning-rate decay)."""

GENERIC_THOUGHTS: tuple[str, ...] = (
    "Let me look at the state and pick an action.",
    "I will choose an action now.",
    "Let me think about what to do next.",
    "I should make a move.",
    "I will try this.",
    "Let me decide on my next step.",
    "I look at the current state first.",
    "Time to act.",
    "I will pick one of the available actions.",
    "Let me read the state carefully.",
    "I need to choose what to do.",
    "This seems like a reasonable choice.",
    "Let me go with this.",
    "I will take an action and see what happens.",
    "Let me check my options.",
    "I have made my decision.",
    "I will answer now.",
    "Let me consider the options briefly.",
    "I choose my action.",
    "Here is my move.",
)
"""Short thoughts that say nothing about any task: the warm-up teaches where thinking goes, not what to think."""

WARMUP_SEED = 0
"""The warm-up's own seed (data and order); fixed so runs with different trainer seeds share one cache."""
_SEED_START = 1_000_000
"""First env seed of the synthetic dialogues: far from training (0..) and evaluation (123..) seeds."""
_BATCH = 8
"""Dialogues per supervised step."""

Progress = Callable[[str], None]


# --------------------------------------------------------------------------- synthetic dialogues


def format_reply(thought: str, actions: Sequence[str], think: bool) -> str:
    """The reply text of the required format (SPEC §3), actions joined by `` || ``."""
    answer = f"<answer>{f' {ACTION_SEP} '.join(actions)}</answer>"
    return f"<think>{thought}</think>{answer}" if think else answer


class RandomFormatGenerator:
    """A ``Generator`` (generators/base.py) that plays random valid actions in the required format.

    It mirrors each episode of ``run_rollouts`` in a shadow env of its own: the loop makes episode
    (group g, member m) with ``reset(seed=seeds[g], options={"dynamics_seed": m})`` and sends all
    episodes, in (group, member) order, to the first ``generate`` call; each session id is bound to
    its shadow there. A reply's actions are sampled from the shadow's state and stepped in it exactly
    as the loop will step them in the real env (up to the turn's and the episode's action budgets,
    stopping at the end of the episode), so every action is valid when the loop runs it.

    Free-form envs (WebShop, Countdown) get one action per reply: the loop matches all actions of a
    reply against the state before the turn, and their valid actions change with the state.
    Reply ids are the tokenizer's ids of the text plus the first stop token (as ``ScriptedGenerator``),
    log-probs are 0.0 (nothing samples them). When a reply would exceed ``max_new_tokens``, its thought
    is replaced by the shortest one that fits.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, env_cfg: EnvConfig, rollout_cfg: RolloutConfig,
                 seeds: Sequence[int], n_per_group: int, rng: np.random.Generator) -> None:
        self.tokenizer = tokenizer
        self.env_cfg = env_cfg
        self.rollout_cfg = rollout_cfg
        self.seeds = [int(s) for s in seeds]
        self.n_per_group = int(n_per_group)
        self.rng = rng
        self.replies: list[str] = []
        """Every reply text, in the order generated (for tests and reading)."""
        self._shadows: dict[Hashable, _Shadow] = {}

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 session_ids: Sequence[Hashable] | None = None) -> list[Generation]:
        if session_ids is None or len(session_ids) != len(prompts):
            raise ValueError("RandomFormatGenerator needs one session id per prompt (run_rollouts passes them)")
        if not self._shadows:
            self._bind(session_ids)
        return [self._reply(self._shadows[sid], params) for sid in session_ids]

    def end_sessions(self, session_ids: Iterable[Hashable]) -> None:
        return None  # shadows are kept: they are small, and a late reply for an ended session is a bug to surface

    def update_weights(self, model: Any) -> None:
        return None

    @property
    def stats(self) -> dict[str, float]:
        return dict.fromkeys(STAT_KEYS, 0.0)

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

    def _reply(self, shadow: _Shadow, params: SamplingParams) -> Generation:
        cfg = self.rollout_cfg
        if shadow.done:
            raise RuntimeError("the rollout loop asked for a reply after the shadow episode ended: they drifted apart")
        most = min(cfg.max_actions_per_turn, cfg.max_actions_per_episode - shadow.used)
        if shadow.env.free_form_actions:
            most = 1
        actions = shadow.play(int(self.rng.integers(1, most + 1)), self.rng, cfg.max_actions_per_episode)
        stop = list(params.stop_token_ids[:1])
        prefill = reply_prefill(cfg.think, cfg.prefill)
        order = [int(self.rng.integers(len(GENERIC_THOUGHTS)))]
        order += sorted(range(len(GENERIC_THOUGHTS)), key=lambda k: len(GENERIC_THOUGHTS[k]))
        for k in order:  # the drawn thought, else the shortest ones that fit
            text = format_reply(GENERIC_THOUGHTS[k], actions, cfg.think)
            sampled = text[len(prefill):] if text.startswith(prefill) else text  # the context ends with the prefill
            ids = list(self.tokenizer(sampled, add_special_tokens=False)["input_ids"]) + stop
            if len(ids) <= params.max_new_tokens:
                self.replies.append(text)
                return Generation(token_ids=tuple(int(i) for i in ids), logprobs=(0.0,) * len(ids),
                                  finish_reason=FINISH_STOP)
        raise ValueError(f"rollout.max_new_tokens={params.max_new_tokens} is too small for even the shortest "
                         f"reply in the required format ({len(ids)} tokens: {text!r})")


class _Shadow:
    """One episode's shadow env and the action budget it has used (mutable, private)."""

    def __init__(self, env: TextEnv) -> None:
        self.env = env
        self.used = 0
        self.done = False

    def play(self, k: int, rng: np.random.Generator, episode_budget: int) -> list[str]:
        """Sample and step up to ``k`` valid actions, stopping where the loop stops (module rules)."""
        actions: list[str] = []
        for _ in range(k):
            text = self.env.sample_action(rng)
            action = self.env.match_action(text)
            if action is None:
                raise RuntimeError(f"{self.env.name}.sample_action gave {text!r}, which match_action rejects")
            _, _, terminated, truncated, info = self.env.step(action)
            if info.get("invalid_action", False):
                raise RuntimeError(f"{self.env.name} rejected its own sampled action {text!r}")
            actions.append(text)
            self.used += 1
            if terminated or truncated or self.used >= episode_budget:
                self.done = True
                break
        return actions


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

    ``seed`` drives the thoughts and actions. Every turn of the result parses and names only valid
    actions (checked: a failure means the shadow envs drifted from the loop, and raises).
    """
    from ragen_core.rollout.loop import run_rollouts

    seeds = list(range(seed_start, seed_start + n))
    gen = RandomFormatGenerator(tokenizer, env_cfg, rollout_cfg, seeds, 1, np.random.default_rng(seed))
    trajs = run_rollouts(env_cfg, gen, tokenizer, rollout_cfg, seeds, 1, model_max_length=model_max_length)
    bad = [(t.seed, i, turn.response_text) for t in trajs for i, turn in enumerate(t.turns) if not turn.parse_ok]
    if bad:
        raise RuntimeError(f"synthetic replies that the rollout loop rejected (seed, turn, reply): {bad[:3]}")
    return trajs


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
                    n: int = 64, *, temperature: float = 1.0, sampling_seed: int = 0) -> list[Trajectory]:
    """``n`` episodes (env seeds 0..n-1, one each) sampled from ``model`` by the real rollout loop (hf backend)."""
    from ragen_core.rollout.generators import make_generator
    from ragen_core.rollout.loop import run_rollouts

    max_len = _max_length(cfg, model)
    gen = make_generator("hf", model, tokenizer, max_length=max_len)
    return run_rollouts(cfg.env, gen, tokenizer, cfg.rollout, list(range(n)), 1, temperature,
                        sampling_seed=sampling_seed, model_max_length=max_len)


def measure_format(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, cfg: ExperimentConfig,
                   n: int = 64, *, temperature: float = 1.0, sampling_seed: int = 0) -> dict[str, float]:
    """:func:`format_stats` of :func:`sample_episodes`: format validity and success of ``model`` on ``cfg``'s env."""
    return format_stats(sample_episodes(model, tokenizer, cfg, n, temperature=temperature, sampling_seed=sampling_seed))


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


def _training_batches(cfg: ExperimentConfig, tokenizer: PreTrainedTokenizerBase, max_length: int | None,
                      steps: int) -> list[TokenBatch]:
    from ragen_core.rollout.batch import build_token_batch

    trajs = synthetic_dialogues(cfg.env, cfg.rollout, tokenizer, steps * _BATCH, model_max_length=max_length)
    return [build_token_batch(trajs[i:i + _BATCH], tokenizer, cfg.rollout, max_length)
            for i in range(0, len(trajs), _BATCH)]


# --------------------------------------------------------------------------- cache


def _base_fingerprint(path: Path) -> str:
    """What identifies the base model's weights: its marker's facts, else config + weight file stats."""
    from ragen_core.models import MARKER

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
    r = cfg.rollout
    facts = {
        "format_version": FORMAT_VERSION,
        "base": cfg.model.name,
        "base_fingerprint": base_fingerprint,
        "env": {"name": cfg.env.name, "params": cfg.env.params},
        "rollout": {k: getattr(r, k) for k in ("think", "max_turns", "max_actions_per_turn", "max_actions_per_episode",
                                               "max_new_tokens", "system_prompt", "window_turns", "max_context_tokens")},
        "max_length": cfg.model.max_length,
        "steps": cfg.model.warmup_steps,
        "lr": cfg.model.warmup_lr,
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode("utf-8")).hexdigest()


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-.") or "model"


def warmup_dir(cfg: ExperimentConfig, base_fingerprint: str) -> Path:
    """``models_dir()/warmup-<base>-<env>-<hash12>``: where the warmed copy of ``cfg``'s model is cached."""
    from ragen_core.models import models_dir

    base = _slug(Path(cfg.model.name.rstrip("/")).name)
    return models_dir() / f"warmup-{base}-{_slug(cfg.env.name)}-{warmup_key(cfg, base_fingerprint)[:12]}"


def warmup_model(cfg: ExperimentConfig, force: bool = False, progress: Progress | None = None) -> Path:
    """The format-warmed copy of ``cfg.model.name`` for ``cfg``'s env and format, trained once and cached.

    Returns a directory that ``load_model(str(path))`` / ``load_tokenizer(str(path))`` load. A complete
    cached copy is returned at once; ``force=True`` trains and replaces it. ``progress`` gets one line
    per stage.
    """
    from ragen_core import models as m

    base_path = m.resolve_model(cfg.model.name)  # before the lock: provisioning the base takes it too
    target = warmup_dir(cfg, _base_fingerprint(base_path))
    if not force and m.check_model_dir(target) is None:
        return target
    with m._models_lock(progress):
        if not force and m.check_model_dir(target) is None:  # another process made it while we waited
            return target
        m._clean_leftovers(target.name)
        with m._staging_dir(target.name) as tmp:
            facts = _build(cfg, base_path, tmp, progress)
            m._publish(tmp, target, facts)
    m._say(progress, f"format-warmed model ready in {target}")
    return target


def _build(cfg: ExperimentConfig, base_path: Path, out: Path, progress: Progress | None) -> dict[str, Any]:
    """Train the warm-up from ``base_path`` and save model + tokenizer into ``out``; the marker's facts."""
    from ragen_core.models import _say, load_model, load_tokenizer

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
            _say(progress, f"format warm-up of {cfg.model.name} on {cfg.env.name}: {steps} steps x {_BATCH} "
                           f"synthetic dialogues, lr {lr:g}")
            batches = _training_batches(cfg, tokenizer, _max_length(cfg, model), steps)
            losses = train_format(model, batches, lr, progress=progress)
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return {
        "spec": f"warmup:{cfg.model.name}",
        "base": cfg.model.name,
        "base_path": str(base_path),
        "env": cfg.env.name,
        "env_params": json.loads(json.dumps(cfg.env.params, default=str)),
        "think": cfg.rollout.think,
        "steps": steps,
        "lr": lr,
        "batch": _BATCH,
        "format_version": FORMAT_VERSION,
        "loss_first": round(losses[0], 4),
        "loss_last": round(losses[-1], 4),
        "seconds": round(time.perf_counter() - started, 1),
        "cpu_seconds": round(time.process_time() - cpu_started, 1),
        "threads": train_threads,
    }


def _device(cfg: ExperimentConfig) -> str:
    from ragen_core.trainer.models import resolve_device

    return str(resolve_device(cfg.model.device))
