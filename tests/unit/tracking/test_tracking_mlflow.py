"""MLflowLogger against a temporary sqlite store (STYLE.md rule 9) and a closed port.

What lands (params, tags, metrics, texts, artifacts), batching within MLflow's limits,
resume into the same run, nested runs, and outages: a simulated one (log_batch raising),
a dead address (a closed port on 127.0.0.1), a crash with undelivered entries, and a
run that could only be created after the fact. Every check reads back through MlflowClient.
"""

from __future__ import annotations

import logging
import socket
import sqlite3
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from ragen_core.tracking import MLflowLogger, default_tracking_uri, deliver_pending
from ragen_core.tracking.mlflow_logger import log as tracking_log


class Sent:
    """Counts successful log_batch calls and every metric point that reached the store."""

    def __init__(self) -> None:
        self.calls = 0
        self.points: Counter[tuple[str, int]] = Counter()
        self.down = False


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> Iterator[Sent]:
    record = Sent()
    original = MlflowClient.log_batch

    def counting(self, run_id, metrics=(), params=(), tags=(), **kw):
        if record.down:
            raise MlflowException("API request failed with exception ConnectionError (simulated outage)")
        out = original(self, run_id, metrics=metrics, params=params, tags=tags, **kw)
        record.calls += 1
        record.points.update((m.key, m.step) for m in metrics)
        return out

    monkeypatch.setattr(MlflowClient, "log_batch", counting)
    yield record


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == tracking_log.name and r.levelno == logging.WARNING]


