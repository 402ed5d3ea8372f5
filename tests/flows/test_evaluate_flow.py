"""`ragen eval`: the variant map and table of ragen_core.evaluation, then the flow on a tiny-model smoke run
(targets, eval.json/eval.md, metrics and files on the run's own MLflow run, no second run)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from flows.evaluate import evaluate
from flows.train import train
from ragen_core import evaluation as ev
from ragen_core.config import EnvConfig, load_experiment
from ragen_core.envs import make
from ragen_core.models import load_model
from tests.flows.conftest import latest_artifact

ROOT = Path(__file__).resolve().parents[2]
SMOKE = str(ROOT / "experiments" / "smoke.yaml")

# --------------------------------------------------------------------------- variants and table (no flow)


def _labels(envs: tuple[EnvConfig, ...]) -> list[str]:
    return [e.label for e in envs]


def test_bandit_family_carries_shared_params_but_not_arm_names():
    train_env = EnvConfig("Bandit", {"low_risk_reward": 0.1, "low_risk_name": "Teacher", "high_risk_name": "Engineer"},
                          tag="Bandit-TE")
    variants = ev.generalisation_variants(train_env)
    # BanditRev is not here: in the paper it is a training run of its own
    assert _labels(variants) == ["Bandit-TE", "Bandit", "BanditTest"]
    assert variants[0] == train_env
    for v in variants[1:]:
        assert v.params == {"low_risk_reward": 0.1}  # the reward setting carries over, the names do not
    # what the registry makes of them: the SPEC §2 pairs, with the carried reward
    test = make(variants[2].name, **variants[2].params)
    assert (test.low_risk_name, test.high_risk_name) == ("Trader", "Librarian")


def test_a_variant_with_the_training_label_is_left_out():
    # trained on "Bandit" with its own names and no tag: the registry's Bandit would reuse the label
    variants = ev.generalisation_variants(
        EnvConfig("Bandit", {"low_risk_name": "Teacher", "high_risk_name": "Engineer"}))
    assert _labels(variants) == ["Bandit", "BanditTest"]
    assert variants[0].params["low_risk_name"] == "Teacher"
    assert _labels(ev.generalisation_variants(EnvConfig("BanditRev"))) == ["BanditRev"]  # trained and tested reversed


def test_sokoban_family_and_envs_outside_a_family():
    variants = ev.generalisation_variants(EnvConfig("SimpleSokoban", {"max_moves": 8, "symbols": "#_O√XPS"}))
    # FrozenLake: zero-shot transfer of the Sokoban-trained model (the paper's Tables 2-4), registry defaults
    assert _labels(variants) == ["SimpleSokoban", "Sokoban", "SokobanNewVocab", "LargerSokoban", "FrozenLake"]
    larger = make(variants[3].name, **variants[3].params)
    assert (larger.height, larger.width, larger.n_boxes, larger.max_moves) == (8, 8, 2, 8)
    assert make(variants[2].name, **variants[2].params).symbols == "W.GCBA@"  # not the training symbols
    assert variants[4].params == {}
    assert _labels(ev.generalisation_variants(EnvConfig("FrozenLake"))) == ["FrozenLake"]
    assert _labels(ev.generalisation_variants(EnvConfig("Countdown"))) == ["Countdown"]
    for v in variants:  # every variant is a valid env
        make(v.name, **v.params).reset(seed=123)


def test_evaluation_envs_put_the_configured_eval_envs_first_and_dedupe_labels(tmp_path):
    cfg = load_experiment(SMOKE, ["eval.envs=[{name: BanditRev}, {name: Countdown}]"])
    assert _labels(ev.evaluation_envs(cfg)) == ["BanditRev", "Countdown", "Bandit", "BanditTest"]
    assert _labels(ev.evaluation_envs(load_experiment(SMOKE))) == ["Bandit", "BanditTest"]


def test_rows_and_table_golden():
    metrics = {"val/final/A/success": 0.5, "val/final/A/pass_at_2": 0.75, "val/final/A/return": 0.25,
               "val/final/A/total_return": 0.125, "val/final/success": 0.5}
    rows = ev.eval_rows(metrics, ("A",), seeds=4, samples=2)
    assert rows == (ev.EvalRow("A", 0.5, 0.75, 0.25, 0.125, 8),)  # 4 seeds x 2 samples = 8 episodes
    report = ev.EvalReport("run", "run/checkpoints/iter=000003", 3, 4, 2, rows, metrics, 1.0)
    assert ev.format_table(report).splitlines()[2:] == [
        "| env | success | pass@2 | return | total return | episodes |",
        "|---|---:|---:|---:|---:|---:|",
        "| A | 0.500 | 0.750 | +0.250 | +0.125 | 8 |",
    ]
    with pytest.raises(KeyError):
        ev.eval_rows(metrics, ("B",), seeds=4, samples=2)


def test_a_lora_final_model_is_loaded_as_the_adapter_over_the_base(tmp_path):
    from peft import LoraConfig, get_peft_model

    cfg = load_experiment(SMOKE, ["model.lora_rank=4", "model.lora_alpha=8", "model.device=cpu"])
    # init_lora_weights=False: B is random, so the adapter really changes the outputs
    adapted = get_peft_model(load_model("tiny-random"), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                                   init_lora_weights=False))
    adapted.save_pretrained(tmp_path / "final-model")  # what session.finish writes under LoRA
    actor, _ = ev.load_policy(cfg, tmp_path / "final-model")
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        assert torch.allclose(actor(ids).logits, adapted.eval()(ids).logits)
        assert not torch.allclose(actor(ids).logits, load_model("tiny-random")(ids).logits)


def test_unknown_targets_say_what_was_looked_for(tmp_path, monkeypatch):
    monkeypatch.setenv("RAGEN_DATA_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="no run 'nope'"):
        ev.resolve_target("nope")
    empty = tmp_path / "runs" / "empty"
    empty.mkdir(parents=True)
    (empty / "config.yaml").write_text("name: empty\n")
    with pytest.raises(FileNotFoundError, match="neither a checkpoint nor a final-model"):
        ev.resolve_target("empty")


# --------------------------------------------------------------------------- the flow on a smoke run


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One 1-iteration smoke run (tiny model) tracked in its own sqlite MLflow store."""
    data = tmp_path_factory.mktemp("eval-data")
    uri = f"sqlite:///{data}/mlflow-eval.db"
    mp = pytest.MonkeyPatch()
    mp.setenv("RAGEN_DATA_DIR", str(data))
    mp.delenv("MLFLOW_TRACKING_URI", raising=False)
    result = train(experiment=SMOKE, run_name="eval-smoke",
                   overrides=["trainer.iterations=1", f"tracking.uri={uri}", "tracking.artifact_every=0"])
    yield result, uri
    mp.undo()


