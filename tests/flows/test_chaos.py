"""Kill `ragen train` with SIGKILL at random points, resume it each time, and end where an unbroken run ends.

The tiny smoke experiment, 6 iterations (16 for the 10 kills), a checkpoint after every one. Each kill waits
until the run has recorded one more iteration than at its start (so every resume makes progress), then SIGKILL: at once
(half the kills, seeded: while the iteration's checkpoint is written, after its metrics went out) or after
a seeded random delay inside the next iteration (rollout, update, shard, MLflow delivery). The run is
resumed with ``ragen train EXP --resume RUN`` (or started again when it was killed before it wrote its
config). Then:

- the final weights equal an uninterrupted run's bit for bit;
- every Parquet shard reads and holds every group of its iteration once;
- MLflow holds one run, and each metric exactly one point per step.

3 kills in the default suite, 10 in the slow one (``make test-slow``); the seed is in the test id, so a
failure reproduces with the same kill schedule. The subprocesses report to the session's Prefect test
server (PREFECT_API_URL), so no process starts its own.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient
from safetensors.torch import load_file

from ragen_core.store.parquet import read_run

REPO = Path(__file__).resolve().parents[2]
SMOKE = "experiments/smoke.yaml"
SETTINGS = ["--set", "trainer.checkpoint_every=1", "--set", "eval.every=3"]


def _env(data_dir: Path) -> dict[str, str]:
    from prefect.settings import get_current_settings

    env = dict(os.environ, RAGEN_DATA_DIR=str(data_dir), PREFECT_API_URL=str(get_current_settings().api.url),
               PYTHONUNBUFFERED="1")
    env.pop("MLFLOW_TRACKING_URI", None)
    return env


def _start(args: list[str], data_dir: Path, log: Path, iterations: int) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "flows.cli", "train", SMOKE, *SETTINGS,
                                 "--set", f"trainer.iterations={iterations}", *args], cwd=REPO,
                                env=_env(data_dir), stdout=out, stderr=subprocess.STDOUT)


def _rows(run: Path) -> int:
    path = run / "history.jsonl"
    return path.read_bytes().count(b"\n") if path.exists() else 0


def _run_to_end(args: list[str], data_dir: Path, log: Path, iterations: int) -> None:
    proc = _start(args, data_dir, log, iterations)
    assert proc.wait(timeout=600) == 0, log.read_text()[-4000:]


# A kill needs one more recorded iteration than its run started with, and a resume redoes the iterations after
# its checkpoint: a run of n iterations takes at most about n kills (the 10-kill case ended after 6 of 6).
@pytest.mark.parametrize("kills,seed,iterations", [
    pytest.param(3, 20261125, 6, id="3-kills-seed-20261125"),
    pytest.param(10, 7, 16, id="10-kills-seed-7", marks=pytest.mark.slow),
])
def test_sigkill_anywhere_then_resume_ends_bit_identical(data_dir, tmp_path: Path, kills: int, seed: int,
                                                         iterations: int) -> None:
    rng = random.Random(seed)
    log = tmp_path / "train.log"
    _run_to_end(["--run-name", "straight"], data_dir, log, iterations)

    run = data_dir / "runs" / "chaos"
    done, schedule = 0, []
    while True:
        resume = (run / "config.yaml").exists()
        proc = _start(["--resume", "chaos"] if resume else ["--run-name", "chaos"], data_dir, log, iterations)
        if done >= kills:
            assert proc.wait(timeout=600) == 0, log.read_text()[-4000:]
            break
        target = _rows(run) + 1
        deadline = time.monotonic() + 300
        while proc.poll() is None and _rows(run) < target and time.monotonic() < deadline:
            time.sleep(0.05)
        # half the kills land at once, while the iteration's checkpoint is being written after its metrics and
        # history row (the resume then redoes an iteration that was already reported); the others anywhere in
        # the next iteration
        delay = 0.0 if rng.random() < 0.5 else rng.uniform(0.0, 1.5)
        time.sleep(delay)
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            done += 1
            schedule.append((target, round(delay, 3)))
        elif proc.returncode != 0:
            pytest.fail(f"a resumed run failed (kills so far {schedule}):\n{log.read_text()[-4000:]}")
        else:  # it finished before the kill: run it again from scratch under a new name would change nothing
            break
    assert done == kills, f"the run ended after {done} kills (schedule {schedule}): lengthen it"

    for name in ("final-model/model.safetensors", f"checkpoints/iter={iterations:06d}/actor.safetensors"):
        a, b = load_file(data_dir / "runs" / "straight" / name), load_file(run / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (name, schedule)

    frame = read_run(run)
    assert sorted(frame["iteration"].unique().tolist()) == list(range(iterations))
    for _, rows in frame.groupby("iteration"):
        members = sorted(zip(rows["group_id"], [json.loads(m)["member"] for m in rows["meta_json"]], strict=True))
        assert members == sorted((g, m) for g in range(4) for m in range(2))  # P x N = 4 x 2, each once

    client = MlflowClient(f"sqlite:///{data_dir / 'mlflow.db'}")
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])
            if r.info.run_name == "chaos"]
    assert len(runs) == 1, [r.info.run_id for r in runs]
    chaos = runs[0]
    assert chaos.info.status == "FINISHED"
    for key in chaos.data.metrics:
        steps = [m.step for m in client.get_metric_history(chaos.info.run_id, key)]
        assert len(steps) == len(set(steps)), (key, sorted(steps), schedule)
    grad_steps = sorted(m.step for m in client.get_metric_history(chaos.info.run_id, "actor/grad_norm"))
    assert grad_steps == list(range(iterations))
