"""A GPU pool on this machine: sweep trials as runs of the ragen-train-trial deployment, scheduled on GPU slots.

What a team does with GPU machines (docs/how-to/gpu-pool.md), with every component real: a Prefect
server, the trial deployment on a process work pool, a worker started by `ragen worker` on a machine declaring
two GPUs (RAGEN_GPUS=0,1: the scheduling is real, the runs compute on the CPU), an MLflow server and the Optuna
study both on PostgreSQL, and `ragen sweep FILE --workers 4` with `dispatch: deployment` launching four trials
at once. The worker takes two runs at a time, each run holds a slot of its own (ragen_core/gpus.py), and every
trial reports to Optuna and nests its MLflow run under the study's parent. The storage URL carries a password
(PostgreSQL here trusts local connections and ignores it): the flow runs' parameters must not.
Uses the `prefect_server` and `background` fixtures of conftest.py and the PostgreSQL fixture of
test_sweep_postgres.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import optuna
import psycopg2
import pytest
from mlflow import MlflowClient
from test_sweep_postgres import FAST, REPO, SMOKE, free_port, postgres_url  # noqa: F401 -- postgres_url: a fixture

from tests.integration.conftest import MlflowServer

if TYPE_CHECKING:  # fixtures of tests/integration/conftest.py
    from tests.integration.conftest import Background, PrefectServer

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1200)]

BIN = Path(sys.executable).parent
PASSWORD = "pool-s3cret"


def run(cmd: list[str], env: dict[str, str], timeout: float = 900, ok: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    if ok:
        assert out.returncode == 0, (f"{' '.join(cmd[:4])} exited {out.returncode}:\n{out.stdout[-4000:]}\n"
                                     f"{out.stderr[-6000:]}")
    return out


def create_database(url: str, name: str) -> str:
    """A second database in the fixture's PostgreSQL server; its SQLAlchemy URL."""
    conn = psycopg2.connect(url.replace("postgresql+psycopg2", "postgresql"))
    conn.autocommit = True
    conn.cursor().execute(f"CREATE DATABASE {name}")
    conn.close()
    return url.rsplit("/", 1)[0] + f"/{name}"


def with_password(url: str) -> str:
    return url.replace("postgres@", f"postgres:{PASSWORD}@")


def deploy_trial_flow(prefect_server: PrefectServer, env: dict[str, str]) -> None:
    prefect = [str(BIN / "prefect"), "--no-prompt"]
    run([*prefect, "work-pool", "create", "gpu-pool", "--type", "process", "--overwrite"], prefect_server.client_env())
    run([*prefect, "deploy", "--name", "ragen-train-trial"], prefect_server.client_env(**env))


def spans(runs: list) -> list[tuple[float, float, str]]:
    return [(r.info.start_time, r.info.end_time, r.data.tags["gpus"]) for r in runs]


