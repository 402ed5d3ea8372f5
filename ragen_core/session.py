"""One training run as plain Python: the steps that flows/train.py chains as Prefect tasks.

    from ragen_core.config import load_experiment
    from ragen_core.session import open_session, run_to_end, finish
    from ragen_core.tracking import NullLogger

    sess = open_session(load_experiment("experiments/smoke.yaml"), NullLogger())
    run_to_end(sess)     # per iteration: (evaluate) -> rollout -> filter -> update -> log -> (checkpoint)
    finish(sess)

Each step is its own function (evaluate_policy, collect_rollouts, diagnose, tokenize_and_filter, update_policy,
record_iteration, save_run_checkpoint, record_final_eval) so the flow can make each a task. Nothing here imports
Prefect or MLflow: the metric logger is passed in (STYLE.md rule 7). Where a run keeps its files (config,
history, checkpoints, shards) is :class:`ragen_core.store.run_dir.RunDir`'s business (``sess.folder``).

Several processes (``torchrun`` or ``ragen train --nproc N``; trainer.backend deepspeed) run the same steps in
the same order, each with its own Session, and end where one process ends (:mod:`ragen_core.distributed`):

- rollouts and evaluations: each rank plays its share of the prompt groups (the episodes keep their global
  group index, hence their sampling streams) and the ranks gather the trajectories in group order, so every
  rank holds the one-process RolloutBatch (under ZeRO-3 the hf generator samples inside
  ``TrainState.generation_weights``: the actor gathered whole once, so each rank's forwards are its own);
- diagnose, filter and update run on every rank on that same full batch (the DeepSpeed engine gives each rank
  its rows of every mini-batch and sums the gradients), so the kept groups and the weights are one process's;
- rank 0 alone (``sess.main``) writes the folder, config, history, shards, checkpoints and final model and
  logs (the others get a NullLogger); every rank still enters the collectives inside those steps (ZeRO
  gathers), and a stop is rank 0's decision, broadcast, so all ranks stop together.

Every rank runs the one loop, :func:`run_to_end`: rank 0 inside the flow, with the steps as Prefect tasks
(tasks/train_steps.py) and the flow's hooks; the others in :func:`follow_main`, with the plain steps.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, ParamSpec, TypeVar

import numpy as np
import torch

from ragen_core import distributed
from ragen_core.algos.collapse import MI_ZSCORE_EPS
from ragen_core.config import ConfigError, ExperimentConfig, load_experiment, to_dict
from ragen_core.memory import PeakMemory
from ragen_core.models import causal_lm, load_model, load_tokenizer, resolve_model
from ragen_core.rollout.batch import build_token_batch, build_turn_batch
from ragen_core.rollout.engine_settings import generator_kwargs
from ragen_core.rollout.evaluate import evaluate, heldout_seeds
from ragen_core.rollout.generators import Generator, make_generator
from ragen_core.rollout.loop import run_rollouts
from ragen_core.rollout.metrics import rollout_metrics, step_group_metrics
from ragen_core.store.run_dir import RunDir
from ragen_core.tracking import (
    CollapseMonitor,
    EarlyStopRules,
    MetricLogger,
    NullLogger,
    plot_curves,
    trajectories_text,
)
from ragen_core.tracking.early_stop import HEALTH_STOP
from ragen_core.tracking.mlflow_logger import browse_hint
from ragen_core.tracking.run_meta import REPLIES_TABLE, default_run_name, replies_table
from ragen_core.tracking.viewer import html_for_iteration
from ragen_core.trainer import (
    TrainState,
    filter_batch,
    init_state,
    load_checkpoint,
    save_checkpoint,
    update,
)
from ragen_core.trainer.collapse import measure_collapse, measure_later_turns
from ragen_core.trainer.engine import compute_precision
from ragen_core.trainer.models import resolve_device
from ragen_core.trainer.update import grad_buckets
from ragen_core.trainer.warmup import warmup_facts, warmup_model
from ragen_core.types import RolloutBatch, Selection, Trajectory, UpdateStats
from ragen_core.watchdog import stall_watchdog

if TYPE_CHECKING:  # transformers only for the annotation: ragen_core.models loads it when a model is loaded
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger("ragen")

TRAIN_SEED_OFFSET = 1_000_000
"""Training env seeds start here, so they never meet the held-out evaluation seeds (123.. in SPEC §5)."""

CHECKPOINTS_KEPT = 2
"""Older checkpoints are deleted: a full fine-tuning checkpoint of the 135M model is ~2 GB."""


class Session:
    """The live objects of a run (mutable on purpose: models, generator and counters change).

    A plain class, not a dataclass: Prefect walks (and may rebuild) dataclass task arguments.
    Not a record in ``types.py``: it owns behaviour (``done``, ``folder``) and the run's live objects.
    """

    cfg: ExperimentConfig
    run_dir: Path
    """The run folder (its layout is ``folder``'s business)."""
    name: str
    """The run's name: the folder's name."""
    tokenizer: PreTrainedTokenizerBase
    state: TrainState
    """Models, engines (optimizers) and counters: what a checkpoint saves."""
    generator: Generator
    """Samples rollouts from the actor; told of new weights after every update."""
    logger: MetricLogger
    monitor: CollapseMonitor
    """Echo Trap monitor (reward std, entropy, grad norm against their baselines)."""
    rules: EarlyStopRules
    """RAGEN-2's early stops and template-collapse rules."""
    collapse_ema: dict[str, float]
    """EMA of the marginal std per collapse/ scope (RAGEN-2), kept across iterations and checkpoints."""
    model_max_length: int | None
    """The context the rollouts must fit (``model.max_length`` or the actor's position limit); None: unknown."""
    history: list[dict[str, float]]
    """One row per recorded iteration (and the final evaluation), as in the run's history.jsonl."""
    stop_reason: str | None
    """Why the run stops early (a health rule or the Echo Trap monitor); None while it goes on."""
    say: Callable[[str], None]
    """Where the one-line messages go (print by default)."""
    progress: Callable[[str, int, int], None] | None
    """(step name, done, total) progress callback of rollouts and evaluations; None: silent."""
    main: bool
    """This process writes the run's files and logs: rank 0 of a multi-process run (module docstring), or alone."""
    memory: PeakMemory
    """The run's peak resident memory and each step's (``perf/peak_rss_gib``), counted from the run's opening, so a
    sweep worker's second trial does not inherit the first one's peak."""
    last_record: float
    """``time.perf_counter()`` at the previous recorded iteration (or the session's start): the wall time of an
    iteration, whatever runs it (the flow's tasks and tracking included), is ``timing/iteration_s``."""

    def __init__(self, cfg: ExperimentConfig, run_dir: Path, tokenizer: PreTrainedTokenizerBase, state: TrainState,
                 generator: Generator, logger: MetricLogger, monitor: CollapseMonitor, model_max_length: int | None,
                 history: list[dict[str, float]], rules: EarlyStopRules,
                 say: Callable[[str], None] = print,
                 progress: Callable[[str, int, int], None] | None = None, memory: PeakMemory | None = None) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.name = run_dir.name
        self.tokenizer = tokenizer
        self.state = state
        self.generator = generator
        self.logger = logger
        self.monitor = monitor
        self.rules = rules
        self.collapse_ema = {}
        self.model_max_length = model_max_length
        self.history = history
        self.stop_reason = None
        self.say = say
        self.progress = progress
        self.main = distributed.is_main()
        self.memory = memory or PeakMemory()
        self.last_record = time.perf_counter()

    @property
    def iteration(self) -> int:
        return int(self.state.iteration)

    @property
    def done(self) -> bool:
        return self.stop_reason is not None or self.iteration >= self.cfg.trainer.iterations

    @property
    def folder(self) -> RunDir:
        """The run folder's layout: config, history, checkpoints, shards (store/run_dir.py)."""
        return RunDir(self.run_dir)


# --------------------------------------------------------------------------- opening


def new_run_name(cfg: ExperimentConfig) -> str:
    """``<preset>-<env>-s<seed>-<time>``: the folder's and the MLflow run's name (tracking/run_meta.py)."""
    return default_run_name(cfg)


def resume_config(run: str, overrides: list[str]) -> tuple[ExperimentConfig, RunDir]:
    """The saved resolved config of a run under the runs root (RunDir.resumable), plus overrides, and its folder."""
    folder = RunDir.resumable(run)
    problem = folder.config_problem()  # a cut config.yaml would resume with defaults for its missing keys
    if problem:
        raise ConfigError(f"cannot resume {folder.name}: {problem}")
    return load_experiment(folder.config_path, overrides), folder


def check_world(cfg: ExperimentConfig, world: int) -> None:
    """ConfigError unless ``cfg`` can train in ``world`` processes: more than one needs the DeepSpeed engine
    (the torch engine would train a separate copy in every process)."""
    if world > 1 and cfg.trainer.backend != "deepspeed":
        raise ConfigError(f"{world} processes need trainer.backend=deepspeed (data parallel, ZeRO 0-3); "
                          f"trainer.backend is {cfg.trainer.backend}")


def agree_run(cfg: ExperimentConfig | None, folder: RunDir | None) -> tuple[ExperimentConfig, RunDir]:
    """Rank 0's config and run folder on every rank (a collective; the other ranks pass None).

    Rank 0 names a new run (the name holds the time, which the ranks need not agree on) and reads a resumed
    run's config once; one process gets its own arguments back.
    """
    cfg, folder = distributed.broadcast((cfg, folder))
    if cfg is None or folder is None:
        raise ValueError("rank 0 has no run to share: pass its config and folder")
    return cfg, folder


def base_model_spec(cfg: ExperimentConfig, say: Callable[[str], None] = print) -> str:
    """The model a run starts from: the configured one, or its cached format-warmed copy (one line says which)."""
    if cfg.model.warmup == "none":
        return cfg.model.name
    path = warmup_model(cfg, progress=say)
    facts = warmup_facts(path)
    say(f"starting from the {facts.get('method')} format warm-up of {cfg.model.name} ({facts.get('steps')} steps, "
        f"format validity {facts.get('validity_before')} -> {facts.get('validity_after')}): {path}")
    return str(path)


def open_session(
    cfg: ExperimentConfig,
    logger: MetricLogger,
    run_dir: Path | RunDir | None = None,
    *,
    say: Callable[[str], None] = print,
    progress: Callable[[str, int, int], None] | None = None,
) -> Session:
    """Build (or, when ``run_dir`` holds a checkpoint, restore) everything a run needs.

    Without ``run_dir`` the run gets a new folder named after the experiment and the time (several processes:
    pass rank 0's, see :func:`agree_run`). Every rank reads the checkpoint; rank 0 alone writes the folder.
    """
    check_world(cfg, distributed.world_size())
    memory = PeakMemory()  # perf/peak_rss_gib is this run's, also in a sweep worker that ran other trials before
    folder = RunDir.named(new_run_name(cfg)) if run_dir is None else RunDir(Path(run_dir))
    if distributed.is_main():
        folder.create()
    with distributed.main_first():  # rank 0 builds a missing format-warmed model, the others then load it
        model_spec = base_model_spec(cfg, say)
    if model_spec != cfg.model.name:  # the warm-up's facts (method, steps, validity before -> after) as params
        logger.log_params({f"warmup.{k}": v for k, v in warmup_facts(Path(model_spec)).items()})
    # A warmed copy is passed as the starting weights, so checkpoints keep the configured model name.
    base = load_model(model_spec, dtype=getattr(torch, cfg.model.dtype)) if model_spec != cfg.model.name else None
    with distributed.main_first():  # rank 0 repairs what a kill left in checkpoints/ before the others look
        ckpt = folder.latest_checkpoint()
    state = load_checkpoint(ckpt, cfg, base) if ckpt else init_state(cfg, base)
    logger.set_tags({"precision": compute_precision(cfg)})  # auto resolved for the host
    h = cfg.health
    monitor = CollapseMonitor(h.baseline_iters, h.std_drop, h.entropy_drop, h.grad_z, h.patience,
                              "off" if h.action == "off" else h.action, level_drop=h.level_drop)
    rules = EarlyStopRules.from_config(h)
    if ckpt and (ckpt / "health.json").exists():
        saved = json.loads((ckpt / "health.json").read_text())
        monitor.load_state_dict(saved["echo"])
        rules.load_state_dict(saved["rules"])
        collapse_ema = {str(k): float(v) for k, v in saved["collapse_ema"].items()}
    else:
        collapse_ema = {}
    with distributed.main_first():  # the iterations after the checkpoint are redone: rank 0 sets their rows aside
        history = (folder.supersede_history(state.iteration) if distributed.is_main()
                   else [r for r in folder.read_history() if int(r.get("iteration", 0)) < state.iteration])
    tokenizer = load_tokenizer(model_spec)
    max_len = cfg.model.max_length or getattr(state.models.actor.config, "max_position_embeddings", None)
    engine_kw = generator_kwargs(cfg, state.models.actor, resolve_device(cfg.model.device), max_len,
                                 value_head=_rollout_value_head(state))  # vLLM: one engine per rank, on its GPU
    with state.full_weights():  # a vLLM generator starts from a saved copy of the actor
        generator = make_generator(cfg.rollout.backend, state.models.actor, tokenizer, **engine_kw)
    if distributed.is_main():
        folder.write_config(to_dict(cfg))
    sess = Session(cfg, folder.path, tokenizer, state, generator, logger, monitor, max_len, history, rules, say,
                   progress, memory)  # the run's peak counted from its opening, the model loads included
    sess.collapse_ema = collapse_ema
    return sess


def _rollout_value_head(state: TrainState) -> torch.nn.Module | None:
    """The actor's value head (``critic: head``) for the hf generator to record old values with, so the update
    runs no forward for them (trainer.update._rollout_side); None with a separate critic or none, or when ZeRO-3
    partitions the head (its weights are whole only inside the engine's forward and generation_weights, and the
    generator that would hold it is built outside both)."""
    head = state.models.value_head
    if head is None or any(hasattr(p, "ds_id") for p in head.parameters()):
        return None
    return head


# --------------------------------------------------------------------------- the steps


def collect_rollouts(sess: Session) -> RolloutBatch:
    """P·k fresh prompt groups × N responses at the training temperature (SPEC §5, Online-k)."""
    cfg, state = sess.cfg, sess.state
    n_groups = cfg.prompts_per_rollout
    seeds = train_seeds(state.env_seed_counter, n_groups)
    before = dict(sess.generator.stats)
    started = time.perf_counter()

    def play(part: range) -> list[Trajectory]:  # groups part.start.. keep their global index (sampling streams)
        return run_rollouts(cfg.env, sess.generator, sess.tokenizer, cfg.rollout, seeds[part.start:part.stop],
                            cfg.rollout.responses_per_prompt, group_offset=part.start,
                            sampling_seed=cfg.trainer.seed * 1_000_003 + state.iteration,
                            model_max_length=sess.model_max_length, progress=_progress(sess, "rollout"))

    split = splits_rollouts(sess)
    with sess.memory.step("rollout") as peak, generation_weights(sess):
        trajs = distributed.split_map(n_groups, play, split)  # every rank: all groups, in group order
    seconds = time.perf_counter() - started
    state.env_seed_counter += n_groups
    gen = {k: sess.generator.stats.get(k, 0.0) - before.get(k, 0.0) for k in before}
    if split:  # each rank generated its share of the tokens
        gen = distributed.sum_values(gen)
    metrics = rollout_metrics(trajs)
    metrics.update(step_group_metrics(trajs))
    metrics["timing/rollout_s"] = seconds
    metrics["perf/generated_tokens"] = gen.get("generated_tokens", 0.0)
    metrics["perf/rollout_tokens_per_s"] = gen.get("generated_tokens", 0.0) / max(seconds, 1e-9)
    metrics.update(peak)
    return RolloutBatch(state.iteration, trajs, metrics)


def splits_rollouts(sess: Session) -> bool:
    """Whether the ranks share out the episodes of rollouts and evaluations (then gather them): with more than one.

    Under ZeRO-3 too: the hf generator samples inside :func:`generation_weights`, so no forward of it is a
    collective and the ranks need not make the same ones.
    """
    return distributed.world_size() > 1


def generation_weights(sess: Session) -> contextlib.AbstractContextManager[None]:
    """The block in which the hf generator samples from the actor itself (rollouts, evaluations): on its whole
    weights, gathered once under ZeRO-3 (:meth:`TrainState.generation_weights`; every rank enters it). A vLLM
    engine holds its own copy of the weights: nothing to do."""
    if sess.cfg.rollout.backend != "hf":
        return contextlib.nullcontext()
    return sess.state.generation_weights()


def train_seeds(counter: int, n: int) -> list[int]:
    """The next ``n`` training seeds: disjoint from every evaluation seed below TRAIN_SEED_OFFSET."""
    return list(range(TRAIN_SEED_OFFSET + counter, TRAIN_SEED_OFFSET + counter + n))


def tokenize_and_filter(sess: Session, rollouts: RolloutBatch) -> Selection:
    """The rollouts as training rows (a TokenBatch), then the StarPO-S filter over whole prompt groups (SPEC §4).

    The filter ranks groups of whole-trajectory rows; under ``rollout.context_window`` K the kept trajectories are
    then laid out one row per turn (``build_turn_batch``), which the update trains on.

    'none' keeps all groups. (Not ``algos.filtering.select_groups``, which picks group indices from scores.)
    """
    trajs = rollouts.trajectories
    full = build_token_batch(trajs, sess.tokenizer, sess.cfg.rollout, sess.model_max_length,
                             reward_placement=sess.cfg.reward_placement)
    result = filter_batch(full, trajs, sess.cfg.algorithm)
    rows = result.rows.tolist()
    kept = [False] * len(trajs)
    for r in rows:
        kept[r] = True
    think = [float(sum(t.think_tokens for t in trajs[r].turns)) for r in rows]
    metrics = dict(result.metrics)
    if grad_buckets_due(sess):  # on every group, the dropped ones included, before the update moves the weights
        with sess.memory.step("grad_buckets") as peak:
            metrics.update(grad_buckets(sess.state, full, sess.cfg))
        metrics.update(peak)
    batch = result.batch
    if sess.cfg.rollout.per_turn_rows and rows:  # the filter ranks whole trajectories; the update trains on turns
        batch = build_turn_batch([trajs[r] for r in rows], sess.tokenizer, sess.cfg.rollout, sess.model_max_length)
        think = [float(turn.think_tokens) for r in rows for turn in trajs[r].turns if turn.response_ids]  # its rows
    return Selection(batch, kept, metrics, think, result.advantage_scale)


def grad_buckets_due(sess: Session) -> bool:
    """The gradient analysis by reward-std bucket runs on this iteration (``diagnostics.grad_buckets_every``)."""
    every = sess.cfg.diagnostics.grad_buckets_every
    return every > 0 and sess.iteration % every == 0


def update_policy(sess: Session, selection: Selection) -> UpdateStats:
    """All optimizer steps of this rollout batch, then fresh weights for the generator.

    When the filter kept nothing (no group with signal), the update is skipped and says so.
    """
    if selection.batch.batch_size == 0:
        sess.say(f"[filter] iteration {sess.iteration + 1}: no group kept, update skipped")
        sess.state.iteration += 1
        return UpdateStats(metrics={"rollout/update_skipped": 1.0}, optimizer_steps=0)
    asleep = sess.cfg.rollout.vllm_sleep and callable(getattr(sess.generator, "sleep", None))
    if asleep:  # the engine's weights and KV cache leave the GPU while the trainer runs
        sess.generator.sleep()  # type: ignore[attr-defined]
    try:
        with sess.memory.step("update") as peak:
            stats = update(sess.state, selection.batch, sess.cfg, think_tokens=selection.think_tokens,
                           advantage_scale=selection.advantage_scale, kl_metric=kl_metric_due(sess))
    finally:
        if asleep:
            sess.generator.wake()  # type: ignore[attr-defined]
    stats.metrics.update(peak)
    # The hf generator samples from the actor itself (inside generation_weights); a vLLM one copies the
    # weights, so they are gathered whole for it.
    gather = sess.state.full_weights() if sess.cfg.rollout.backend != "hf" else contextlib.nullcontext()
    with gather:
        sess.generator.update_weights(sess.state.models.actor)
    sess.state.iteration += 1
    stats.metrics["rollout/update_skipped"] = 0.0
    return stats


def kl_metric_due(sess: Session) -> bool:
    """This iteration's update logs ``actor/kl_ref`` (every ``diagnostics.kl_every``). Only a KL whose gradient
    does not read the reference (k1 in the loss) is skipped on the other iterations; any other KL runs its
    reference forward every iteration and logs it."""
    every = sess.cfg.diagnostics.kl_every
    return every > 0 and sess.iteration % every == 0


def collapse_due(sess: Session) -> bool:
    """Template-collapse diagnostics run on this iteration's rollouts (every ``diagnostics.collapse_every``)."""
    every = sess.cfg.diagnostics.collapse_every
    return every > 0 and sess.iteration % every == 0


def diagnose(sess: Session, rollouts: RolloutBatch) -> dict[str, float]:
    """RAGEN-2's template-collapse metrics of this iteration's rollouts, under ``collapse/`` (SPEC §8).

    First turns and (for multi-turn envs) one uniformly drawn later turn per drawn trajectory,
    each on a seeded sample capped by ``diagnostics``; the MI z-score is also normalised by an EMA of
    the marginal std, kept across iterations (and checkpoints) as the reference does.
    """

    d, trajs = sess.cfg.diagnostics, rollouts.trajectories
    rng = np.random.default_rng([sess.cfg.trainer.seed, rollouts.iteration, 7])
    picked = [trajs[i] for i in sorted(rng.permutation(len(trajs))[: d.collapse_samples])]
    model = sess.state.models.actor
    # fp32 whatever trainer.precision: bf16 scores (docs/benchmarks.md) read their rounding noise as information,
    # which raises a small MI, the collapse end of the scale (FrozenLake first turns: 0.122 against 0.098)
    with sess.memory.step("diagnose") as peak, sess.state.generation_weights():
        scopes = {"first_turn": measure_collapse(model, sess.tokenizer, picked)}
        if d.collapse_later_samples and any(len(t.turns) > 1 for t in trajs):
            scopes["later_turns"] = measure_later_turns(model, sess.tokenizer, trajs, d.collapse_later_samples, rng)
    out: dict[str, float] = dict(peak)
    for scope, m in scopes.items():
        if "marginal_std" in m:  # the EMA-normalised z-score (RAGEN-2 reference metrics, §7.3)
            prev = sess.collapse_ema.get(scope)
            ema = (m["marginal_std"] if prev is None
                   else d.collapse_ema * prev + (1 - d.collapse_ema) * m["marginal_std"])
            sess.collapse_ema[scope] = ema
            m = {**m, "marginal_std_ema": ema, "mi_zscore_ema": m["mi"] / (ema + MI_ZSCORE_EPS)}
        out.update({f"collapse/{scope}/{k}": float(v) for k, v in m.items()})
    return out


def evaluate_policy(sess: Session, seeds: int | None = None) -> dict[str, float]:
    """Held-out seeds at the evaluation temperature on every eval env (SPEC §5)."""
    ev = sess.cfg.eval
    started = time.perf_counter()
    with sess.memory.step("eval") as peak, generation_weights(sess):
        result = evaluate(sess.cfg.eval_envs, sess.generator, sess.tokenizer, sess.cfg.rollout,
                          heldout_seeds(seeds or ev.seeds, ev.seed_start), ev.samples, temperature=ev.temperature,
                          sampling_seed=sess.cfg.trainer.seed, model_max_length=sess.model_max_length,
                          progress=_progress(sess, "evaluate"), split=splits_rollouts(sess))
    return {**result.metrics, "timing/eval_s": time.perf_counter() - started, **peak}


def eval_due(sess: Session) -> bool:
    """Before iteration i's rollout when i % eval.every == 0: the policy after i updates (0 = untrained)."""
    every = sess.cfg.eval.every
    return every > 0 and sess.iteration % every == 0


def final_eval_due(sess: Session) -> bool:
    """One more evaluation after the last update, unless the last iteration already began with one."""
    every = sess.cfg.eval.every
    return every > 0 and not any(r.get("iteration") == sess.iteration and "val/success" in r for r in sess.history)


def checkpoint_due(sess: Session) -> bool:
    every = sess.cfg.trainer.checkpoint_every
    return every > 0 and (sess.iteration % every == 0 or sess.done)


def record_iteration(sess: Session, rollouts: RolloutBatch, selection: Selection, stats: UpdateStats,
                     val: dict[str, float] | None, diagnostics: dict[str, float] | None = None) -> dict[str, float]:
    """Health checks, metrics to the logger, the Parquet shard, readable samples, one summary line."""
    cfg, step = sess.cfg, rollouts.iteration
    metrics = {**rollouts.metrics, **selection.metrics, **stats.metrics, **(val or {}), **(diagnostics or {})}
    now = time.perf_counter()
    metrics["timing/iteration_s"], sess.last_record = now - sess.last_record, now
    metrics["perf/peak_rss_gib"] = sess.memory.run_peak() / 2**30
    report = sess.monitor.update(step, metrics.get("rollout/reward_std_all", metrics.get("rollout/reward_std", 0.0)),
                                 metrics.get("actor/entropy", 0.0), metrics.get("actor/grad_norm", 0.0),
                                 metrics.get("rollout/success", math.nan))
    metrics.update(report.metrics)
    if report.warning:
        sess.say(f"[health] {report.warning}")
    if report.stop and cfg.health.action == "stop":
        sess.stop_reason = f"{HEALTH_STOP} {report.reason or 'collapse detected'}"
    rules = sess.rules.update(step, metrics)  # RAGEN-2's early stops and template collapse (SPEC §8)
    metrics.update(rules.metrics)
    for line in rules.warnings:
        sess.say(f"[health] {line}")
    if rules.fired:
        sess.logger.set_tags({f"health.{rule}": str(step) for rule in rules.fired})
    if rules.stop and sess.stop_reason is None:
        sess.stop_reason = f"{HEALTH_STOP} {rules.reason}"
    sess.stop_reason = distributed.broadcast(sess.stop_reason)  # rank 0 decides: every rank stops with it
    row = {"iteration": step, **metrics}
    sess.history.append(row)
    if sess.main:
        _publish_iteration(sess, rollouts, selection, row)
    sess.say(summary_line(sess, row))
    return metrics


def _publish_iteration(sess: Session, rollouts: RolloutBatch, selection: Selection, row: dict[str, float]) -> None:
    """Rank 0's part of recording: the shard, the history row, metrics, samples and the shard as artifacts."""
    step, cfg = rollouts.iteration, sess.cfg
    metrics = {k: v for k, v in row.items() if k != "iteration"}
    shard = sess.folder.write_shard(step, rollouts.trajectories, selection.kept)
    sess.logger.log_metrics(metrics, step=step)
    every = cfg.tracking.artifact_every
    if every and (step % every == 0 or sess.done):
        sample = rollouts.trajectories[: cfg.tracking.sample_trajectories]
        if sample:
            sess.logger.log_text(trajectories_text(sample), f"samples/iter={step:04d}.txt")
            sess.logger.log_table(replies_table(step, sample, selection.kept[: len(sample)]), REPLIES_TABLE)
        sess.logger.log_artifact(shard, f"rollouts/iteration={step}")  # the run folder's partition name
        page = html_for_iteration(rollouts.trajectories, selection.kept, sess.name, step)
        sess.logger.log_text(page, f"viewer/iteration={step}.html")  # states, thoughts, actions, rewards, kept
    sess.folder.append_history(row)


def summary_line(sess: Session, m: dict[str, float]) -> str:
    tag = sess.cfg.env.label
    val = m.get("val/success")
    parts = [
        f"iter {m['iteration'] + 1}/{sess.cfg.trainer.iterations}",
        f"success {m.get(f'env/{tag}/success', float('nan')):.2f}",
        *([f"val {val:.2f}"] if val is not None else []),
        f"return {m.get(f'env/{tag}/total_return', float('nan')):+.3f}",
        f"reward std {m.get('rollout/reward_std_all', float('nan')):.3f}",
        f"entropy {m.get('actor/entropy', float('nan')):.3f}",
        f"grad norm {m.get('actor/grad_norm', float('nan')):.3f}",
        f"{m.get('timing/rollout_s', 0.0) + m.get('timing/update_s', 0.0) + m.get('timing/eval_s', 0.0):.1f}s",
    ]
    return " | ".join(parts)


def save_run_checkpoint(sess: Session) -> Path:
    """Atomic checkpoint (models, optimizers, RNGs, counters, monitor); keeps the last few.

    Every rank gathers (ZeRO partitions), rank 0 writes.
    """
    target = sess.folder.checkpoint_path(sess.iteration)
    health = json.dumps({"echo": sess.monitor.state_dict(), "rules": sess.rules.state_dict(),
                         "collapse_ema": sess.collapse_ema})
    # health.json goes in with the rest: a kill after the rename must not leave a checkpoint without it
    save_checkpoint(sess.state, target, write=sess.main, extra_files={"health.json": health})
    if sess.main:
        sess.folder.prune_checkpoints(keep=CHECKPOINTS_KEPT)
    return target


def record_final_eval(sess: Session, val: dict[str, float]) -> None:
    """The evaluation after the last update, logged at step = iterations done."""
    row = {"iteration": sess.iteration, **val}
    sess.history.append(row)
    if sess.main:
        sess.logger.log_metrics(val, step=sess.iteration)
        sess.folder.append_history(row)
    sess.say(f"final evaluation after {sess.iteration} iterations | "
             f"val success {val.get('val/success', float('nan')):.2f}")


@dataclass(frozen=True)
class Steps:
    """The steps :func:`run_to_end` chains: the plain functions of this module, or the same functions wrapped
    as Prefect tasks (tasks/train_steps.py ``STEPS``), so the flow and every other rank run one loop."""

    evaluate: Callable[[Session], dict[str, float]]
    rollout: Callable[[Session], RolloutBatch]
    diagnose: Callable[[Session, RolloutBatch], dict[str, float]]
    filter: Callable[[Session, RolloutBatch], Selection]
    update: Callable[[Session, Selection], UpdateStats]
    record: Callable[[Session, RolloutBatch, Selection, UpdateStats, dict[str, float] | None, dict[str, float] | None],
                     dict[str, float]]
    checkpoint: Callable[[Session], Path]


@dataclass(frozen=True)
class Hooks:
    """What the caller of :func:`run_to_end` adds around the steps (rank 0 of the flow: the sweep trial's
    reporter, the Prefect artifacts). Each gets the session and the step's result; none is called on other
    ranks unless they pass it."""

    after_eval: Callable[[Session, dict[str, float]], None] | None = None
    """After each evaluation inside the loop; may end the run (``sess.stop_reason``), and that evaluation is then
    recorded as the final one."""
    after_iteration: Callable[[Session, dict[str, float]], None] | None = None
    """After each recorded iteration, with its metrics."""
    after_final_eval: Callable[[Session, dict[str, float]], None] | None = None
    """After the final evaluation is recorded."""


def run_iteration(sess: Session) -> dict[str, float]:
    """(evaluate) -> rollout -> filter -> update -> record -> (checkpoint): one iteration of :func:`run_to_end`
    with the plain steps (no orchestration)."""
    return _iteration(sess, PLAIN_STEPS, PLAIN_STEPS.evaluate(sess) if eval_due(sess) else None)


def _iteration(sess: Session, steps: Steps, val: dict[str, float] | None) -> dict[str, float]:
    rollouts = steps.rollout(sess)
    diagnostics = steps.diagnose(sess, rollouts) if collapse_due(sess) else None  # the policy that sampled them
    selection = steps.filter(sess, rollouts)
    stats = steps.update(sess, selection)
    metrics = steps.record(sess, rollouts, selection, stats, val, diagnostics)
    if checkpoint_due(sess):
        steps.checkpoint(sess)
    return metrics


_P = ParamSpec("_P")
_R = TypeVar("_R")


def run_to_end(sess: Session, steps: Steps | None = None, hooks: Hooks | None = None) -> None:
    """All remaining iterations, then the final evaluation: the one loop of a run, on every rank.

    ``steps`` defaults to the plain functions; the flow passes its Prefect tasks and its ``hooks`` (rank 0).
    A stop decided in ``after_eval`` is rank 0's and is broadcast like a health stop, so all ranks stop together.
    Each step and each turn of a rollout or evaluation (``sess.progress``) is progress for the stall watchdog
    (``trainer.stall_seconds``, ragen_core/watchdog.py): a process that hangs longer between two of them exits.
    """
    steps, hooks = steps or PLAIN_STEPS, hooks or Hooks()
    report = sess.progress
    with stall_watchdog(sess.cfg.trainer.stall_seconds, sess.say) as progress:

        def turns(what: str, done: int, total: int) -> None:
            progress()
            if report is not None:
                report(what, done, total)

        def armed(step: Callable[_P, _R]) -> Callable[_P, _R]:
            def run(*args: _P.args, **kwargs: _P.kwargs) -> _R:
                progress()
                return step(*args, **kwargs)

            return run

        sess.progress = turns
        try:
            _run_to_end(sess, Steps(*(armed(getattr(steps, f.name)) for f in fields(Steps))), hooks)
        finally:
            sess.progress = report


def _run_to_end(sess: Session, steps: Steps, hooks: Hooks) -> None:
    while not sess.done:
        val = steps.evaluate(sess) if eval_due(sess) else None  # the policy after `iteration` updates
        if val is not None and hooks.after_eval is not None:
            hooks.after_eval(sess, val)
        if val is not None:
            sess.stop_reason = distributed.broadcast(sess.stop_reason)
            if sess.done:  # this evaluation is the last one
                record_final_eval(sess, val)
                return
        metrics = _iteration(sess, steps, val)
        if hooks.after_iteration is not None:
            hooks.after_iteration(sess, metrics)
    if final_eval_due(sess):
        val = steps.evaluate(sess)
        record_final_eval(sess, val)
        if hooks.after_final_eval is not None:
            hooks.after_final_eval(sess, val)


PLAIN_STEPS = Steps(evaluate_policy, collect_rollouts, diagnose, tokenize_and_filter, update_policy, record_iteration,
                    save_run_checkpoint)
"""The steps as plain functions: what ranks other than the flow's run, and ``run_to_end`` without Prefect."""


def follow_main(say: Callable[[str], None] = lambda line: None) -> TrainResult:
    """A non-zero rank's whole run, while rank 0 runs the flow: rank 0's config and folder, then the same
    :func:`run_to_end` with the plain steps and ``finish`` (for their collectives), with a NullLogger.

    Quiet by default: rank 0 prints the run's lines. The process group must exist (distributed.join).
    """
    cfg, folder = agree_run(None, None)
    sess = open_session(cfg, NullLogger(record=False), folder, say=say)
    run_to_end(sess)
    return finish(sess)


def _progress(sess: Session, what: str) -> Callable[[int, int], None] | None:
    if sess.progress is None:
        return None
    report = sess.progress
    return lambda done, total: report(what, done, total)


# --------------------------------------------------------------------------- finishing


@dataclass(frozen=True)
class TrainResult:
    """What a finished run reports."""

    run_name: str
    run_dir: str
    mlflow_run_id: str | None
    iterations: int
    first_val_success: float | None
    last_val_success: float | None
    stop_reason: str | None
    summary: str


CURVES = ("val/success", "rollout/reward_std_all", "actor/entropy", "actor/grad_norm",
          "response/length_mean", "response/think_length_mean")


def finish(sess: Session, tracking_uri: str | None = None, log_model: bool = True) -> TrainResult:
    """Curves PNG, the final model (or adapter) as the run's logged model, a summary; closes the logger."""
    series = {k: [(int(r["iteration"]), float(r[k])) for r in sess.history if k in r] for k in CURVES}
    series[f"env/{sess.cfg.env.label}/success"] = [
        (int(r["iteration"]), float(r[f"env/{sess.cfg.env.label}/success"]))
        for r in sess.history if f"env/{sess.cfg.env.label}/success" in r]
    metrics = [k for k, v in series.items() if v]
    if metrics and sess.main:
        png = plot_curves({sess.name: series}, metrics, sess.folder.curves_png, title=sess.name)
        sess.logger.log_artifact(Path(png), "plots")
    if log_model:
        final = sess.folder.final_model
        with sess.state.full_weights():  # every rank gathers (ZeRO-3), rank 0 writes
            if sess.main:
                shutil.rmtree(final, ignore_errors=True)
                causal_lm(sess.state.models.actor).save_pretrained(final)
        if sess.main:
            sess.tokenizer.save_pretrained(final)
            # a loadable, registrable model (tracking/model_registry.py); a LoRA adapter refers to the base it adapts
            adapter = (final / "adapter_config.json").is_file()
            base = resolve_model(base_model_spec(sess.cfg, say=lambda _: None)) if adapter else None
            sess.logger.log_model(final, "model", base_model=base, step=sess.iteration)
    vals = [r["val/success"] for r in sess.history if "val/success" in r]
    first, last = (vals[0], vals[-1]) if vals else (None, None)
    close = getattr(sess.generator, "close", None)  # a vLLM engine holds its KV cache until shut down
    if callable(close):
        close()
    status = "FINISHED"
    sess.logger.set_tags({"stop_reason": sess.stop_reason} if sess.stop_reason else {})
    sess.logger.close(status)
    uri = tracking_uri or ""

    def fmt(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.2f}"

    summary = (f"run {sess.name}: {sess.iteration} iterations, val success first {fmt(first)} -> last {fmt(last)}"
               + (f", stopped: {sess.stop_reason}" if sess.stop_reason else "")
               + f"\nrun directory: {sess.run_dir}"
               + browse_hint(sess.logger, uri))
    return TrainResult(sess.name, str(sess.run_dir), sess.logger.run_id, sess.iteration, first, last,
                       sess.stop_reason, summary)
