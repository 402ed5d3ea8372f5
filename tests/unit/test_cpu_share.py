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


@pytest.fixture
def threads_kept():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


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


def test_follow_sets_the_published_count_once(tmp_path, monkeypatch, threads_kept) -> None:
    share = tmp_path / "threads"
    monkeypatch.delenv(cpu_share.SHARE_ENV, raising=False)
    torch.set_num_threads(1)
    assert cpu_share.follow() is None  # not a study's worker
    monkeypatch.setenv(cpu_share.SHARE_ENV, str(share))
    assert cpu_share.follow() is None  # no file (yet, or the study's round ended)
    for bad in ("", "two\n", "0\n", "-2\n"):
        share.write_text(bad)
        assert cpu_share.follow() is None
        assert torch.get_num_threads() == 1
    cpu_share.publish(share, 2)
    assert cpu_share.follow() == 2 and torch.get_num_threads() == 2
    assert cpu_share.follow() is None  # already in force


def test_a_worker_started_on_one_thread_takes_up_the_published_count(tmp_path) -> None:
    """As a study's worker starts: OMP_NUM_THREADS=1, then the file says 2."""
    share = tmp_path / "threads"
    cpu_share.publish(share, 2)
    code = ("import torch; from ragen_core import cpu_share; a = torch.get_num_threads(); b = cpu_share.follow(); "
            "torch.randn(256, 256) @ torch.randn(256, 256); print(a, b, torch.get_num_threads())")
    env = {**os.environ, "OMP_NUM_THREADS": "1", cpu_share.SHARE_ENV: str(share), "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["1", "2", "2"]
