"""A study carried to another machine in its carry file (ragen_core/sweeps/carry.py): half the study runs on one
data folder, the rest on a fresh one that has only the study YAML and the carry file; the carried trial is not
run again, its run is made again in MLflow with every metric, and the report covers both. A carry file that does
not fit the study is refused before anything is added."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import optuna
import pytest
from mlflow.tracking import MlflowClient

from flows.sweep import sweep
from ragen_core.config import ConfigError
from ragen_core.sweeps import open_study, plan_sweep, storage_url
from ragen_core.sweeps.carry import carry_in, carry_out, read_carry

ROOT = Path(__file__).resolve().parents[2]
SMOKE = ROOT / "experiments" / "smoke.yaml"
FAST = ["trainer.iterations=2", "eval.seeds=2", "eval.every=1", "rollout.max_new_tokens=8",
        "trainer.checkpoint_every=0", "tracking.artifact_every=0", "tracking.sample_trajectories=0",
        "diagnostics.collapse_every=1"]


def _study_file(folder: Path, name: str = "carried", seeds: str = "[0, 1]") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.yaml"
    path.write_text(f"name: {name}\nbase: {SMOKE}\noverrides: {json.dumps(FAST)}\n"
                    f"space: {{preset: [starpo-s], trainer.seed: {seeds}}}\ngroup_by: preset\nobjective: final\n"
                    f"pruner: none\nprune_on_health: false\ncarry: carry/{name}.jsonl\n")
    return path


def _children(uri: str, study: str) -> list:
    client = MlflowClient(uri)
    experiments = [e.experiment_id for e in client.search_experiments()]
    parent = client.search_runs(experiments, f"tags.mlflow.runName = '{study}'")[0]
    return client.search_runs(experiments, f"tags.mlflow.parentRunId = '{parent.info.run_id}'")


@pytest.fixture(scope="module")
def two_machines(tmp_path_factory):
    repo, first, second = (tmp_path_factory.mktemp(n) for n in ("repo", "first", "second"))
    path = _study_file(repo)
    mp = pytest.MonkeyPatch()
    mp.delenv("MLFLOW_TRACKING_URI", raising=False)
    mp.setenv("RAGEN_DATA_DIR", str(first))
    sweep(sweep_file=str(path), overrides=["n_trials=1"])  # the first machine's session ends after one trial
    after_first = (repo / "carry" / "carried.jsonl").read_text()
    mp.setenv("RAGEN_DATA_DIR", str(second))  # a fresh machine: no optuna.db, mlflow.db or runs
    summary = sweep(sweep_file=str(path))
    yield repo, first, second, after_first, summary
    mp.undo()


def test_the_first_machine_writes_its_finished_trial_with_its_run(two_machines) -> None:
    _, first, _, after_first, _ = two_machines
    (record,) = [json.loads(line) for line in after_first.splitlines()]
    assert record["state"] == "COMPLETE" and record["params"]["preset"] == "starpo-s"
    assert "run_dir" not in record["user_attrs"] and record["user_attrs"]["curve"]
    (child,) = _children(f"sqlite:///{first}/mlflow.db", "carried")
    assert record["run"]["run_id"] == child.info.run_id and record["run"]["name"] == child.info.run_name
    assert set(record["run"]["metrics"]) == set(child.data.metrics)  # every metric, not only the report's
    steps = [s for s, _ in record["run"]["metrics"]["val/success"]]
    assert steps == [0, 1, 2]  # each evaluation (eval.every=1, then after the last iteration)


def test_the_second_machine_runs_only_the_rest_and_reports_both(two_machines) -> None:
    repo, _, second, after_first, summary = two_machines
    trials = optuna.load_study(study_name="carried", storage=f"sqlite:///{second}/optuna.db").get_trials()
    assert [t.state.name for t in trials] == ["COMPLETE", "COMPLETE"]
    carried, ran = trials
    (record,) = [json.loads(line) for line in after_first.splitlines()]
    assert carried.params == record["params"] and carried.user_attrs["carried_from"]["trial"] == record["number"]
    assert ran.params["trainer.seed"] != carried.params["trainer.seed"]  # the other grid point, run here
    runs = sorted((second / "runs").iterdir())
    assert len(runs) == 1  # only one run trained on this machine
    uri = f"sqlite:///{second}/mlflow.db"
    by_id = {r.info.run_id: r for r in _children(uri, "carried")}
    made = by_id[carried.user_attrs["mlflow_run_id"]]
    assert made.data.tags["carried_from"] == record["run"]["run_id"] and made.info.status == "FINISHED"
    assert made.info.run_name == record["run"]["name"] and made.data.params == record["run"]["params"]
    history = MlflowClient(uri).get_metric_history(made.info.run_id, "val/success")
    assert [[m.step, m.value] for m in history] == record["run"]["metrics"]["val/success"]
    assert "carried: 2 runs by preset" in summary
    groups = (second / "sweeps" / "carried" / "study" / "groups.csv").read_text().splitlines()
    assert groups[1].startswith("starpo-s,2,")
    # the file now holds both trials: the carried one's line as it came (its first number, times and run id), the
    # new one with the run it has on this machine
    text = (repo / "carry" / "carried.jsonl").read_text()
    assert after_first.strip() in text.splitlines()
    lines = [json.loads(line) for line in text.splitlines()]
    assert sorted(r["params"]["trainer.seed"] for r in lines) == [0, 1]
    assert {r["run"]["run_id"] for r in lines} == {record["run"]["run_id"], ran.user_attrs["mlflow_run_id"]}


def test_carrying_in_again_adds_nothing(two_machines, monkeypatch) -> None:
    repo, _, second, *_ = two_machines
    monkeypatch.setenv("RAGEN_DATA_DIR", str(second))
    plan = plan_sweep(repo / "carried.yaml")
    study = open_study(plan.sweep, plan.grid, storage_url(plan.sweep))
    assert carry_in(plan, study, parent_run_id=None) == []  # both points finished here already
    assert len(study.get_trials()) == 2


@pytest.mark.parametrize(("text", "match"), [
    ("not json\n", "line 1 is not JSON"),
    ('{"carry": 99, "study": "carried"}\n', "not a carried trial of format 1"),
    ('{"carry": 1, "study": "other"}\n', "trial of study 'other'"),
    ('{"carry": 1, "study": "carried", "number": 0, "state": "FAIL", "params": {}, "distributions": {}, '
     '"values": null}\n', "only finished trials"),
])
def test_a_bad_carry_file_is_refused_and_nothing_is_added(tmp_path, monkeypatch, text, match) -> None:
    monkeypatch.setenv("RAGEN_DATA_DIR", str(tmp_path / "data"))
    path = _study_file(tmp_path / "repo")
    (tmp_path / "repo" / "carry").mkdir()
    (tmp_path / "repo" / "carry" / "carried.jsonl").write_text(text)
    plan = plan_sweep(path)
    study = open_study(plan.sweep, plan.grid, storage_url(plan.sweep))
    with pytest.raises(ConfigError, match=match):
        carry_in(plan, study, parent_run_id=None)
    assert study.get_trials() == [] and (tmp_path / "repo" / "carry" / "carried.jsonl").read_text() == text


def test_a_carry_file_of_another_grid_is_refused(two_machines, tmp_path, monkeypatch) -> None:
    repo, *_ = two_machines
    monkeypatch.setenv("RAGEN_DATA_DIR", str(tmp_path / "data"))
    path = _study_file(tmp_path / "repo", seeds="[0, 1, 2]")  # the same study with a third seed
    (tmp_path / "repo" / "carry").mkdir()
    (tmp_path / "repo" / "carry" / "carried.jsonl").write_text((repo / "carry" / "carried.jsonl").read_text())
    plan = plan_sweep(path)
    assert len(read_carry(plan.sweep.carry, "carried")) == 2
    study = open_study(plan.sweep, plan.grid, storage_url(plan.sweep))
    with pytest.raises(ConfigError, match="this study's grid is"):
        carry_in(plan, study, parent_run_id=None)
    assert study.get_trials() == []


def test_a_carry_file_that_cannot_be_written_is_said_and_the_study_goes_on(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("RAGEN_DATA_DIR", str(tmp_path / "data"))
    path = _study_file(tmp_path / "repo")
    (tmp_path / "repo" / "carry" / "carried.jsonl").mkdir(parents=True)  # a folder where the file should be
    plan = plan_sweep(path)
    study = open_study(plan.sweep, plan.grid, storage_url(plan.sweep))
    said: list[str] = []
    assert carry_out(plan, study, say=said.append) is None
    assert len(said) == 1 and "could not write the carry file" in said[0]
    assert [p.name for p in (tmp_path / "repo" / "carry").iterdir()] == ["carried.jsonl"]  # as it was, no leftover


def test_the_metrics_read_from_a_runs_shards_travel_in_the_carry_file(tmp_path) -> None:
    """A run made before the step-group metrics were logged has them only in its Parquet shards, which stay on the
    machine: the carry file gets them filled in (sweeps/shards.py), so the report on the next machine has them."""
    from mlflow.entities import Metric

    from ragen_core.store.parquet import write_shard
    from ragen_core.sweeps.carry import trial_lines
    from ragen_core.types import Trajectory, Turn

    def turn(key: str) -> Turn:
        return Turn("obs", (1,), (5,), (-1.0,), "r", ("Up",), 0.0, 0.0, True, "stop", 0, 1, state_key=key)

    run_dir = tmp_path / "run"
    # one group of two trajectories: turns ['s', 't'] and ['s'] -> 2 of 3 turns in a step group of 2 or more;
    # the one later turn, t, alone (0 of 1)
    ends = {"success": False, "terminated": True, "truncated": False}
    write_shard(run_dir, 0, [Trajectory("Lake", 0, 0, (turn("s"), turn("t")), **ends),
                             Trajectory("Lake", 0, 0, (turn("s"),), **ends)])
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    run = client.create_run(client.create_experiment("lake"), run_name="lake-20260101-000000")
    client.log_batch(run.info.run_id, metrics=[Metric("val/success", 0.5, 0, 0)])
    client.set_terminated(run.info.run_id)
    study = optuna.create_study()
    study.add_trial(optuna.trial.create_trial(
        params={"trainer.seed": 0}, distributions={"trainer.seed": optuna.distributions.CategoricalDistribution([0])},
        value=0.5, user_attrs={"mlflow_run_id": run.info.run_id, "run_dir": str(run_dir)}))

    (record,) = trial_lines(study, uri)
    metrics = record["run"]["metrics"]
    assert metrics["val/success"] == [[0, 0.5]]
    assert metrics["rollout/step_group_share"] == [[0, pytest.approx(2 / 3)]]
    assert metrics["rollout/step_group_share_later"] == [[0, 0.0]]
    assert "run_dir" not in record["user_attrs"]
    # once the run's folder is gone, what tracking has is written as it is
    shutil.rmtree(run_dir)
    (again,) = trial_lines(study, uri)
    assert again["run"]["metrics"] == {"val/success": [[0, 0.5]]}
