"""Benchmark of the text environments: speed, and how hard each one is for a random policy.

Speed: resets per second (consecutive seeds) and steps per second (random valid actions,
``env.sample_action``, resetting when an episode ends); only the ``reset`` / ``step`` calls are
timed. ``setup_s`` is the first ``make`` + ``reset`` (for WebShop it includes building the
catalogue and its FTS5 index once per process). The point: env work must be negligible next to
LLM generation, which takes tens of milliseconds or more per turn.

Difficulty: the success rate of uniformly random valid actions, one episode per seed (300 seeds
from 0 by default), each episode up to 10 actions or the env's own budget when it has one (Bandit
and Countdown: 1, WebShop: 9). For Sokoban variants also the distribution of the shortest
solution length (``info["min_moves"]``): the share of levels solvable in <= 2 moves and the
median. Printed next to the paper's trained StarPO-S success (SPEC §7) and, where SPEC §2 gives
it, the reference generator's random-play band: a trained number near the random one says the
benchmark, not the policy, sets the score.

Run:  .venv/bin/python bench/envs.py [--seconds 1.0] [--envs Sokoban WebShop] [--seeds 300] [--seed-start 0]
The last line printed is one JSON object: {"Bandit": {"resets_per_s": ..., "steps_per_s": ...,
"setup_s": ..., "random_success": ..., "paper_starpo_s": ..., "reference_random": ...}, ...};
Sokoban variants add "min_moves_le2" and "min_moves_median".
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import numpy as np

from ragen_core.envs import list_envs, make

RANDOM_ACTIONS = 10
"""Actions per random episode when the env has no smaller budget of its own (SPEC §2: 10 per episode)."""
PAPER_STARPO_S: dict[str, float] = {
    "Bandit": 1.0, "BanditRev": 0.6758, "FrozenLake": 0.1992, "Sokoban": 0.2148,
    "SokobanNewVocab": 0.1875, "LargerSokoban": 0.0234,
}
"""Trained StarPO-S success of the paper (SPEC §7), for comparison with random play."""
REFERENCE_RANDOM: dict[str, tuple[float, float]] = {
    "Sokoban": (0.18, 0.20), "SokobanNewVocab": (0.18, 0.20), "LargerSokoban": (0.02, 0.04),
}
"""Random-play success band of the reference's level generator, 10 random actions over 300 seeds
(SPEC §2; NewVocab has Sokoban's levels)."""


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


def random_play(name: str, seeds: range) -> dict[str, Any]:
    """Success of uniformly random valid actions, one episode per seed; min_moves figures where reported."""
    env = make(name)
    budget = env.max_episode_actions or RANDOM_ACTIONS
    wins, lengths = 0, []
    for seed in seeds:
        _, info = env.reset(seed=seed)
        if "min_moves" in info:
            lengths.append(info["min_moves"])
        rng = np.random.default_rng([seed, 1])  # this seed's action stream, apart from the env's own
        for _ in range(min(budget, RANDOM_ACTIONS)):
            _, _, terminated, truncated, info = env.step(env.sample_action(rng))
            if terminated or truncated:
                break
        wins += bool(info["success"])
    out: dict[str, Any] = {"random_success": round(wins / len(seeds), 4)}
    if lengths:
        known = [k for k in lengths if k is not None]  # None: longer than the solver's cap
        out["min_moves_le2"] = round(sum(k <= 2 for k in known) / len(lengths), 4)
        out["min_moves_median"] = statistics.median(known) if len(known) * 2 > len(lengths) else None
    return out


def _difficulty_text(name: str, figures: dict[str, Any]) -> str:
    text = f"random {100 * figures['random_success']:5.1f}%"
    if name in REFERENCE_RANDOM:
        lo, hi = REFERENCE_RANDOM[name]
        text += f" (reference {100 * lo:.0f}-{100 * hi:.0f}%)"
    if name in PAPER_STARPO_S:
        text += f"   paper StarPO-S {100 * PAPER_STARPO_S[name]:.2f}%"
    if "min_moves_le2" in figures:
        text += f"   min moves: <=2 {100 * figures['min_moves_le2']:.0f}%, median {figures['min_moves_median']}"
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=1.0, help="timed seconds per measurement")
    parser.add_argument("--envs", nargs="*", default=list_envs(), help="env names (default: all registered)")
    parser.add_argument("--seeds", type=int, default=300, help="episodes (seeds) of random play per env")
    parser.add_argument("--seed-start", type=int, default=0, help="first seed of random play")
    args = parser.parse_args()
    results: dict[str, dict[str, Any]] = {}
    for name in args.envs:
        t0 = time.perf_counter()
        make(name).reset(seed=0)
        setup = time.perf_counter() - t0
        resets = _resets_per_s(name, args.seconds)
        steps = _steps_per_s(name, args.seconds)
        difficulty = random_play(name, range(args.seed_start, args.seed_start + args.seeds))
        results[name] = {"resets_per_s": round(resets, 1), "steps_per_s": round(steps, 1), "setup_s": round(setup, 4),
                         **difficulty, "paper_starpo_s": PAPER_STARPO_S.get(name),
                         "reference_random": REFERENCE_RANDOM.get(name)}
        print(f"{name:16s} resets/s {resets:10.1f}   steps/s {steps:10.1f}   setup {setup * 1000:7.1f} ms   "
              f"{_difficulty_text(name, difficulty)}", flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
