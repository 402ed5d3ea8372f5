"""RAGEN-2's early-stop rules and the template-collapse rule (tracking/early_stop.py), on hand-made metric streams.

Run: .venv/bin/python -m pytest tests/unit/tracking/test_tracking_early_stop.py -q
"""

from __future__ import annotations

import math

import pytest

from ragen_core.tracking.early_stop import HEALTH_STOP, EarlyStopRules


def _run(rules: EarlyStopRules, stream: list[dict[str, float]]) -> list[tuple[str, ...]]:
    return [rules.update(step, m).fired for step, m in enumerate(stream)]


def test_reward_std_rule_needs_ten_low_iterations_after_a_ten_iteration_baseline() -> None:
    # baseline: iterations 0-9 at std 1.0 (mean 1.0); then 0.05 < 10% of 1.0 from iteration 10 on:
    # the 10th low iteration is iteration 19.
    rules = EarlyStopRules({"reward_std": "stop"})
    fired = _run(rules, [{"rollout/reward_std_all": 1.0}] * 10 + [{"rollout/reward_std_all": 0.05}] * 12)
    assert [i for i, f in enumerate(fired) if f] == [19] and fired[19] == ("reward_std",)
    assert rules.fired() == {"reward_std": 19}
    # 0.2 is not below 10%: never fires; a healthy value in between resets the streak
    calm = EarlyStopRules({"reward_std": "stop"})
    stream = [{"rollout/reward_std_all": 1.0}] * 10 + [{"rollout/reward_std_all": 0.05}] * 9
    stream += ([{"rollout/reward_std_all": 0.5}] + [{"rollout/reward_std_all": 0.05}] * 9
               + [{"rollout/reward_std_all": 0.2}])
    assert not any(_run(calm, stream))


def test_val_rule_counts_validations_not_iterations() -> None:
    rules = EarlyStopRules({"val_success": "warn"})
    stream = []
    for _ in range(5):  # a validation every other iteration, success 0: the 5th validation is iteration 8
        stream += [{"val/success": 0.0}, {}]
    fired = _run(rules, stream)
    assert [i for i, f in enumerate(fired) if f] == [8]
    rep = EarlyStopRules({"val_success": "warn"}).update(0, {"val/success": 0.0})
    assert rep.metrics["health/val_success_streak"] == 1.0 and not rep.stop  # warn: never stops


def test_empty_filter_rule_and_stop_reason() -> None:
    rules = EarlyStopRules({"empty_filter": "stop"})
    reps = [rules.update(i, {"rollout/kept_groups": 0.0}) for i in range(5)]
    assert [r.stop for r in reps] == [False] * 4 + [True]
    assert reps[-1].reason.startswith("health rule empty_filter at step 4")
    assert not rules.update(5, {"rollout/kept_groups": 0.0}).fired  # a rule fires once


def _mi(mi: float, entropy_ratio: float = 0.9, bound: float = math.log(8)) -> dict[str, float]:
    return {"collapse/first_turn/mi": mi, "collapse/first_turn/mi_upper_bound": bound,
            "health/entropy_ratio": entropy_ratio}


def test_template_rule_mi_falls_while_entropy_holds() -> None:
    # baseline MI 1.0 over 3 measurements; then 0.2 < 30% of 1.0 twice with entropy at 90%: fires at the 2nd.
    rules = EarlyStopRules({"template": "stop"})
    fired = _run(rules, [_mi(1.0)] * 3 + [{}] + [_mi(0.2)] * 2)  # an iteration without a measurement in between
    assert [i for i, f in enumerate(fired) if f] == [5]
    # the same MI fall with entropy also falling (50% < 70%) is the Echo Trap's business, not template collapse
    echo = EarlyStopRules({"template": "stop"})
    assert not any(_run(echo, [_mi(1.0)] * 3 + [_mi(0.2, entropy_ratio=0.5)] * 4))
    # a run that starts collapsed: 0.05 < 5% of log 8 = 0.104 fires without a baseline
    born = EarlyStopRules({"template": "warn"})
    assert _run(born, [_mi(0.05)] * 2)[1] == ("template",)


def test_off_rules_say_nothing_and_state_round_trips() -> None:
    rules = EarlyStopRules({"reward_std": "warn", "template": "off"})
    rep = rules.update(0, {"rollout/reward_std_all": 1.0, **_mi(0.0)})
    assert "health/template_streak" not in rep.metrics and "health/reward_std_streak" in rep.metrics
    stream = [{"rollout/reward_std_all": 1.0}] * 10 + [{"rollout/reward_std_all": 0.0}] * 4
    for i, m in enumerate(stream, start=1):
        rules.update(i, m)
    resumed = EarlyStopRules({"reward_std": "warn", "template": "off"})
    resumed.load_state_dict(rules.state_dict())
    assert resumed.state == rules.state
    with pytest.raises(ValueError):
        EarlyStopRules({"reward_std": "panic"})


def test_a_session_stops_on_a_rule_with_the_reason_and_a_tag(tmp_path, monkeypatch) -> None:
    # The tiny random model writes no valid reply, so validation success is 0: a val rule with patience 1
    # and action stop ends the smoke run after its first iteration, with the reason and a tag.
    from pathlib import Path

    from ragen_core.config import load_experiment
    from ragen_core.session import finish, open_session, run_to_end
    from ragen_core.tracking import NullLogger

    monkeypatch.setenv("RAGEN_DATA_DIR", str(tmp_path))
    smoke = Path(__file__).resolve().parents[3] / "experiments" / "smoke.yaml"
    cfg = load_experiment(smoke, ["health.val_rule=stop", "health.val_rule_patience=1",
                                  "health.val_rule_threshold=1.0", "trainer.iterations=3"])
    logger = NullLogger()
    sess = open_session(cfg, logger, say=lambda line: None)
    run_to_end(sess)
    result = finish(sess, log_model=False)
    assert result.iterations == 1 and result.stop_reason.startswith(HEALTH_STOP + " health rule val_success at step 0")
    assert logger.tags["health.val_success"] == "0"
