"""A study's share of the cores per worker (ragen_core/cpu_share.py): the study writes the thread count, a worker
takes it up between iterations; anything unreadable changes nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ragen_core import cpu_share

REPO = Path(__file__).resolve().parents[2]


def test_publish_writes_the_count_and_refuses_a_non_count(tmp_path) -> None:
    share = tmp_path / "threads"
    cpu_share.publish(share, 3)
    assert share.read_text() == "3\n"
    cpu_share.publish(share, 1)
    assert share.read_text() == "1\n"
    with pytest.raises(ValueError, match="threads: 0 is not a thread count"):
        cpu_share.publish(share, 0)
    assert share.read_text() == "1\n"  # the count in force is kept
    assert sorted(p.name for p in tmp_path.iterdir()) == ["threads"]  # no temporary file left behind


class Threads:
    """torch's thread count as this test sets it: an earlier test in the same process may have started vLLM's CPU
    engine in-process, which turns torch.set_num_threads into a no-op for the process (the real count is
    test_a_worker_started_on_one_thread_takes_up_the_published_count's, in a fresh process)."""

    def __init__(self, monkeypatch, count: int, settable: bool = True) -> None:
        self.count, self.asked = count, []
        monkeypatch.setattr(torch, "get_num_threads", lambda: self.count)
        monkeypatch.setattr(torch, "set_num_threads", self.set if settable else self.asked.append)

    def set(self, n: int) -> None:
        self.asked.append(n)
        self.count = n


def test_follow_sets_the_published_count_once(tmp_path, monkeypatch) -> None:
    share = tmp_path / "threads"
    monkeypatch.delenv(cpu_share.SHARE_ENV, raising=False)
    monkeypatch.setattr(cpu_share, "_refused", set())
    threads = Threads(monkeypatch, 1)
    assert cpu_share.follow() is None  # not a study's worker
    monkeypatch.setenv(cpu_share.SHARE_ENV, str(share))
    assert cpu_share.follow() is None  # no file (yet, or the study's round ended)
    for bad in ("", "two\n", "0\n", "-2\n"):
        share.write_text(bad)
        assert cpu_share.follow() is None
    cpu_share.publish(share, 1)
    assert cpu_share.follow() is None  # already in force
    assert threads.asked == []
    cpu_share.publish(share, 2)
    assert cpu_share.follow() == 2 and threads.count == 2
    assert cpu_share.follow() is None and threads.asked == [2]


def test_a_count_the_process_cannot_take_is_not_claimed_nor_asked_again(tmp_path, monkeypatch) -> None:
    """vLLM's in-process CPU engine makes torch.set_num_threads a no-op: the count stays, follow says nothing changed
    and does not ask again (each refusal logs a vLLM warning)."""
    share = tmp_path / "threads"
    monkeypatch.setenv(cpu_share.SHARE_ENV, str(share))
    monkeypatch.setattr(cpu_share, "_refused", set())
    threads = Threads(monkeypatch, 1, settable=False)
    cpu_share.publish(share, 2)
    assert cpu_share.follow() is None and cpu_share.follow() is None
    assert threads.count == 1 and threads.asked == [2]


def test_a_worker_started_on_one_thread_takes_up_the_published_count(tmp_path) -> None:
    """As a study's worker starts: OMP_NUM_THREADS=1, then the file says 2."""
    share = tmp_path / "threads"
    cpu_share.publish(share, 2)
    code = ("import torch; from ragen_core import cpu_share; a = torch.get_num_threads(); b = cpu_share.follow(); "
            "torch.randn(256, 256) @ torch.randn(256, 256); print(a, b, torch.get_num_threads())")
    env = {**os.environ, "OMP_NUM_THREADS": "1", cpu_share.SHARE_ENV: str(share), "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["1", "2", "2"]


def test_cores_are_the_ones_this_process_may_run_on() -> None:
    """Under a CPU affinity of one core (taskset, a container's cpuset) the study counts one, where os.cpu_count
    counts the machine's: two workers of one thread each would then share that one core."""
    code = ("import os; from ragen_core import cpu_share; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
            "print(cpu_share.cores(), os.cpu_count())")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                         check=True).stdout.split()
    assert out[0] == "1" and int(out[1]) == os.cpu_count()
    assert cpu_share.cores() == len(os.sched_getaffinity(0))
