"""Multi-process training on the tiny model over gloo: the train flow with ``nproc=2`` (this process
is rank 0 and starts rank 1 as ``python -m flows.cli train-rank``) against one process on the same experiment and
DeepSpeed stage: the same final weights, exactly one MLflow run, every group once in every shard, the same
history; a run checkpointed by 2 processes resumes in 1 and ends where an unbroken run ends.

ZeRO-2 runs by default (about 70 s for the module on 2 cores); stages 0 and 3 (rollouts on every rank: ZeRO-3
gathers each layer from all ranks as it runs), the 1 -> 2 resume and a torchrun launch only with the slow tests.
Run: ``python -m pytest tests/flows/test_train_ranks.py -q`` (``-m slow`` for the others).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient
from prefect.client.orchestration import get_client
from safetensors.torch import load_file

from flows import ranks
from flows.train import train, train_trial
from ragen_core.config import ConfigError
from ragen_core.store import read_shard
from ragen_core.store.run_dir import shard_path
from tests.conftest import require_module

ROOT = Path(__file__).resolve().parents[2]
SMOKE = str(ROOT / "experiments" / "smoke.yaml")
# Two processes reduce the fp32 gradients in another order than one. Adam divides each step by the root of its
# second moment, so a rounding difference in a near-zero gradient becomes a visible share of the step: 1.03e-5 for
# ZeRO-3 on an AVX2-only CPU (1e-5 or less on AVX512, every stage). The bound is a fifth of the smoke file's
# actor_lr (1e-4): a wrong gradient (a shard lost, a group counted twice, a stale layer) moves weights by about lr
# each step, several steps here.
ATOL = 2e-5
GROUPS, MEMBERS, ITERATIONS = 4, 2, 2  # experiments/smoke.yaml: P x N = 4 x 2, 2 iterations
SAME_IN_HISTORY = ("iteration", "env/Bandit/success", "val/success", "rollout/kept_groups", "rollout/reward_std_all",
                   "perf/generated_tokens", "perf/update_rows", "response/length_mean")


def _ds(stage: int) -> list[str]:
    # threads=1: two processes share 2 cores; ZeRO-3 threshold 0 partitions every weight of the tiny model
    keep_whole = ["trainer.deepspeed.zero_optimization.stage3_param_persistence_threshold=0"] if stage == 3 else []
    return ["trainer.backend=deepspeed", f"trainer.zero_stage={stage}", "trainer.threads=1", *keep_whole]


def _weights(run_dir: str, iteration: int = ITERATIONS) -> dict[str, torch.Tensor]:
    return load_file(Path(run_dir) / "checkpoints" / f"iter={iteration:06d}" / "actor.safetensors")


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _history(run_dir: str) -> list[dict[str, float]]:
    return [json.loads(line) for line in (Path(run_dir) / "history.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module", params=[2, pytest.param(0, marks=pytest.mark.slow),
                                        pytest.param(3, marks=pytest.mark.slow)], ids=lambda s: f"zero{s}")
def runs(request, tmp_path_factory):
    """(stage, data dir, the one-process run, the two-process run): only the latter is tracked in MLflow."""
    require_module("deepspeed", "multi-process training runs DeepSpeed (a dev dependency, in locks/cpu.txt)")
    stage = request.param
    data = tmp_path_factory.mktemp(f"data-zero{stage}")
    mp = pytest.MonkeyPatch()
    mp.setenv("RAGEN_DATA_DIR", str(data))
    mp.delenv("MLFLOW_TRACKING_URI", raising=False)
    for key in ("RANK", "WORLD_SIZE", "CUDA_VISIBLE_DEVICES"):
        mp.delenv(key, raising=False)
    mp.setenv("RAGEN_GPUS", "0,1")  # two declared GPU slots: the two-process run holds both (ragen_core/gpus.py)
    mp.setenv("RAGEN_GPU_LOCK_DIR", str(data / "gpu-locks"))
    one = train(experiment=SMOKE, run_name="one", overrides=[*_ds(stage), "tracking.backend=none"])
    two = train(experiment=SMOKE, run_name="two", overrides=_ds(stage), nproc=2)
    yield stage, data, one, two
    mp.undo()


def test_two_processes_end_with_the_one_process_weights(runs) -> None:
    stage, _, one, two = runs
    assert two.iterations == one.iterations == ITERATIONS and two.run_name == "two"
    diff = _max_diff(_weights(two.run_dir), _weights(one.run_dir))
    print(f"ZeRO-{stage}: max |w(2 processes) - w(1 process)| = {diff:.3g}")
    assert diff <= ATOL
    final = load_file(Path(two.run_dir) / "final-model" / "model.safetensors")  # rank 0 wrote the gathered model
    assert final.keys() and all(v.numel() > 0 for v in final.values())


def test_exactly_one_mlflow_run_from_rank_0(runs) -> None:
    _, data, _, two = runs
    client = MlflowClient(f"sqlite:///{data}/mlflow.db")
    found = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert [r.info.run_id for r in found] == [two.mlflow_run_id]
    assert found[0].info.run_name == "two" and found[0].info.status == "FINISHED"
    assert found[0].data.tags["gpus"] == "0,1"  # one slot per rank, given back when the run ended
    assert "CUDA_VISIBLE_DEVICES" not in os.environ
    assert [m.step for m in client.get_metric_history(two.mlflow_run_id, "actor/grad_norm")] == [0, 1]


def test_every_shard_holds_every_group_once_as_one_process_played_it(runs) -> None:
    _, _, one, two = runs
    for it in range(ITERATIONS):
        got, want = (read_shard(shard_path(r.run_dir, it)) for r in (two, one))
        assert Counter(got["group_id"]) == dict.fromkeys(range(GROUPS), MEMBERS)
        for key in ("group_id", "seed", "kept", "total_return"):
            assert got[key].tolist() == want[key].tolist(), key


def test_history_is_the_one_process_history(runs) -> None:
    _, _, one, two = runs
    got, want = _history(two.run_dir), _history(one.run_dir)
    assert [r["iteration"] for r in got] == [0, 1, 2]
    for g, w in zip(got, want, strict=True):
        assert {k: g.get(k) for k in SAME_IN_HISTORY} == {k: w.get(k) for k in SAME_IN_HISTORY}
        # the update's metrics are the whole batch's (the ranks add up their sums), not rank 0's rows only
        for key in ("actor/entropy", "actor/pg_loss", "actor/grad_norm"):
            assert (key in g) == (key in w)
            if key in w:
                assert g[key] == pytest.approx(w[key], rel=1e-4, abs=1e-6), key


def test_a_two_process_checkpoint_resumes_in_one_process(runs) -> None:
    stage, _, one, _ = runs
    train(experiment=SMOKE, run_name="broken-2", overrides=[*_ds(stage), "tracking.backend=none",
                                                            "trainer.iterations=1"], nproc=2)
    resumed = train(experiment=SMOKE, resume="broken-2", overrides=[f"trainer.iterations={ITERATIONS}"])
    assert _max_diff(_weights(resumed.run_dir), _weights(one.run_dir)) <= ATOL


@pytest.mark.slow
def test_a_one_process_checkpoint_resumes_in_two_processes(runs) -> None:
    stage, _, one, _ = runs
    train(experiment=SMOKE, run_name="broken-1", overrides=[*_ds(stage), "tracking.backend=none",
                                                            "trainer.iterations=1"])
    resumed = train(experiment=SMOKE, resume="broken-1", overrides=[f"trainer.iterations={ITERATIONS}"], nproc=2)
    assert _max_diff(_weights(resumed.run_dir), _weights(one.run_dir)) <= ATOL


@pytest.mark.slow
@pytest.mark.parametrize("runs", [2], ids=["zero2"], indirect=True)  # one stage is enough for the launcher
def test_torchrun_runs_the_cli_with_rank_0_in_the_flow(runs) -> None:
    # the external launcher: every rank runs `python -m flows.cli train ...`; rank 0 the flow, rank 1 follows it
    stage, _, one, _ = runs
    with get_client(sync_client=True) as client:  # report to this session's Prefect server, start none
        api = str(client.api_url).rstrip("/")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), "-m", "flows.cli", "train", SMOKE, "--run-name", "torchrun",
           *[a for o in [*_ds(stage), "tracking.backend=none"] for a in ("--set", o)]]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PREFECT_API_URL": api, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = Path(os.environ["RAGEN_DATA_DIR"]) / "runs" / "torchrun"
    assert _max_diff(_weights(str(run_dir)), _weights(one.run_dir)) <= ATOL


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_rank_that_dies_fails_the_run_and_names_it(monkeypatch) -> None:
    # rank 1 exits before the group is complete: rank 0 says so at once instead of waiting out the rendezvous
    for key in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(ranks, "rank_command", lambda device: [sys.executable, "-c", "raise SystemExit(3)"])
    with pytest.raises(RuntimeError, match="rank 1 exited with 3 before all ranks met"):
        with ranks.world(2, torch.device("cpu")):
            pytest.fail("the block must not run without rank 1")


def test_sweep_trials_and_the_torch_engine_refuse_several_processes(data_dir, monkeypatch) -> None:
    for key in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    with monkeypatch.context() as torchrun:  # a trial flow started under torchrun with two ranks
        torchrun.setenv("WORLD_SIZE", "2")
        torchrun.setenv("RANK", "0")
        with pytest.raises(ConfigError, match="sweep trial reports to Optuna from one process"):
            train_trial(experiment=SMOKE, overrides=_ds(2), trial={"storage": "sqlite://", "number": 0})
    with pytest.raises(ConfigError, match=r"2 processes need trainer\.backend=deepspeed"):
        train(experiment=SMOKE, nproc=2)
    assert not (data_dir / "runs").exists()
