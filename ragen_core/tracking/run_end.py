"""A tracked run ends FINISHED, FAILED or KILLED as it really ended, never left RUNNING.

    @closes_runs                      # the training flow (flows/train.py), under Prefect's @flow
    def train(...):
        logger = open_logger(cfg, ...)    # joins the innermost closes_runs scope (factory.open_logger)
        ...                               # returns: FINISHED; raises: FAILED; Ctrl-C or SIGTERM: KILLED

    with run_scope():                 # the same as a block, for code that is no flow
        ...

Why: a run that crashed or was cancelled showed RUNNING in MLflow forever, indistinguishable from one that is
still training (only sweep trials were repaired afterwards). The loggers opened inside a scope are closed on the
way out with the status of how the scope ended (:func:`exit_status`), after the error (type and message) is set
as the run's ``error`` tag. A logger already closed (``session.finish`` closes it FINISHED) is not changed.

SIGTERM is how Prefect cancels a flow run and how a batch system stops a job. Python's default would end the
process at once, with no ``finally`` or ``except`` running, so a scope turns it into an exception: Prefect's flow
engine already does (its handler raises ``TerminationSignal``, which carries ``.signal``, as ours does); where no
handler is installed (a plain script, in the main thread) the scope installs one that raises :class:`Terminated`.
Either one unwinds the run's code, the run is closed KILLED, and the exception goes on up (Prefect then ends the
process with the signal, so a job's exit status still says it was terminated).

No Prefect here (tests/unit/test_layering.py): Prefect's exception is recognised by its ``signal`` attribute.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any, ParamSpec, TypeVar

from ragen_core.tracking.logger import MetricLogger

__all__ = ["Terminated", "adopt", "closes_runs", "end_runs", "exit_status", "run_scope", "sigterm_raises"]

log = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")

KILL_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
"""Signals that mean "stop" from outside: a run ended by one is KILLED."""

_SCOPES: contextvars.ContextVar[tuple[list[MetricLogger], ...]] = contextvars.ContextVar("ragen_run_scopes",
                                                                                         default=())


class Terminated(BaseException):
    """Raised in the main thread by :func:`sigterm_raises`'s handler: the process was asked to stop.

    A BaseException, like KeyboardInterrupt, so that ``except Exception`` clauses on the way up do not swallow it.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(f"terminated by signal {signal.Signals(signum).name}")
        self.signal = signum


def exit_status(exc: BaseException | None) -> str:
    """FINISHED (no exception, or ``sys.exit(0)``), KILLED (Ctrl-C, a termination signal, a cancelled task) or
    FAILED (any other exception)."""
    if exc is None or (isinstance(exc, SystemExit) and exc.code in (0, None)):
        return "FINISHED"
    if isinstance(exc, KeyboardInterrupt) or getattr(exc, "signal", None) in KILL_SIGNALS:
        return "KILLED"
    if type(exc).__name__ == "CancelledError":  # asyncio's (and concurrent.futures'): a cancelled run
        return "KILLED"
    return "FAILED"


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """Within the block, SIGTERM raises :class:`Terminated` in the main thread, unless a handler is set already.

    An existing handler (Prefect's flow engine, or the program's own) is left in place: it decides what SIGTERM
    does. Outside the main thread nothing can be installed (Python delivers signals to the main thread only).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous not in (signal.SIG_DFL, None):
        yield
        return

    def raise_terminated(signum: int, frame: Any) -> None:
        raise Terminated(signum)

    signal.signal(signal.SIGTERM, raise_terminated)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGTERM) is raise_terminated:
            signal.signal(signal.SIGTERM, previous)


def adopt(logger: MetricLogger) -> MetricLogger:
    """Put ``logger`` in the innermost open :func:`run_scope`, which will close it; returns it. No scope: no-op."""
    scopes = _SCOPES.get()
    if scopes:
        scopes[-1].append(logger)
    return logger


def end_runs(loggers: list[MetricLogger], exc: BaseException | None) -> str:
    """Close ``loggers`` (newest first) with the status ``exc`` means; returns that status. Never raises.

    A failure also goes on the run as the tag ``error`` (type and message), where the runs table shows it.
    """
    status = exit_status(exc)
    for logger in reversed(loggers):
        try:
            if exc is not None and status != "FINISHED":
                logger.set_tags({"error": f"{type(exc).__name__}: {exc}"[:500]})
        except Exception:  # noqa: BLE001 -- already closed (finish ran): nothing more to record
            pass
        try:
            logger.close(status)
        except Exception as e:  # noqa: BLE001 -- the run's own exception matters more than a tracking one
            log.warning("could not close tracked run %s as %s: %s", logger.run_id, status, e)
    return status


@contextlib.contextmanager
def run_scope() -> Iterator[list[MetricLogger]]:
    """Every logger adopted in the block is closed when it ends, with the status of how it ended."""
    loggers: list[MetricLogger] = []
    token = _SCOPES.set((*_SCOPES.get(), loggers))
    try:
        with sigterm_raises():
            try:
                yield loggers
            except BaseException as exc:
                end_runs(loggers, exc)
                raise
            end_runs(loggers, None)
    finally:
        _SCOPES.reset(token)


def closes_runs(fn: Callable[P, R]) -> Callable[P, R]:
    """Decorator: ``fn`` runs inside a :func:`run_scope` (see the module docstring).

    Placed under Prefect's ``@flow`` so that the scope is inside the flow run, where Prefect's SIGTERM handler is
    already installed; ``functools.wraps`` keeps the signature and annotations Prefect reads for parameters.
    """

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        with run_scope():
            return fn(*args, **kwargs)

    return wrapper
