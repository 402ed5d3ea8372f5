"""Evaluate a trained policy on held-out seeds of its env and the generalisation variants (SPEC §2, §5).

The plain-Python part of ``ragen eval`` (flows/evaluate.py chains these steps as a Prefect flow):

    from ragen_core.config import load_experiment
    from ragen_core import evaluation
    from ragen_core.store.run_dir import RunDir
    target = evaluation.resolve_target("smoke-20260101-120000")      # run name, run dir or checkpoint dir
    cfg = load_experiment(RunDir(target.run_dir).config_path)
    report = evaluation.evaluate_target(cfg, target, evaluation.evaluation_envs(cfg), seeds=32)
    print(evaluation.format_table(report))

Variants (RAGEN §5.2, SPEC §2 "Variants used for generalisation"): a Bandit run is also
evaluated on BanditTest (the held-out names Trader/Librarian), a Sokoban run on SokobanNewVocab,
LargerSokoban and, zero-shot, FrozenLake (the FrozenLake column of the paper's Tables 2-4 and of
the Online-k study). BanditRev is a training run of its own (roles reversed in training and test),
never a zero-shot test of a Bandit model. Within a family the training env's own parameters that
do not define the variant (reward values, action budget) carry over, so a run trained with a 0.1
low-risk reward is tested with 0.1 on every variant too; a transfer env (another game) takes none.

Tests: ``.venv/bin/python -m pytest tests/flows/test_evaluate_flow.py -q`` (variant map and table, then the flow).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ragen_core.config import EnvConfig, ExperimentConfig
from ragen_core.envs import env_spec
from ragen_core.rollout.evaluate import evaluate, heldout_seeds
from ragen_core.rollout.generators import make_generator
from ragen_core.store.run_dir import RunDir

__all__ = [
    "EVAL_PREFIX",
    "TRANSFER",
    "VARIANT_FAMILIES",
    "EvalReport",
    "EvalRow",
    "EvalTarget",
    "eval_rows",
    "evaluate_target",
    "evaluation_envs",
    "format_table",
    "generalisation_variants",
    "load_policy",
    "report_dict",
    "resolve_target",
    "write_report",
]

EVAL_PREFIX = "val/final"
"""Metric prefix of a stand-alone evaluation, so it never mixes with the per-iteration ``val/...`` curves."""

VARIANT_FAMILIES: dict[str, tuple[str, ...]] = {
    "Bandit": ("Bandit", "BanditTest"),
    "BanditRev": ("BanditRev",),
    "Sokoban": ("Sokoban", "SokobanNewVocab", "LargerSokoban"),
    "FrozenLake": ("FrozenLake",),
}
"""Registered env names evaluated together (SPEC §2); an env outside every family is evaluated alone."""

TRANSFER: dict[str, tuple[str, ...]] = {"Sokoban": ("FrozenLake",)}
"""Other games a family's runs are evaluated on zero-shot, with the registry's defaults (SPEC §2)."""

_DEFINING_PARAMS: dict[str, frozenset[str]] = {
    "Bandit": frozenset({"low_risk_name", "high_risk_name"}),
    "BanditRev": frozenset({"low_risk_name", "high_risk_name"}),
    "Sokoban": frozenset({"height", "width", "n_boxes", "symbols", "generator", "search_depth", "room_steps"}),
    "FrozenLake": frozenset(),
}
"""Parameters that make a variant what it is: taken from the registry, never from the training env."""


def _family(name: str) -> str | None:
    canonical = env_spec(name).name
    return next((fam for fam, members in VARIANT_FAMILIES.items() if canonical in members), None)


def generalisation_variants(env: EnvConfig) -> tuple[EnvConfig, ...]:
    """``env`` itself, then the other registered variants of its family (none outside a family).

    A variant gets ``env``'s parameters minus those that define variants (arm names; grid size,
    box count and symbols), and no tag, so it is labelled by its registered name. A variant
    whose label equals ``env``'s label is left out (e.g. a run trained on Bandit with its
    own arm names keeps the label "Bandit"). The family's transfer envs (:data:`TRANSFER`) follow,
    with their registered defaults.
    """
    family = _family(env.name)
    if family is None:
        return (env,)
    shared = {k: v for k, v in env.params.items() if k not in _DEFINING_PARAMS[family]}
    others = tuple(EnvConfig(name=name, params=dict(shared)) for name in VARIANT_FAMILIES[family])
    transfer = tuple(EnvConfig(name=name) for name in TRANSFER.get(family, ()))
    return (env, *(v for v in others + transfer if v.label != env.label))


def evaluation_envs(cfg: ExperimentConfig) -> tuple[EnvConfig, ...]:
    """The run's eval envs (``eval.envs``, else the training env), then the training env's variants; each label once."""
    out: dict[str, EnvConfig] = {}
    for env in (*cfg.eval_envs, *generalisation_variants(cfg.env)):
        out.setdefault(env.label, env)
    return tuple(out.values())


# --------------------------------------------------------------------------- what to evaluate


@dataclass(frozen=True)
class EvalTarget:
    """Which weights of which run to evaluate."""

    run_dir: Path
    """The run directory (holds config.yaml)."""
    weights: Path
    """A training checkpoint (``checkpoints/iter=NNNNNN``, has state.json) or a saved model (``final-model``)."""
    iteration: int
    """Training iterations (updates) behind the weights; also the MLflow step of the results, as a
    run's own ``val/...`` at step i describe the policy after i updates (session.eval_due)."""


