"""Format warm-up on the DEFAULT model (SmolLM2-135M-Instruct) on Sokoban: validity rises and the first-turn
thoughts stay state-dependent. tests/integration/test_warmup_default_model.py says what the warm-up is for and
where the thresholds come from; this test is a module of its own so that the suite's two workers (``make test``:
pytest-xdist, a module to a worker) can run the two multi-minute warm-ups at once.

Run: .venv/bin/python -m pytest -m slow tests/integration/test_warmup_sokoban_default_model.py -q -s
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from ragen_core.config import ExperimentConfig, load_experiment
from ragen_core.models import load_model, load_tokenizer
from ragen_core.trainer import warmup
from ragen_core.trainer.collapse import measure_collapse

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]  # a warm-up on the default model takes minutes

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"


def _first_turn(cfg: ExperimentConfig) -> ExperimentConfig:
    return dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, max_turns=1))


def test_warmup_keeps_sokoban_thoughts_state_dependent() -> None:
    cfg = load_experiment(EXPERIMENTS / "sokoban-starpo-s.yaml", ["rollout.max_new_tokens=128"])
    tok = load_tokenizer(cfg.model.name)
    base = load_model(cfg.model.name)
    # the base model's first turns: with no history it closes no thought, and later turns only repeat it (5
    # turns of 128-token replies would cost five times as much to say the same)
    before = warmup.format_stats(warmup.sample_episodes(base, tok, _first_turn(cfg), 32))
    # the base model's own first-turn thoughts on 8 states x 4 replies, cut as the warm-up cuts them
    cut, _ = warmup.self_distill_dialogues(base, tok, _first_turn(cfg), 8, seed_start=0, n_per_group=4)
    mi_before = measure_collapse(base, tok, cut)
    path = warmup.warmup_model(cfg, progress=print)
    warmed = load_model(str(path))
    after = warmup.format_stats(warmup.sample_episodes(warmed, tok, cfg, 32))
    # 8 states x 8 replies: one draw of 8 x 4 gave I(X;Z) from 0.08 to 0.48 nats on the same warmed model (3
    # sampling seeds each on 6 warm-ups, mean 0.30, sd about 0.1); 8 per state halves the estimate's variance
    grid = warmup.sample_episodes(warmed, tok, _first_turn(cfg), 8, n_per_group=8, sampling_seed=1)
    mi_after = measure_collapse(warmed, tok, grid)
    print(f"validity {before['validity']:.3f} -> {after['validity']:.3f}; I(X;Z) {mi_before['mi']:.3f} -> "
          f"{mi_after['mi']:.3f} of {mi_after['mi_upper_bound']:.2f}; retrieval {mi_before['retrieval_acc']:.3f} -> "
          f"{mi_after['retrieval_acc']:.3f} (chance {mi_after['retrieval_chance']:.3f}); "
          f"{mi_after['distinct_reasonings']:.0f} distinct of {mi_after['n_reasonings']:.0f}")
    for m in (mi_before, mi_after):  # the diagnostics themselves on real samples: finite and in range
        assert all(math.isfinite(v) for v in m.values())
        assert -0.5 <= m["mi"] <= m["mi_upper_bound"] + 0.05  # an estimate: a little noise either way
        assert m["retrieval_chance"] <= 1.0 and 0.0 <= m["retrieval_acc"] <= 1.0
    assert before["validity"] <= 0.1
    assert after["validity"] >= 0.7
    assert mi_after["n_prompts"] == 8 and mi_after["n_reasonings"] >= 48  # most replies close their thought
    assert mi_after["mi"] >= 0.5 * mi_before["mi"]
    assert mi_after["mi"] > 0.05 * mi_after["mi_upper_bound"]  # not template-collapsed
    assert mi_after["retrieval_acc"] > mi_after["retrieval_chance"]