def test_targets_resolve_to_the_same_weights(smoke):
    result, _ = smoke
    run_dir = Path(result.run_dir)
    by_name, by_dir = ev.resolve_target("eval-smoke"), ev.resolve_target(str(run_dir))
    ckpt = run_dir / "checkpoints" / "iter=000001"
    assert by_name == by_dir == ev.EvalTarget(run_dir, ckpt, 1)
    assert ev.resolve_target(str(ckpt)) == by_name
    assert ev.resolve_target(str(run_dir / "final-model")) == ev.EvalTarget(run_dir, run_dir / "final-model", 1)
    # the checkpoint and the saved final model hold the trained actor, not the base model
    cfg = load_experiment(run_dir / "config.yaml")
    from_ckpt = ev.load_policy(cfg, ckpt)[0].state_dict()
    from_final = ev.load_policy(cfg, run_dir / "final-model")[0].state_dict()
    base = load_model("tiny-random").state_dict()
    assert from_ckpt.keys() == from_final.keys() == base.keys()
    assert all(torch.equal(from_ckpt[k], from_final[k]) for k in base)
    assert any(not torch.equal(from_ckpt[k], base[k]) for k in base)  # one update at lr 1e-4 moved it


def test_evaluate_flow_table_files_and_mlflow(smoke):
    result, uri = smoke
    run_dir = Path(result.run_dir)
    text = evaluate(target="eval-smoke", seeds=4)
    lines = text.splitlines()
    assert "| env | success | pass@1 | return | total return | episodes |" in lines
    rows = [ln.split(" | ") for ln in lines if ln.startswith("| Bandit")]
    assert [r[0] for r in rows] == ["| Bandit", "| BanditTest"]
    assert all(r[-1] == "4 |" for r in rows)  # 4 seeds x eval.samples 1
    saved = json.loads((run_dir / "eval.json").read_text())
    assert saved["iteration"] == 1 and saved["seeds"] == 4 and saved["weights"].endswith("iter=000001")
    assert (run_dir / "eval.md").read_text().splitlines()[2:] == lines[2:6]
    for tag in ("Bandit", "BanditTest"):
        assert 0.0 <= saved["metrics"][f"val/final/{tag}/success"] <= 1.0
    # same seeds, temperature and sampling seed as the run's own final evaluation: same numbers
    history = [json.loads(x) for x in (run_dir / "history.jsonl").read_text().splitlines()]
    final_val = next(r for r in reversed(history) if "val/Bandit/success" in r)
    assert final_val["iteration"] == 1
    for key in ("success", "return", "total_return", "pass_at_1"):
        assert saved["metrics"][f"val/final/Bandit/{key}"] == pytest.approx(final_val[f"val/Bandit/{key}"])
    # onto the run's own MLflow run, at step = updates behind the weights; no second run
    client = MlflowClient(uri)
    assert "logged to MLflow run " + result.mlflow_run_id in text
    runs = client.search_runs([client.get_run(result.mlflow_run_id).info.experiment_id])
    assert [r.info.run_id for r in runs] == [result.mlflow_run_id]
    hist = client.get_metric_history(result.mlflow_run_id, "val/final/BanditTest/success")
    assert [(m.step, m.value) for m in hist] == [(1, saved["metrics"]["val/final/BanditTest/success"])]
    assert {a.path for a in client.list_artifacts(result.mlflow_run_id, "eval")} == {"eval/eval.json", "eval/eval.md"}
    assert client.get_run(result.mlflow_run_id).info.status == "FINISHED"
    # the table is also the flow run's Markdown artifact in the Prefect UI
    artifact = latest_artifact("evaluation-eval-smoke-it1")
    assert artifact is not None and artifact.type == "markdown"
    assert "| env | success | pass@1 | return | total return | episodes |" in artifact.data
    assert "| BanditTest |" in artifact.data and result.mlflow_run_id in artifact.data


def test_overrides_and_a_checkpoint_target(smoke):
    result, _ = smoke
    ckpt = Path(result.run_dir) / "checkpoints" / "iter=000001"
    text = evaluate(target=str(ckpt), seeds=2, overrides=["eval.samples=2"])
    assert "| env | success | pass@2 |" in text
    assert all(ln.endswith("| 4 |") for ln in text.splitlines() if ln.startswith("| Bandit"))  # 2 seeds x 2
