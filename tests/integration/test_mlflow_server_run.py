"""The training flow against a real `mlflow server` on 127.0.0.1: a team's tracking set-up.

1. The smoke experiment with ``tracking.uri`` set to the server: the run arrives with its
   params, tags, namespaced metrics and artifacts (config.yaml, samples, plots, the replies table) and its
   logged model.
2. The server is SIGKILLed right after the first iteration is recorded and restarted on the
   same port and store: training goes on, and after the run every metric of every
   iteration is on the server exactly once (what close() could not deliver is delivered
   with ``ragen_core.tracking.deliver_pending``, as its warning says).

The flows run in this process against the session's real Prefect server (conftest.py).
Run alone: ``.venv/bin/python -m pytest tests/integration/test_mlflow_server_run.py -s`` (~2-4 min);
the outage test is also marked slow (``make test-slow``); the logger-level one
(tests/unit/tracking/test_tracking_server_outage.py) runs with ``make test``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml

from tests.conftest import prefect_api

if TYPE_CHECKING:  # fixtures of tests/integration/conftest.py
    from tests.integration.conftest import MlflowServer, PrefectServer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
SMOKE = str(REPO / "experiments" / "smoke.yaml")


@pytest.fixture
def data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private RAGEN_DATA_DIR; the MLflow URI comes only from the config (tracking.uri)."""
    d = tmp_path / "data"
    monkeypatch.setenv("RAGEN_DATA_DIR", str(d))
    for key in ("MLFLOW_TRACKING_URI", "MLFLOW_HTTP_REQUEST_TIMEOUT", "MLFLOW_HTTP_REQUEST_MAX_RETRIES"):
        monkeypatch.delenv(key, raising=False)  # the logger sets the last two; undone after the test
    return d


@pytest.fixture
def on_prefect_server(prefect_server: PrefectServer) -> Iterator[None]:
    """Flows called in this process report to the session's real Prefect server, their events too; the flows
    after this module (tests/flows, on the same xdist worker) report to theirs again."""
    with prefect_api(prefect_server.api_url):
        yield


def run_smoke(server: MlflowServer, run_name: str, *overrides: str) -> Any:
    from flows.train import train

    t0 = time.monotonic()
    result = train(SMOKE, [f"tracking.uri={server.uri}", *overrides], run_name=run_name)
    print(f"smoke flow {run_name}: {time.monotonic() - t0:.1f} s")
    return result


def history(run_dir: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (run_dir / "history.jsonl").read_text().splitlines()]


def test_smoke_run_arrives_on_mlflow_server(
    mlflow_server: MlflowServer, data_dir: Path, on_prefect_server: None, tmp_path: Path
) -> None:
    from mlflow import MlflowClient

    result = run_smoke(mlflow_server, "it-server", "trainer.iterations=1")
    client = MlflowClient(mlflow_server.uri)
    run = client.get_run(result.mlflow_run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "it-server"
    assert client.get_experiment(run.info.experiment_id).name == "ragen-Bandit"  # one experiment per env family

    tags = run.data.tags
    assert {k: tags[k] for k in ("algo", "env", "estimator", "preset", "model")} == {
        "algo": "starpo-s", "env": "Bandit", "estimator": "gae", "preset": "starpo-s", "model": "tiny-random"}
    assert len(tags["prefect.flow_run_id"]) == 36  # a UUID: the flow run on the Prefect server
    params = run.data.params
    assert params["trainer.iterations"] == "1" and params["env.name"] == "Bandit"
    assert params["tracking.uri"] == mlflow_server.uri

    metrics = run.data.metrics
    for ns in ("rollout/", "actor/", "critic/", "val/", "env/", "timing/"):
        assert any(k.startswith(ns) for k in metrics), f"no {ns}* metric in {sorted(metrics)}"
    trained = [h for h in history(Path(result.run_dir)) if "rollout/success" in h]
    assert [h["iteration"] for h in trained] == [0]
    assert metrics["actor/entropy"] == pytest.approx(trained[0]["actor/entropy"])

    top = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "samples", "plots", "replies.json"} <= top, top
    # the final model is the run's logged model (MLflow 3: beside the run's artifacts), stored by the server too
    [output] = run.outputs.model_outputs
    assert client.get_logged_model(output.model_id).name == "model"
    assert any((mlflow_server.root / "artifacts").rglob("MLmodel"))
    assert [a.path for a in client.list_artifacts(run.info.run_id, "plots")] == ["plots/curves.png"]
    assert client.list_artifacts(run.info.run_id, "samples")
    cfg_file = client.download_artifacts(run.info.run_id, "config.yaml", str(tmp_path))
    cfg = yaml.safe_load(Path(cfg_file).read_text())
    assert cfg["name"] == "smoke" and cfg["trainer"]["iterations"] == 1
    # stored by the server (proxied artifacts), not written next to the client
    assert any((mlflow_server.root / "artifacts").rglob("curves.png"))


