"""Effect of the format warm-up (issue 5): format validity and task success before and after, and its cost.

On an experiment's model and env (default: experiments/demo.yaml, SmolLM2-135M-Instruct on Bandit,
think on, one turn), it samples ``--samples`` episodes (env seeds 0..n-1, temperature 1.0) with the
real rollout loop from the base model, makes (or takes from the cache) the warmed model with
``warmup_model``, samples the same seeds from it, and prints format validity (share of turns whose
reply parses and names only valid actions) and task success for both, next to the random-policy
level (success of uniformly random valid actions on seeds 0..255, which is what the warm-up's data
plays). Target: validity >= 0.9 after; success near the random level (the warm-up teaches the
format, not the task).

Run:  .venv/bin/python bench/warmup.py [EXP.yaml] [--set key=value ...] [--samples 64] [--force] [--threads 2]
      e.g. --set env.name=Sokoban --set rollout.max_turns=5 ... for a multi-turn env.
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from ragen_core.config import load_experiment
from ragen_core.models import MARKER, load_model, load_tokenizer
from ragen_core.rollout.parse import parse_response
from ragen_core.trainer import warmup as W
from ragen_core.types import Trajectory


def _examples(trajs: list[Trajectory], k: int = 3) -> list[str]:
    """A few replies, the failing ones first: what the model writes."""
    turns = sorted((turn for t in trajs for turn in t.turns), key=lambda turn: turn.parse_ok)
    return [turn.response_text[:160] for turn in turns[:k]]


def say(line: str) -> None:
    print(line, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("experiment", nargs="?", default="experiments/demo.yaml")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="config override a.b=value")
    ap.add_argument("--samples", type=int, default=64, help="episodes sampled before and after")
    ap.add_argument("--force", action="store_true", help="train the warm-up again even if cached")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_experiment(args.experiment, args.overrides)

    tok = load_tokenizer(cfg.model.name)
    t0 = time.perf_counter()
    before_trajs = W.sample_episodes(load_model(cfg.model.name), tok, cfg, args.samples)
    sample_s = time.perf_counter() - t0
    before = W.format_stats(before_trajs)
    say(f"before: validity {before['validity']:.3f}, success {before['success']:.3f} ({sample_s:.0f} s to sample)")
    for text in _examples(before_trajs):
        say(f"  e.g. {text!r}")
    random = W.random_policy_stats(cfg.env, cfg.rollout, tok, 256)
    say(f"random valid actions: success {random['success']:.3f}")

    t0 = time.perf_counter()
    path = W.warmup_model(cfg, force=args.force, progress=say)
    call_s = time.perf_counter() - t0
    marker = json.loads((path / MARKER).read_text())
    after_trajs = W.sample_episodes(load_model(str(path)), load_tokenizer(str(path)), cfg, args.samples)
    after = W.format_stats(after_trajs)
    say(f"after:  validity {after['validity']:.3f}, success {after['success']:.3f}")
    say(f"warm-up: {marker['seconds']:.0f} s wall, {marker.get('cpu_seconds', 0):.0f} s CPU on {marker.get('threads')} "
        f"threads when trained; this call {call_s:.1f} s")
    for text in _examples(after_trajs):
        say(f"  e.g. {text!r}")
    bad = [t.error for t in (parse_response(turn.response_text, cfg.rollout.think, cfg.rollout.max_actions_per_turn)
                             for tr in after_trajs for turn in tr.turns) if not t.ok]
    print(json.dumps({
        "model": cfg.model.name, "env": cfg.env.name, "think": cfg.rollout.think, "max_turns": cfg.rollout.max_turns,
        "samples": args.samples, "threads": args.threads, "turns_before": before["turns"], "turns_after": after["turns"],
        "validity_before": round(before["validity"], 4), "validity_after": round(after["validity"], 4),
        "success_before": round(before["success"], 4), "success_after": round(after["success"], 4),
        "success_random": round(random["success"], 4), "parse_errors_after": {e: bad.count(e) for e in set(bad)},
        "warmup_steps": marker["steps"], "warmup_lr": marker["lr"], "loss_first": marker["loss_first"],
        "loss_last": marker["loss_last"], "warmup_seconds": marker["seconds"],
        "warmup_cpu_seconds": marker.get("cpu_seconds"), "warmup_threads": marker.get("threads"), "call_seconds": round(call_s, 1),
        "model_dir": str(path),
    }))


if __name__ == "__main__":
    main()
