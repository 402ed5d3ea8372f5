"""Real servers on 127.0.0.1 for integration tests: `prefect server start` and `mlflow server`.

Each server is a child process in its own session (process group), started on a free port
with its state under a temporary directory, waited on until its health endpoint answers,
and stopped (TERM, then KILL, descendants included) when the test is over, failed or not.

    def test_x(prefect_server, mlflow_server):
        subprocess.run(["prefect", "work-pool", "ls"], env=prefect_server.client_env(), check=True)
        MlflowClient(mlflow_server.uri).search_experiments()

Fixtures: ``prefect_server`` (one per session, ~10-20 s to start, UI on), ``mlflow_server`` (one per
test, its sqlite schema made before start-up so it starts in a few seconds), ``background``
(other long-running children of a test, e.g. a `prefect worker`, stopped the same way), ``chrome``
(Debian's headless chromium driven by selenium; the test is skipped where one is missing, failed under CI).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.conftest import require, require_module, with_default_signals

BIN = Path(sys.executable).parent  # the venv's console scripts (prefect, mlflow, ragen)
REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_env(**extra: str) -> dict[str, str]:
    """This process's environment without anything that would point a child at another server or data dir."""
    drop = ("PREFECT_API_URL", "PREFECT_HOME", "PREFECT_PROFILE", "MLFLOW_TRACKING_URI", "RAGEN_DATA_DIR", "RAGEN_HOME")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    # nothing leaves the machine: no usage analytics, no version checks, no prompts
    env.update(PREFECT_SERVER_ANALYTICS_ENABLED="false", PREFECT_CLI_PROMPT="false", DO_NOT_TRACK="true",
               MLFLOW_DISABLE_TELEMETRY="true", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def stop_tree(proc: subprocess.Popen[bytes] | None, grace_s: float = 10.0, sig: int = signal.SIGTERM) -> None:
    """Stop a child started with ``start_new_session=True`` and everything it started.

    Descendants are collected first (a flow run may sit in a session of its own), then each
    process group gets ``sig``; whatever is still alive after ``grace_s`` is killed.
    """
    if proc is None:
        return
    try:
        family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        family = []
    groups = {proc.pid}
    for p in family:
        try:
            groups.add(os.getpgid(p.pid))
        except ProcessLookupError:
            pass
    groups.discard(os.getpgrp())  # never our own group
    for g in groups:
        try:
            os.killpg(g, sig)
        except ProcessLookupError:
            pass
    _, alive = psutil.wait_procs(family, timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


class ServerProcess:
    """A server command run in its own session, healthy once ``health_url`` answers 200."""

    def __init__(self, name: str, cmd: Sequence[str], env: Mapping[str, str], health_url: str,
                 log_path: Path, cwd: Path | None = None) -> None:
        self.name, self.cmd, self.env, self.health_url = name, list(cmd), dict(env), health_url
        self.log_path, self.cwd = log_path, cwd
        self.proc: subprocess.Popen[bytes] | None = None
        self.start_seconds: list[float] = []  # how long each start took until healthy

    def start(self, timeout_s: float = 180.0) -> None:
        t0 = time.monotonic()
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                         cwd=self.cwd, start_new_session=True)
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            if self.healthy():
                self.start_seconds.append(time.monotonic() - t0)
                return
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"{self.name} was not healthy after {timeout_s:.0f} s:\n{self.log_tail()}")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.health_url, timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL the whole server at once, like a crash."""
        stop_tree(self.proc, grace_s=0.0, sig=signal.SIGKILL)

    def stop(self) -> None:
        stop_tree(self.proc)

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return "(no log)"


class PrefectServer(ServerProcess):
    """`prefect server start` with its own PREFECT_HOME (sqlite database, profiles) under ``root``."""

    def __init__(self, root: Path, port: int) -> None:
        self.root, self.port = root, port
        self.home = root / "prefect-home"
        self.home.mkdir(parents=True, exist_ok=True)
        # the UI is on (the browser tests open it); its pages call the API at this address
        env = base_env(PREFECT_HOME=str(self.home), PREFECT_UI_ENABLED="true",
                       PREFECT_UI_API_URL=f"http://127.0.0.1:{port}/api")
        super().__init__("prefect server", [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1",
                                            "--port", str(port)],
                         env, f"http://127.0.0.1:{port}/api/health", root / "prefect-server.log", cwd=root)

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    def client_env(self, **extra: str) -> dict[str, str]:
        """Environment for a `prefect` CLI, worker or flow process that talks to this server."""
        return base_env(PREFECT_HOME=str(self.home), PREFECT_API_URL=self.api_url, **extra)


class MlflowServer(ServerProcess):
    """`mlflow server` with a sqlite backend store (or ``backend_uri``: PostgreSQL) and a local artifact store
    under ``root``."""

    def __init__(self, root: Path, port: int, backend_uri: str | None = None) -> None:
        self.root, self.port = root, port
        root.mkdir(parents=True, exist_ok=True)
        self.backend_uri = backend_uri or f"sqlite:///{root}/mlflow.db"
        cmd = [str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port),
               "--backend-store-uri", self.backend_uri, "--artifacts-destination", str(root / "artifacts"),
               "--workers", "1"]
        # no background job runner: one process less to start on a small machine
        env = base_env(MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
        super().__init__("mlflow server", cmd, env, f"http://127.0.0.1:{port}/health", root / "mlflow-server.log")

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def make_schema(self) -> None:
        """Create the backend tables here, so the server does not migrate them while starting."""
        from mlflow import MlflowClient

        MlflowClient(self.backend_uri).search_experiments()


class Background:
    """Long-running children of one test, each in its own session; all stopped at teardown."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, cmd: Sequence[str], env: Mapping[str, str], cwd: Path) -> subprocess.Popen[bytes]:
        """Start ``cmd``; its output goes to ``<log_dir>/<name>.log``."""
        with open(self.log_dir / f"{name}.log", "ab") as out:
            proc = subprocess.Popen(with_default_signals(cmd), stdout=out, stderr=subprocess.STDOUT, env=dict(env),
                                    cwd=cwd, start_new_session=True)  # stop() sends SIGINT
        self.procs.append(proc)
        return proc

    def log(self, name: str, n: int = 3000) -> str:
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace")[-n:] if path.exists() else "(no log)"

    def stop(self, proc: subprocess.Popen[bytes], sig: int = signal.SIGINT) -> None:
        """SIGINT first (Prefect workers and uvicorn shut down cleanly on it), then KILL."""
        stop_tree(proc, sig=sig)


