"""Two worker processes on one sqlite study: every grid point runs exactly once, both workers
take part, and all trials nest under the one parent run."""

from __future__ import annotations

import os
from pathlib import Path

import optuna
from mlflow.tracking import MlflowClient
from test_sweep_flow import FAST, write_sweep

from flows.sweep import sweep
from ragen_core import cpu_share

ROOT = Path(__file__).resolve().parents[2]


def check_each_point_once(study: optuna.Study, points: list[dict]) -> None:
    """COMPLETE trials hold each grid point exactly once; nothing else finished or still runs."""
    done = [t.params for t in study.get_trials() if t.state.name == "COMPLETE"]
    assert sorted(map(repr, done)) == sorted(map(repr, points))
    assert len(done) == len(points)


def test_two_workers_share_one_sqlite_study(data_dir, tmp_path) -> None:
    path = write_sweep(tmp_path, "two-workers", "knobs: {responses_per_prompt: [1, 2, 4]}\npruner: none\n"
                       "heartbeat_seconds: 20\n", FAST)
    summary = sweep(sweep_file=str(path), workers=2)
    study = optuna.load_study(study_name="two-workers", storage=f"sqlite:///{data_dir}/optuna.db")
    # both workers may still start the last point at once (Optuna's ask is not atomic across processes): the
    # younger trial steps aside (FAIL, user attr "skipped", by design in flows/sweep.py objective) before training
    skipped = [t for t in study.trials if t.state.name != "COMPLETE"]
    assert all(t.state.name == "FAIL" and "skipped" in t.user_attrs for t in skipped), summary
    assert len(skipped) <= 1, summary
    check_each_point_once(study, [{"responses_per_prompt": n} for n in (1, 2, 4)])
    assert "3 trials (COMPLETE 3, PRUNED 0, FAIL 0)" in summary
    # each run's peak resident memory, for sizing how many run at a time (flows/sweep.py study_workers)
    assert all(t.user_attrs["peak_rss_bytes"] > 100 * 2**20 for t in study.trials if t.state.name == "COMPLETE")
    workers = {t.user_attrs["worker"] for t in study.trials}
    assert len(workers) == 2 and not any(w.endswith(f":{os.getpid()}") for w in workers)
    parent = study.user_attrs["mlflow_parent_run_id"]
    client = MlflowClient(f"sqlite:///{data_dir}/mlflow.db")
    children = client.search_runs([client.get_run(parent).info.experiment_id],
                                  f"tags.mlflow.parentRunId = '{parent}'")
    ran = sorted(str(t.number) for t in study.trials if t.state.name == "COMPLETE")  # a skipped one never trains
    assert sorted(r.data.tags["trial"] for r in children) == ran
    assert all(r.info.status == "FINISHED" for r in children)


