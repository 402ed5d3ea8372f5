"""The training flow end to end on the tiny model: iterations, MLflow metrics/tags/artifacts,
readable shards, checkpoints, and resume continuing the same MLflow run; how the run looks in MLflow
(experiment, names, tags, charts, replies table, the logged and registered model) and that it
ends FINISHED, FAILED or KILLED as the flow did."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
from mlflow.tracking import MlflowClient
from prefect.client.orchestration import get_client
from safetensors.torch import load_file
from typer.testing import CliRunner

from flows.cli import app
from flows.train import train
from ragen_core import cpu_share, session
from ragen_core.config import load_experiment
from ragen_core.store import read_run
from ragen_core.tracking.model_registry import load_logged_model
from tests.conftest import require_module

ROOT = Path(__file__).resolve().parents[2]
SMOKE = str(ROOT / "experiments" / "smoke.yaml")
NAMESPACES = ("env/", "rollout/", "actor/", "critic/", "response/", "val/", "timing/", "perf/", "health/")


def _uri(data_dir: Path) -> str:
    return f"sqlite:///{data_dir}/mlflow.db"


def _artifacts(client: MlflowClient, run_id: str, path: str | None = None) -> set[str]:
    out: set[str] = set()
    for item in client.list_artifacts(run_id, path):
        out |= _artifacts(client, run_id, item.path) if item.is_dir else {item.path}
    return out


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    data = tmp_path_factory.mktemp("data")
    mp = pytest.MonkeyPatch()
    mp.setenv("RAGEN_DATA_DIR", str(data))
    mp.delenv("MLFLOW_TRACKING_URI", raising=False)
    result = train(experiment=SMOKE, run_name="smoke-a")
    yield data, result
    mp.undo()


def test_two_iterations_leave_history_rows_a_checkpoint_and_the_final_model(smoke_run) -> None:
    _, result = smoke_run
    assert result.iterations == 2 and result.run_name == "smoke-a"
    run_dir = Path(result.run_dir)
    rows = [json.loads(x) for x in (run_dir / "history.jsonl").read_text().splitlines()]
    # one row per iteration, then the evaluation after the last update (step = iterations done)
    assert [r["iteration"] for r in rows] == [0, 1, 2]
    assert "val/success" in rows[0] and "actor/grad_norm" not in rows[2] and "val/success" in rows[2]
    assert (run_dir / "checkpoints" / "iter=000002" / "state.json").exists()
    assert (run_dir / "final-model" / "config.json").exists()
    assert "val success first" in result.summary and "mlflow ui" in result.summary


def test_metrics_tags_and_artifacts_in_mlflow(smoke_run) -> None:
    data, result = smoke_run
    client = MlflowClient(_uri(data))
    run = client.get_run(result.mlflow_run_id)
    names = set(run.data.metrics)
    for ns in NAMESPACES:
        assert any(n.startswith(ns) for n in names), f"no metric under {ns}: {sorted(names)}"
    for key in ("env/Bandit/success", "rollout/reward_std_all", "actor/entropy", "actor/grad_norm",
                "critic/value_loss", "timing/rollout_s", "timing/update_s", "response/length_mean"):
        assert [m.step for m in client.get_metric_history(run.info.run_id, key)] == [0, 1], key
    # eval.every = 1: before each update (0 = untrained policy) and after the last
    assert [m.step for m in client.get_metric_history(run.info.run_id, "val/success")] == [0, 1, 2]
    tags = run.data.tags
    assert tags["algo"] == "starpo-s" and tags["env"] == "Bandit" and tags["estimator"] == "gae"
    assert tags["preset"] == "starpo-s" and tags["model"] == "tiny-random"
    assert tags.get("prefect.flow_run_id")
    assert run.data.params["rollout.prompts_per_iter"] == "4"
    arts = _artifacts(client, run.info.run_id)
    assert "config.yaml" in arts
    assert any(a.startswith("samples/") for a in arts)
    assert any(a.startswith("rollouts/iteration=") and a.endswith(".parquet") for a in arts)
    assert {"viewer/iteration=0.html", "viewer/iteration=1.html"} <= arts  # the trajectory viewer's pages
    assert any(a.startswith("plots/") and a.endswith(".png") for a in arts)
    assert run.info.status == "FINISHED"


def test_run_opens_as_training_runs_in_its_env_familys_experiment(smoke_run) -> None:
    data, result = smoke_run
    client = MlflowClient(_uri(data))
    exp = client.get_experiment(client.get_run(result.mlflow_run_id).info.experiment_id)
    assert exp.name == "ragen-Bandit"
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    assert f"/#/experiments/{exp.experiment_id}/runs/{result.mlflow_run_id}?workflowType=machine_learning" in (
        result.summary)


def test_standard_tags_and_the_experiment_files_header_as_description(smoke_run) -> None:
    data, result = smoke_run
    tags = MlflowClient(_uri(data)).get_run(result.mlflow_run_id).data.tags
    assert tags["mlflow.user"] and tags["mlflow.source.type"] == "LOCAL"
    assert tags["mlflow.source.name"].endswith("experiments/smoke.yaml")
    assert tags["mlflow.note.content"].startswith("Smoke: the whole pipeline on the tiny random model")
    assert (tags["seed"], tags["name"], tags["preset"], tags["env"], tags["model"]) == (
        "0", "smoke", "starpo-s", "Bandit", "tiny-random")


def test_comparison_curves_come_first_in_the_chart_view(smoke_run) -> None:
    data, result = smoke_run
    client = MlflowClient(_uri(data))
    names = set(client.get_run(result.mlflow_run_id).data.metrics)
    assert sorted({n.rsplit("/", 1)[0] for n in names})[0] == "0_compare"  # the UI's first section
    pairs = [("val/success", "0_compare/1_val_success"), ("rollout/reward_std_all", "0_compare/2_reward_std"),
             ("actor/entropy", "0_compare/3_entropy"), ("actor/grad_norm", "0_compare/4_grad_norm")]
    for source, alias in pairs:
        a, b = (sorted((m.step, m.value) for m in client.get_metric_history(result.mlflow_run_id, k))
                for k in (source, alias))
        assert a == b and a, alias


def test_sampled_replies_are_a_table_matching_the_shards(smoke_run, tmp_path) -> None:
    data, result = smoke_run
    client = MlflowClient(_uri(data))
    run = client.get_run(result.mlflow_run_id)
    assert {"path": "replies.json", "type": "table"} in json.loads(run.data.tags["mlflow.loggedArtifacts"])
    table = pd.read_json(client.download_artifacts(run.info.run_id, "replies.json", str(tmp_path)), orient="split")
    # artifact_every 1, sample_trajectories 2, one turn each: two rows per iteration
    assert table["iteration"].tolist() == [0, 0, 1, 1] and set(table["turn"]) == {1}
    shards = read_run(result.run_dir)
    for _, row in table.iterrows():
        shard = shards[(shards["iteration"] == row["iteration"]) & (shards["seed"] == row["env_seed"])
                       & (shards["group_id"] == row["group"])].iloc[int(row["member"])]
        assert bool(shard["kept"]) == bool(row["kept"])
    assert table["reply"].map(len).gt(0).all() and table["state"].str.len().gt(0).all()


def test_final_model_loads_back_and_registers(smoke_run) -> None:
    data, result = smoke_run
    model, tokenizer = load_logged_model(_uri(data), result.run_name)
    saved = load_file(Path(result.run_dir) / "final-model" / "model.safetensors")
    state = model.state_dict()
    assert saved and all(torch.equal(state[k], saved[k]) for k in saved)
    assert tokenizer("Dragon").input_ids
    out = CliRunner().invoke(app, ["model", "register", result.run_name])
    assert out.exit_code == 0, out.output
    assert "registered ragen-Bandit-starpo-s version 1" in out.output
    client = MlflowClient(_uri(data))
    [version] = client.search_model_versions("name = 'ragen-Bandit-starpo-s'")
    assert version.run_id == result.mlflow_run_id and version.source.startswith("models:/m-")
    bad = CliRunner().invoke(app, ["model", "register", "no-such-run"])
    assert bad.exit_code == 2 and "no MLflow run" in bad.output


def test_shards_hold_every_trajectory_and_mark_the_kept_group(smoke_run) -> None:
    _, result = smoke_run
    df = read_run(result.run_dir)
    # smoke: P=4 groups x N=2, StarPO-S keeps max(1, floor(0.25 * 4)) = 1 group = 2 trajectories
    assert sorted(df["iteration"].unique().tolist()) == [0, 1]
    assert len(df) == 16 and int(df["kept"].sum()) == 4


def test_resume_continues_the_same_mlflow_run(smoke_run) -> None:
    data, first = smoke_run
    again = train(experiment=SMOKE, resume="smoke-a", overrides=["trainer.iterations=3"])
    assert again.mlflow_run_id == first.mlflow_run_id and again.iterations == 3
    client = MlflowClient(_uri(data))
    steps = [m.step for m in client.get_metric_history(first.mlflow_run_id, "actor/grad_norm")]
    assert steps == [0, 1, 2]
    assert len(client.search_runs([client.get_run(first.mlflow_run_id).info.experiment_id])) == 1


def test_a_lora_runs_final_model_is_its_adapter_over_the_base(data_dir) -> None:
    from peft import PeftModel

    from ragen_core.evaluation import load_policy

    result = train(experiment=SMOKE, run_name="lora", overrides=[
        "model.lora_rank=4", "model.lora_alpha=8", "trainer.iterations=1", "eval.every=0", "trainer.checkpoint_every=0",
        "tracking.artifact_every=0"])
    model, _ = load_logged_model(_uri(data_dir), "lora")
    assert isinstance(model, PeftModel)
    policy, _ = load_policy(load_experiment(Path(result.run_dir) / "config.yaml"),
                            Path(result.run_dir) / "final-model")
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        assert torch.allclose(model.eval()(ids).logits, policy(ids).logits)


def test_a_flow_that_raises_ends_its_run_failed(data_dir, monkeypatch) -> None:
    """Also: a run without --run-name is named <preset>-<env>-s<seed>-<time>, its folder too."""

    def boom(sess, selection):
        raise RuntimeError("update exploded")

    monkeypatch.setattr(session, "update_policy", boom)
    with pytest.raises(RuntimeError, match="update exploded"):
        train(experiment=SMOKE, overrides=["trainer.seed=7"])
    client = MlflowClient(_uri(data_dir))
    [run] = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.info.status == "FAILED" and run.data.tags["error"] == "RuntimeError: update exploded"
    [folder] = (data_dir / "runs").iterdir()
    assert re.fullmatch(r"starpo-s-Bandit-s7-\d{8}-\d{6}", folder.name), folder.name
    assert run.info.run_name == folder.name


def test_ragen_train_sent_sigterm_ends_its_run_killed(data_dir, tmp_path) -> None:
    """SIGTERM is how Prefect cancels a flow run: the process stops and the MLflow run says KILLED."""
    with get_client(sync_client=True) as client:  # the test harness's API: no second server to start
        api = str(client.api_url).rstrip("/")
    env = {**os.environ, "PREFECT_API_URL": api, "RAGEN_DATA_DIR": str(data_dir), "PYTHONUNBUFFERED": "1"}
    state = data_dir / "runs" / "term" / "tracking-outbox.state.json"
    with open(tmp_path / "train.log", "w") as log:
        # `-m flows.cli` from the repository root: this checkout's code, as sweep workers start
        proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "train", SMOKE, "--run-name", "term",
                                 "--set", "trainer.iterations=200"], cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 300
            while not (state.exists() and json.loads(state.read_text()).get("run_id")):
                assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "train.log").read_text()
                time.sleep(0.2)
            os.kill(proc.pid, signal.SIGTERM)
            rc = proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
    output = (tmp_path / "train.log").read_text()
    assert rc == -signal.SIGTERM, output[-3000:]  # the process still ends by the signal (a job's status says so)
    run = MlflowClient(_uri(data_dir)).get_run(json.loads(state.read_text())["run_id"])
    assert run.info.status == "KILLED", output[-3000:]
    assert run.data.tags["error"].startswith("TerminationSignal")


def test_resumed_run_matches_an_unbroken_one(data_dir) -> None:
    """Stop after 1 iteration, resume for 1 more: same weights as 2 iterations straight (tiny model, CPU)."""
    straight = train(experiment=SMOKE, run_name="straight", overrides=["tracking.backend=none"])
    train(experiment=SMOKE, run_name="broken", overrides=["tracking.backend=none", "trainer.iterations=1"])
    resumed = train(experiment=SMOKE, resume="broken", overrides=["trainer.iterations=2"])
    a = load_file(Path(straight.run_dir) / "checkpoints" / "iter=000002" / "actor.safetensors")
    b = load_file(Path(resumed.run_dir) / "checkpoints" / "iter=000002" / "actor.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_study_worker_takes_up_the_threads_its_study_publishes(data_dir, tmp_path, monkeypatch, caplog) -> None:
    """A local study's worker (``RAGEN_CPU_SHARE`` set: ragen_core/cpu_share.py) sets torch's threads to the count
    the study published once an iteration ends, and says so; a run with its own trainer.threads keeps them."""
    # an earlier test in this process may have started vLLM's CPU engine in-process, which replaces
    # torch.set_num_threads with a no-op for the process: the real one for this test
    monkeypatch.setattr(torch, "set_num_threads", torch._C.set_num_threads)
    monkeypatch.setattr(cpu_share, "_refused", set())
    before = torch.get_num_threads()
    share = tmp_path / "threads"
    cpu_share.publish(share, before + 1)
    monkeypatch.setenv(cpu_share.SHARE_ENV, str(share))
    try:
        train(experiment=SMOKE, run_name="shared", overrides=["tracking.backend=none", "trainer.iterations=2"])
        assert torch.get_num_threads() == before + 1
        assert f"torch threads: {before + 1} from iteration 2 on (a worker of the study ended)" in caplog.text
        caplog.clear()
        torch.set_num_threads(before)
        train(experiment=SMOKE, run_name="own", overrides=["tracking.backend=none", "trainer.iterations=1",
                                                           f"trainer.threads={before}"])
        assert torch.get_num_threads() == before
        assert "torch threads:" not in caplog.text
    finally:
        torch.set_num_threads(before)


def test_zero3_run_resumes_and_matches_the_torch_backend(data_dir) -> None:
    """The whole flow under DeepSpeed ZeRO-3 (every weight partitioned, threshold 0): rollouts, update, eval,
    checkpoint, resume and the final model; it ends where the torch backend ends."""
    require_module("deepspeed", "the deepspeed backend needs deepspeed (a dev dependency, in locks/cpu.txt)")
    zero3 = ["tracking.backend=none", "trainer.backend=deepspeed", "trainer.zero_stage=3",
             "trainer.deepspeed.zero_optimization.stage3_param_persistence_threshold=0"]
    straight = train(experiment=SMOKE, run_name="torch", overrides=["tracking.backend=none"])
    train(experiment=SMOKE, run_name="z3", overrides=[*zero3, "trainer.iterations=1"])
    resumed = train(experiment=SMOKE, resume="z3", overrides=["trainer.iterations=2"])
    assert "zero_stage: 3" in (Path(resumed.run_dir) / "config.yaml").read_text()  # resumed under ZeRO-3 too
    for name in ("checkpoints/iter=000002/actor.safetensors", "final-model/model.safetensors"):
        a, b = load_file(Path(straight.run_dir) / name), load_file(Path(resumed.run_dir) / name)
        assert a.keys() == b.keys() and all(b[k].numel() > 0 for k in b), name  # whole weights, not slices
        for k in a:
            torch.testing.assert_close(b[k], a[k], atol=1e-5, rtol=1e-4,
                                       msg=lambda m, k=k, name=name: f"{name} {k}: {m}")


def test_the_prefect_ui_shows_progress_logs_artifacts_and_readable_task_names(smoke_run) -> None:
    """Per-iteration lines in the run's logs, a table and a progress artifact, a link to MLflow, an
    evaluation table, task runs named rollout-it0000..., and the MLflow run tagged with the flow run's page."""
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterKey,
        LogFilter,
        LogFilterFlowRunId,
        TaskRunFilter,
        TaskRunFilterFlowRunId,
    )
    from prefect.client.schemas.sorting import TaskRunSort

    data, result = smoke_run
    run = MlflowClient(_uri(data)).get_run(result.mlflow_run_id)
    # the tag names the run's latest flow run (a later test in this module resumes it): the two agree
    assert run.data.tags["prefect.flow_run_url"].endswith(run.data.tags["prefect.flow_run_id"])

    async def read() -> tuple[object, list, list, list, list]:
        async with get_client() as client:
            keys = ["iterations-smoke-a", "progress-smoke-a", "mlflow-smoke-a", "evaluation-smoke-a"]
            artifacts = await client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=keys)))
            first = min(artifacts, key=lambda a: a.created).flow_run_id  # the run's first flow run: 2 iterations
            artifacts = [a for a in artifacts if a.flow_run_id == first]
            logs = await client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[first])))
            # Prefect 3 records task runs from their events, which the server writes a little after the
            # artifacts and logs: on a loaded machine the first read can come before them
            only_first = TaskRunFilter(flow_run_id=TaskRunFilterFlowRunId(any_=[first]))
            deadline = time.monotonic() + 120
            while True:
                names = [t.name for t in await client.read_task_runs(task_run_filter=only_first)]
                if "checkpoint-it0002" in names or time.monotonic() > deadline:
                    break
                await asyncio.sleep(1)
            newest = await client.read_task_runs(sort=TaskRunSort.EXPECTED_START_TIME_DESC, limit=5)
            return first, artifacts, logs, names, [(t.name, str(t.flow_run_id)) for t in newest]

    first, artifacts, logs, task_names, newest = asyncio.run(read())
    latest = {}
    for a in sorted(artifacts, key=lambda a: a.created):
        latest[a.key] = a
    assert set(latest) == {"iterations-smoke-a", "progress-smoke-a", "mlflow-smoke-a", "evaluation-smoke-a"}
    table = json.loads(latest["iterations-smoke-a"].data)
    assert [row["iteration"] for row in table] == [0, 1] and "actor/grad_norm" in table[0]
    assert float(latest["progress-smoke-a"].data) == 100.0
    assert "val/success" in latest["evaluation-smoke-a"].data
    assert any("iter 2/2" in log.message for log in logs)
    assert {"rollout-it0000", "update-it0000", "rollout-it0001", "checkpoint-it0002"} <= set(task_names), \
        f"task runs of flow run {first}: {task_names}; the server's newest task runs: {newest}"