def test_a_pool_with_two_gpu_slots_runs_four_trials_two_at_a_time(
        prefect_server: PrefectServer, background: Background, postgres_url: str, tmp_path: Path) -> None:  # noqa: F811
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    mlflow = MlflowServer(tmp_path / "mlflow", free_port(), with_password(create_database(postgres_url, "mlflow")))
    mlflow.make_schema()
    mlflow.start()
    try:
        data = tmp_path / "data"
        job_env = {"RAGEN_DATA_DIR": str(data), "MLFLOW_TRACKING_URI": mlflow.uri}
        deploy_trial_flow(prefect_server, job_env)
        worker_dir = tmp_path / "worker"
        worker_dir.mkdir()
        storage = with_password(postgres_url)
        worker = background.start(
            "worker", [str(BIN / "ragen"), "worker", "--pool", "gpu-pool"],
            env=prefect_server.client_env(RAGEN_GPUS="0,1", RAGEN_GPU_LOCK_DIR=str(tmp_path / "gpu-locks"),
                                          RAGEN_OPTUNA_STORAGE=storage),  # the password: the worker's own
            cwd=worker_dir)
        path = tmp_path / "pool.yaml"  # no storage here: the launcher's RAGEN_OPTUNA_STORAGE names it
        path.write_text(f"name: pool-sweep\nbase: {SMOKE}\noverrides: {json.dumps(FAST)}\n"
                        "space: {trainer.seed: [0, 1, 2, 3]}\npruner: none\nheartbeat_seconds: 60\n"
                        "dispatch: deployment\n")
        try:
            t0 = time.monotonic()
            out = run([str(BIN / "ragen"), "sweep", str(path), "--workers", "4"],
                      prefect_server.client_env(**job_env, RAGEN_OPTUNA_STORAGE=storage))
            print(f"pool sweep of 4 trials on 2 GPU slots: {time.monotonic() - t0:.0f} s")
        finally:
            background.stop(worker)
        assert "--limit 2" in background.log("worker")  # ragen worker: one run per declared GPU
        assert "study pool-sweep: 4 trials (COMPLETE 4, PRUNED 0, FAIL 0)" in out.stdout, background.log("worker")
        assert PASSWORD not in out.stdout + out.stderr

        study = optuna.load_study(study_name="pool-sweep", storage=storage)
        assert sorted(t.params["trainer.seed"] for t in study.trials) == [0, 1, 2, 3]
        with temporary_settings({PREFECT_API_URL: prefect_server.api_url}), get_client(sync_client=True) as client:
            flow_runs = [r for r in client.read_flow_runs() if (r.parameters.get("trial") or {}).get("study_name")
                         == "pool-sweep"]
        assert len(flow_runs) == 4 and all(r.state and r.state.is_completed() for r in flow_runs)
        assert all(r.deployment_id is not None for r in flow_runs)
        for r in flow_runs:  # read back from the Prefect API: no password in any parameter
            assert PASSWORD not in json.dumps(r.parameters)
            assert r.parameters["trial"]["storage"] == storage.replace(PASSWORD, "***")

        client = MlflowClient(mlflow.uri)
        parent = study.user_attrs["mlflow_parent_run_id"]
        children = client.search_runs([client.get_run(parent).info.experiment_id],
                                      f"tags.mlflow.parentRunId = '{parent}'")
        assert {r.info.run_id for r in children} == {t.user_attrs["mlflow_run_id"] for t in study.trials}
        assert [r.info.status for r in children] == ["FINISHED"] * 4
        assert {r.data.tags["prefect.flow_run_id"] for r in children} == {str(r.id) for r in flow_runs}
        held = spans(children)
        print("trials (start, end, gpus):", sorted(held))
        assert {g for _, _, g in held} <= {"0", "1"}
        for i, (s1, e1, g1) in enumerate(held):  # overlapping trials held different slots
            for s2, e2, g2 in held[i + 1:]:
                if s1 < e2 and s2 < e1:
                    assert g1 != g2, held
        assert max(sum(s <= t < e for s, e, _ in held) for t, _, _ in held) <= 2
    finally:
        mlflow.stop()


def test_a_pool_sweep_without_a_worker_stops_after_its_pickup_timeout(
        prefect_server: PrefectServer, tmp_path: Path) -> None:
    data = tmp_path / "data"
    deploy_trial_flow(prefect_server, {"RAGEN_DATA_DIR": str(data), "MLFLOW_TRACKING_URI": ""})
    path = tmp_path / "nobody.yaml"
    path.write_text(f"name: nobody-sweep\nbase: {SMOKE}\noverrides: {json.dumps([*FAST, 'tracking.backend=none'])}\n"
                    "knobs: {responses_per_prompt: [2]}\npruner: none\ndispatch: deployment\npickup_timeout_s: 5\n")
    env = prefect_server.client_env(RAGEN_DATA_DIR=str(data))
    env.pop("MLFLOW_TRACKING_URI", None)
    t0 = time.monotonic()
    out = run([str(BIN / "ragen"), "sweep", str(path)], env, timeout=300, ok=False)
    took = time.monotonic() - t0
    assert out.returncode != 0
    assert "no worker took up" in out.stdout + out.stderr, out.stdout[-3000:] + out.stderr[-3000:]
    print(f"stopped after {took:.0f} s")
    study = optuna.load_study(study_name="nobody-sweep", storage=f"sqlite:///{data}/optuna.db")
    (trial,) = study.trials
    assert trial.state.name == "FAIL" and trial.user_attrs["interrupted"] == "NoWorker"  # queued again on resume


def test_a_study_on_the_pool_is_refused_without_a_data_folder_or_a_tracking_server(tmp_path: Path) -> None:
    """`ragen study studies/echo-trap-paper.yaml` (dispatch: deployment) exits 2 with one line, before anything
    starts, when RAGEN_DATA_DIR is unset (the workers would write to their own ./data), when MLFLOW_TRACKING_URI
    is (trials elsewhere could not report), and when the tracking server does not answer."""
    base = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "RAGEN_DATA_DIR",
                                                                "PREFECT_API_URL")}
    study = [str(BIN / "ragen"), "study", "studies/echo-trap-paper.yaml"]
    cases = {"RAGEN_DATA_DIR is not set": {},
             "export MLFLOW_TRACKING_URI": {"RAGEN_DATA_DIR": str(tmp_path)},
             "does not answer": {"RAGEN_DATA_DIR": str(tmp_path),
                                 "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{free_port()}"}}
    for says, env in cases.items():
        out = run(study, {**base, **env}, timeout=120, ok=False)
        assert out.returncode == 2 and out.stderr.count("\n") == 1 and says in out.stderr, (says, out.stderr)
        assert out.stderr.startswith("error: dispatch: deployment")
    assert not (tmp_path / "sweeps").exists() and not (tmp_path / "optuna.db").exists()  # nothing started
