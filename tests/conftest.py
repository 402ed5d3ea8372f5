"""What every test shares: the rule for a component a test needs but the machine lacks.

Outside CI such a test skips with the reason; under CI (``CI`` is ``true`` or ``1``, as ``.ci/run`` sets it) it
fails with the reason, so a missing install step (chromium, PostgreSQL, a C++ compiler, vLLM) can never turn
into a quiet skip. GPU-only tests are not covered by this rule: CI has no GPU, and they skip there too.

    from tests.conftest import require, require_module
    require(shutil.which("chromium") is not None, "needs Debian's chromium (apt-get install chromium)")
    deepspeed = require_module("deepspeed", "the DeepSpeed engine needs deepspeed (in locks/cpu.txt)")
"""

from __future__ import annotations

import contextlib
import importlib
import os
import random
import sys
from collections.abc import Iterator, Sequence
from types import ModuleType

import pytest


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (``make test`` runs two workers) each worker takes its share of the cores for torch, and
    the processes its tests start inherit it through ``OMP_NUM_THREADS`` unless that is set. Two workers of two
    threads each on two cores would leave parallel ops waiting at their barriers for a thread that is not running
    (in a default-model decode profiled beside another busy process, its RMS norms took a fifth of the time)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 0)
    if workers > 1:
        import torch

        threads = max(1, len(os.sched_getaffinity(0)) // workers)
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


TEST_SEED = 0
"""The seed of the global random streams (Python's, NumPy's, torch's) at the start of every test's setup and body."""


def reseed_global_rngs(seed: int = TEST_SEED) -> None:
    """Seed Python's, NumPy's and torch's global random streams, the last two where a test has imported them (torch
    seeds its own deterministically at import; NumPy's legacy stream is seeded from the OS otherwise)."""
    random.seed(seed)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(seed)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.manual_seed(seed)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Every test draws the same numbers from the global streams whatever ran before it in its process: which tests
    an xdist worker runs before it depends on the collection and on timing, and a tiny model a test builds from the
    global stream would otherwise be another model whenever tests are added or moved elsewhere. Seeded before the
    fixtures (a module-scoped one is made by whichever test needs it first) and again before the test's body
    (:func:`pytest_runtest_call`)."""
    reseed_global_rngs()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item: pytest.Item) -> None:
    reseed_global_rngs()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest modules first, so that the xdist workers start them at once instead of finishing on them: a
    module whose tests declare a timeout above the suite's (``pytest.mark.timeout``; ``timeout`` in pyproject.toml)
    before one with a shorter, then those with a slow test, then the rest; the order within a module, and
    otherwise the collection's, is kept."""
    default = float(config.getini("timeout") or 0)

    def timeout(item: pytest.Item) -> float:
        mark = item.get_closest_marker("timeout")
        declared = float(mark.args[0]) if mark is not None and mark.args else 0.0
        return declared if declared > default else 0.0

    modules: dict[str, tuple[float, int]] = {}
    for item in items:
        name = item.nodeid.split("::")[0]
        longest, slow = modules.get(name, (0.0, 1))
        modules[name] = (max(longest, timeout(item)), min(slow, 0 if item.get_closest_marker("slow") else 1))
    order = {name: (-longest, slow, i) for i, (name, (longest, slow)) in enumerate(modules.items())}
    items.sort(key=lambda item: order[item.nodeid.split("::")[0]])


def in_ci() -> bool:
    """Whether this run is CI's (``CI=true`` or ``CI=1``)."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1")


def require(available: bool, reason: str) -> None:
    """Go on when ``available``; else skip with ``reason``, or fail with it under CI."""
    __tracebackhide__ = True  # pytest reports the skip at the caller's line, not at this helper's
    if available:
        return
    if in_ci():
        pytest.fail(f"{reason} (CI=true: a missing component fails the test)", pytrace=False)
    pytest.skip(reason)


def require_module(name: str, reason: str) -> ModuleType:
    """``import name``, as :func:`require` treats a module that does not import."""
    __tracebackhide__ = True
    try:
        return importlib.import_module(name)
    except ImportError as err:
        require(False, f"{reason} ({err})")
        raise  # unreachable: require skipped or failed


_DEFAULT_SIGNALS = ("import os, signal, sys\n"
                    "for sig in (signal.SIGINT, signal.SIGHUP):\n"
                    "    signal.signal(sig, signal.SIG_DFL)\n"
                    "os.execvp(sys.argv[1], sys.argv[1:])")


def with_default_signals(cmd: Sequence[str]) -> list[str]:
    """``cmd`` for a child a test signals, started with SIGINT and SIGHUP at their default action: a small Python
    resets them, then execs ``cmd`` in its place (same process id). A child inherits ignored signals, and pytest
    started in the background (``cmd &`` ignores SIGINT, ``nohup`` SIGHUP) would hand that on: the child would not
    see the signal the test sends (a run went on to its end). Not a ``preexec_fn``: with one, Python forks the
    whole test process, and a worker holding large mappings then cannot (``ENOMEM`` under xdist, seen); without
    one it spawns by vfork."""
    return [sys.executable, "-c", _DEFAULT_SIGNALS, *cmd]


def drain_prefect_workers() -> None:
    """Stop this process's Prefect events and log workers after sending what they hold. Prefect keeps one events
    worker per process and binds it to the API URL current when it starts (for a self-hosted server the worker
    is not keyed by URL): a flow run in this process after the URL changed would send its events, and so its
    task runs, to the old server. The next event or log starts a worker on the URL current then."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    # each call stops and forgets the workers at once; the timeout bounds only the wait for their last items
    APILogWorker.drain_all(timeout=30)
    EventsWorker.drain_all(timeout=30)


@contextlib.contextmanager
def prefect_api(url: str) -> Iterator[None]:
    """Flows run in this process inside the block report to the Prefect server at ``url``, their events too
    (:func:`drain_prefect_workers` on the way in and out)."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    drain_prefect_workers()
    try:
        with temporary_settings({PREFECT_API_URL: url}):
            yield
    finally:
        drain_prefect_workers()
