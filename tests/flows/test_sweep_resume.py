"""An interrupted sweep, started again, continues the interrupted trial's run from its last checkpoint instead of
training it again from iteration 0: one run folder, one MLflow run, each iteration once, the whole curve."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
from mlflow.tracking import MlflowClient
from test_sweep_flow import write_sweep

from flows.sweep import sweep

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = ["trainer.iterations=6", "trainer.checkpoint_every=1", "eval.every=2", "eval.seeds=2",
            "rollout.max_new_tokens=8", "tracking.artifact_every=0", "tracking.sample_trajectories=0"]


def test_a_sweep_interrupted_mid_run_continues_that_run(data_dir, tmp_path) -> None:
    from prefect.settings import get_current_settings

    path = write_sweep(tmp_path, "resumed", "space: {trainer.seed: [0]}\nsampler: grid\npruner: none\n", SETTINGS)
    env = {**os.environ, "RAGEN_DATA_DIR": str(data_dir), "PREFECT_API_URL": str(get_current_settings().api.url),
           "PYTHONUNBUFFERED": "1"}
    log = tmp_path / "first.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "sweep", str(path), "--workers", "1"],
                                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        if list((data_dir / "runs").glob("resumed-t000-*/checkpoints/iter=000003/state.json")):
            break
        time.sleep(0.1)
    assert proc.poll() is None, log.read_text()[-3000:]
    proc.send_signal(signal.SIGTERM)  # as when a session ends under a running study
    proc.wait(timeout=120)
    (run,) = (data_dir / "runs").iterdir()
    before = (run / "history.jsonl").read_text().splitlines()
    reached = json.loads(before[-1])["iteration"]
    assert 2 <= reached < 5, reached  # checkpoint iter=000003: iterations 0, 1 and 2 done

    summary = sweep(sweep_file=str(path), workers=1)
    study = optuna.load_study(study_name="resumed", storage=f"sqlite:///{data_dir}/optuna.db")
    lost, retry = study.trials
    assert lost.state.name == "FAIL" and lost.user_attrs["interrupted"], summary
    assert retry.state.name == "COMPLETE" and retry.system_attrs["failed_trial"] == 0
    # the same run folder, continued: no second run, each iteration in its history once, the curve whole
    assert [p.name for p in (data_dir / "runs").iterdir()] == [run.name]
    assert Path(retry.user_attrs["run_dir"]).name == run.name
    iterations = [json.loads(line)["iteration"] for line in (run / "history.jsonl").read_text().splitlines()]
    assert sorted(set(iterations)) == list(range(7)) and (run / "final-model").is_dir()  # 6: the final evaluation
    assert [step for step, _ in retry.user_attrs["curve"]] == [0, 2, 4, 6]
    # the resumed process started from the checkpoint, not from iteration 0: the rows up to it are as they were
    after = (run / "history.jsonl").read_text().splitlines()
    kept = [row for row in before if json.loads(row)["iteration"] <= 2]
    assert after[:len(kept)] == kept
    client = MlflowClient(f"sqlite:///{data_dir}/mlflow.db")
    parent = study.user_attrs["mlflow_parent_run_id"]
    children = client.search_runs([client.get_run(parent).info.experiment_id],
                                  f"tags.mlflow.parentRunId = '{parent}'")
    assert len(children) == 1 and children[0].info.status == "FINISHED"
    history = client.get_metric_history
    assert sorted(m.step for m in history(children[0].info.run_id, "val/success")) == [0, 2, 4, 6]
    assert sorted(m.step for m in history(children[0].info.run_id, "rollout/success")) == list(range(6))
