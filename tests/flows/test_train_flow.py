"""The training flow end to end on the tiny model: iterations, MLflow metrics/tags/artifacts,
readable shards, checkpoints, and resume continuing the same MLflow run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file

from flows.train import train
from ragen_core.store import read_run

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


def test_iterations_ran_and_are_recorded(smoke_run) -> None:
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
    assert any(a.startswith("model/") for a in arts)
    assert run.info.status == "FINISHED"


def test_shards_are_readable(smoke_run) -> None:
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


def test_resumed_run_matches_an_unbroken_one(data_dir) -> None:
    """Stop after 1 iteration, resume for 1 more: same weights as 2 iterations straight (tiny model, CPU)."""
    straight = train(experiment=SMOKE, run_name="straight", overrides=["tracking.backend=none"])
    train(experiment=SMOKE, run_name="broken", overrides=["tracking.backend=none", "trainer.iterations=1"])
    resumed = train(experiment=SMOKE, resume="broken", overrides=["trainer.iterations=2"])
    a = load_file(Path(straight.run_dir) / "checkpoints" / "iter=000002" / "actor.safetensors")
    b = load_file(Path(resumed.run_dir) / "checkpoints" / "iter=000002" / "actor.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_zero3_run_resumes_and_matches_the_torch_backend(data_dir) -> None:
    """The whole flow under DeepSpeed ZeRO-3 (every weight partitioned, threshold 0): rollouts, update, eval,
    checkpoint, resume and the final model; it ends where the torch backend ends."""
    pytest.importorskip("deepspeed")
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
    """Issue 19: per-iteration lines in the run's logs, a table and a progress artifact, a link to MLflow, an
    evaluation table, task runs named rollout-it0000..., and the MLflow run tagged with the flow run's page."""
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        ArtifactFilterKey,
        LogFilter,
        LogFilterFlowRunId,
    )

    data, result = smoke_run
    run = MlflowClient(_uri(data)).get_run(result.mlflow_run_id)
    flow_run_id = run.data.tags["prefect.flow_run_id"]
    assert run.data.tags["prefect.flow_run_url"].endswith(flow_run_id)

    async def read() -> tuple[list, list, list]:
        async with get_client() as client:
            keys = ["iterations-smoke-a", "progress-smoke-a", "mlflow-smoke-a", "evaluation-smoke-a"]
            artifacts = await client.read_artifacts(  # this flow run's (a later test resumes the run)
                artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=keys),
                                               flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
            logs = await client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
            tasks = await client.read_task_runs()
            return artifacts, logs, [t.name for t in tasks if t.flow_run_id is not None
                                     and str(t.flow_run_id) == flow_run_id]

    artifacts, logs, task_names = asyncio.run(read())
    latest = {}
    for a in sorted(artifacts, key=lambda a: a.created):
        latest[a.key] = a
    assert set(latest) == {"iterations-smoke-a", "progress-smoke-a", "mlflow-smoke-a", "evaluation-smoke-a"}
    table = json.loads(latest["iterations-smoke-a"].data)
    assert [row["iteration"] for row in table] == [0, 1] and "actor/grad_norm" in table[0]
    assert float(latest["progress-smoke-a"].data) == 100.0
    assert "val/success" in latest["evaluation-smoke-a"].data
    assert any("iter 2/2" in log.message for log in logs)
    assert {"rollout-it0000", "update-it0000", "rollout-it0001", "checkpoint-it0002"} <= set(task_names)
