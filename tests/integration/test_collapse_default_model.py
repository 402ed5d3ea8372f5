"""Template-collapse diagnostics on the DEFAULT model (SmolLM2-135M-Instruct): 8 distinct first-turn Sokoban states.

The metrics of ``trainer.collapse.measure_collapse`` on real samples, before and after the format
warm-up: finite, MI at most log N (plus Monte-Carlo noise), retrieval accuracy a probability. The numbers
are printed (-s) for the closing note; the warm-up must leave thoughts that depend on the state, so after
it MI is not collapsed to ~0 (RAGEN-2's template collapse, which the canned-thought warm-up produced:
0.006 of 2.08 nats). Uses experiments/sokoban-starpo-s.yaml with the CPU-sized reply cap of
bench/warmup.py (128 tokens), so the cached warmed model is shared with that bench; the first run
builds it (tens of minutes on two cores). Marked slow.

Run: .venv/bin/python -m pytest -m slow tests/integration/test_collapse_default_model.py -q -s
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from ragen_core.config import load_experiment
from ragen_core.models import load_model, load_tokenizer
from ragen_core.rollout.generators import make_generator
from ragen_core.rollout.loop import run_rollouts
from ragen_core.trainer import warmup
from ragen_core.trainer.collapse import measure_collapse

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]  # a warm-up on the default model takes minutes

SOKOBAN = Path(__file__).resolve().parents[2] / "experiments" / "sokoban-starpo-s.yaml"
STATES, SAMPLES = 8, 4


def _measure(model_dir: str, cfg) -> dict[str, float]:
    model, tok = load_model(model_dir), load_tokenizer(model_dir)
    gen = make_generator("hf", model, tok, max_length=2048)
    trajs = run_rollouts(cfg.env, gen, tok, cfg.rollout, list(range(STATES)), SAMPLES, 1.0, sampling_seed=0)
    return measure_collapse(model, tok, trajs)


def test_collapse_metrics_of_the_default_model_before_and_after_the_warm_up() -> None:
    torch.set_num_threads(2)
    cfg = load_experiment(SOKOBAN, ["rollout.max_new_tokens=128", "rollout.max_turns=1"])
    after_dir = str(warmup.warmup_model(load_experiment(SOKOBAN, ["rollout.max_new_tokens=128"]), progress=print))
    results = {"before": _measure(cfg.model.name, cfg), "after": _measure(after_dir, cfg)}
    for when, m in results.items():
        print(f"{when}: {int(m['n_reasonings'])}/{int(m['n_first_turns'])} closed thoughts, "
              + (f"MI {m['mi']:.3f} of {m['mi_upper_bound']:.3f} nats, H(Z|X) {m['cond_entropy']:.1f}, "
                 f"retrieval {m['retrieval_acc']:.3f} (chance {m['retrieval_chance']:.3f}), {m['seconds']:.1f} s"
                 if "mi" in m else "no closed thought"))
        if "mi" in m:
            assert all(math.isfinite(v) for v in m.values())
            assert -0.5 <= m["mi"] <= m["mi_upper_bound"] + 0.05  # an estimate: a little noise either way
            assert 0.0 <= m["retrieval_acc"] <= 1.0 and m["n_prompts"] <= STATES
    after = results["after"]
    assert after["n_reasonings"] >= STATES * SAMPLES // 2  # the warm-up taught the model to close its thoughts
    assert after["n_prompts"] == STATES
    # Not template-collapsed: well above the canned warm-up's 0.006 nats (0.3% of log 8); 5% of log N is
    # the template rule's floor (health.template_mi_floor).
    assert after["mi"] > 0.05 * after["mi_upper_bound"]
