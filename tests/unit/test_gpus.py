"""GPUs as a scheduled resource (ragen_core/gpus.py): which devices a machine offers, and runs in separate
processes holding distinct ones, waiting while none is free, and freeing theirs when killed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ragen_core import distributed, gpus
from ragen_core.config import ConfigError

REPO = Path(__file__).resolve().parents[2]

HOLDER = """
import json, sys, time
from ragen_core import gpus
ids = gpus.hold(int(sys.argv[1]), poll_s=0.05, say=lambda line: None)
import os
print(json.dumps({"ids": ids, "visible": os.environ["CUDA_VISIBLE_DEVICES"], "t": time.time()}), flush=True)
time.sleep(float(sys.argv[2]))
print(json.dumps({"end": time.time()}), flush=True)
"""


@pytest.fixture
def slots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Two declared slots and a private lock folder, here and in child processes."""
    env = {"RAGEN_GPUS": "0,1", "RAGEN_GPU_LOCK_DIR": str(tmp_path / "locks")}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    yield {**os.environ, **env, "PYTHONPATH": str(REPO)}
    gpus.release()


def holder(env: dict[str, str], n: int = 1, seconds: float = 1.0) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", HOLDER, str(n), str(seconds)], env=env, stdout=subprocess.PIPE,
                            text=True)


def test_declared_devices_win_over_what_cuda_reports(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,4,5")
    monkeypatch.setenv("RAGEN_GPUS", " 0, 1 ")
    assert gpus.offered() == ["0", "1"]
    monkeypatch.delenv("RAGEN_GPUS")
    assert gpus.offered() == ["3", "4", "5"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setattr(gpus.shutil, "which", lambda name: None)  # no NVIDIA driver: no GPU
    assert gpus.offered() == []
    monkeypatch.setenv("RAGEN_GPUS", "0,0")
    with pytest.raises(ConfigError, match="names a device twice"):
        gpus.offered()


def test_a_machine_without_gpus_holds_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAGEN_GPUS", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(gpus.shutil, "which", lambda name: None)
    assert gpus.hold(1) == () and "CUDA_VISIBLE_DEVICES" not in os.environ


def test_a_run_holds_distinct_devices_and_sees_only_them(slots: dict[str, str]) -> None:
    assert gpus.hold(2) == ("0", "1") and os.environ["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert gpus.hold(1) == ("0", "1")  # this process keeps what it holds
    with pytest.raises(ConfigError, match="needs a process of its own"):
        gpus.hold(3)
    proc = holder(slots, 1, 0)  # another process finds none free, and waits
    time.sleep(1.0)
    assert proc.poll() is None
    gpus.release()
    out, _ = proc.communicate(timeout=60)
    assert json.loads(out.splitlines()[0])["ids"] == ["0"]


def test_asking_for_more_than_the_machine_offers_is_refused(slots: dict[str, str]) -> None:
    with pytest.raises(ConfigError, match="3 GPUs asked for, this machine offers 2"):
        gpus.hold(3)


def test_a_bounded_wait_ends_with_a_clear_error(slots: dict[str, str]) -> None:
    proc = holder(slots, 2, 30)
    try:
        assert "ids" in proc.stdout.readline()
        with pytest.raises(TimeoutError, match=r"not free within 0\.3 s"):
            gpus.hold(1, wait_s=0.3, poll_s=0.05, say=lambda line: None)
    finally:
        proc.kill()
        proc.wait()


def test_three_runs_on_two_slots_never_share_one_and_a_killed_run_frees_its_own(slots: dict[str, str]) -> None:
    procs = [holder(slots, 1, 1.5) for _ in range(3)]
    spans = []
    for p in procs:
        out, _ = p.communicate(timeout=120)
        start, end = (json.loads(line) for line in out.splitlines())
        assert start["visible"] == ",".join(start["ids"])
        spans.append((start["t"], end["end"], start["ids"][0]))
    for i, (s1, e1, d1) in enumerate(spans):  # two runs that overlapped in time held different devices
        for s2, e2, d2 in spans[i + 1:]:
            if s1 < e2 and s2 < e1:
                assert d1 != d2
    at_once = max(sum(s <= t < e for s, e, _ in spans) for t, _, _ in spans)
    assert at_once == 2  # the third waited for a free slot
    killed = holder(slots, 2, 60)
    assert "ids" in killed.stdout.readline()
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert gpus.hold(2, wait_s=10, poll_s=0.05) == ("0", "1")  # the operating system dropped the dead run's locks


@pytest.mark.parametrize("local_rank", [0, 1, 3])
def test_each_rank_engine_gets_its_own_device(monkeypatch: pytest.MonkeyPatch, local_rank: int) -> None:
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    assert distributed.engine_devices(torch.device("cuda")) == [local_rank]
    assert distributed.engine_devices(torch.device("cpu")) == []


def test_gpus_are_locked_by_uuid_so_two_jobs_calling_theirs_0_do_not_collide(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A scheduler gives two jobs one GPU each and shows it to each as GPU 0 (CUDA_VISIBLE_DEVICES=0, and a
    # cgroup: nvidia-smi lists it as index 0 with its own UUID). Their runs must not wait on each other.
    monkeypatch.delenv("RAGEN_GPUS", raising=False)
    monkeypatch.setenv("RAGEN_GPU_LOCK_DIR", str(tmp_path / "locks"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\necho "0, $FAKE_UUID"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    env = {**os.environ, "PYTHONPATH": str(REPO), "FAKE_UUID": "GPU-aaaa"}
    first = holder(env, 1, 30)
    try:
        assert json.loads(first.stdout.readline())["ids"] == ["0"]
        monkeypatch.setenv("FAKE_UUID", "GPU-bbbb")  # the other job's GPU 0
        assert gpus.hold(1, wait_s=1, poll_s=0.05) == ("0",)
        gpus.release()
        monkeypatch.setenv("FAKE_UUID", "GPU-aaaa")  # the same GPU: held
        with pytest.raises(TimeoutError):
            gpus.hold(1, wait_s=0.3, poll_s=0.05, say=lambda line: None)
    finally:
        first.kill()
        first.wait()
        gpus.release()
    assert sorted(p.name for p in (tmp_path / "locks").iterdir()) == ["gpu-GPU-aaaa.lock", "gpu-GPU-bbbb.lock"]
