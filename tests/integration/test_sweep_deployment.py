"""Sweep trials as runs of the ragen-train deployment on a work pool, with a PostgreSQL study.

What a team does with several GPU machines: a Prefect server, the train deployment on the pool,
`prefect worker start` on each machine, one PostgreSQL database for the study; then
`ragen sweep FILE --workers 2` with `dispatch: deployment` launches every trial as a deployment
run, and each run reports its validation success to Optuna through the shared storage.
Here all of it runs on 127.0.0.1 with the tiny model (~3 min). Uses the `prefect_server` and
`background` fixtures of conftest.py and the PostgreSQL fixture of test_sweep_postgres.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import optuna
import pytest
from mlflow import MlflowClient
from test_sweep_postgres import FAST, REPO, SMOKE, postgres_url  # noqa: F401 -- postgres_url is a fixture

if TYPE_CHECKING:  # fixtures of tests/integration/conftest.py
    from tests.integration.conftest import Background, PrefectServer

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

BIN = Path(sys.executable).parent


def run(cmd: list[str], env: dict[str, str], timeout: float = 600) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    assert out.returncode == 0, (f"{' '.join(cmd[:4])} exited {out.returncode}:\n{out.stdout[-4000:]}\n"
                                 f"{out.stderr[-6000:]}")
    return out


def test_trials_run_as_deployment_runs(prefect_server: PrefectServer, background: Background,
                                       postgres_url: str, tmp_path: Path) -> None:  # noqa: F811
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    data, mlflow_uri = tmp_path / "data", f"sqlite:///{tmp_path}/mlflow.db"
    job_env = {"RAGEN_DATA_DIR": str(data), "MLFLOW_TRACKING_URI": mlflow_uri}
    prefect = [str(BIN / "prefect"), "--no-prompt"]
    run([*prefect, "work-pool", "create", "gpu-pool", "--type", "process", "--overwrite"], prefect_server.client_env())
    run([*prefect, "deploy", "--name", "ragen-train-trial"], prefect_server.client_env(**job_env))
    worker_dir = tmp_path / "worker"
    worker_dir.mkdir()
    worker = background.start("worker", [str(BIN / "prefect"), "worker", "start", "--pool", "gpu-pool"],
                              env=prefect_server.client_env(RAGEN_HOME=str(REPO)), cwd=worker_dir)
    path = tmp_path / "pool.yaml"
    path.write_text(f"name: pool-sweep\nbase: {SMOKE}\noverrides: {json.dumps(FAST)}\n"
                    "knobs: {responses_per_prompt: [2, 4]}\npruner: none\nheartbeat_seconds: 20\n"
                    f"dispatch: deployment\nstorage: {postgres_url}\n")
    try:
        t0 = time.monotonic()
        out = run([str(BIN / "ragen"), "sweep", str(path), "--workers", "2"], prefect_server.client_env(**job_env))
        print(f"sweep of 2 deployment-run trials: {time.monotonic() - t0:.0f} s")
    finally:
        background.stop(worker)
    assert "study pool-sweep: 2 trials (COMPLETE 2, PRUNED 0, FAIL 0)" in out.stdout, background.log("worker")

    study = optuna.load_study(study_name="pool-sweep", storage=postgres_url)
    assert sorted(t.params["responses_per_prompt"] for t in study.trials) == [2, 4]
    for t in study.trials:  # written by the reporter inside the deployment run, read back by the sweep
        assert [step for step, _ in t.user_attrs["curve"]] == [0, 1] and t.user_attrs["mlflow_run_id"]
    with temporary_settings({PREFECT_API_URL: prefect_server.api_url}), get_client(sync_client=True) as client:
        flow_runs = [r for r in client.read_flow_runs() if (r.parameters.get("trial") or {}).get("study_name")
                     == "pool-sweep"]
    assert len(flow_runs) == 2 and all(r.state and r.state.is_completed() for r in flow_runs)
    assert all(r.deployment_id is not None for r in flow_runs)

    client = MlflowClient(mlflow_uri)
    parent = study.user_attrs["mlflow_parent_run_id"]
    children = client.search_runs([client.get_run(parent).info.experiment_id], f"tags.mlflow.parentRunId = '{parent}'")
    assert {r.info.run_id for r in children} == {t.user_attrs["mlflow_run_id"] for t in study.trials}
    assert {r.data.tags["prefect.flow_run_id"] for r in children} == {str(r.id) for r in flow_runs}