class Outage(threading.Thread):
    """Kills the server when the first iteration is in history.jsonl, restarts it ``down_s`` later."""

    def __init__(self, server: MlflowServer, history_file: Path, down_s: float) -> None:
        super().__init__(daemon=True)
        self.server, self.history_file, self.down_s = server, history_file, down_s
        self.killed_after_lines: int | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline:
                lines = self.history_file.read_text().count("\n") if self.history_file.exists() else 0
                if lines >= 1:
                    self.server.kill()
                    self.killed_after_lines = lines  # counted before the kill, which takes a moment itself
                    break
                time.sleep(0.05)
            else:
                raise TimeoutError(f"{self.history_file} got no line in 600 s")
            time.sleep(self.down_s)
            self.server.start()
        except BaseException as exc:  # noqa: BLE001 -- re-raised in the test
            self.error = exc


@pytest.mark.slow  # ~1.5 min (two server start-ups and a 2-iteration run); the logger-level outage test runs by default
def test_server_killed_mid_run_no_metric_lost_or_doubled(
    mlflow_server: MlflowServer, data_dir: Path, on_prefect_server: None
) -> None:
    from mlflow import MlflowClient

    from ragen_core.tracking import deliver_pending
    from ragen_core.tracking.mlflow_logger import log as tracking_log

    # A handler on the logger itself: a flow run's logging set-up can stop records reaching pytest's root handler.
    records: list[logging.LogRecord] = []
    catcher = logging.Handler(logging.WARNING)
    catcher.emit = records.append  # type: ignore[method-assign]
    tracking_log.addHandler(catcher)
    run_dir = data_dir / "runs" / "it-outage"
    outage = Outage(mlflow_server, run_dir / "history.jsonl", down_s=2.0)
    outage.start()
    # 2 iterations: the second one is logged into the outage (16 prompts instead of 4 lengthen it, so the
    # kill, which itself takes a moment, lands well before its metrics are sent)
    result = run_smoke(mlflow_server, "it-outage", "rollout.prompts_per_iter=16")
    outage.join(timeout=300)
    tracking_log.removeHandler(catcher)
    assert outage.error is None, outage.error
    assert outage.killed_after_lines == 1, "the server must die before the second iteration is recorded"
    assert len(mlflow_server.start_seconds) == 2
    print(f"mlflow server start-ups: {', '.join(f'{s:.1f} s' for s in mlflow_server.start_seconds)}")
    warnings = [r.getMessage() for r in records]
    assert any("unreachable" in w for w in warnings), warnings  # the outage was felt, once, as a warning

    left = deliver_pending(run_dir, mlflow_server.uri)  # no-op when close() already got through
    assert left == 0

    client = MlflowClient(mlflow_server.uri)
    run = client.get_run(result.mlflow_run_id)
    assert run.info.status == "FINISHED"
    lines = history(run_dir)
    assert [h["iteration"] for h in lines if "rollout/success" in h] == [0, 1]
    keys = sorted({k for h in lines for k in h} - {"iteration"})
    assert set(keys) <= set(run.data.metrics)
    for key in keys:
        points = client.get_metric_history(run.info.run_id, key)
        per_step = Counter(p.step for p in points)
        assert set(per_step.values()) == {1}, f"{key}: a step logged twice: {per_step}"
        got = {p.step: p.value for p in points}
        want = {int(h["iteration"]): h[key] for h in lines if key in h}
        assert set(want) <= set(got), f"{key}: steps {sorted(set(want) - set(got))} lost"
        assert all(got[s] == pytest.approx(v, nan_ok=True) for s, v in want.items()), key
    assert run.data.params["trainer.iterations"] == "2"
    top = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "samples", "plots", "replies.json"} <= top, top
    [output] = run.outputs.model_outputs  # the final model, logged once, through the outbox
    assert client.get_logged_model(output.model_id).name == "model"
