"""Format warm-up on the DEFAULT model (SmolLM2-135M-Instruct) with the demo's settings (Bandit, think, one turn).

Issue 5: before the warm-up the model almost never writes <think>..</think><answer>..</answer>
(measured 0/128), so RL has no signal; after it, >= 90% of replies are valid, while task success
stays near the random-policy level (the warm-up plays uniformly random valid actions: it teaches
the format, not the task). Needs the converted model under $RAGEN_DATA_DIR/models (``ragen model
fetch``); the warmed model is cached there too, so only the first run trains (about two minutes on
two idle cores). Marked slow. The tiny model's checks are tests/unit/trainer/test_warmup.py; the
same measurement with more detail is bench/warmup.py.

Run: .venv/bin/python -m pytest -m slow tests/integration/test_warmup_default_model.py -q -s
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ragen_core.config import load_experiment
from ragen_core.models import DEFAULT_MODEL, check_model_dir, load_model, load_tokenizer
from ragen_core.trainer import warmup as W

pytestmark = pytest.mark.slow

DEMO = Path(__file__).resolve().parents[2] / "experiments" / "demo.yaml"
SAMPLES = 64


def test_warmup_teaches_the_format_not_the_task() -> None:
    cfg = load_experiment(DEMO)
    assert (cfg.model.name, cfg.env.name, cfg.rollout.think, cfg.rollout.max_turns) == (DEFAULT_MODEL, "Bandit", True, 1)
    tok = load_tokenizer(cfg.model.name)
    before = W.measure_format(load_model(cfg.model.name), tok, cfg, SAMPLES)
    path = W.warmup_model(cfg, progress=print)
    assert check_model_dir(path) is None
    after = W.measure_format(load_model(str(path)), load_tokenizer(str(path)), cfg, SAMPLES)
    # Bandit's random level: a uniformly random pull picks the better (high-risk) arm half the time.
    random = W.random_policy_stats(cfg.env, cfg.rollout, tok, 256)["success"]
    print(f"validity {before['validity']:.3f} -> {after['validity']:.3f}; success {before['success']:.3f} -> "
          f"{after['success']:.3f} (random valid actions: {random:.3f})")
    assert before["validity"] <= 0.2
    assert after["validity"] >= 0.9
    # 64 episodes: one binomial std of a success rate near 0.5 is 0.0625; +-0.25 is four of them.
    assert abs(after["success"] - random) <= 0.25
