"""Format warm-up on the DEFAULT model (SmolLM2-135M-Instruct): self-distillation teaches the reply format
without deciding what the model thinks.

Before: with the ``<think>`` prefill and no warm-up, the model closes ``<think>..</think><answer>..</answer>``
in 0 of 64 demo replies (Bandit) and in no Sokoban turn (measured), so every trajectory gets the same format
penalty and RL has no signal. The old canned-thought warm-up fixed the thoughts instead: over 8 Sokoban
states x 4 first-turn replies they carried I(X;Z) = 0.006 of log 8 = 2.08 nats (template collapse).

After ``model.warmup: self_distill`` (bench/warmup.py prints the same numbers and more):

- demo (Bandit, 48-token replies): validity rises to >= 0.85 and task success stays within 0.25 of the
  random-policy level (the actions it trains on are random: it teaches the format, not the task);
- Sokoban (5 turns, replies capped at 128 tokens for a CPU): validity rises from <= 0.1 of the base
  model's first turns to >= 0.7 over every turn, and the first-turn thoughts stay state-dependent (8
  states x 8 replies, the mean of three sampling seeds for each model): I(X;Z) at least half of the base
  model's own thoughts' (cut as the warm-up cuts them, since the base model rarely closes the block itself,
  and drawn the same way), above 5% of log 8 (0.104 nats: the template
  rule's floor, health.template_mi_floor; 17x the canned warm-up's 0.006), and retrieval accuracy above
  chance (1/8). The collapse diagnostics (``trainer.collapse.measure_collapse``) are checked on these real
  samples too: finite, MI at most log N (plus Monte-Carlo noise), retrieval accuracy a probability.

The thresholds were set from first principles (what the warm-up is for), not from the measured numbers;
the numbers measured are in docs/concepts/fidelity.md (the format warm-up).

Needs the converted model under $RAGEN_DATA_DIR/models (``ragen model fetch``); each warmed model is cached
there too, so only the first run trains (minutes on two cores; docs/how-to/tests.md says how many). Marked slow.
The tiny model's checks are tests/unit/trainer/test_warmup.py.

The Sokoban test is tests/integration/test_warmup_sokoban_default_model.py.

Run: .venv/bin/python -m pytest -m slow tests/integration/test_warmup_default_model.py -q -s
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ragen_core.config import load_experiment
from ragen_core.models import DEFAULT_MODEL, check_model_dir, load_model, load_tokenizer
from ragen_core.trainer import warmup

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]  # a warm-up on the default model takes minutes

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"
SAMPLES = 64
# The base model closed its reply in 0 of 64 demo episodes (measured); 32 decide "at most 0.2": at a true rate of
# 0.05 they reach 7 valid with probability about 0.001. Each of them decodes all 48 tokens (it never closes).
BASE_SAMPLES = 32


def test_warmup_teaches_the_format_not_the_task() -> None:
    cfg = load_experiment(EXPERIMENTS / "demo.yaml")
    assert (cfg.model.name, cfg.model.warmup, cfg.env.name, cfg.rollout.think, cfg.rollout.max_turns) == \
           (DEFAULT_MODEL, "self_distill", "Bandit", True, 1)
    tok = load_tokenizer(cfg.model.name)
    before = warmup.measure_format(load_model(cfg.model.name), tok, cfg, BASE_SAMPLES)
    path = warmup.warmup_model(cfg, progress=print)
    assert check_model_dir(path) is None
    after = warmup.measure_format(load_model(str(path)), load_tokenizer(str(path)), cfg, SAMPLES)
    # Bandit's random level: a uniformly random pull picks the better (high-risk) arm half the time.
    random = warmup.random_policy_stats(cfg.env, cfg.rollout, tok, 256)["success"]
    print(f"validity {before['validity']:.3f} -> {after['validity']:.3f}; success {before['success']:.3f} -> "
          f"{after['success']:.3f} (random valid actions: {random:.3f})")
    assert before["validity"] <= 0.2
    assert after["validity"] >= 0.85
    # 64 episodes: one binomial std of a success rate near 0.5 is 0.0625; +-0.25 is four of them.
    assert abs(after["success"] - random) <= 0.25
