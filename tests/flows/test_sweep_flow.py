"""The sweep flow end to end on the tiny model: a 3-trial grid with nested MLflow runs and the
results table, resuming a finished study, pruning a deliberately bad trial, and the
deployment dispatch path (parameters of the deployment run, reporting through the storage)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import optuna
import pytest
from mlflow.tracking import MlflowClient

import flows.sweep
from flows.sweep import run_trial, sweep
from ragen_core.sweeps import open_study, plan_sweep, storage_url, trial_reporter
from ragen_core.sweeps.trials import objective
from tests.flows.conftest import latest_artifact

ROOT = Path(__file__).resolve().parents[2]
SMOKE = ROOT / "experiments" / "smoke.yaml"
# one short iteration per trial keeps three trials to well under a minute each on two cores
FAST = ["trainer.iterations=1", "eval.seeds=2", "rollout.max_new_tokens=8", "trainer.checkpoint_every=0",
        "tracking.artifact_every=0", "tracking.sample_trajectories=0"]


def write_sweep(dir_: Path, name: str, body: str, overrides: list[str] = FAST) -> Path:
    path = dir_ / f"{name}.yaml"
    path.write_text(f"name: {name}\nbase: {SMOKE}\noverrides: {json.dumps(overrides)}\n" + body)
    return path


def load(name: str, data: Path) -> optuna.Study:
    return optuna.load_study(study_name=name, storage=f"sqlite:///{data}/optuna.db")


@pytest.fixture(scope="module")
def smoke_sweep(tmp_path_factory):
    data = tmp_path_factory.mktemp("data")
    mp = pytest.MonkeyPatch()
    mp.setenv("RAGEN_DATA_DIR", str(data))
    mp.delenv("MLFLOW_TRACKING_URI", raising=False)
    path = write_sweep(data, "smoke-grid", "knobs: {responses_per_prompt: [1, 2, 4]}\npruner: none\n")
    summary = sweep(sweep_file=str(path), workers=1)
    yield data, path, summary
    mp.undo()


def test_every_grid_point_ran_once(smoke_sweep) -> None:
    data, _, summary = smoke_sweep
    trials = load("smoke-grid", data).get_trials()
    assert [t.state.name for t in trials] == ["COMPLETE"] * 3
    assert sorted(t.params["responses_per_prompt"] for t in trials) == [1, 2, 4]
    for t in trials:  # N = 1 runs without the filter, at P = 8 (fixed total 4 x 2)
        n = t.params["responses_per_prompt"]
        assert f"rollout.prompts_per_iter={8 // n}" in t.user_attrs["overrides"]
        assert ("algorithm.filter_strategy=none" in t.user_attrs["overrides"]) == (n == 1)
        # evaluations of the untrained policy (step 0) and after the one update (step 1); objective: final
        assert [step for step, _ in t.user_attrs["curve"]] == [0, 1] and t.value == t.user_attrs["curve"][-1][1]
        assert set(t.user_attrs["val"]) == {"Bandit"} and sorted(t.intermediate_values) == [0, 1]
    assert "study smoke-grid: 3 trials (COMPLETE 3, PRUNED 0, FAIL 0)" in summary
    assert "optuna-dashboard sqlite:///" in summary
    # the summary with its results table is the sweep flow run's Markdown artifact in the Prefect UI
    artifact = latest_artifact("sweep-smoke-grid")
    assert artifact is not None and artifact.type == "markdown"
    table_rows = [line for line in summary.splitlines() if line.startswith("|")]
    assert len(table_rows) >= 5 and all(row in artifact.data.splitlines() for row in table_rows)
    assert "study smoke-grid: 3 trials (COMPLETE 3, PRUNED 0, FAIL 0)" in artifact.data


def test_nested_runs_are_tagged_and_the_parent_has_the_results(smoke_sweep) -> None:
    data, _, _ = smoke_sweep
    study = load("smoke-grid", data)
    client = MlflowClient(f"sqlite:///{data}/mlflow.db")
    parent_id = study.user_attrs["mlflow_parent_run_id"]
    parent = client.get_run(parent_id)
    assert parent.info.run_name == "smoke-grid" and parent.info.status == "FINISHED"
    # the base experiment's env family's experiment; the trials are nested in it below
    assert client.get_experiment(parent.info.experiment_id).name == "ragen-Bandit"
    best = study.best_trial
    assert parent.data.params["best.responses_per_prompt"] == str(best.params["responses_per_prompt"])
    assert parent.data.tags["best_trial"] == str(best.number) and parent.data.tags["study"] == "smoke-grid"
    assert parent.data.params["sweep.knobs.responses_per_prompt"] == "[1, 2, 4]"
    arts = {a.path for a in client.list_artifacts(parent_id, "results")}
    assert arts == {"results/results.csv", "results/results.md", "results/results.png", "results/results-cost.png"}
    children = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent_id}'")
    assert len(children) == 3
    by_trial = {run.data.tags["trial"]: run for run in children}
    assert set(by_trial) == {"0", "1", "2"}
    flow_runs = {run.data.tags["prefect.flow_run_id"] for run in children}
    assert len(flow_runs) == 3 and all(flow_runs)
    for t in study.get_trials():
        run = by_trial[str(t.number)]
        assert run.data.tags["study"] == "smoke-grid" and run.info.run_id == t.user_attrs["mlflow_run_id"]
        assert run.data.params["rollout.responses_per_prompt"] == str(t.params["responses_per_prompt"])


def test_results_table_files(smoke_sweep) -> None:
    data, _, summary = smoke_sweep
    out = data / "sweeps" / "smoke-grid"
    rows = (out / "results.csv").read_text().splitlines()
    assert rows[0] == "responses_per_prompt,Bandit,objective,tokens,update_s,wall_s,state,trials"
    for row in rows[1:]:  # every trial says what it cost
        tokens, update_s, wall_s = map(float, row.split(",")[3:6])
        assert tokens > 0 and 0 < update_s < wall_s
    assert [r.split(",")[0] for r in rows[1:]] == ["1", "2", "4"]
    md = (out / "results.md").read_text()
    assert "| responses_per_prompt | Bandit (%) |" in md and md.strip().splitlines()[-1] in summary
    assert (out / "results.png").read_bytes()[:4] == b"\x89PNG"


def test_a_finished_study_resumes_without_new_trials(smoke_sweep, monkeypatch) -> None:
    data, path, _ = smoke_sweep
    monkeypatch.setenv("RAGEN_DATA_DIR", str(data))
    before = load("smoke-grid", data).user_attrs["mlflow_parent_run_id"]
    summary = sweep(sweep_file=str(path))
    study = load("smoke-grid", data)
    assert len(study.trials) == 3 and study.user_attrs["mlflow_parent_run_id"] == before
    assert "COMPLETE 3" in summary


def good_first_seed(space: dict[str, list], good: object) -> int:
    """A sampler seed whose shuffled grid starts with ``good`` (asked through Optuna's public API)."""
    for seed in range(50):
        probe = optuna.create_study(sampler=optuna.samplers.GridSampler(space, seed=seed))
        (name, values), = space.items()
        if probe.ask().suggest_categorical(name, values) == good:
            return seed
    raise AssertionError("no seed puts the good point first")


def test_pruning_stops_a_deliberately_bad_trial_early(data_dir, tmp_path) -> None:
    # With a format penalty of -2 every unparsable reply (all of the tiny random model's) returns
    # -2 instead of -0.1. Evaluations come before iterations 0 and 1 and after the last (step 2);
    # pruning may start at the second evaluation (pruner_warmup 1), where the bad trial's -2 is
    # below the median (-0.1) of the finished trial at step 1: it stops after 1 of its 2 updates.
    space = {"rollout.format_penalty": [-0.1, -2.0]}
    seed = good_first_seed(space, -0.1)
    path = write_sweep(tmp_path, "prune", (
        f"space: {json.dumps(space)}\nseed: {seed}\nmetric: val/Bandit/total_return\n"
        "pruner: median\npruner_startup_trials: 1\npruner_warmup: 1\n"), [*FAST, "trainer.iterations=2"])
    sweep(sweep_file=str(path))
    good, bad = load("prune", data_dir).get_trials()
    assert good.params == {"rollout.format_penalty": -0.1} and good.state.name == "COMPLETE"
    assert bad.params == {"rollout.format_penalty": -2.0} and bad.state.name == "PRUNED"
    assert sorted(good.intermediate_values) == [0, 1, 2]
    assert bad.intermediate_values == {0: pytest.approx(-2.0), 1: pytest.approx(-2.0)}
    assert bad.user_attrs["pruned_at"] == 1

    def updates(trial: optuna.trial.FrozenTrial) -> int:
        rows = [json.loads(x) for x in (Path(trial.user_attrs["run_dir"]) / "history.jsonl").read_text().splitlines()]
        return sum("timing/update_s" in r for r in rows)

    assert (updates(good), updates(bad)) == (2, 1)
    run = MlflowClient(f"sqlite:///{data_dir}/mlflow.db").get_run(bad.user_attrs["mlflow_run_id"])
    assert run.data.tags["stop_reason"] == "pruned by optuna" and run.info.status == "FINISHED"


@pytest.mark.parametrize("cost", ["none", "generated_tokens"])
def test_deployment_dispatch_passes_the_trial_and_reads_back_its_reports(data_dir, tmp_path, monkeypatch,
                                                                         cost) -> None:
    """Each trial as a run of the ragen-train deployment: the parameters, and a reporter that talks
    to the storage from "another machine" (here: a fake run_deployment that reports like the flow).
    With a cost objective the study has two objectives: success up, generated tokens down."""
    import prefect.deployments

    calls = []

    def fake_run_deployment(name, parameters, timeout):
        calls.append((name, parameters, timeout))
        report = trial_reporter(parameters["trial"])  # what flows/train.py does on the worker
        sess = SimpleNamespace(iteration=1, history=[{"perf/generated_tokens": 64.0}], run_dir=tmp_path / "r",
                               logger=SimpleNamespace(run_id="remote-run"), stop_reason=None, say=print)
        report(sess, {"val/success": 0.75, "val/Bandit/success": 0.75})
        return SimpleNamespace(name="fake", id="id", state=SimpleNamespace(name="Completed", is_completed=lambda: True))

    monkeypatch.setattr(prefect.deployments, "run_deployment", fake_run_deployment)
    monkeypatch.setattr(flows.sweep, "wait_for_run", lambda run, deployment, timeout_s: run.state)
    monkeypatch.chdir(ROOT)
    path = write_sweep(tmp_path, "pool", f"knobs: {{online_k: [2]}}\ndispatch: deployment\npruner: none\n"
                                         f"cost_objective: {cost}\n", [])
    plan = plan_sweep(path)
    url = storage_url(plan.sweep)
    study = open_study(plan.sweep, plan.grid, url)
    study.optimize(lambda t: objective(t, plan, url, "parent-id", lambda p: run_trial(plan, p)), n_trials=1)
    (name, params, timeout), = calls
    assert name == "ragen-train-trial/ragen-train-trial" and timeout == 0  # it waits itself (wait_for_run)
    assert params["experiment"] == "experiments/smoke.yaml"  # relative: the worker runs in its own checkout
    assert params["overrides"] == ["trainer.online_k=2"] and params["parent_run_id"] == "parent-id"
    assert params["tags"] == {"study": "pool", "trial": "0"} and params["run_name"].startswith("pool-t000-")
    assert params["trial"] == {"storage": url, "study_name": "pool", "trial_number": 0,
                               "metric": "val/success", "pruner": "none", "pruner_startup_trials": 5,
                               "pruner_warmup": 1}
    json.dumps(params)  # deployment parameters must be plain JSON
    trial = study.trials[0]
    assert trial.state.name == "COMPLETE" and trial.values == ([0.75] if cost == "none" else [0.75, 64.0])
    assert trial.intermediate_values == ({1: 0.75} if cost == "none" else {})  # Optuna: none for 2 objectives
    assert trial.user_attrs["mlflow_run_id"] == "remote-run" and trial.user_attrs["val"] == {"Bandit": 0.75}
    assert trial.user_attrs["cost"]["generated_tokens"] == 64.0


def test_a_trial_stopped_by_a_health_rule_is_pruned(data_dir, tmp_path) -> None:
    # A sweep prunes on the health rules. The tiny model's validation success is 0, so a val rule
    # with patience 1 and action stop ends each trial's run at its first evaluation; with prune_on_health
    # (the default) the trial is PRUNED and says why; with it off the trial completes.
    rule = ["health.val_rule=stop", "health.val_rule_patience=1", "health.val_rule_threshold=1.0"]
    fast = [*FAST, "trainer.iterations=2", *rule]
    sweep(sweep_file=str(write_sweep(tmp_path, "health", "knobs: {online_k: [1]}\npruner: none\n", fast)))
    (trial,) = load("health", data_dir).get_trials()
    assert trial.state.name == "PRUNED"
    assert trial.user_attrs["health_stop"].startswith("health: health rule val_success at step 0")
    sweep(sweep_file=str(write_sweep(tmp_path, "health-kept", "knobs: {online_k: [1]}\npruner: none\n"
                                                             "prune_on_health: false\n", fast)))
    (kept,) = load("health-kept", data_dir).get_trials()
    assert kept.state.name == "COMPLETE" and kept.user_attrs["health_stop"]


def test_a_worker_restores_the_storage_password_from_its_env_or_a_prefect_secret(monkeypatch) -> None:
    """A trial's parameters carry the storage URL with *** for its password; the worker puts it back from its own
    RAGEN_OPTUNA_STORAGE, else from the Prefect Secret block ragen-optuna-storage, else refuses clearly."""
    from prefect.blocks.system import Secret

    from flows.train import STORAGE_SECRET, _trial_storage
    from ragen_core.config import ConfigError
    from ragen_core.sweeps.study import STORAGE_ENV, redact

    full = "postgresql+psycopg2://ragen:hunter2@db-host:5432/optuna"
    shown = redact(full)
    assert "hunter2" not in shown
    monkeypatch.delenv(STORAGE_ENV, raising=False)
    with pytest.raises(ConfigError, match="needs its password on this worker"):
        _trial_storage(shown)
    Secret(value=full).save(STORAGE_SECRET, overwrite=True)
    try:
        assert _trial_storage(shown) == full
        monkeypatch.setenv(STORAGE_ENV, full.replace("db-host", "other-host"))  # not this storage: the secret
        assert _trial_storage(shown) == full
        monkeypatch.setenv(STORAGE_ENV, full)
        assert _trial_storage(shown) == full
    finally:
        Secret.delete(STORAGE_SECRET)