def _run_iterations(run_dir: Path) -> int:
    """Updates recorded in a run's history.jsonl: the last row with an update's metrics, + 1 (0 when none).

    Rows of evaluations alone (the one after the last update) do not count.
    """
    rows = RunDir(run_dir).read_history()
    return max((int(r["iteration"]) + 1 for r in rows if "timing/update_s" in r), default=0)


def resolve_target(target: str) -> EvalTarget:
    """A checkpoint dir, a saved model dir (``final-model``), or a run (name or dir: its latest checkpoint,
    else its final model). Raises FileNotFoundError saying what was looked for."""
    path = Path(target)
    if (path / "state.json").is_file():  # a training checkpoint: <run>/checkpoints/iter=NNNNNN
        run = RunDir.of_checkpoint(path)
        iteration = int(json.loads((path / "state.json").read_text())["iteration"])
    elif (path / "config.json").is_file() and RunDir(path.parent).config_path.is_file():  # <run>/final-model
        run = RunDir(path.resolve().parent)
        iteration = _run_iterations(run.path)
    else:
        run = RunDir.find(target)
        ckpt = run.latest_checkpoint()
        if ckpt is not None:
            return resolve_target(str(ckpt))
        if not (run.final_model / "config.json").is_file():
            raise FileNotFoundError(f"run {run.path} has neither a checkpoint nor a final-model to evaluate")
        return EvalTarget(run.path, run.final_model, _run_iterations(run.path))
    if not run.config_path.is_file():
        raise FileNotFoundError(f"{target}: its run directory {run.path} holds no config.yaml")
    return EvalTarget(run.path, path.resolve(), iteration)


def load_policy(cfg: ExperimentConfig, weights: Path) -> tuple[Any, Any]:
    """The actor (eval mode) and tokenizer of ``weights``, on the run's base model.

    A checkpoint is restored with the trainer's own loader (same model-fact checks; it also restores
    the global RNG states saved with it); a saved model is a full model directory, or a LoRA adapter
    (adapter_config.json) over the base.
    """
    # Lazily: torch and the model stack only when weights are loaded; `ragen compare` imports this module
    # (through tasks/eval_steps.py) for its tables and needs neither.
    import torch

    from ragen_core.models import load_model, load_tokenizer
    from ragen_core.session import base_model_spec
    from ragen_core.trainer import load_checkpoint
    from ragen_core.trainer.models import resolve_device

    spec = base_model_spec(cfg)  # the format-warmed copy when model.warmup is on
    dtype, device = getattr(torch, cfg.model.dtype), str(resolve_device(cfg.model.device))
    if (weights / "state.json").is_file():
        # cfg keeps the configured model name (what the checkpoint's facts record); the base passed in is
        # the model the run actually started from, which differs from it under warm-up.
        actor = load_checkpoint(weights, cfg, base=load_model(spec, dtype, device)).models.actor
    else:
        if (weights / "adapter_config.json").is_file():
            from peft import PeftModel  # lazily: peft is slow to import and only LoRA adapters need it

            actor = PeftModel.from_pretrained(load_model(spec, dtype, device), weights)
        else:
            actor = load_model(str(weights), dtype, device)
    return actor.eval(), load_tokenizer(spec)


# --------------------------------------------------------------------------- running and reporting