def history(client: MlflowClient, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens here once the socket is closed


def test_params_tags_metrics_text_and_artifacts_land(uri: str, tmp_path: Path, sent: Sent) -> None:
    log = MLflowLogger(uri, "land", run_name="r1", outbox_dir=tmp_path / "run", tags={"algo": "starpo-s"})
    assert log.run_id is not None
    log.log_params({"trainer.lr": 1e-6, "rollout.P": 8})
    log.set_tags({"env": "Bandit"})
    for step in range(3):
        log.log_metrics({"env/success": 0.1 * step, "actor/grad_norm": 1.0 + step}, step=step)
    log.log_text("turn 1: Left", "samples/iter_0002.txt")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "weights.bin").write_bytes(b"\0" * 10)
    log.log_artifact(tmp_path / "model", "final_model")
    log.close()

    client = MlflowClient(uri)
    run = client.get_run(log.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "r1"
    assert run.data.params == {"trainer.lr": "1e-06", "rollout.P": "8"}
    assert run.data.tags["algo"] == "starpo-s" and run.data.tags["env"] == "Bandit"
    assert history(client, log.run_id, "env/success") == [(0, 0.0), (1, 0.1), (2, 0.2)]
    local = client.download_artifacts(log.run_id, "samples/iter_0002.txt", str(tmp_path / "dl"))
    assert Path(local).read_text() == "turn 1: Left"
    assert [a.path for a in client.list_artifacts(log.run_id, "final_model")] == ["final_model/weights.bin"]
    # artifacts of a sqlite store live beside the database, not in the current directory
    assert run.info.artifact_uri.startswith(Path(uri[len("sqlite:///"):]).parent.as_uri())
    assert log.pending_count == 0 and sent.calls == 5  # params, tags, 3 x metrics: one call each


def test_large_calls_are_chunked_to_mlflow_limits(uri: str, tmp_path: Path, sent: Sent) -> None:
    log = MLflowLogger(uri, "chunks", run_name="big", outbox_dir=tmp_path)
    log.log_metrics({f"actor/m{i}": float(i) for i in range(2500)}, step=0)  # 1000 + 1000 + 500
    log.log_params({f"p{i}": i for i in range(250)})  # 100 + 100 + 50
    assert sent.calls == 6 and len(sent.points) == 2500
    run = MlflowClient(uri).get_run(log.run_id)
    assert len(run.data.params) == 250 and len(run.data.metrics) == 2500


def test_outage_keeps_entries_warns_once_and_delivers_them_in_one_batch(
    uri: str, tmp_path: Path, sent: Sent, caplog: pytest.LogCaptureFixture
) -> None:
    log = MLflowLogger(uri, "outage", run_name="o", outbox_dir=tmp_path, retry_interval_s=0.0)
    log.log_metrics({"env/success": 0.0}, step=0)
    sent.down = True
    for step in range(1, 21):  # 20 steps x 30 metrics while the server is "down"
        log.log_metrics({f"actor/m{i}": step + i for i in range(29)} | {"env/success": step / 20}, step=step)
        log.flush()
    assert log.pending_count == 20
    assert len(warnings_of(caplog)) == 1
    assert "unreachable or failing" in warnings_of(caplog)[0] and str(log.outbox_path) in warnings_of(caplog)[0]
    sent.down = False
    calls_before = sent.calls
    log.flush()
    assert sent.calls == calls_before + 1  # 600 points fit one log_batch
    assert log.pending_count == 0
    log.close()
    # every point sent exactly once, and present
    assert set(sent.points.values()) == {1} and len(sent.points) == 1 + 20 * 30
    assert [s for s, _ in history(MlflowClient(uri), log.run_id, "env/success")] == list(range(21))
    assert len(warnings_of(caplog)) == 1


def test_back_off_skips_attempts_until_flush(uri: str, tmp_path: Path, sent: Sent) -> None:
    log = MLflowLogger(uri, "backoff", run_name="b", outbox_dir=tmp_path, retry_interval_s=3600.0)
    sent.down = True
    log.log_metrics({"env/success": 0.0}, step=0)  # fails: back off for an hour
    sent.down = False
    log.log_metrics({"env/success": 1.0}, step=1)  # within the back-off: recorded, not sent
    assert log.pending_count == 2 and sent.calls == 0
    log.flush()  # flush always tries
    assert log.pending_count == 0 and sent.calls == 1


def test_crash_with_pending_entries_is_delivered_on_restart(uri: str, tmp_path: Path, sent: Sent) -> None:
    first = MLflowLogger(uri, "crash", run_name="c", outbox_dir=tmp_path, retry_interval_s=0.0)
    first.log_metrics({"env/success": 0.0}, step=0)
    sent.down = True
    first.log_metrics({"env/success": 0.5}, step=1)
    first.log_metrics({"env/success": 0.7}, step=2)
    del first  # the process dies here: no flush, no close
    sent.down = False
    second = MLflowLogger(uri, "crash", outbox_dir=tmp_path)  # same run directory, no run id given
    second.log_metrics({"env/success": 0.9}, step=3)
    second.close()
    client = MlflowClient(uri)
    assert history(client, second.run_id, "env/success") == [(0, 0.0), (1, 0.5), (2, 0.7), (3, 0.9)]
    assert set(sent.points.values()) == {1}
    assert len(client.search_runs([client.get_experiment_by_name("crash").experiment_id])) == 1


def test_resume_continues_the_same_run(uri: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    first = MLflowLogger(uri, "resume", run_name="r", outbox_dir=tmp_path / "a")
    first.log_params({"trainer.iterations": 3, "seed": 1})
    for step in range(3):
        first.log_metrics({"env/success": step / 10}, step=step)
    first.close("KILLED")
    client = MlflowClient(uri)
    assert client.get_run(first.run_id).info.status == "KILLED"

    second = MLflowLogger(uri, "resume", run_id=first.run_id, outbox_dir=tmp_path / "b", tags={"resumed": "yes"})
    assert second.run_id == first.run_id
    assert client.get_run(first.run_id).info.status == "RUNNING"  # set back to RUNNING
    second.log_params({"seed": 1})  # already there with this value: nothing to send, no error
    second.log_params({"trainer.iterations": 5, "seed": 1, "new": "x"})  # same value: fine; changed: skipped
    for step in range(3, 5):
        second.log_metrics({"env/success": step / 10}, step=step)
    second.close()
    run = client.get_run(first.run_id)
    assert run.info.status == "FINISHED" and run.data.tags["resumed"] == "yes"
    assert run.data.params == {"trainer.iterations": "3", "seed": "1", "new": "x"}
    assert [s for s, _ in history(client, first.run_id, "env/success")] == [0, 1, 2, 3, 4]
    assert any("'trainer.iterations' is already '3'" in w for w in warnings_of(caplog))
    assert second.pending_count == 0


def test_resume_with_another_runs_outbox_is_refused(uri: str, tmp_path: Path) -> None:
    MLflowLogger(uri, "mismatch", run_name="m", outbox_dir=tmp_path).close()
    with pytest.raises(ValueError, match="belongs to MLflow run"):
        MLflowLogger(uri, "mismatch", run_id="0" * 32, outbox_dir=tmp_path)


def test_nested_run_has_parent_tag(uri: str, tmp_path: Path) -> None:
    parent = MLflowLogger(uri, "sweep", run_name="study", outbox_dir=tmp_path / "p")
    child = MLflowLogger(uri, "sweep", run_name="trial-0", parent_run_id=parent.run_id, outbox_dir=tmp_path / "c")
    child.log_metrics({"val/success": 0.5}, step=0)
    child.close()
    parent.close()
    tags = MlflowClient(uri).get_run(child.run_id).data.tags
    assert tags["mlflow.parentRunId"] == parent.run_id


def test_refused_entry_is_set_aside_and_the_rest_still_arrives(
    uri: str, tmp_path: Path, sent: Sent, caplog: pytest.LogCaptureFixture
) -> None:
    log = MLflowLogger(uri, "refused", run_name="x", outbox_dir=tmp_path, retry_interval_s=3600.0)
    sent.down = True  # queue everything, so the bad entry sits inside a multi-entry batch
    log.log_metrics({"env/success": 0.0}, step=0)
    log.set_tags({"bad\x00key": "v"})  # MLflow refuses this tag key (400): retrying cannot help
    log.log_metrics({"env/success": 1.0}, step=1)
    log.log_artifact(tmp_path / "missing.bin")  # gone by delivery time
    sent.down = False
    log.close()
    client = MlflowClient(uri)
    assert history(client, log.run_id, "env/success") == [(0, 0.0), (1, 1.0)]
    assert set(sent.points.values()) == {1}
    assert client.get_run(log.run_id).info.status == "FINISHED"
    rejected = (tmp_path / "tracking-rejected.jsonl").read_text().splitlines()
    assert len(rejected) == 2 and "bad" in rejected[0] and "missing.bin" in rejected[1]
    assert sum("refused an entry" in w for w in warnings_of(caplog)) == 2
    assert log.pending_count == 0


def test_dead_server_never_raises_then_the_run_is_created_later(
    uri: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    dead = f"http://127.0.0.1:{closed_port()}"
    log = MLflowLogger(dead, "late", run_name="offline", outbox_dir=tmp_path, tags={"algo": "grpo"},
                       retry_interval_s=0.0)
    assert log.run_id is None  # nothing fake: no run until a server has one
    log.log_params({"a": 1})
    for step in range(5):
        log.log_metrics({"env/success": step / 4}, step=step)
        log.flush()
    log.log_text("sample", "samples/s.txt")
    log.close()  # still down: keeps everything and says how to deliver it
    assert log.pending_count == 8  # params, 5 metrics, text, final status
    msgs = warnings_of(caplog)
    assert len(msgs) == 2 and "unreachable" in msgs[0] and "deliver_pending" in msgs[1]

    assert deliver_pending(tmp_path, uri) == 0  # a server is back (here: the sqlite store)
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("late").experiment_id])
    assert run.info.run_name == "offline" and run.data.tags["algo"] == "grpo"
    assert run.info.status == "FINISHED" and run.data.params == {"a": "1"}
    assert [s for s, _ in history(client, run.info.run_id, "env/success")] == [0, 1, 2, 3, 4]
    assert deliver_pending(tmp_path, uri) == 0  # nothing left, nothing sent twice
    assert len(history(client, run.info.run_id, "env/success")) == 5


@pytest.mark.timeout(60)
def test_hung_server_costs_one_timeout_not_a_stall(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "1")  # MLflow reads it per request
    with socket.socket() as hung:  # listens (the kernel completes connections) but never answers
        hung.bind(("127.0.0.1", 0))
        hung.listen(16)
        log = MLflowLogger(f"http://127.0.0.1:{hung.getsockname()[1]}", outbox_dir=tmp_path, retry_interval_s=3600.0)
        for step in range(20):  # within the back-off: recorded locally, no network wait
            log.log_metrics({"env/success": 0.5}, step=step)
    assert log.run_id is None and log.pending_count == 20
    assert len(warnings_of(caplog)) == 1 and "Timeout" in warnings_of(caplog)[0]


def test_short_http_defaults_unless_the_user_chose(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "42")
    MLflowLogger(f"http://127.0.0.1:{closed_port()}", outbox_dir=tmp_path)
    import os

    assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "42"
    assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "0"


def test_bad_metric_name_raises_before_anything_is_recorded(uri: str, tmp_path: Path) -> None:
    log = MLflowLogger(uri, "names", run_name="n", outbox_dir=tmp_path)
    with pytest.raises(ValueError, match="namespace"):
        log.log_metrics({"actr/loss": 1.0}, step=0)
    assert log.pending_count == 0
    with pytest.raises(ValueError):
        log.close("DONE")
    log.close()
    with pytest.raises(RuntimeError, match="closed"):
        log.log_metrics({"actor/loss": 1.0}, step=1)


def test_default_tracking_uri(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("RAGEN_DATA_DIR", str(tmp_path / "d"))
    assert default_tracking_uri() == f"sqlite:///{tmp_path}/d/mlflow.db"
    assert (tmp_path / "d").is_dir()  # made for SQLite, which does not make a database file's folder
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RAGEN_DATA_DIR", "rel")
    assert default_tracking_uri() == f"sqlite:///{tmp_path}/rel/mlflow.db"  # always absolute
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    assert default_tracking_uri() == "http://127.0.0.1:5000"


def test_default_outbox_dir_is_under_the_run_directory(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                       uri: str) -> None:
    monkeypatch.setenv("RAGEN_DATA_DIR", str(tmp_path))
    log = MLflowLogger(uri, "dirs", run_name="bandit-001")
    assert log.outbox_path == tmp_path / "runs" / "bandit-001" / "tracking-outbox.jsonl"
    log.close()
    with pytest.raises(ValueError, match="outbox_dir"):
        MLflowLogger(uri, "dirs")


def test_a_resumed_run_logs_each_metric_point_once(uri: str, tmp_path: Path) -> None:
    """After a kill, the iterations since the last checkpoint are redone; their metrics must not land
    twice. once_per_step keeps the first point of each (key, step) the outbox has seen."""
    first = MLflowLogger(uri, "resume-once", run_name="r", outbox_dir=tmp_path, once_per_step=True)
    first.log_metrics({"env/success": 0.25}, step=0)
    first.log_metrics({"env/success": 0.5, "timing/rollout_s": 3.0}, step=1)
    first.flush()  # ... then SIGKILL: no close
    again = MLflowLogger(uri, "resume-once", run_name="r", outbox_dir=tmp_path, once_per_step=True)
    again.log_metrics({"env/success": 0.5, "timing/rollout_s": 3.5}, step=1)  # iteration 1 redone
    again.log_metrics({"env/success": 0.75}, step=2)
    again.close()
    client = MlflowClient(uri)
    points = [(m.step, m.value) for m in client.get_metric_history(again.run_id, "env/success")]
    assert sorted(points) == [(0, 0.25), (1, 0.5), (2, 0.75)]
    assert [(m.step, m.value) for m in client.get_metric_history(again.run_id, "timing/rollout_s")] == [(1, 3.0)]
    # without it (the default: sweeps re-log summaries at a step on purpose) both points are kept
    plain = MLflowLogger(uri, "resume-once", run_name="p", outbox_dir=tmp_path / "p")
    plain.log_metrics({"val/x": 1.0}, step=0)
    plain.log_metrics({"val/x": 2.0}, step=0)
    plain.close()
    assert len(client.get_metric_history(plain.run_id, "val/x")) == 2


@pytest.mark.timeout(120)
def test_a_run_closed_while_another_process_writes_the_sqlite_store_still_ends(tmp_path: Path) -> None:
    """A study's workers share one sqlite file: a close that meets another writer's transaction (held here for
    21 s, past the 20 s busy timeout MLflow gives sqlite, so the first attempt fails with "database is locked")
    tries again and the run ends FINISHED instead of staying RUNNING with its status in the outbox."""
    db = tmp_path / "mlflow.db"
    uri = f"sqlite:///{db}"
    log = MLflowLogger(uri, "busy", run_name="busy", outbox_dir=tmp_path / "run")
    log.log_metrics({"env/success": 0.5}, step=0)
    log.flush()
    assert log.pending_count == 0
    other = sqlite3.connect(db, isolation_level=None, check_same_thread=False)
    other.execute("BEGIN EXCLUSIVE")  # what a writer in another process holds while it commits
    release = threading.Timer(21.0, lambda: other.execute("COMMIT"))
    release.start()
    try:
        log.close("FINISHED")
    finally:
        release.join()
        other.close()
    assert log.pending_count == 0
    assert MlflowClient(uri).get_run(log.run_id).info.status == "FINISHED"
