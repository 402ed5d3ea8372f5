"""Which process of a multi-process run this is, and the few collectives a run needs.

    from ragen_core import distributed
    part = distributed.share(n_groups)             # this rank's contiguous block of range(n_groups)
    trajs = distributed.gather_lists(mine)         # every rank's list, concatenated in rank order, on every rank
    name = distributed.broadcast(name)             # rank 0's value on every rank
    if distributed.is_main(): ...                  # rank 0 alone writes files and talks to MLflow

A run of N processes (``torchrun --nproc_per_node N -m flows.cli train ...`` or ``ragen train --nproc N``) is
data parallel: every rank holds the models and the DeepSpeed engine splits each mini-batch's rows
(trainer/update.py). The session splits the work before the update the same way (each rank plays its share of
the prompt groups and they gather the trajectories), so that every rank then filters and trains on the same
full batch and the run equals the one-process run. The session decides what to split; this module only
answers "who am I" and moves Python objects between ranks.

Without a process group, or with a group of one (DeepSpeed's one-process group), everything here is a no-op
that returns its input: one-process runs never pay for it, and the library needs no ``if distributed`` at
every call.

Starting a group: :func:`join` when the environment names one (torchrun's ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``, ``LOCAL_RANK``; also what ``ragen train --nproc N`` gives the ranks it
starts), or :func:`open_store` then :func:`join_as_main` in the process that becomes rank 0 and starts the
others itself. Objects travel
pickled (``torch.distributed.all_gather_object``): fine for a few MB of trajectories per iteration.

No Prefect, no MLflow: the edge (flows/) launches processes; the session calls this.
Tests: ``tests/unit/test_distributed.py`` (one process); the multi-process run: tests/flows/.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

__all__ = ["ENV_KEYS", "barrier", "broadcast", "gather_lists", "is_main", "join", "join_as_main", "launched",
           "leave", "main_first", "open_store", "rank", "rank_env", "share", "split_map", "sum_values", "world_size"]

T = TypeVar("T")
ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""The launcher environment of one rank (torchrun's names; DeepSpeed reads them too)."""


def world_size() -> int:
    """Processes in this run's group (1 without one)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    """This process's rank (0 without a group)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def is_main() -> bool:
    """Rank 0: the one that writes the run's files and logs to MLflow."""
    return rank() == 0


def share(n: int, of_rank: int | None = None, world: int | None = None) -> range:
    """Rank ``of_rank``'s contiguous block of ``range(n)`` (default: this rank of this group).

    Near-equal blocks in rank order, the first ``n % world`` one longer (``numpy.array_split``'s rule), so the
    blocks concatenated in rank order are ``range(n)`` again; a block may be empty when n < world.
    """
    r = rank() if of_rank is None else of_rank
    w = world_size() if world is None else world
    if not 0 <= r < w:
        raise ValueError(f"rank {r} is not in a world of {w}")
    base, extra = divmod(n, w)
    start = r * base + min(r, extra)
    return range(start, start + base + (r < extra))


def all_gather(obj: T) -> list[T]:
    """Every rank's ``obj``, in rank order, on every rank (a collective); ``[obj]`` without a group."""
    if world_size() == 1:
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def gather_lists(items: Sequence[T]) -> list[T]:
    """Every rank's ``items`` concatenated in rank order, on every rank (a collective)."""
    return [x for part in all_gather(list(items)) for x in part]


def split_map(n: int, fn: Callable[[range], Sequence[T]], split: bool = True) -> list[T]:
    """``fn`` on this rank's :func:`share` of ``range(n)``, every rank's results concatenated in rank order.

    ``fn`` must return the results of its block in order, so the outcome is ``fn(range(n))`` as one process
    computes it. ``split=False``: every rank runs ``fn(range(n))`` itself (no collective), for work whose
    inner collectives need every rank to do the same (ZeRO-3 forwards).
    """
    if not split or world_size() == 1:
        return list(fn(range(n)))
    return gather_lists(fn(share(n)))


def sum_values(values: dict[str, float]) -> dict[str, float]:
    """Per key, the sum over ranks of ``values`` (keys missing on a rank count 0); a collective."""
    if world_size() == 1:
        return dict(values)
    out: dict[str, float] = {}
    for part in all_gather(values):
        for k, v in part.items():
            out[k] = out.get(k, 0.0) + v
    return out


