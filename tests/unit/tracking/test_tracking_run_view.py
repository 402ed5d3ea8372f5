"""How a run looks in MLflow: run names, one experiment per env family marked as training runs,
the comparison curves first in the chart view, standard tags and the description, the replies table, nested
runs in their parent's experiment, and the UI links. Against a temporary sqlite store."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd
import pytest
from mlflow import MlflowClient

from ragen_core.config import load_experiment
from ragen_core.tracking import MLflowLogger, NullLogger
from ragen_core.tracking.logger import check_table
from ragen_core.tracking.mlflow_logger import CHART_FIRST, EXPERIMENT_KIND, EXPERIMENT_KIND_TAG, browse_hint, ui_url
from ragen_core.tracking.run_meta import (
    REPLIES_TABLE,
    default_run_name,
    env_family,
    experiment_name,
    header_comment,
    replies_table,
    source_tags,
)
from ragen_core.types import Trajectory, Turn

ROOT = Path(__file__).resolve().parents[3]
SMOKE = ROOT / "experiments" / "smoke.yaml"


# --------------------------------------------------------------------------- names and experiments


def test_default_run_name_says_preset_env_and_seed() -> None:
    cfg = load_experiment(SMOKE, ["trainer.seed=3"])
    when = 1_800_000_000.0
    name = default_run_name(cfg, when)
    assert re.fullmatch(r"starpo-s-Bandit-s3-\d{8}-\d{6}", name), name
    assert default_run_name(load_experiment(SMOKE, ["preset=starpo"]), when).startswith("starpo-Bandit-s0-")
    # a custom preset is named by what the config does
    custom = load_experiment(SMOKE, ["preset=custom", "algorithm.estimator=grpo", "env.tag=Bandit.Rev_2"])
    assert default_run_name(custom, when).startswith("grpo-Bandit.Rev_2-s0-")  # a plain folder name


def test_one_experiment_per_env_family_unless_one_is_named() -> None:
    assert [env_family(n) for n in ("Bandit", "BanditRev", "BanditTest", "LargerSokoban", "SokobanNewVocab",
                                    "FrozenLake", "WebShop", "Countdown", "NoSuchEnv")] == [
        "Bandit", "Bandit", "Bandit", "Sokoban", "Sokoban", "FrozenLake", "WebShop", "Countdown", "NoSuchEnv"]
    assert experiment_name(load_experiment(SMOKE)) == "ragen-Bandit"
    assert experiment_name(load_experiment(SMOKE, ["env.name=LargerSokoban"])) == "ragen-Sokoban"
    assert experiment_name(load_experiment(SMOKE, ["tracking.experiment=ragen"])) == "ragen"  # the old setting


def test_experiment_is_created_and_opened_as_training_runs(uri: str, tmp_path: Path) -> None:
    client = MlflowClient(uri)
    log = MLflowLogger(uri, "kind-new", run_name="r", outbox_dir=tmp_path / "a")
    assert client.get_experiment(log.experiment_id).tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND
    # an experiment made before (by ragen or anyone) gets the tag when a run opens it; a chosen kind stays
    old = client.create_experiment("kind-old")
    chosen = client.create_experiment("kind-chosen", tags={EXPERIMENT_KIND_TAG: "genai_development"})
    MLflowLogger(uri, "kind-old", run_name="r", outbox_dir=tmp_path / "b").close()
    MLflowLogger(uri, "kind-chosen", run_name="r", outbox_dir=tmp_path / "c").close()
    assert client.get_experiment(old).tags[EXPERIMENT_KIND_TAG] == "custom_model_development"
    assert client.get_experiment(chosen).tags[EXPERIMENT_KIND_TAG] == "genai_development"
    log.close()


def test_nested_run_goes_into_its_parents_experiment(uri: str, tmp_path: Path) -> None:
    parent = MLflowLogger(uri, "ragen-Bandit", run_name="study", outbox_dir=tmp_path / "p")
    child = MLflowLogger(uri, "ragen-Sokoban", run_name="t0", parent_run_id=parent.run_id, outbox_dir=tmp_path / "c")
    assert child.experiment_id == parent.experiment_id
    assert MlflowClient(uri).get_experiment_by_name("ragen-Sokoban") is None
    child.close()
    parent.close()


# --------------------------------------------------------------------------- charts, tags, links


def test_comparison_curves_are_logged_again_under_names_that_sort_first(uri: str, tmp_path: Path) -> None:
    log = MLflowLogger(uri, "charts", run_name="r", outbox_dir=tmp_path)
    metrics = {"val/success": 0.5, "rollout/reward_std_all": 0.2, "actor/entropy": 1.5, "actor/grad_norm": 3.0,
               "actor/loss": 0.1, "collapse/first_turn/mi": 0.3, "env/Bandit/success": 0.4}
    log.log_metrics(metrics, step=4)
    log.close()
    logged = MlflowClient(uri).get_run(log.run_id).data.metrics
    for source, alias in CHART_FIRST.items():
        assert logged[alias] == logged[source] == metrics[source]
    # the UI's sections are the key up to its last '/', sorted; charts in a section sorted by key
    sections = sorted({k.rsplit("/", 1)[0] for k in logged})
    assert sections[0] == "0_compare"
    assert sorted(k for k in logged if k.startswith("0_compare/")) == [
        "0_compare/1_val_success", "0_compare/2_reward_std", "0_compare/3_entropy", "0_compare/4_grad_norm"]


def test_header_comment_is_the_files_leading_comment(tmp_path: Path) -> None:
    assert header_comment(SMOKE).startswith("Smoke: the whole pipeline on the tiny random model")
    assert header_comment(SMOKE).splitlines()[-1] == "  ragen train experiments/smoke.yaml"
    bare = tmp_path / "bare.yaml"
    bare.write_text("name: x  # not a header\n# nor this\n")
    assert header_comment(bare) == "" and header_comment(tmp_path / "missing.yaml") == ""


def test_source_tags_user_source_and_description(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    tags = source_tags(SMOKE)
    assert tags["mlflow.source.name"] == "experiments/smoke.yaml" and tags["mlflow.source.type"] == "LOCAL"
    assert tags["mlflow.user"]
    assert tags["mlflow.note.content"] == header_comment(SMOKE)
    assert "mlflow.source.name" not in source_tags(None)


def test_ui_links_open_the_runs_view() -> None:
    assert ui_url("sqlite:///x.db", "3") == "http://127.0.0.1:5000/#/experiments/3/runs?workflowType=machine_learning"
    assert ui_url("http://mlflow:5000/", "3", "abc") == (
        "http://mlflow:5000/#/experiments/3/runs/abc?workflowType=machine_learning")
    assert browse_hint(NullLogger(), "sqlite:///x.db") == "\nbrowse it: mlflow ui --backend-store-uri sqlite:///x.db"
    assert browse_hint(NullLogger(), "") == ""


# --------------------------------------------------------------------------- the replies table


def _traj(seed: int, group: int, member: int, replies: list[str], success: bool) -> Trajectory:
    turns = tuple(Turn(observation=f"state {seed}.{k}", prompt_ids=(1,), response_ids=(2,), logprobs=(-0.1,),
                       response_text=r, actions=("Left",), reward=1.0 if success else 0.0, penalty=-0.1,
                       parse_ok=True) for k, r in enumerate(replies))
    return Trajectory(env_tag="Bandit", seed=seed, group_id=group, turns=turns, success=success, terminated=True,
                      truncated=False, meta={"member": member})


def test_replies_table_has_a_row_per_turn() -> None:
    trajs = [_traj(1_000_000, 0, 0, ["a", "b"], True), _traj(1_000_000, 0, 1, ["c"], False)]
    table = replies_table(7, trajs, [True, True])
    check_table(table, REPLIES_TABLE)
    rows = [dict(zip(table, values, strict=True)) for values in zip(*table.values(), strict=True)]
    assert [(r["env_seed"], r["member"], r["turn"], r["reply"]) for r in rows] == [
        (1_000_000, 0, 1, "a"), (1_000_000, 0, 2, "b"), (1_000_000, 1, 1, "c")]
    assert rows[0] == {"iteration": 7, "env_seed": 1_000_000, "group": 0, "member": 0, "turn": 1, "state": "state "
                       "1000000.0", "reply": "a", "actions": "Left", "reward": 0.9, "return": 1.8, "success": True,
                       "kept": True}
    assert replies_table(7, trajs)["kept"] == [None, None, None]


def test_replies_table_lands_in_mlflow_and_grows(uri: str, tmp_path: Path) -> None:
    log = MLflowLogger(uri, "tables", run_name="r", outbox_dir=tmp_path)
    log.log_table(replies_table(0, [_traj(5, 0, 0, ["x"], True)], [False]), REPLIES_TABLE)
    log.log_table(replies_table(10, [_traj(9, 0, 0, ["y"], False)], [True]), REPLIES_TABLE)
    log.close()
    client = MlflowClient(uri)
    run = client.get_run(log.run_id)
    assert {"path": REPLIES_TABLE, "type": "table"} in json.loads(run.data.tags["mlflow.loggedArtifacts"])
    # (client.load_table would search runs at the process-wide tracking URI, not the client's)
    df = pd.read_json(client.download_artifacts(log.run_id, REPLIES_TABLE, str(tmp_path / "dl")), orient="split")
    assert df["iteration"].tolist() == [0, 10] and df["reply"].tolist() == ["x", "y"]
    assert df["kept"].tolist() == [False, True]


def test_tables_must_be_json_with_equal_columns() -> None:
    with pytest.raises(ValueError, match="json"):
        NullLogger().log_table({"a": [1]}, "t.csv")
    with pytest.raises(ValueError, match="different lengths"):
        NullLogger().log_table({"a": [1], "b": [1, 2]}, "t.json")
    log = NullLogger()
    log.log_table({"a": [1]}, "t.json")
    log.log_table({"a": [2, 3]}, "t.json")
    assert log.tables == {"t.json": {"a": [1, 2, 3]}}
