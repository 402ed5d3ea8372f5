"""prefect.yaml end to end on 127.0.0.1: server, process work pool, `prefect deploy --all`, a worker, a run.

What a team does on its GPU machines (docs/how-to/gpu-pool.md), with the smoke
experiment for one iteration on CPU:

    prefect server start                                  (fixture, conftest.py)
    prefect work-pool create gpu-pool --type process
    RAGEN_DATA_DIR=... MLFLOW_TRACKING_URI=... prefect --no-prompt deploy --all
    RAGEN_HOME=<checkout> prefect worker start --pool gpu-pool
    prefect deployment run ragen-train/ragen-train --param overrides=[...] --watch

The worker has neither RAGEN_DATA_DIR nor MLFLOW_TRACKING_URI: the run can only land in the
test's directories through the deployment's job variables. RAGEN_HOME is unset while
deploying, so the pull step's placeholder is resolved on the worker. Run it alone with
``.venv/bin/python -m pytest tests/integration/test_prefect_deploy.py -s`` (~1.5-3 min).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import yaml

if TYPE_CHECKING:  # fixtures of tests/integration/conftest.py
    from tests.integration.conftest import Background, PrefectServer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[2]

DEPLOYMENTS = {  # deployment name -> (entrypoint, flow name): what prefect.yaml must declare
    "ragen-train": ("flows/train.py:train", "ragen-train"),
    "ragen-train-trial": ("flows/train.py:train_trial", "ragen-train-trial"),
    "ragen-train-multi-gpu": ("flows/train.py:train", "ragen-train"),
    "ragen-evaluate": ("flows/evaluate.py:evaluate", "ragen-evaluate"),
    "ragen-sweep": ("flows/sweep.py:sweep", "ragen-sweep"),
}

POOLS = {name: "control-pool" if name == "ragen-sweep" else "gpu-pool" for name in DEPLOYMENTS}
"""Each deployment's work pool: the sweep orchestrator waits on its trials and needs no GPU machine's slot."""


def declared_deployments() -> dict[str, dict]:
    """prefect.yaml's deployments, by name, as the file declares them."""
    spec = yaml.safe_load((REPO / "prefect.yaml").read_text())
    return {d["name"]: d for d in spec["deployments"]}


def prefect_cli(server: PrefectServer, *args: str, timeout: float = 300,
                **env: str) -> subprocess.CompletedProcess[str]:
    """Run the `prefect` CLI against ``server`` from the repository root; raise with its output on failure."""
    cmd = [str(BIN / "prefect"), "--no-prompt", *args]
    out = subprocess.run(cmd, cwd=REPO, env=server.client_env(**env), capture_output=True, text=True,
                         timeout=timeout, check=False)
    if out.returncode != 0:
        hint = ""
        if "workers/filter" in out.stdout + out.stderr:
            hint = ("\nThe server refused the CLI's worker query (offset/limit sent as null), as fastapi >= 0.151 "
                    "did under prefect 3.8.8; use the pins of locks/shared-constraints.txt.")
        raise AssertionError(f"{' '.join(args)} exited {out.returncode}:\n{out.stdout[-3000:]}\n"
                             f"{out.stderr[-3000:]}{hint}")
    return out


def test_prefect_yaml_declares_every_deployment_on_gpu_pool_with_the_deployers_env() -> None:
    """prefect.yaml declares exactly the deployments of DEPLOYMENTS, each with an entrypoint that exists, the runs
    on gpu-pool's default queue and the sweep orchestrator on control-pool (it holds no GPU slot), no device pinned
    (a run holds its GPUs itself), and the data dir and MLflow URI left to the deployer's shell; the checkout
    comes from the worker's RAGEN_HOME; the multi-GPU one runs DeepSpeed on several ranks."""
    spec = yaml.safe_load((REPO / "prefect.yaml").read_text())
    assert spec["name"] == "ragen"
    assert spec["pull"] == [{"prefect.deployments.steps.set_working_directory": {"directory": "{{ $RAGEN_HOME }}"}}]
    by_name = declared_deployments()
    assert set(by_name) == set(DEPLOYMENTS)
    for name, (entrypoint, _) in DEPLOYMENTS.items():
        d = by_name[name]
        assert d["entrypoint"] == entrypoint and (REPO / entrypoint.split(":")[0]).is_file()
        assert d["work_pool"]["name"] == POOLS[name] and d["work_pool"]["work_queue_name"] == "default"
        env = d["work_pool"]["job_variables"]["env"]
        assert "CUDA_VISIBLE_DEVICES" not in env  # it would override the devices the run holds
        assert env["RAGEN_DATA_DIR"] == "{{ $RAGEN_DATA_DIR }}"
        assert env["MLFLOW_TRACKING_URI"] == "{{ $MLFLOW_TRACKING_URI }}"
    assert (REPO / by_name["ragen-train"]["parameters"]["experiment"]).is_file()
    assert (REPO / by_name["ragen-sweep"]["parameters"]["sweep_file"]).is_file()
    multi = by_name["ragen-train-multi-gpu"]["parameters"]
    assert multi["nproc"] > 1 and "trainer.backend=deepspeed" in multi["overrides"]


