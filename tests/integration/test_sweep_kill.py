"""A sweep worker killed mid-trial (SIGKILL, like a lost machine): its heartbeat stops, that trial
ends FAIL, the same grid point is queued once more, its retry continues the lost trial's run (same folder,
same MLflow run), and the study completes every point."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import psutil
import pytest
from mlflow.tracking import MlflowClient
from test_sweep_postgres import FAST, REPO, SMOKE, cli_env

pytestmark = pytest.mark.integration

optuna.logging.set_verbosity(optuna.logging.WARNING)


def wait_for_trial_in_training(url: str, sweep: subprocess.Popen, log: Path, timeout: float = 400) -> tuple[int, int]:
    """(trial number, worker pid) of a trial that has evaluated once and is now training."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert sweep.poll() is None, "the sweep ended before any trial was seen training"
        trials = []
        # read only once the sweep has made the database and study (a second creator would race it)
        if "[sweep] study kill-sweep in" in log.read_text(errors="replace"):
            trials = optuna.load_study(study_name="kill-sweep", storage=url).get_trials(deepcopy=False)
        for t in trials:
            # wait for the last attribute the report stores, so the kill cannot fall between them
            if t.state.name == "RUNNING" and t.user_attrs.get("mlflow_run_id") and t.user_attrs.get("worker"):
                return t.number, int(t.user_attrs["worker"].rsplit(":", 1)[1])
        time.sleep(0.5)
    raise AssertionError("no trial reached training in time")


def test_killed_worker_trial_fails_and_the_study_completes(tmp_path: Path) -> None:
    data = tmp_path / "data"
    url = f"sqlite:///{data}/optuna.db"
    path = tmp_path / "kill.yaml"
    # two updates per trial leave time to kill one while it trains; a 6 s heartbeat notices quickly
    path.write_text(f"name: kill-sweep\nbase: {SMOKE}\noverrides: {[*FAST, 'trainer.iterations=2']}\n"
                    "knobs: {responses_per_prompt: [1, 2, 4]}\npruner: none\nheartbeat_seconds: 6\nretries: 1\n")
    with open(tmp_path / "sweep.log", "w") as log:
        sweep = subprocess.Popen([str(Path(sys.executable).parent / "ragen"), "sweep", str(path), "--workers", "2"],
                                 env=cli_env(tmp_path), cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        try:
            number, pid = wait_for_trial_in_training(url, sweep, tmp_path / "sweep.log")
            # only a process this test started: a worker child of the sweep command
            assert pid in {p.pid for p in psutil.Process(sweep.pid).children(recursive=True)}
            os.kill(pid, signal.SIGKILL)
            rc = sweep.wait(timeout=600)
        finally:
            if sweep.poll() is None:
                os.killpg(sweep.pid, signal.SIGKILL)
    output = (tmp_path / "sweep.log").read_text(errors="replace")
    assert rc == 0, output[-5000:]
    study = optuna.load_study(study_name="kill-sweep", storage=url)
    killed = study.trials[number]
    assert killed.state.name == "FAIL" and killed.params
    retry = [t for t in study.trials if t.system_attrs.get("failed_trial") == number]
    assert len(retry) == 1 and retry[0].state.name == "COMPLETE" and retry[0].params == killed.params
    done = [t.params["responses_per_prompt"] for t in study.trials if t.state.name == "COMPLETE"]
    assert sorted(done) == [1, 2, 4]  # every point exactly once, the killed one by its retry
    assert [t.state.name for t in study.trials].count("FAIL") == 1
    assert "study kill-sweep: 4 trials (COMPLETE 3, PRUNED 0, FAIL 1)" in output
    assert len((data / "sweeps" / "kill-sweep" / "results.csv").read_text().splitlines()) == 4  # header + 3
    # the retry continued the lost trial's run (its folder is on this machine) and ended that MLflow run
    assert retry[0].user_attrs["run_dir"] == killed.user_attrs["run_dir"]
    assert retry[0].user_attrs["mlflow_run_id"] == killed.user_attrs["mlflow_run_id"]
    client = MlflowClient(f"sqlite:///{data}/mlflow.db")
    assert client.get_run(killed.user_attrs["mlflow_run_id"]).info.status == "FINISHED"
