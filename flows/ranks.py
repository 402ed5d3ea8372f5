"""The processes of a multi-process training run: who starts them, how they meet, how they end.

    ragen train experiments/smoke.yaml --set trainer.backend=deepspeed --nproc 2
    torchrun --nproc_per_node 2 -m flows.cli train experiments/smoke.yaml --set trainer.backend=deepspeed

Two ways in, one contract (torchrun's environment: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``):

- ``--nproc N`` (or the flow's ``nproc``): the flow's process becomes rank 0, opens the rendezvous on a free
  port of 127.0.0.1 and starts ranks 1..N-1 as ``python -m flows.cli train-rank`` with that environment;
- torchrun (one node or many: ``--nnodes``, ``--node-rank``, ``--rdzv-endpoint``) sets the environment of every
  rank itself; rank 0 runs the flow, the others the same ``train-rank`` body.

GPUs: with ``--nproc N`` the flow first holds N GPUs of the machine (ragen_core/gpus.py), which sets
``CUDA_VISIBLE_DEVICES`` to them; the ranks inherit it, rank r trains on ``cuda:r`` (``LOCAL_RANK``) and builds its
vLLM engine on that same device (distributed.engine_devices). Under torchrun the launcher's placement stands.

Rank 0 runs the Prefect flow and is the only one that logs to MLflow and writes the run's files; every other
rank runs :func:`ragen_core.session.follow_main` (the same steps in the same order, NullLogger) and gets the
run's config and folder from rank 0. At the end every rank waits for the others and destroys the group
(:func:`ragen_core.distributed.leave`); rank 0 then waits for the ranks it started and fails, naming the rank,
when one did not exit cleanly. No Prefect here: ``train-rank`` processes never import it.

Tests: tests/flows/test_train_ranks.py.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import NoReturn

import torch

from ragen_core import distributed
from ragen_core.config import ConfigError

SOURCE_ROOT = Path(__file__).resolve().parents[1]
"""The checkout this module was imported from: started ranks import the same code (PYTHONPATH)."""


def planned_world(nproc: int) -> int:
    """The run's world size: the launcher's ``WORLD_SIZE`` under torchrun, else ``nproc``.

    ConfigError when both name one and they differ (``nproc`` is for starting ranks, not for torchrun).
    """
    if nproc < 1:
        raise ConfigError(f"nproc must be >= 1, got {nproc}")
    if not distributed.launched():
        return nproc
    world = int(os.environ["WORLD_SIZE"])
    if nproc not in (1, world):
        raise ConfigError(f"--nproc {nproc}, but the launcher (torchrun) started {world} processes; drop --nproc")
    return world


def is_main_of(env: Mapping[str, str]) -> bool:
    """Whether a process with this environment is rank 0 (or alone): not a rank torchrun started as another."""
    return int(env.get("RANK", "0")) == 0


def rank_command(device: torch.device) -> list[str]:
    """The command line of a started rank: the hidden ``train-rank`` command of flows/cli.py."""
    return [sys.executable, "-m", "flows.cli", "train-rank", "--device", device.type]


def _start(world: int, device: torch.device, port: int) -> list[subprocess.Popen[bytes]]:
    path = os.pathsep.join(p for p in (str(SOURCE_ROOT), os.environ.get("PYTHONPATH")) if p)
    return [subprocess.Popen(rank_command(device), env={**os.environ, **distributed.rank_env(r, world, port),
                                                         "PYTHONPATH": path})
            for r in range(1, world)]


def _stop(procs: list[subprocess.Popen[bytes]]) -> str:
    """End the ranks this process started (after a failure here) and say how each ended."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    lines = []
    for r, p in enumerate(procs, start=1):
        try:
            code = p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            code = p.wait()
        lines.append(f"rank {r} (pid {p.pid}) exited with {code}")
    return "; ".join(lines)


def _meet(procs: list[subprocess.Popen[bytes]], join: Callable[[], None]) -> None:
    """Rank 0 joins the group while it watches the ranks it started: one that dies before the group is complete
    (a bad environment, an import error) would otherwise leave rank 0 waiting out the rendezvous timeout
    (30 minutes). The join runs in a thread; this one polls the processes."""
    done, failed = threading.Event(), list[BaseException]()

    def run() -> None:
        try:
            join()
        except BaseException as e:  # noqa: BLE001 -- not swallowed: raised again in the calling thread below
            failed.append(e)
        finally:
            done.set()

    threading.Thread(target=run, name="ragen-rendezvous", daemon=True).start()
    while not done.wait(0.5):
        dead = [f"rank {r} exited with {p.returncode}" for r, p in enumerate(procs, start=1) if p.poll() is not None]
        if dead:
            raise RuntimeError(f"{', '.join(dead)} before all ranks met; its output above says why")
    if failed:
        raise failed[0]


@contextlib.contextmanager
def world(nproc: int, device: torch.device) -> Iterator[int]:
    """This process as rank 0 of the run's world for the block; yields the world size.

    Under torchrun: join the launcher's group. With ``nproc`` > 1: host a group and start ranks 1..nproc-1
    (:func:`rank_command`). Otherwise (one process) nothing happens. On a clean exit every rank meets at a
    barrier and the group is destroyed; rank 0 then waits for the ranks it started and raises RuntimeError
    naming any that failed. On an error here the started ranks are stopped.
    """
    size = planned_world(nproc)
    if size == 1:
        yield 1
        return
    if distributed.launched():
        distributed.join(device)
        yield size
        distributed.leave()
        return
    store = distributed.open_store(size)
    procs = _start(size, device, store.port)
    try:
        _meet(procs, lambda: distributed.join_as_main(store, size, device))
        yield size
        distributed.leave()
    except BaseException as e:
        if torch.distributed.is_initialized():  # maybe broken (a rank died): leave without a barrier
            with contextlib.suppress(Exception):
                torch.distributed.destroy_process_group()
        e.add_note(f"ranks started by this one: {_stop(procs)}")
        raise
    codes = [p.wait() for p in procs]
    failed = [f"rank {r} exited with {c}" for r, c in enumerate(codes, start=1) if c != 0]
    if failed:
        raise RuntimeError(f"the run finished on rank 0 but {', '.join(failed)}")


def follow(device: torch.device) -> NoReturn:
    """A non-zero rank's whole life: join the group the environment names, run rank 0's run, leave, exit 0.

    The exit is ``os._exit`` once the group is left: this rank writes no files (rank 0 does), and the
    interpreter's own teardown can abort a finished rank. Seen once in CI under load: rank 1 of a two-process
    ZeRO-2 run finished, left the group, then died at exit with "terminate called without an active
    exception" (SIGABRT, a C++ thread destroyed while joinable), which failed a run that had succeeded.
    An error in the run still propagates (a traceback and a non-zero status).
    """
    from ragen_core.session import follow_main  # torch, transformers: only once the rank really trains

    distributed.join(device)
    follow_main()
    distributed.leave()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
