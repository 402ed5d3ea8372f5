"""Several processes opening one new sqlite Optuna database at the same moment (two `ragen sweep`
commands, or sweep workers starting together): all must get the same study, none an error."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import optuna

WORKER = """
import sys, time
from ragen_core.sweeps.study import open_storage
import optuna
url, start = sys.argv[1], float(sys.argv[2])
while time.time() < start:
    time.sleep(0.001)
optuna.create_study(study_name="same", storage=open_storage(url), directions=["maximize"], load_if_exists=True)
"""


def test_simultaneous_first_opens_of_one_sqlite_database_all_succeed(tmp_path: Path) -> None:
    # Without the lock file, 1-3 of 4 such starts failed ("table studies already exists", or a UNIQUE
    # constraint on alembic_version) in every one of 5 rounds.
    url = f"sqlite:///{tmp_path}/optuna.db"
    start = time.time() + 6  # every process is imported and waiting by then
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, url, str(start)], stderr=subprocess.PIPE, text=True)
             for _ in range(4)]
    errors = [p.communicate(timeout=180)[1] for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, "\n".join(e[-1500:] for e in errors)
    assert [s.study_name for s in optuna.get_all_study_summaries(url)] == ["same"]