def broadcast(obj: T) -> T:
    """Rank 0's ``obj`` on every rank (a collective): what rank 0 alone decides (a run name, a stop)."""
    if world_size() == 1:
        return obj
    box: list[Any] = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier() -> None:
    """Wait until every rank is here (nothing without a group)."""
    if world_size() > 1:
        dist.barrier()


@contextlib.contextmanager
def main_first() -> Iterator[None]:
    """Rank 0 runs the block first, the others after it: one process builds a shared cache (a converted or
    format-warmed model), the rest find it built."""
    if not is_main():
        barrier()
    yield
    if is_main():
        barrier()


# --------------------------------------------------------------------------- starting and leaving a group


def launched() -> bool:
    """The environment names this process's rank and world (torchrun, or a rank ``ragen train --nproc`` started)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _use_local_device(device: torch.device) -> None:
    """One GPU per process: ``cuda`` means ``cuda:LOCAL_RANK`` from now on (NCCL's objects travel there too)."""
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))


def engine_devices(device: torch.device) -> list[int]:
    """The GPU a rank's own inference engine runs on, as vLLM's ``device_ids`` (an index into the visible
    devices): ``LOCAL_RANK``'s, the device this rank trains on, so the ranks' engines never meet on one GPU
    (vLLM's single-process executor would otherwise take the first visible device on every rank). Empty off CUDA."""
    return [int(os.environ.get("LOCAL_RANK", "0"))] if device.type == "cuda" else []


def _drop_lone_group() -> None:
    """A one-process group left by an earlier DeepSpeed run in this process must make way for a new world."""
    if dist.is_initialized():
        if dist.get_world_size() > 1:
            raise RuntimeError(f"this process is already rank {dist.get_rank()} of {dist.get_world_size()}")
        dist.destroy_process_group()


def join(device: torch.device) -> int:
    """Join the group the environment names (see :func:`launched`; init_method ``env://``) and return the world size.

    Nothing happens when this process already belongs to that world. Rank 0 serves the rendezvous store on
    ``MASTER_PORT`` (torchrun's agent serves it instead when it set ``TORCHELASTIC_USE_AGENT_STORE``).
    """
    want = int(os.environ["WORLD_SIZE"])
    if dist.is_initialized() and dist.get_world_size() == want:
        return want
    _drop_lone_group()
    _use_local_device(device)
    dist.init_process_group(_backend(device), init_method="env://")
    return world_size()


def open_store(world: int) -> dist.TCPStore:
    """The rendezvous store of a new group of ``world`` processes on this machine, served by this process (rank 0)
    on a port of 127.0.0.1 the OS picks (``.port``; no race for a free port). Start the other ranks with
    :func:`rank_env` (that port), then :func:`join_as_main`."""
    _drop_lone_group()
    return dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)


def join_as_main(store: dist.TCPStore, world: int, device: torch.device) -> None:
    """Join the group of :func:`open_store` as rank 0; returns once all ``world`` ranks are in."""
    os.environ.setdefault("LOCAL_RANK", "0")  # deepspeed.initialize insists on it (launchers set it)
    _use_local_device(device)
    # The other ranks come in through env:// (join), which puts its keys under the prefix "default_pg"; a store
    # passed in is used as it is, so rank 0 adds the same prefix or the ranks never see each other.
    dist.init_process_group(_backend(device), store=dist.PrefixStore("default_pg", store), rank=0, world_size=world)


def rank_env(of_rank: int, world: int, port: int, addr: str = "127.0.0.1") -> dict[str, str]:
    """The launcher environment (:data:`ENV_KEYS`) of rank ``of_rank`` of a one-machine group whose store
    :func:`open_store` serves on ``port``."""
    return {"RANK": str(of_rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(of_rank),
            "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": addr, "MASTER_PORT": str(port)}


def leave() -> None:
    """End this process's part in a multi-process group: wait for every rank, then destroy the group.

    The barrier first: a rank that tears down while another still talks to it aborts the other (gloo);
    after it, this process can start another run of any world size. A one-process group is left alone
    (DeepSpeed's; the next one-process run reuses it).
    """
    if world_size() > 1:
        dist.barrier()
        dist.destroy_process_group()
