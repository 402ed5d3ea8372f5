"""ragen_core/torch_builds.py: a torch extension build folder held under a lock that dies with its holder, and
torch's own owner-less lock file removed once no live holder can own it."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
from filelock import Timeout

from ragen_core.torch_builds import TORCH_LOCK, exclusive_build

ROOT = Path(__file__).resolve().parents[2]

HOLD = """
import sys, time
from pathlib import Path
from ragen_core.torch_builds import exclusive_build
folder = Path(sys.argv[1])
with exclusive_build(folder, 5.0):
    (folder / "lock").touch()  # torch's lock, as a build in progress makes it
    print("held", flush=True)
    time.sleep(600)
"""


def test_a_lock_file_left_by_a_dead_process_is_removed(tmp_path: Path) -> None:
    folder = tmp_path / "build"
    folder.mkdir()
    (folder / TORCH_LOCK).touch()  # what a process killed during its build leaves: no owner
    with exclusive_build(folder, 1.0):
        assert not (folder / TORCH_LOCK).exists()


def test_a_live_build_is_waited_for_and_a_killed_one_releases_the_folder(tmp_path: Path) -> None:
    folder = tmp_path / "build"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(Timeout), exclusive_build(folder, 0.5):
            pass
        assert (folder / TORCH_LOCK).exists()  # a live build's lock is left alone
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
        assert (folder / TORCH_LOCK).exists()  # the killed build's lock stays behind...
        with exclusive_build(folder, 5.0):  # ...and the folder is free at once, without it
            assert not (folder / TORCH_LOCK).exists()
    finally:
        holder.kill()
        holder.wait(timeout=30)
