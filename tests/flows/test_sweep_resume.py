"""An interrupted sweep, started again, continues the interrupted trials' runs from their last checkpoints instead
of training them again from iteration 0: one run folder and one MLflow run a trial, each iteration once, the whole
curve. The sweep runs two worker processes, as a study does on two cores; SIGTERM to the command (a scheduler, a
Prefect cancellation) stops them too."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import psutil
from mlflow.tracking import MlflowClient
from test_sweep_flow import write_sweep

from flows.sweep import sweep

ROOT = Path(__file__).resolve().parents[2]
ITERATIONS = 30  # room for one run to be ahead of the other: both must be stopped before their end
SETTINGS = [f"trainer.iterations={ITERATIONS}", "trainer.checkpoint_every=1", "eval.every=2", "eval.seeds=2",
            "rollout.max_new_tokens=64", "tracking.artifact_every=0", "tracking.sample_trajectories=0"]


def test_a_sweep_interrupted_mid_run_continues_its_runs(data_dir, tmp_path) -> None:
    from prefect.settings import get_current_settings

    path = write_sweep(tmp_path, "resumed", "space: {trainer.seed: [0, 1]}\nsampler: grid\npruner: none\n",
                       SETTINGS)
    env = {**os.environ, "RAGEN_DATA_DIR": str(data_dir), "PREFECT_API_URL": str(get_current_settings().api.url),
           "PYTHONUNBUFFERED": "1"}
    log = tmp_path / "first.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "sweep", str(path), "--workers", "2"],
                                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        saved = [max((int(c.parent.name.split("=")[1]) for c in run.glob("checkpoints/iter=*/state.json")), default=-1)
                 for run in (data_dir / "runs").glob("resumed-t*")]
        if len(saved) == 2 and min(saved) >= 3:  # both runs have a checkpoint after iteration 2
            break
        time.sleep(0.05)
    assert proc.poll() is None, log.read_text()[-3000:]
    workers = [p for p in psutil.Process(proc.pid).children() if "sweep-worker" in " ".join(p.cmdline())]
    assert len(workers) == 2
    proc.send_signal(signal.SIGTERM)  # the command only, as a scheduler or a Prefect cancellation sends it
    proc.wait(timeout=180)
    # the command ended only once its workers had (a scheduler's job ends with its main process)
    assert not [w for w in workers if w.is_running() and w.status() != psutil.STATUS_ZOMBIE], log.read_text()[-3000:]
    # both trials ended FAIL, marked interrupted (not left RUNNING until their heartbeat goes stale, which would
    # count against retries)
    first = optuna.load_study(study_name="resumed", storage=f"sqlite:///{data_dir}/optuna.db").trials
    assert [(t.state.name, t.user_attrs.get("interrupted")) for t in first] == [("FAIL", "TerminationSignal")] * 2, \
        log.read_text()[-6000:]  # the workers' own lines: how each one ended its trial
    runs = sorted((data_dir / "runs").iterdir())
    assert len(runs) == 2
    before = {run.name: (run / "history.jsonl").read_text().splitlines() for run in runs}
    for rows in before.values():  # checkpoint iter=000003 reached and the run stopped before its end
        assert 2 <= json.loads(rows[-1])["iteration"] < ITERATIONS, log.read_text()[-3000:]

    summary = sweep(sweep_file=str(path), workers=1)
    study = optuna.load_study(study_name="resumed", storage=f"sqlite:///{data_dir}/optuna.db")
    lost = [t for t in study.trials if t.state.name == "FAIL"]
    retries = [t for t in study.trials if t.state.name == "COMPLETE"]
    assert [t.number for t in lost] == [0, 1] and all(t.user_attrs["interrupted"] for t in lost), summary
    assert sorted(t.system_attrs["failed_trial"] for t in retries) == [0, 1]
    # the same run folders, continued: no other run, each iteration in its history once, the curve whole
    assert sorted(p.name for p in (data_dir / "runs").iterdir()) == [run.name for run in runs]
    for retry in retries:
        run = Path(retry.user_attrs["run_dir"])
        assert run.name == Path(lost[retry.system_attrs["failed_trial"]].user_attrs["run_dir"]).name
        rows = (run / "history.jsonl").read_text().splitlines()
        # the last: the final evaluation
        assert sorted({json.loads(line)["iteration"] for line in rows}) == list(range(ITERATIONS + 1))
        assert (run / "final-model").is_dir()
        assert [step for step, _ in retry.user_attrs["curve"]] == list(range(0, ITERATIONS + 1, 2))
        # the resumed process started from a checkpoint, not from iteration 0: the rows up to it are as they were
        kept = [row for row in before[run.name] if json.loads(row)["iteration"] <= 2]
        assert rows[:len(kept)] == kept
    client = MlflowClient(f"sqlite:///{data_dir}/mlflow.db")
    parent = study.user_attrs["mlflow_parent_run_id"]
    children = client.search_runs([client.get_run(parent).info.experiment_id],
                                  f"tags.mlflow.parentRunId = '{parent}'")
    assert len(children) == 2 and {c.info.status for c in children} == {"FINISHED"}
    for child in children:
        history = client.get_metric_history
        assert sorted(m.step for m in history(child.info.run_id, "val/success")) == list(range(0, ITERATIONS + 1, 2))
        assert sorted(m.step for m in history(child.info.run_id, "rollout/success")) == list(range(ITERATIONS))
