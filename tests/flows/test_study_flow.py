"""A study end to end on the tiny model: preset x seed as nested MLflow runs tagged algo / seed / env, resumed
after it stopped half-way, aggregated by preset under the study's folder and on the parent run; and
``ragen compare`` over the same runs as a group (by parent and by tag)."""

from __future__ import annotations

import json
from pathlib import Path

import optuna
import pytest
from mlflow.tracking import MlflowClient

from flows.compare import compare
from flows.sweep import sweep
from ragen_core.config import ConfigError, load_experiment
from ragen_core.sweeps import plan_sweep

ROOT = Path(__file__).resolve().parents[2]
SMOKE = ROOT / "experiments" / "smoke.yaml"
FAST = ["trainer.iterations=2", "eval.seeds=2", "eval.every=1", "rollout.max_new_tokens=8",
        "trainer.checkpoint_every=0", "tracking.artifact_every=0", "tracking.sample_trajectories=0",
        "diagnostics.collapse_every=1", "diagnostics.grad_buckets_every=1"]
BODY = ("space: {preset: [starpo, starpo-s], trainer.seed: [0, 1]}\ngroup_by: preset\nobjective: final\n"
        "pruner: none\nprune_on_health: false\n")


@pytest.fixture(scope="module")
def study_run(tmp_path_factory):
    data = tmp_path_factory.mktemp("data")
    mp = pytest.MonkeyPatch()
    mp.setenv("RAGEN_DATA_DIR", str(data))
    mp.delenv("MLFLOW_TRACKING_URI", raising=False)
    path = data / "tiny-study.yaml"
    path.write_text(f"name: tiny-study\nbase: {SMOKE}\noverrides: {json.dumps(FAST)}\n" + BODY)
    first = sweep(sweep_file=str(path), overrides=["n_trials=2"])  # stops after half the grid
    summary = sweep(sweep_file=str(path))  # the same command again resumes with the other half
    yield data, path, first, summary
    mp.undo()


def test_the_study_resumes_and_runs_every_preset_and_seed_once(study_run) -> None:
    data, _, first, summary = study_run
    assert "2 runs by preset" in first
    trials = optuna.load_study(study_name="tiny-study", storage=f"sqlite:///{data}/optuna.db").get_trials()
    assert [t.state.name for t in trials] == ["COMPLETE"] * 4
    assert sorted((t.params["preset"], t.params["trainer.seed"]) for t in trials) == \
           [("starpo", 0), ("starpo", 1), ("starpo-s", 0), ("starpo-s", 1)]
    assert "tiny-study: 4 runs by preset" in summary


def test_children_are_nested_and_tagged(study_run) -> None:
    data, *_ = study_run
    client = MlflowClient(f"sqlite:///{data}/mlflow.db")
    parent = client.search_runs([e.experiment_id for e in client.search_experiments()],
                                "tags.mlflow.runName = 'tiny-study'")[0]
    children = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    tags = sorted((r.data.tags["algo"], r.data.tags["seed"], r.data.tags["env"], r.data.tags["study"])
                  for r in children)
    assert tags == [("starpo", "0", "Bandit", "tiny-study"), ("starpo", "1", "Bandit", "tiny-study"),
                    ("starpo-s", "0", "Bandit", "tiny-study"), ("starpo-s", "1", "Bandit", "tiny-study")]
    arts = {a.path for a in client.list_artifacts(parent.info.run_id, "study")}
    assert {"study/study.md", "study/groups.csv", "study/monitor.csv", "study/curves.csv", "study/curves.png"} <= arts
    assert parent.data.metrics["val/study/starpo/seeds"] == 2
    assert "val/study/starpo-s/final_success_mean" in parent.data.metrics


def test_the_aggregate_has_a_row_per_preset_and_every_signal_judged(study_run) -> None:
    data, *_ = study_run
    out = data / "sweeps" / "tiny-study" / "study"
    groups = (out / "groups.csv").read_text().splitlines()
    assert groups[0].startswith("group,seeds,final_mean,final_std")
    assert sorted(line.split(",")[:2] for line in groups[1:]) == [["starpo", "2"], ["starpo-s", "2"]]
    monitor = (out / "monitor.csv").read_text().splitlines()
    assert len(monitor) == 1 + 4 * 5  # 4 runs x 5 signals
    curves = (out / "curves.csv").read_text()
    for metric in ("val/success", "rollout/reward_std_all", "rollout/reward_std_kept", "actor/entropy",
                   "actor/grad_norm", "response/length_mean"):
        assert f"starpo-s,{metric},1," in curves, metric
    # the tiny random model never closes its thought, so there was no reasoning to score: no MI curve, no error
    assert "collapse/first_turn/mi," not in curves
    md = (out / "study.md").read_text()
    assert "## The monitor on these runs" in md and "## Which signal moved first" in md
    # the gradient analysis, read whole from each run (grad/ names depend on the bucket edges): both measured
    # iterations of every run, each bucket of the default edges
    grad = [line.split(",") for line in (out / "grad.csv").read_text().splitlines()]
    assert grad[0] == ["run", "preset", "seed", "iteration", "bucket", "task", "entropy", "kl", "value", "rows"]
    assert sorted({(r[1], r[3], r[4]) for r in grad[1:]}) == sorted(
        (p, it, b) for p in ("starpo", "starpo-s") for it in ("0", "1") for b in ("zero", "le_0.2", "gt_0.2"))
    assert len(grad) == 1 + 4 * 2 * 3 and "## Gradient by reward-std bucket" in md


