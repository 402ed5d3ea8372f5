"""A real `mlflow server` on 127.0.0.1 dies mid-run and comes back: no metric lost, none doubled.

Starts the server as a child process group (its uvicorn worker and job runner included),
logs, kills the group, logs on (training must neither raise nor stall), restarts it on
the same port with the same sqlite backend, and checks every point arrived exactly once.
Marked `integration` (it starts servers); about 20-40 s, mostly two server start-ups.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from mlflow import MlflowClient

from ragen_core.tracking import MLflowLogger
from ragen_core.tracking.mlflow_logger import log as tracking_log

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

N_METRICS = 30


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`mlflow server` on 127.0.0.1:port with a sqlite backend under ``root``."""

    def __init__(self, root: Path, port: int) -> None:
        self.root, self.port = root, port
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        cmd = [
            sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port),
            "--backend-store-uri", f"sqlite:///{self.root}/server.db",
            "--artifacts-destination", str(self.root / "artifacts"), "--workers", "1",
        ]
        # no background job runner: one process less to start on a 2-core machine
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        with open(self.root / "server.log", "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited: {(self.root / 'server.log').read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.3)
        raise RuntimeError("mlflow server did not become healthy in 120 s")

    def kill(self) -> None:
        """SIGKILL the server's own process group (new session: pgid == pid), like a crash."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    MlflowClient(f"sqlite:///{tmp_path}/server.db").search_experiments()  # schema made here, not at start-up
    srv = Server(tmp_path, free_port())
    srv.start()
    try:
        yield srv
    finally:
        srv.kill()


def test_server_killed_mid_run_and_restarted_loses_nothing(
    server: Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_TIMEOUT", raising=False)
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", raising=False)
    delivered: Counter[tuple[str, int]] = Counter()
    original = MlflowClient.log_batch

    def counting(self, run_id, metrics=(), params=(), tags=(), **kw):
        out = original(self, run_id, metrics=metrics, params=params, tags=tags, **kw)
        delivered.update((m.key, m.step) for m in metrics)  # only calls that succeeded
        return out

    monkeypatch.setattr(MlflowClient, "log_batch", counting)

    def metrics(step: int) -> dict[str, float]:
        return {f"actor/m{i}": step * 100.0 + i for i in range(N_METRICS - 1)} | {"env/success": step / 11}

    log = MLflowLogger(server.uri, "outage-e2e", run_name="live", outbox_dir=tmp_path / "run",
                       tags={"algo": "starpo-s"}, retry_interval_s=0.2)
    log.log_params({"trainer.iterations": 12})
    for step in range(5):
        log.log_metrics(metrics(step), step)
    assert log.pending_count == 0 and log.run_id is not None

    server.kill()
    slowest = 0.0
    for step in range(5, 10):  # training goes on: nothing raises
        t0 = time.monotonic()
        log.log_metrics(metrics(step), step)
        log.log_text(f"samples of step {step}", f"samples/iter_{step:04d}.txt")
        slowest = max(slowest, time.monotonic() - t0)
        time.sleep(0.25)  # lets later steps retry the dead server (back-off 0.2 s, doubling)
    print(f"slowest logging call while the server was down: {slowest * 1000:.1f} ms")
    assert log.pending_count == 10
    warnings = [r for r in caplog.records if r.name == tracking_log.name and r.levelno == logging.WARNING]
    assert len(warnings) == 1 and server.uri in warnings[0].getMessage()

    server.start()  # same port, same backend store
    for step in range(10, 12):
        log.log_metrics(metrics(step), step)
    log.close()
    assert log.pending_count == 0

    client = MlflowClient(server.uri)
    run = client.get_run(log.run_id)
    assert run.info.status == "FINISHED" and run.data.params == {"trainer.iterations": "12"}
    assert run.data.tags["algo"] == "starpo-s"
    for i in range(N_METRICS - 1):
        points = sorted((m.step, m.value) for m in client.get_metric_history(log.run_id, f"actor/m{i}"))
        assert points == [(s, s * 100.0 + i) for s in range(12)]
    assert sorted(m.step for m in client.get_metric_history(log.run_id, "env/success")) == list(range(12))
    assert len(delivered) == 12 * N_METRICS and set(delivered.values()) == {1}  # exactly once each
    texts = {a.path for a in client.list_artifacts(log.run_id, "samples")}
    assert texts == {f"samples/iter_{s:04d}.txt" for s in range(5, 10)}
    assert len([r for r in caplog.records if r.name == tracking_log.name and r.levelno == logging.WARNING]) == 1