def test_a_study_runs_two_at_a_time_on_a_cpu_machine_with_room(monkeypatch, tmp_path) -> None:
    """`ragen study` without --workers: two runs at a time, each on half the cores, where no GPU is offered, there
    are 2+ cores and memory for two runs; one otherwise. A run's memory: the larger of the study's run_memory_gib
    and the largest peak its runs measured (a resumed study), else 4 GiB. An OMP_NUM_THREADS set by the user is kept."""
    from types import SimpleNamespace

    import psutil

    from flows import sweep as sweep_module

    storage = f"sqlite:///{tmp_path}/optuna.db"

    def plan(dispatch: str = "local", gib: float | None = None, name: str = "fresh") -> SimpleNamespace:
        return SimpleNamespace(sweep=SimpleNamespace(dispatch=dispatch, run_memory_gib=gib, name=name,
                                                     storage=storage))

    def machine(cores: int, free_gib: float, offered: list[str]) -> None:
        monkeypatch.setattr(sweep_module.cpu_share, "cores", lambda: cores)
        monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=int(free_gib * 2**30)))
        monkeypatch.setattr(sweep_module.gpus, "offered", lambda: offered)

    said: list[str] = []
    machine(2, 20, [])
    assert sweep_module.study_workers(plan(), said.append) == 2 and sweep_module.worker_threads(plan(), 2) == 1
    assert said == ["[sweep] 2 run(s) at a time: 20.0 GiB available, a run needs 6.0 GiB (the default); "
                    "--workers N to choose"]
    assert sweep_module.study_workers(plan("deployment")) == 1  # a pool's workers set the pace
    assert sweep_module.study_workers(plan(gib=11), said.append) == 1  # two would need 22 GiB
    assert said[-1].endswith("a run needs 11.0 GiB (run_memory_gib); --workers N to choose")
    study = optuna.create_study(study_name="measured", storage=storage)
    for peak in (3 * 2**30, 11 * 2**30, None):  # a trial that reported no evaluation has no peak
        trial = study.ask()
        if peak is not None:
            trial.set_user_attr("peak_rss_bytes", peak)
    assert sweep_module.study_workers(plan(name="measured"), said.append) == 1
    assert said[-1].endswith("a run needs 11.0 GiB (the largest peak its runs measured); --workers N to choose")
    # a measured peak above the setting wins (the setting was too low); a setting above the peaks stands
    assert sweep_module.study_workers(plan(name="measured", gib=4), said.append) == 1
    assert said[-1].endswith("a run needs 11.0 GiB (the largest peak its runs measured, above its run_memory_gib "
                             "4); --workers N to choose")
    machine(2, 23, [])  # room for two runs of 11 GiB, not of 12
    assert sweep_module.study_workers(plan(name="measured", gib=12), said.append) == 1
    assert said[-1].endswith("a run needs 12.0 GiB (run_memory_gib); --workers N to choose")
    machine(2, 23, [])
    assert sweep_module.study_workers(plan(name="measured"), said.append) == 2
    machine(8, 20, [])
    assert sweep_module.worker_threads(plan(), 2) == 4 and sweep_module.worker_threads(plan(), 1) is None
    machine(2, 10, [])  # room for one run of 6 GiB, not two
    assert sweep_module.study_workers(plan(), said.append) == 1
    machine(1, 20, [])
    assert sweep_module.study_workers(plan()) == 1
    machine(16, 100, ["GPU-a", "GPU-b"])  # GPUs: one run unless asked (each worker then holds a GPU)
    assert sweep_module.study_workers(plan()) == 1 and sweep_module.worker_threads(plan(), 2) is None
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:1/api")  # worker_env asks no server then
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert sweep_module.worker_env(threads=1)["OMP_NUM_THREADS"] == "1"
    assert "OMP_NUM_THREADS" not in sweep_module.worker_env()
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert sweep_module.worker_env(threads=1)["OMP_NUM_THREADS"] == "3"
    # each round shares the cores among the workers it starts: with one trial left, its one worker gets them all
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    machine(2, 20, [])
    started: list[tuple[int, str | None]] = []
    shares: list[str | None] = []

    def spawn_workers(cmd, env, n, study, on_alive=None):
        # a round of two: each worker reads its thread count from the share file, and when one ended, the one left
        # reads all the cores there (ragen_core/cpu_share.py); a round of one has nothing to share
        started.append((n, env.get("OMP_NUM_THREADS")))
        share = env.get(cpu_share.SHARE_ENV)
        shares.append(share and Path(share).read_text())
        if on_alive is not None:
            on_alive(1)
            shares.append(Path(share).read_text())
        return [0] * n

    monkeypatch.setattr(sweep_module.steps, "spawn_workers", spawn_workers)
    spawn = sweep_module.spawner(SimpleNamespace(sweep=SimpleNamespace(dispatch="local"), path="s.yaml"), [], "p",
                                 None)
    assert spawn(2) == [0, 0] and spawn(1) == [0]
    assert started == [(2, "1"), (1, None)]
    assert shares == ["1\n", "2\n", None]
    machine(8, 40, [])
    shares.clear()
    assert spawn(4) == [0] * 4 and shares == ["2\n", "8\n"]  # 8 cores: 2 each, the one left all 8
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the user's own count: kept, no share file
    shares.clear()
    assert spawn(2) == [0, 0] and shares == [None]


def test_a_worker_alive_after_its_trial_stopped_beating_is_killed(tmp_path) -> None:
    """A hung worker (a deadlock stops its heartbeat with it, but the process never exits) would hold the study's
    round forever: once its trial went FAIL by heartbeat (it has a retry) the worker is killed. A worker whose trial
    failed by raising (no retry) goes on and is left alone."""
    import socket
    import subprocess
    import sys

    from optuna.trial import TrialState, create_trial

    from ragen_core.sweeps.trials import wait_workers

    study = optuna.create_study(study_name="hung", storage=f"sqlite:///{tmp_path}/optuna.db")
    hung = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    busy = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3)"])
    host = socket.gethostname()
    for proc in (hung, busy):
        trial = study.ask()
        trial.set_user_attr("worker", f"{host}:{proc.pid}")
        study.tell(trial, state=TrialState.FAIL)
    study.add_trial(create_trial(state=TrialState.WAITING, system_attrs={"failed_trial": 0}))  # trial 0's retry
    said: list[str] = []
    assert wait_workers([hung, busy], study, poll_s=0.2, say=said.append) == [-9, 0]
    assert said == [f"[sweep] worker {hung.pid} is alive but trial 0 it ran stopped beating: killing it (its retry "
                    "continues the run from its last checkpoint)"]


def test_the_workers_left_running_hear_how_many_they_are(tmp_path) -> None:
    """When a round's worker ends and others still run (their last trials), wait_workers says how many are left, once
    per change, so the study shares the cores out among them (flows/sweep.py spawner); never with none left."""
    import subprocess
    import sys

    from ragen_core.sweeps.trials import wait_workers

    study = optuna.create_study(study_name="tail", storage=f"sqlite:///{tmp_path}/optuna.db")
    procs = [subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({s})"]) for s in (0.2, 1.5, 3)]
    heard: list[int] = []
    assert wait_workers(procs, study, poll_s=0.1, on_alive=heard.append) == [0, 0, 0]
    assert heard == [2, 1]