@dataclass(frozen=True)
class EvalRow:
    """One env's line of the evaluation table."""

    env: str
    success: float
    """Mean success over all episodes (pass@1 estimated with every sample)."""
    pass_at_n: float
    """Share of seeds where any of the N samples succeeded."""
    ret: float
    """Mean env return (format penalties excluded)."""
    total_return: float
    """Mean return with format penalties (what training optimises)."""
    episodes: int


@dataclass(frozen=True)
class EvalReport:
    """A finished evaluation: the table rows, the raw metrics and what was evaluated."""

    run_dir: str
    weights: str
    iteration: int
    seeds: int
    samples: int
    """N of pass@N: responses per held-out seed."""
    rows: tuple[EvalRow, ...]
    metrics: dict[str, float]
    """``val/final/<tag>/success|return|total_return|pass_at_N`` and ``val/final/success``."""
    seconds: float


def eval_rows(metrics: dict[str, float], labels: tuple[str, ...], seeds: int, samples: int,
              prefix: str = EVAL_PREFIX) -> tuple[EvalRow, ...]:
    """Table rows from :func:`ragen_core.rollout.evaluate.evaluate`'s metrics, in ``labels`` order."""
    def get(tag: str, name: str) -> float:
        return metrics[f"{prefix}/{tag}/{name}"]

    return tuple(
        EvalRow(env=tag, success=get(tag, "success"), pass_at_n=get(tag, f"pass_at_{samples}"),
                ret=get(tag, "return"), total_return=get(tag, "total_return"), episodes=seeds * samples)
        for tag in labels
    )


def evaluate_target(
    cfg: ExperimentConfig,
    target: EvalTarget,
    envs: tuple[EnvConfig, ...],
    seeds: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> EvalReport:
    """Roll out ``envs`` on ``seeds`` held-out seeds (default ``eval.seeds``) x ``eval.samples`` each,
    at the evaluation temperature."""
    ev, n_seeds = cfg.eval, seeds or cfg.eval.seeds
    actor, tokenizer = load_policy(cfg, target.weights)
    max_len = cfg.model.max_length or getattr(actor.config, "max_position_embeddings", None)
    # the same engine settings as the training session's (an explicit GPU memory share for vLLM)
    from ragen_core.rollout.engine_settings import generator_kwargs  # lazily: torch (see load_policy)
    from ragen_core.trainer.models import resolve_device

    generator = make_generator(cfg.rollout.backend, actor, tokenizer,
                               **generator_kwargs(cfg, actor, resolve_device(cfg.model.device), max_len))
    started = time.perf_counter()
    # Same seeds, temperature and sampling seed as the in-training evaluation (session.evaluate_policy).
    result = evaluate(envs, generator, tokenizer, cfg.rollout, heldout_seeds(n_seeds, ev.seed_start), ev.samples,
                      temperature=ev.temperature, sampling_seed=cfg.trainer.seed, model_max_length=max_len,
                      prefix=EVAL_PREFIX, progress=progress)
    rows = eval_rows(result.metrics, tuple(e.label for e in envs), n_seeds, ev.samples)
    return EvalReport(str(target.run_dir), str(target.weights), target.iteration, n_seeds, ev.samples, rows,
                      dict(result.metrics), time.perf_counter() - started)


def format_table(report: EvalReport) -> str:
    """The report as a Markdown table (readable in a terminal, renders in MLflow and on GitHub)."""
    n = report.samples
    head = (f"evaluation of {report.weights} (after {report.iteration} iterations): "
            f"{report.seeds} held-out seeds x {n} samples per env\n\n")
    lines = [f"| env | success | pass@{n} | return | total return | episodes |",
             "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r.env} | {r.success:.3f} | {r.pass_at_n:.3f} | {r.ret:+.3f} | {r.total_return:+.3f} | {r.episodes} |"
              for r in report.rows]
    return head + "\n".join(lines) + "\n"


def report_dict(report: EvalReport) -> dict[str, Any]:
    """Plain data for eval.json."""
    return dataclasses.asdict(report)


def write_report(report: EvalReport, out_dir: Path) -> tuple[Path, Path]:
    """Write ``eval.json`` and ``eval.md`` into ``out_dir`` (temp file + rename); returns both paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = (out_dir / "eval.json", out_dir / "eval.md")
    for path, text in zip(paths, (json.dumps(report_dict(report), indent=2), format_table(report)), strict=True):
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(text)
        tmp.replace(path)
    return paths
