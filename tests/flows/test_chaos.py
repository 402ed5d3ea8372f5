"""Kill `ragen train` with SIGKILL at random points, resume it each time, and end where an unbroken run ends.

The tiny smoke experiment, 6 iterations (10 for the 6 kills), a checkpoint after every one. Each kill waits
until the run has recorded one more iteration than at its start (so every resume makes progress), then SIGKILL: at once
(half the kills, seeded: while the iteration's checkpoint is written, after its metrics went out) or after
a seeded random delay inside the next iteration (rollout, update, shard, MLflow delivery). The run is
resumed with ``ragen train EXP --resume RUN`` (or started again when it was killed before it wrote its
config). Then:

- the final weights equal an uninterrupted run's bit for bit;
- every Parquet shard reads and holds every group of its iteration once;
- MLflow holds one run, and each metric exactly one point per step.

After every kill nothing the run started may still run (flows/reaper.py): each run's environment carries a
mark of the test's, inherited by every process it starts, and the test waits until no live process carries it.

3 kills in the quick tests, 6 in the slow one; the seed is in the test id, so a failure reproduces with the
same kill schedule. The subprocesses report to the session's Prefect test server (PREFECT_API_URL), so no
process starts its own; ``test_a_run_killed_by_any_signal_leaves_no_process_running`` kills runs in Prefect's
ephemeral mode instead, where each run starts a temporary API server of its own.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest
import torch
from mlflow import MlflowClient
from safetensors.torch import load_file

from ragen_core.store.parquet import read_run
from tests.conftest import with_default_signals

REPO = Path(__file__).resolve().parents[2]
SMOKE = "experiments/smoke.yaml"
SETTINGS = ["--set", "trainer.checkpoint_every=1", "--set", "eval.every=3"]


MARK = "RAGEN_TEST_CHAOS_MARK"  # set on each run the test starts; every process of the run inherits it


def _env(data_dir: Path) -> dict[str, str]:
    from prefect.settings import get_current_settings

    env = dict(os.environ, RAGEN_DATA_DIR=str(data_dir), PREFECT_API_URL=str(get_current_settings().api.url),
               PYTHONUNBUFFERED="1")
    env.pop("MLFLOW_TRACKING_URI", None)
    return env


def _start(args: list[str], data_dir: Path, log: Path, iterations: int, mark: str = "",
           env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """``ragen train`` on the smoke experiment, its environment carrying ``mark`` under MARK."""
    with open(log, "ab") as out:
        return subprocess.Popen(with_default_signals([sys.executable, "-m", "flows.cli", "train", SMOKE, *SETTINGS,
                                                      "--set", f"trainer.iterations={iterations}", *args]),
                                cwd=REPO, env={**(env or _env(data_dir)), MARK: mark}, stdout=out,
                                stderr=subprocess.STDOUT)


def _left_behind(mark: str, wait_s: float = 30.0) -> list[str]:
    """The command lines of live processes that still carry ``mark`` after up to ``wait_s`` (the reaper's
    grace included); empty when none is left."""
    deadline = time.monotonic() + wait_s
    while True:
        left = []
        for p in psutil.process_iter():
            try:
                if p.status() != psutil.STATUS_ZOMBIE and p.environ().get(MARK) == mark:
                    left.append(" ".join(p.cmdline())[:200])
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


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
    pytest.param(6, 7, 10, id="6-kills-seed-7", marks=pytest.mark.slow),
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
        mark = uuid.uuid4().hex
        proc = _start(["--resume", "chaos"] if resume else ["--run-name", "chaos"], data_dir, log, iterations, mark)
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
            assert _left_behind(mark) == [], f"kill {done} left processes running (kills so far {schedule})"
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


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP],
                         ids=lambda s: signal.Signals(s).name)
def test_a_run_killed_by_any_signal_leaves_no_process_running(data_dir, tmp_path: Path, sig: int) -> None:
    """In Prefect's ephemeral mode `ragen train` starts a temporary API server as a child: killed while that
    server runs (any signal, SIGKILL included), the run leaves no process of its own behind."""
    env = {k: v for k, v in _env(data_dir).items() if k != "PREFECT_API_URL"}
    env["PREFECT_HOME"] = str(tmp_path / "prefect")  # the temporary server's database, not the user's
    mark, log = uuid.uuid4().hex, tmp_path / "train.log"
    proc = _start(["--run-name", "killed"], data_dir, log, 100, mark, env)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None and \
            not any("uvicorn" in line for line in _left_behind(mark, wait_s=0)):
        time.sleep(0.2)
    running = _left_behind(mark, wait_s=0)
    assert proc.poll() is None and any("uvicorn" in line for line in running), (running, log.read_text()[-3000:])
    proc.send_signal(sig)
    code = proc.wait(timeout=60)
    # the signal ended the run: a run that went on to its 100th iteration exits 0
    assert code != 0 and "final evaluation" not in log.read_text(), (code, log.read_text()[-3000:])
    assert _left_behind(mark) == [], f"left running after {signal.Signals(sig).name}: {log.read_text()[-3000:]}"