def test_deploy_all_registers_every_declared_deployment_and_a_worker_runs_ragen_train(
        prefect_server: PrefectServer, background: Background, tmp_path: Path) -> None:
    """`prefect deploy --all` registers every deployment prefect.yaml declares (and no other) with the deployer's
    data dir and MLflow URI; a worker that knows neither runs ragen-train for one iteration, and the run lands
    in those directories: one run dir, one MLflow run tagged with its flow run."""
    from mlflow import MlflowClient
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
    from prefect.settings import PREFECT_API_URL, temporary_settings

    data_dir, mlflow_uri = tmp_path / "data", f"sqlite:///{tmp_path}/mlflow.db"
    for pool in sorted(set(POOLS.values())):
        prefect_cli(prefect_server, "work-pool", "create", pool, "--type", "process", "--overwrite")

    t0 = time.monotonic()
    prefect_cli(prefect_server, "deploy", "--all", RAGEN_DATA_DIR=str(data_dir), MLFLOW_TRACKING_URI=mlflow_uri)
    print(f"prefect deploy --all: {time.monotonic() - t0:.1f} s")

    with temporary_settings({PREFECT_API_URL: prefect_server.api_url}), get_client(sync_client=True) as client:
        deployments = {d.name: d for d in client.read_deployments()}
        flow_names = {f.id: f.name for f in client.read_flows()}
    # the names prefect.yaml declares, all of them; nothing else in this session deploys another name
    assert sorted(deployments) == sorted(declared_deployments())
    for name, dep in deployments.items():
        assert flow_names[dep.flow_id] == DEPLOYMENTS[name][1]
        assert dep.work_pool_name == POOLS[name] and dep.entrypoint == DEPLOYMENTS[name][0]
        assert dep.job_variables["env"]["RAGEN_DATA_DIR"] == str(data_dir)  # read from the deployer's shell
        assert dep.job_variables["env"]["MLFLOW_TRACKING_URI"] == mlflow_uri
        assert "CUDA_VISIBLE_DEVICES" not in dep.job_variables["env"]
        # RAGEN_HOME was unset: the placeholder waits for the worker's environment
        assert dep.pull_steps == [{"prefect.deployments.steps.set_working_directory":
                                   {"directory": "{{ $RAGEN_HOME }}"}}]
    assert deployments["ragen-train"].parameters["experiment"] == "experiments/smoke.yaml"
    # the form of ragen-train holds what a person sets; the sweep's own parameters are on ragen-train-trial's
    form = set(deployments["ragen-train"].parameter_openapi_schema["properties"])
    assert form == {"experiment", "overrides", "resume", "run_name", "nproc"}
    trial_form = deployments["ragen-train-trial"].parameter_openapi_schema["properties"]
    assert {"parent_run_id", "tags", "trial"} <= set(trial_form)

    # the worker runs elsewhere (its own cwd), knows the checkout, but not the data dir or MLflow URI
    worker_dir = tmp_path / "worker"
    worker_dir.mkdir()
    worker = background.start("worker", [str(BIN / "prefect"), "worker", "start", "--pool", "gpu-pool",
                                         "--name", "it-worker"],
                              env=prefect_server.client_env(RAGEN_HOME=str(REPO)), cwd=worker_dir)
    try:
        t0 = time.monotonic()
        run = prefect_cli(
            prefect_server, "deployment", "run", "ragen-train/ragen-train",
            "--param", f"overrides={json.dumps(['trainer.iterations=1'])}",
            "--flow-run-name", "it-smoke", "--watch", "--watch-timeout", "720", timeout=780,
        )
        print(f"deployment run (created -> Completed, worker pick-up included): {time.monotonic() - t0:.1f} s")
    finally:
        background.stop(worker)
        print("worker log tail:\n", background.log("worker"))
    assert "Completed" in run.stdout

    with temporary_settings({PREFECT_API_URL: prefect_server.api_url}), get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployments["ragen-train"].id]))
        )
    assert [r.name for r in runs] == ["it-smoke"]
    flow_run = runs[0]
    assert flow_run.state is not None and flow_run.state.is_completed(), flow_run.state
    assert flow_run.parameters["overrides"] == ["trainer.iterations=1"]

    # the run wrote where the deployment's job variables said, not where the worker would have
    run_dirs = list((data_dir / "runs").iterdir())
    assert len(run_dirs) == 1 and run_dirs[0].name.startswith("starpo-s-Bandit-s0-")
    history = [json.loads(line) for line in (run_dirs[0] / "history.jsonl").read_text().splitlines()]
    assert [h["iteration"] for h in history if "rollout/success" in h] == [0]  # one training iteration
    assert (run_dirs[0] / "config.yaml").is_file() and any((run_dirs[0] / "checkpoints").iterdir())
    assert not (worker_dir / "data").exists() and not (REPO / "mlflow.db").exists()

    client = MlflowClient(mlflow_uri)
    mruns = client.search_runs([client.get_experiment_by_name("ragen-Bandit").experiment_id])
    assert len(mruns) == 1
    mrun = mruns[0]
    assert mrun.info.status == "FINISHED" and mrun.info.run_name == run_dirs[0].name
    assert mrun.data.tags["prefect.flow_run_id"] == str(flow_run.id)
    assert mrun.data.tags["algo"] == "starpo-s" and mrun.data.tags["env"] == "Bandit"
    assert [m.step for m in client.get_metric_history(mrun.info.run_id, "rollout/success")] == [0]