def test_the_train_deployment_form_holds_only_what_a_person_sets() -> None:
    """The sweep's own parameters (parent run, tags, Optuna trial) belong to the trial flow, so the
    ragen-train deployment's form in the Prefect UI shows experiment, overrides, resume, run name and nproc."""
    from prefect.utilities.callables import parameter_schema

    from flows.train import train_trial

    assert list(parameter_schema(train.fn).properties) == ["experiment", "overrides", "resume", "run_name", "nproc"]
    assert {"parent_run_id", "tags", "trial"} <= set(parameter_schema(train_trial.fn).properties)
    assert parameter_schema(train_trial.fn).required == ["experiment"]


def test_a_sigterm_lost_in_a_garbage_collection_callback_still_stops_the_run(monkeypatch) -> None:
    """Prefect's SIGTERM handler raises wherever the main thread is; inside a weakref (garbage-collection) callback
    Python prints the exception and drops it. The flow's guard raises it again at the loop's next step."""
    import weakref

    from prefect.exceptions import TerminationSignal
    from prefect.utilities.engine import _prefect_sigterm_handler

    from flows.train import _Termination
    from ragen_core.session import PLAIN_STEPS

    monkeypatch.setattr("sys.unraisablehook", lambda unraisable: None)  # Python's "Exception ignored" line
    previous = signal.signal(signal.SIGTERM, _prefect_sigterm_handler)
    try:
        with _Termination() as termination:
            class Owner:
                pass

            def collected(ref: object) -> None:
                os.kill(os.getpid(), signal.SIGTERM)
                sum(range(10_000))  # the handler runs in here: its TerminationSignal is dropped

            owner = Owner()
            ref = weakref.ref(owner, collected)
            del owner  # the callback runs; nothing reaches this frame
            assert ref() is None and termination.received == signal.SIGTERM
            guarded = termination.guard(PLAIN_STEPS)
            with pytest.raises(TerminationSignal):
                guarded.rollout(None)  # the next step raises it before running
    finally:
        signal.signal(signal.SIGTERM, previous)