def test_compare_takes_a_group_by_parent_or_by_tag(study_run, tmp_path) -> None:
    data, *_ = study_run
    uri = f"sqlite:///{data}/mlflow.db"
    text = compare(runs=[], out_dir=str(tmp_path / "a"), tracking_uri=uri, parent="tiny-study", group_by="preset")
    assert "4 runs by preset" in text and (tmp_path / "a" / "study" / "curves.png").exists()
    # Bandit keys its one state: every member of a prompt group acts on it, and no episode has a later turn
    recurred = (tmp_path / "a" / "study" / "study.md").read_text().split("## How often states recurred")[1]
    assert recurred.count("| 1.00 (1.00-1.00) | - |") == 4
    assert (tmp_path / "a" / "study" / "grad.csv").read_text() == (data / "sweeps" / "tiny-study" / "study" /
                                                                   "grad.csv").read_text()
    text = compare(runs=[], out_dir=str(tmp_path / "b"), tracking_uri=uri, tags={"study": "tiny-study", "seed": "1"},
                   group_by="algo")
    assert "2 runs by algo" in text
    with pytest.raises(LookupError, match="no MLflow run"):
        compare(runs=[], out_dir=str(tmp_path / "c"), tracking_uri=uri, tags={"study": "no-such-study"})


def test_a_study_must_group_by_something_it_has(tmp_path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(f"name: bad\nbase: {SMOKE}\nspace: {{trainer.seed: [0, 1]}}\ngroup_by: learning_rate\n")
    with pytest.raises(ConfigError, match="group_by"):
        plan_sweep(path)


def test_the_repository_study_files_are_valid() -> None:
    plans = {f.name: plan_sweep(f) for f in sorted((ROOT / "studies").glob("*.yaml"))}
    assert set(plans) >= {"echo-trap-bandit.yaml", "echo-trap-paper.yaml"}
    for name, plan in plans.items():
        assert (ROOT / "studies" / name).read_text().startswith("#"), f"{name} needs a header comment"
        assert plan.sweep.group_by and set(plan.grid["trainer.seed"]) >= {0, 1, 2}  # >= 3 seeds each
        # the presets compared: a grid dimension, or one per base experiment (studies/bases/)
        if plan.sweep.group_by == "preset":
            presets = set(plan.grid.get("preset", ())) | {load_experiment(p).preset for p in plan.bases.values()}
            assert {"starpo", "starpo-s"} <= presets
    assert plans["echo-trap-bandit.yaml"].target == 6
    assert plans["bandit-presets.yaml"].target == 12 and plans["bandit-payoff-control.yaml"].target == 6
    # step-level credit: GiGPO (no critic) and StarPO-S's bi-level GAE (value head), 3 seeds each, against the
    # StarPO-S runs of echo-trap-frozenlake, which have the same configuration but for the gradient analysis
    gigpo = plans["gigpo-frozenlake.yaml"]
    algos = {name: load_experiment(p, gigpo.sweep.overrides).algorithm for name, p in gigpo.bases.items()}
    assert gigpo.target == 6 and {(a.estimator, a.critic) for a in algos.values()} == {
        ("bilevel_gae", "head"), ("gigpo", "none")}
    echo = plans["echo-trap-frozenlake.yaml"]
    (echo_base,) = echo.bases.values()
    starpo_s = load_experiment(echo_base, [*echo.sweep.overrides, "preset=starpo-s"])
    assert starpo_s == load_experiment(ROOT / "studies" / "bases" / "frozenlake-starpo-s.yaml",
                                       [*gigpo.sweep.overrides, "diagnostics.grad_buckets_every=5"])
    assert starpo_s.algorithm.estimator == "gae" and starpo_s.algorithm.critic == "head"
    vanilla = load_experiment(plans["bandit-vanilla-paper.yaml"].bases["demo-starpo"],
                              plans["bandit-vanilla-paper.yaml"].sweep.overrides)
    assert vanilla.algorithm.kl_in_reward and vanilla.trainer.mini_batch_rows == 16  # 4 steps at 8 x 8
    paper = plans["echo-trap-paper.yaml"]
    assert paper.target == 18 and paper.sweep.dispatch == "deployment" and paper.sweep.group_by == "env,preset"
