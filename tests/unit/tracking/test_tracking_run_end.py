"""A run ends FINISHED, FAILED or KILLED as it really ended: the status of each way out of a
``run_scope``, SIGTERM turned into an exception, and the status reaching MLflow (a temporary sqlite store).
The flow level (a flow that raises, ``ragen train`` sent SIGTERM) is in tests/flows/test_train_flow.py."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from ragen_core.tracking import MLflowLogger, NullLogger
from ragen_core.tracking.history import fail_running_runs
from ragen_core.tracking.run_end import Terminated, adopt, closes_runs, exit_status, run_scope, sigterm_raises


class PrefectLike(BaseException):
    """Stands in for prefect.exceptions.TerminationSignal (a BaseException with ``.signal``)."""

    def __init__(self, signum: int) -> None:
        self.signal = signum


@pytest.mark.parametrize(("exc", "status"), [
    (None, "FINISHED"), (SystemExit(0), "FINISHED"), (RuntimeError("boom"), "FAILED"), (SystemExit(3), "FAILED"),
    (KeyboardInterrupt(), "KILLED"), (Terminated(signal.SIGTERM), "KILLED"), (PrefectLike(signal.SIGTERM), "KILLED"),
    (asyncio.CancelledError(), "KILLED"),
])
def test_exit_status(exc: BaseException | None, status: str) -> None:
    assert exit_status(exc) == status


@pytest.mark.parametrize(("exc", "status"), [(RuntimeError("boom"), "FAILED"), (KeyboardInterrupt(), "KILLED")])
def test_scope_closes_its_loggers_with_the_status_of_the_exception(exc: BaseException, status: str) -> None:
    log, outside = NullLogger(), NullLogger()
    adopt(outside)  # no scope open: nothing happens
    with pytest.raises(type(exc)), run_scope():
        adopt(log)
        raise exc
    assert log.status == status and outside.status is None
    assert log.tags["error"] == f"{type(exc).__name__}: {exc}"


def test_scope_that_returns_closes_finished_and_a_closed_run_stays_as_it_is(uri: str, tmp_path: Path) -> None:
    log = NullLogger()

    @closes_runs
    def flow_body(x: int) -> int:
        adopt(log)
        return x + 1

    assert flow_body(1) == 2 and log.status == "FINISHED"
    assert flow_body.__wrapped__.__name__ == "flow_body"  # type: ignore[attr-defined]  # Prefect reads the signature
    # finish() closed the run FINISHED; an exception after that does not turn it FAILED
    mlog = MLflowLogger(uri, "end", run_name="done", outbox_dir=tmp_path)
    with pytest.raises(RuntimeError), run_scope():
        adopt(mlog)
        mlog.close("FINISHED")
        raise RuntimeError("after the end")
    assert MlflowClient(uri).get_run(mlog.run_id).info.status == "FINISHED"


def test_sigterm_raises_terminated_and_the_run_ends_killed(uri: str, tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGTERM)
    log = MLflowLogger(uri, "end", run_name="killed", outbox_dir=tmp_path)
    with pytest.raises(Terminated), run_scope():
        adopt(log)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises at once (a signal interrupts the sleep)
    assert signal.getsignal(signal.SIGTERM) is before  # restored
    run = MlflowClient(uri).get_run(log.run_id)
    assert run.info.status == "KILLED" and run.data.tags["error"] == "Terminated: terminated by signal SIGTERM"


def test_an_installed_sigterm_handler_is_left_alone() -> None:
    def mine(signum: int, frame: object) -> None:
        raise PrefectLike(signum)

    before = signal.signal(signal.SIGTERM, mine)
    try:
        with sigterm_raises():
            assert signal.getsignal(signal.SIGTERM) is mine
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, before)




def test_lost_runs_are_marked_failed_and_ended_runs_stay_as_they_are(uri: str) -> None:
    client = MlflowClient(uri)
    exp = client.create_experiment("lost-runs")
    running = client.create_run(exp, run_name="lost").info.run_id
    done = client.create_run(exp, run_name="done").info.run_id
    client.set_terminated(done, "FINISHED")
    said: list[str] = []
    fail_running_runs(uri, [running, done, "no-such-run"], say=said.append)
    assert client.get_run(running).info.status == "FAILED"
    assert client.get_run(done).info.status == "FINISHED"
    assert len(said) == 1 and "no-such-run" in said[0]  # a tracking error is said, not raised
