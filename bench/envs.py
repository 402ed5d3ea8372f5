"""Benchmark of the text environments: resets per second and steps per second for each registered env.

Resets use consecutive seeds; steps are random valid actions (``env.sample_action``), resetting
when an episode ends; only the ``reset`` / ``step`` calls themselves are timed. ``setup_s`` is
the first ``make`` + ``reset`` (for WebShop it includes building the catalogue and its FTS5
index once per process). The point: env work must be negligible next to LLM generation, which
takes tens of milliseconds or more per turn.

Run:  .venv/bin/python bench/envs.py [--seconds 1.0] [--envs Sokoban WebShop]
The last line printed is one JSON object: {"Bandit": {"resets_per_s": ..., "steps_per_s": ..., "setup_s": ...}, ...}
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from ragen_core.envs import list_envs, make


def _resets_per_s(name: str, seconds: float) -> float:
    env = make(name)
    n, spent, seed = 0, 0.0, 1000
    while spent < seconds or n < 20:
        t0 = time.perf_counter()
        env.reset(seed=seed)
        spent += time.perf_counter() - t0
        n, seed = n + 1, seed + 1
    return n / spent


def _steps_per_s(name: str, seconds: float) -> float:
    env = make(name)
    rng = np.random.default_rng(0)
    seed = 0
    env.reset(seed=seed)
    n, spent = 0, 0.0
    while spent < seconds or n < 20:
        action = env.sample_action(rng)
        t0 = time.perf_counter()
        _, _, terminated, truncated, _ = env.step(action)
        spent += time.perf_counter() - t0
        n += 1
        if terminated or truncated:
            seed += 1
            env.reset(seed=seed)
    return n / spent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=1.0, help="timed seconds per measurement")
    parser.add_argument("--envs", nargs="*", default=list_envs(), help="env names (default: all registered)")
    args = parser.parse_args()
    results: dict[str, dict[str, float]] = {}
    for name in args.envs:
        t0 = time.perf_counter()
        make(name).reset(seed=0)
        setup = time.perf_counter() - t0
        resets = _resets_per_s(name, args.seconds)
        steps = _steps_per_s(name, args.seconds)
        results[name] = {"resets_per_s": round(resets, 1), "steps_per_s": round(steps, 1), "setup_s": round(setup, 4)}
        print(f"{name:16s} resets/s {resets:12.1f}   steps/s {steps:12.1f}   setup {setup * 1000:8.1f} ms", flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