@pytest.fixture
def background(tmp_path: Path) -> Iterator[Background]:
    bg = Background(tmp_path)
    try:
        yield bg
    finally:
        for proc in bg.procs:
            bg.stop(proc)


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrefectServer]:
    """One real Prefect server for the session (start-up is the slow part: ~10-20 s)."""
    server = PrefectServer(tmp_path_factory.mktemp("prefect"), free_port())
    server.start()
    print(f"prefect server healthy after {server.start_seconds[-1]:.1f} s")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def mlflow_server(tmp_path: Path) -> Iterator[MlflowServer]:
    """A fresh `mlflow server` for one test (stop/kill/start it again as the test needs)."""
    server = MlflowServer(tmp_path / "mlflow-server", free_port())
    server.make_schema()
    server.start()
    print(f"mlflow server healthy after {server.start_seconds[-1]:.1f} s")
    try:
        yield server
    finally:
        server.stop()


CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")


@pytest.fixture
def chrome() -> Iterator[Any]:
    """Headless Debian chromium through Debian's chromium-driver (selenium); no browser or driver download.

    Skipped where chromium, chromium-driver or selenium is missing, failed under CI (tests/conftest.py; `.ci/run`
    installs the Debian packages).
    """
    require(CHROMIUM is not None and CHROMEDRIVER is not None,
            "needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)")
    webdriver = require_module("selenium.webdriver", "drives chromium through selenium (a dev dependency)")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1600,1000",
                "--disable-gpu", "--no-first-run", "--disable-extensions", "--lang=en-US"):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    try:
        yield driver
    finally:
        driver.quit()
