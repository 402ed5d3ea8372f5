"""The metric catalogue (ragen_core/tracking/metrics.py) describes every name a run logs, so the docs' metric
reference, made from it, cannot fall behind the code."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ragen_core.tracking.metrics import METRICS, describe, pattern_of

SMOKE = Path(__file__).resolve().parents[3] / "experiments" / "smoke.yaml"


def test_patterns_match_their_segments_only() -> None:
    assert pattern_of("env/Bandit/success") == "env/<tag>/success"
    assert pattern_of("val/final/success") == "val/final/success"  # the literal wins over val/<tag>/success
    assert pattern_of("grad/le_0.2/task") == "grad/<bucket>/<term>"
    assert pattern_of("grad/zero/rows") == "grad/<bucket>/rows"
    assert pattern_of("rollout/pass_at_8") == "rollout/pass_at_<N>"
    assert pattern_of("collapse/first_turn/retrieval_acc_top2") == "collapse/<scope>/retrieval_acc_top<k>"
    assert pattern_of("rollout/pass_at_x") is None  # <N> is a whole number
    assert pattern_of("env/a/b/success") is None  # <tag> is one path segment
    assert describe("actor/entropy") == METRICS["actor/entropy"]
    assert describe("actor/entrpy") is None


def test_every_entry_has_a_meaning_and_a_known_namespace() -> None:
    from ragen_core.tracking.logger import NAMESPACES

    for pattern, meaning in METRICS.items():
        assert pattern.split("/", 1)[0] in NAMESPACES, pattern
        assert meaning.strip() and "\n" not in meaning, pattern


@pytest.mark.parametrize("preset,extra", [  # between them: both critics, the KL in loss and reward, TIS, a filter
    ("starpo", ["algorithm.critic=separate", "diagnostics.kl_every=1", "algorithm.old_logprobs=recompute",
                "algorithm.tis_cap=2.0"]),
    ("starpo-s", ["algorithm.critic=head", "algorithm.kl_coef=0.001", "algorithm.kl_in_reward=true"]),
])
def test_a_run_logs_only_described_metrics(preset: str, extra: list[str], tmp_path, monkeypatch) -> None:
    from ragen_core.config import load_experiment
    from ragen_core.rollout.scripted import ScriptedGenerator
    from ragen_core.session import finish, open_session, run_iteration
    from ragen_core.tracking import NullLogger

    monkeypatch.setenv("RAGEN_DATA_DIR", str(tmp_path))
    cfg = load_experiment(SMOKE, [f"preset={preset}", "diagnostics.collapse_every=1",
                                  "diagnostics.grad_buckets_every=1", "trainer.iterations=2", "eval.every=1",
                                  "trainer.checkpoint_every=0", "rollout.max_new_tokens=40", *extra])
    log = NullLogger()
    sess = open_session(cfg, log, say=lambda line: None)
    # the tiny random model never closes a think block: scripted replies that do, so the MI diagnostics log
    sess.generator = ScriptedGenerator(sess.tokenizer, lambda c, r, p: f"<think>plan {r % 3}</think>"
                                                                       "<answer>Dragon</answer>")
    for _ in range(cfg.trainer.iterations):
        run_iteration(sess)
    finish(sess)
    names = {name for _, metrics in log.metrics for name in metrics}
    assert "collapse/first_turn/mi" in names and "grad/zero/task" in names and "val/Bandit/success" in names
    if sys.platform.startswith("linux"):  # each step's own peak memory, where the kernel resets the peak
        steps = ("rollout", "diagnose", "grad_buckets", "update", "eval")
        assert {f"perf/peak_rss_gib/{step}" for step in steps} <= names
    assert sorted(n for n in names if describe(n) is None) == []
