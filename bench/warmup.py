"""Effect of the format warm-up: format validity, entropy, thinking and template collapse,
before and after, and its cost.

On an experiment's model and env (default: experiments/demo.yaml, SmolLM2-135M-Instruct on Bandit, think on,
one turn), with the experiment's warm-up method (``model.warmup``; ``none`` is measured as ``self_distill``):

- samples ``--samples`` episodes (env seeds 0..n-1, temperature 1.0) with the real rollout loop from the base
  model and reports format validity (share of turns whose reply parses and names only valid actions), task
  success, the policy's mean per-token entropy over the replies (a forward pass), the share of replies that
  close a think block and the mean think length in tokens;
- samples the first turn of ``--mi-states`` distinct states x ``--mi-samples`` replies (seeds 0.., temperature
  1.0) and measures template collapse (SPEC §8): I(X;Z), H(Z|X), retrieval accuracy against chance, distinct
  thoughts, and the seconds the teacher-forced [M, N] matrix took (ragen_core/trainer/collapse.py); ``mi``
  uses the replies that close a think block, ``mi_cut`` every reply's thought cut as the warm-up cuts it
  (the base model rarely closes the block itself, so ``mi_cut`` is the fair baseline for "after");
- makes (or takes from the cache) the warmed model with ``warmup_model`` and measures the same on it;
- reports the random-policy level (success of uniformly random valid actions on seeds 0..255).

Targets: validity >= 0.9 after; success near the random level (the warm-up teaches the format, not the task);
MI after not collapsed (well above 0, near the base model's); the warm-up a few minutes on 2 idle cores.

Run:  .venv/bin/python bench/warmup.py [EXP.yaml] [--set key=value ...] [--samples 64] [--force] [--threads 2]
      e.g. .venv/bin/python bench/warmup.py experiments/sokoban-starpo-s.yaml --samples 32
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from typing import Any

import torch

from ragen_core.config import ExperimentConfig, load_experiment
from ragen_core.models import MARKER, load_model, load_tokenizer
from ragen_core.rollout.parse import parse_response
from ragen_core.trainer import warmup
from ragen_core.trainer.collapse import measure_collapse
from ragen_core.types import Trajectory

_MI_KEYS = ("mi", "mi_per_token", "cond_entropy", "marginal_entropy", "mi_upper_bound", "retrieval_acc",
            "retrieval_chance", "retrieval_acc_top2", "n_prompts", "n_reasonings", "n_first_turns",
            "distinct_reasonings", "reasoning_tokens", "seconds")


def _examples(trajs: list[Trajectory], k: int = 3) -> list[str]:
    """A few replies, the failing ones first: what the model writes."""
    turns = sorted((turn for t in trajs for turn in t.turns), key=lambda turn: turn.parse_ok)
    return [turn.response_text[:160] for turn in turns[:k]]


def say(line: str) -> None:
    print(line, flush=True)


def measure(label: str, spec: str, cfg: ExperimentConfig, args: argparse.Namespace) -> dict[str, Any]:
    """Reply statistics over ``--samples`` episodes and template collapse over the MI grid, of model ``spec``."""
    model, tok = load_model(spec), load_tokenizer(spec)
    t0 = time.perf_counter()
    trajs = warmup.sample_episodes(model, tok, cfg, args.samples)
    sample_s = time.perf_counter() - t0
    stats = warmup.reply_stats(model, tok, cfg, trajs)
    first = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, max_turns=1))
    mi_trajs = warmup.sample_episodes(model, tok, first, args.mi_states, n_per_group=args.mi_samples, sampling_seed=1)
    mi = measure_collapse(model, tok, mi_trajs)
    # the same grid with every thought cut as the warm-up cuts it: the base model's own reasoning, all of it
    # (most base replies never close the block, so the plain measure sees only a few short ones)
    cut_trajs, _ = warmup.self_distill_dialogues(model, tok, first, args.mi_states, seed_start=0,
                                                 n_per_group=args.mi_samples)
    mi_cut = measure_collapse(model, tok, cut_trajs)
    say(f"{label}: validity {stats['validity']:.3f}, success {stats['success']:.3f}, entropy {stats['entropy']:.3f}, "
        f"think closed {stats['closed_think']:.2f} / {stats['think_tokens']:.1f} tokens ({sample_s:.0f} s to sample)")
    say(f"{label}: I(X;Z) {mi.get('mi', float('nan')):.3f} of {mi.get('mi_upper_bound', float('nan')):.2f} nats, "
        f"H(Z|X) {mi.get('cond_entropy', float('nan')):.1f}, retrieval {mi.get('retrieval_acc', float('nan')):.3f} "
        f"(chance {mi.get('retrieval_chance', float('nan')):.3f}), {int(mi['distinct_reasonings'])} distinct thoughts "
        f"in {int(mi['n_reasonings'])} of {int(mi['n_first_turns'])} replies; matrix {mi.get('seconds', 0.0):.1f} s")
    say(f"{label}, thoughts cut as the warm-up cuts them: I(X;Z) {mi_cut['mi']:.3f}, "
        f"H(Z|X) {mi_cut['cond_entropy']:.1f}, "
        f"retrieval {mi_cut['retrieval_acc']:.3f}, {int(mi_cut['distinct_reasonings'])} distinct in "
        f"{int(mi_cut['n_reasonings'])}")
    for text in _examples(trajs):
        say(f"  e.g. {text!r}")
    bad = [p.error for p in (parse_response(turn.response_text, cfg.rollout.think, cfg.rollout.max_actions_per_turn)
                             for tr in trajs for turn in tr.turns) if not p.ok]
    out = {k: round(v, 4) for k, v in stats.items()}
    out.update({f"mi.{k}": round(mi[k], 4) for k in _MI_KEYS if k in mi})
    out.update({f"mi_cut.{k}": round(mi_cut[k], 4) for k in _MI_KEYS if k in mi_cut})
    out["parse_errors"] = {e: bad.count(e) for e in sorted(set(bad))}
    out["sample_seconds"] = round(sample_s, 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("experiment", nargs="?", default="experiments/demo.yaml")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="config override a.b=value")
    ap.add_argument("--samples", type=int, default=64, help="episodes sampled before and after")
    ap.add_argument("--mi-states", type=int, default=8, help="distinct first-turn states of the MI measurement")
    ap.add_argument("--mi-samples", type=int, default=4, help="replies per state of the MI measurement")
    ap.add_argument("--force", action="store_true", help="train the warm-up again even if cached")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_experiment(args.experiment, args.overrides)
    if cfg.model.warmup == "none":
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, warmup="self_distill"))

    tok = load_tokenizer(cfg.model.name)
    before = measure("before", cfg.model.name, cfg, args)
    random = warmup.random_policy_stats(cfg.env, cfg.rollout, tok, 256)
    say(f"random valid actions: success {random['success']:.3f}")

    t0 = time.perf_counter()
    path = warmup.warmup_model(cfg, force=args.force, progress=say)
    call_s = time.perf_counter() - t0
    marker = json.loads((path / MARKER).read_text())
    say(f"warm-up ({marker['method']}): {marker['seconds']:.0f} s wall ({marker['sample_seconds']:.0f} sampling, "
        f"{marker['train_seconds']:.0f} training, {marker['check_seconds']:.0f} checking), "
        f"{marker['cpu_seconds']:.0f} s CPU on {marker['threads']} threads when trained; this call {call_s:.1f} s; "
        f"own thought ends {marker['own_thought_end']:.2f}, own actions {marker['own_actions']:.2f}, "
        f"placeholder copies left out {marker['placeholder_copies']:.2f}, "
        f"thoughts {marker['thought_tokens']:.1f} tokens")
    after = measure("after", str(path), cfg, args)
    facts = ("method", "steps", "lr", "loss_first", "loss_last", "validity_before", "validity_after", "own_thought_end",
             "sentence_cut", "length_cut", "own_actions", "placeholder_copies", "thought_tokens", "thought_cap",
             "distinct_first_thoughts", "sample_seconds", "train_seconds", "check_seconds", "seconds", "cpu_seconds",
             "threads")
    print(json.dumps({
        "model": cfg.model.name, "env": cfg.env.name, "think": cfg.rollout.think, "prefill": cfg.rollout.prefill,
        "max_turns": cfg.rollout.max_turns, "max_new_tokens": cfg.rollout.max_new_tokens, "samples": args.samples,
        "mi_grid": [args.mi_states, args.mi_samples], "threads": args.threads,
        "before": before, "after": after, "success_random": round(random["success"], 4),
        "warmup": {k: marker.get(k) for k in facts}, "call_seconds": round(call_s, 1), "model_dir": str(path),
    }))


if __name__ == "__main__":
    main()
