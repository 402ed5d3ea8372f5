"""Run-level rules of ragen_core.session that no flow test would notice going wrong."""

from __future__ import annotations

import pytest

from ragen_core.config import ConfigError, EvalConfig, ExperimentConfig
from ragen_core.rollout.evaluate import heldout_seeds
from ragen_core.session import TRAIN_SEED_OFFSET, train_seeds


def test_training_seeds_never_meet_heldout_seeds() -> None:
    # 200 iterations x P=8 x Online-k 10: far more than any run uses
    used = set(train_seeds(0, 200 * 8 * 10))
    assert used.isdisjoint(heldout_seeds(256, 123))
    assert min(used) == TRAIN_SEED_OFFSET
    # consecutive iterations continue where the last stopped, without overlap
    assert train_seeds(0, 8)[-1] + 1 == train_seeds(8, 8)[0]


def test_heldout_range_reaching_training_seeds_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"eval\.seed_start"):
        ExperimentConfig(eval=EvalConfig(seed_start=TRAIN_SEED_OFFSET - 10, seeds=256))


def test_collapse_diagnostics_every_k_iterations_with_an_ema_kept_in_checkpoints(tmp_path, monkeypatch) -> None:
    # Issue 15: collapse/ metrics every diagnostics.collapse_every iterations, on the policy that sampled the
    # rollouts; mi_zscore_ema divides MI by an EMA (decay 0.9) of the marginal std, carried across a resume.
    import json
    from pathlib import Path

    from ragen_core.algos.collapse import MI_ZSCORE_EPS
    from ragen_core.config import load_experiment
    from ragen_core.rollout.scripted import ScriptedGenerator
    from ragen_core.session import open_session, run_iteration
    from ragen_core.tracking import NullLogger

    monkeypatch.setenv("RAGEN_DATA_DIR", str(tmp_path))
    smoke = Path(__file__).resolve().parents[2] / "experiments" / "smoke.yaml"
    cfg = load_experiment(smoke, ["diagnostics.collapse_every=2", "trainer.iterations=5", "eval.every=0",
                                  "trainer.checkpoint_every=2", "rollout.max_new_tokens=40"])

    def scripted(sess):  # the tiny random model never closes a think block: script replies that do
        sess.generator = ScriptedGenerator(sess.tokenizer, lambda c, r, p: f"<think>plan {r % 3}</think>"
                                                                           "<answer>Dragon</answer>")
        return sess

    sess = scripted(open_session(cfg, NullLogger(), say=lambda line: None))
    rows = [run_iteration(sess) for _ in range(3)]  # iterations 0, 1, 2: measured at 0 and 2
    assert ["collapse/first_turn/mi" in r for r in rows] == [True, False, True]
    first, third = rows[0], rows[2]
    assert first["collapse/first_turn/marginal_std_ema"] == first["collapse/first_turn/marginal_std"]
    ema = 0.9 * first["collapse/first_turn/marginal_std"] + 0.1 * third["collapse/first_turn/marginal_std"]
    assert third["collapse/first_turn/marginal_std_ema"] == pytest.approx(ema)
    assert third["collapse/first_turn/mi_zscore_ema"] == pytest.approx(
        third["collapse/first_turn/mi"] / (ema + MI_ZSCORE_EPS))
    assert first["collapse/first_turn/valid_share"] == 1.0 and "collapse/later_turns/mi" not in first  # one turn
    # the checkpoint after iteration 2 holds the EMA; a resumed session continues from it
    saved = json.loads((sess.run_dir / "checkpoints" / "iter=000002" / "health.json").read_text())
    assert saved["collapse_ema"]["first_turn"] == pytest.approx(first["collapse/first_turn/marginal_std"])
    resumed = open_session(cfg, NullLogger(), sess.run_dir, say=lambda line: None)
    assert resumed.collapse_ema == pytest.approx(saved["collapse_ema"])


@pytest.mark.parametrize("critic", ["head", "separate"])
def test_a_value_heads_old_values_come_from_the_rollout(tmp_path, monkeypatch, critic: str) -> None:
    # Issue 21: with critic: head the hf generator records the head's values as it samples, so the update needs
    # no forward for its old values; they are what that forward gives (1e-4). A separate critic records none.
    from pathlib import Path

    import torch

    from ragen_core.config import load_experiment
    from ragen_core.session import collect_rollouts, open_session, tokenize_and_filter
    from ragen_core.tracking import NullLogger
    from ragen_core.trainer.models import critic_values

    monkeypatch.setenv("RAGEN_DATA_DIR", str(tmp_path))
    smoke = Path(__file__).resolve().parents[2] / "experiments" / "smoke.yaml"
    cfg = load_experiment(smoke, [f"algorithm.critic={critic}", "eval.every=0", "algorithm.filter_strategy=none",
                                  "rollout.max_new_tokens=12"])
    sess = open_session(cfg, NullLogger(), tmp_path / "run", say=lambda line: None)
    batch = tokenize_and_filter(sess, collect_rollouts(sess)).batch
    if critic == "separate":
        assert batch.old_values is None
        return
    assert batch.old_values is not None
    assert batch.batch_size == cfg.prompts_per_rollout * cfg.rollout.responses_per_prompt
    with torch.no_grad():
        values = critic_values(sess.state.models, batch.input_ids, batch.attention_mask.long())
    torch.testing.assert_close(batch.old_values[batch.loss_mask], values[batch.loss_mask], rtol=0, atol=1e-4)
    assert not batch.old_values[~batch.loss_mask].any()
