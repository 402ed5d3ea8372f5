"""`ragen sweep --workers 2` with a real PostgreSQL server as the Optuna storage: the two worker
processes complete the study with every grid point run exactly once.

The server is Debian's (`apt-get install -y postgresql`): the test finds initdb/pg_ctl under
/usr/lib/postgresql/*/bin and skips with the reason when they are missing (fails with it under CI,
tests/conftest.py; `.ci/run` installs the package). It makes a cluster in
a temporary directory, starts it on 127.0.0.1 on a free port (as the `postgres` user when run as
root: the server refuses root), and stops it at the end.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import optuna
import pytest

from tests.conftest import require

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
SMOKE = REPO / "experiments" / "smoke.yaml"
FAST = ["trainer.iterations=1", "eval.seeds=2", "rollout.max_new_tokens=8", "trainer.checkpoint_every=0",
        "tracking.artifact_every=0", "tracking.sample_trajectories=0"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pg_bin() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))
    return Path(found[-1]).parent if found else None


def as_server_user(cmd: list[str]) -> list[str]:
    """PostgreSQL refuses to run as root; then run it as the package's `postgres` user."""
    if os.geteuid() != 0:
        return cmd
    return ["runuser", "-u", "postgres", "--", *cmd]


@pytest.fixture(scope="module")
def postgres_url() -> Iterator[str]:
    bin_dir = pg_bin()
    require(bin_dir is not None,
            "PostgreSQL server binaries not found (/usr/lib/postgresql/*/bin); apt-get install -y postgresql")
    require(os.geteuid() != 0 or shutil.which("runuser") is not None,
            "running as root without runuser: cannot start PostgreSQL as another user")
    root = Path(tempfile.mkdtemp(prefix="ragen-pg-"))
    data = root / "data"
    if os.geteuid() == 0:
        shutil.chown(root, "postgres", "postgres")
    port = free_port()
    subprocess.run(as_server_user([str(bin_dir / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust",
                                   "-E", "UTF8", "--no-sync"]), check=True, capture_output=True)
    options = f"-c listen_addresses=127.0.0.1 -p {port} -k {data} -c fsync=off"
    subprocess.run(as_server_user([str(bin_dir / "pg_ctl"), "-D", str(data), "-o", options, "-l",
                                   str(root / "server.log"), "-w", "-t", "60", "start"]),
                   check=True, capture_output=True)
    try:
        import psycopg2

        conn = psycopg2.connect(host="127.0.0.1", port=port, user="postgres", dbname="postgres")
        conn.autocommit = True
        conn.cursor().execute("CREATE DATABASE optuna")
        conn.close()
        yield f"postgresql+psycopg2://postgres@127.0.0.1:{port}/optuna"
    finally:
        subprocess.run(as_server_user([str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"]),
                       capture_output=True, check=False)
        shutil.rmtree(root, ignore_errors=True)


def cli_env(tmp_path: Path) -> dict[str, str]:
    """A private data dir and Prefect home; no outside server (the sweep's ephemeral API serves its workers)."""
    drop = ("PREFECT_API_URL", "PREFECT_HOME", "PREFECT_PROFILE", "MLFLOW_TRACKING_URI", "RAGEN_DATA_DIR")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(RAGEN_DATA_DIR=str(tmp_path / "data"), PREFECT_HOME=str(tmp_path / "prefect"),
               PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="true", MLFLOW_DISABLE_TELEMETRY="true",
               PYTHONUNBUFFERED="1")
    return env


def ragen_sweep(sweep_file: Path, tmp_path: Path, *args: str, timeout: float = 900,
                gpus: str | None = None) -> subprocess.CompletedProcess:
    """`ragen sweep`; ``gpus``: the devices the machine declares (RAGEN_GPUS), with a lock folder of this test's."""
    cmd = [str(Path(sys.executable).parent / "ragen"), "sweep", str(sweep_file), *args]
    env = cli_env(tmp_path)
    if gpus:
        env.update(RAGEN_GPUS=gpus, RAGEN_GPU_LOCK_DIR=str(tmp_path / "gpu-locks"))
    return subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          check=False)


def test_two_workers_on_postgresql_run_each_grid_point_once(postgres_url: str, tmp_path: Path) -> None:
    """Also the local form of the GPU slots: with two declared GPUs (RAGEN_GPUS=0,1) each of the two workers holds
    one of its own, and its trials' runs record it (MLflow tag gpus)."""
    path = tmp_path / "pg.yaml"
    path.write_text(f"name: pg-sweep\nbase: {SMOKE}\noverrides: {FAST}\nknobs: {{responses_per_prompt: [1, 2, 4]}}\n"
                    f"pruner: none\nheartbeat_seconds: 20\nstorage: {postgres_url}\n")
    started = time.monotonic()
    done = ragen_sweep(path, tmp_path, "--workers", "3", gpus="0,1")
    print(f"sweep of 3 trials on 2 workers took {time.monotonic() - started:.0f} s")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    study = optuna.load_study(study_name="pg-sweep", storage=postgres_url)
    # two workers may ask the sampler for the same last grid point at once: the second trial is skipped (FAIL,
    # user attr "skipped", by design in flows/sweep.py objective), so each point still trains once
    done_trials = [t for t in study.trials if t.state.name == "COMPLETE"]
    assert len(done_trials) == 3
    assert all("skipped" in t.user_attrs for t in study.trials if t.state.name != "COMPLETE"), \
        [(t.number, t.state.name, t.user_attrs) for t in study.trials]
    assert sorted(t.params["responses_per_prompt"] for t in done_trials) == [1, 2, 4]  # each point once
    assert len({t.user_attrs["worker"] for t in study.trials}) == 2
    assert "study pg-sweep: 3 trials (COMPLETE 3, PRUNED 0, FAIL 0)" in done.stdout
    assert "postgresql+psycopg2://postgres@127.0.0.1" in done.stdout  # where to point optuna-dashboard
    assert (tmp_path / "data" / "sweeps" / "pg-sweep" / "results.csv").exists()
    assert "3 workers asked for, this machine offers 2 GPUs (0,1): starting 2" in done.stdout
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'data' / 'mlflow.db'}")
    held = {t.user_attrs["worker"]: client.get_run(t.user_attrs["mlflow_run_id"]).data.tags["gpus"]
            for t in done_trials}
    by_worker = {}
    for t in done_trials:
        by_worker.setdefault(t.user_attrs["worker"], set()).add(
            client.get_run(t.user_attrs["mlflow_run_id"]).data.tags["gpus"])
    assert all(len(g) == 1 for g in by_worker.values()), by_worker  # a worker keeps its GPU
    assert set().union(*by_worker.values()) <= {"0", "1"} and len(set(held.values())) == len(held), held
