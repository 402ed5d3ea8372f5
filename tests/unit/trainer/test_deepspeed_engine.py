"""The DeepSpeed backend on the tiny model, on CPU (gloo): same update as the torch backend at ZeRO 0-3,
a 2-process data-parallel update equal to the 1-process one, checkpoints, ZeRO-3 rollouts, and clear errors.

Run with ``python -m pytest tests/unit/trainer/test_deepspeed_engine.py -q``. The 2-process check runs
stages 0 (gradients reduced once, in step), 2 (reduced inside every backward) and 3 (weights partitioned
too) by default, stage 1 (the same path as 0) only with the slow tests; each takes about 10 s on 2 cores. The
first DeepSpeed use on a machine compiles its shared-memory comm op (about 35 s here, then cached in
~/.cache/torch_extensions).
"""

from __future__ import annotations

import math
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import TINY, make_batch, make_cfg
from ds_data_parallel_worker import trained

from ragen_core.config import ConfigError
from ragen_core.models import load_tokenizer
from ragen_core.rollout.generators import SamplingParams, make_generator
from ragen_core.trainer import init_state, load_checkpoint, save_checkpoint, update
from ragen_core.trainer.state import TrainState
from ragen_core.trainer.update import micro_slices, rank_micro_rows
from tests.conftest import require_module

WORKER = Path(__file__).with_name("ds_data_parallel_worker.py")
ROOT = Path(__file__).resolve().parents[3]
ATOL, RTOL = 1e-5, 1e-4


@pytest.fixture(scope="module")
def deepspeed_installed() -> None:
    """The tests that run DeepSpeed ask for this; the others (config checks, the missing-deepspeed error, the
    row split) run without it."""
    require_module("deepspeed", "the deepspeed backend needs deepspeed (a dev dependency, in locks/cpu.txt)")


OFFLOAD = "trainer.deepspeed.zero_optimization.offload_optimizer.device=cpu"
"""The example of docs/how-to/gpu-pool.md (GPU backends): ZeRO-Offload of the optimizer state to host memory (torch
AdamW runs there)."""


def _ds(stage: int) -> list[str]:
    # ZeRO-3 keeps parameters under 1e5 elements whole by default, i.e. all of the tiny model's: threshold 0
    # makes it partition (and gather around each use) every one of them, as it does a real model's big ones.
    keep_whole = ["trainer.deepspeed.zero_optimization.stage3_param_persistence_threshold=0"] if stage == 3 else []
    return ["trainer.backend=deepspeed", f"trainer.zero_stage={stage}", *keep_whole]


def _weights(state: TrainState) -> dict[str, torch.Tensor]:
    out = {}
    with state.full_weights():  # ZeRO-3 holds slices of the weights outside it
        for prefix, m in (("actor", state.models.actor), ("critic", state.models.critic),
                          ("head", state.models.value_head)):
            if m is not None:
                out.update({f"{prefix}.{k}": v.detach().clone() for k, v in m.state_dict().items()})
    return out


def _assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], atol: float = ATOL,
                  rtol: float = RTOL) -> None:
    assert got.keys() == want.keys()
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, atol=atol, rtol=rtol, msg=lambda m, k=k: f"{k}: {m}")


def _assert_same_optimizer_state(got: dict, want: dict) -> None:
    """Same torch AdamW state_dict layout (param groups, per-parameter ids and keys), values within tolerance."""
    assert got["param_groups"] == want["param_groups"]
    assert got["state"].keys() == want["state"].keys()
    for i, st in want["state"].items():
        assert got["state"][i].keys() == st.keys()
        for k, v in st.items():
            torch.testing.assert_close(got["state"][i][k], v, atol=1e-7, rtol=RTOL)


def test_rank_micro_rows_split_each_block_between_ranks() -> None:
    # 5 rows, micro-batches of 2, 2 ranks: blocks of 2·2 = 4 rows -> [0..3], [4].
    # Block [0..3] halves into [0, 1] | [2, 3]; block [4] into [4] | [] (rank 1 gets an empty part).
    got = [[r.tolist() for r in rank_micro_rows(5, 2, rank, 2)] for rank in (0, 1)]
    assert got == [[[0, 1], [4]], [[2, 3], []]]
    # One rank: exactly micro_slices, so the torch backend's micro-batches are unchanged.
    for n, size in ((8, 2), (7, 3), (1, 4)):
        assert [r.tolist() for r in rank_micro_rows(n, size)] == [list(range(s.start, s.stop))
                                                                  for s in micro_slices(n, size)]


@pytest.mark.usefixtures("deepspeed_installed")
@pytest.mark.parametrize(
    ("stage", "overrides"),
    [(0, []), (1, []), (2, []), (2, ["algorithm.critic=head"]), (3, []), (3, ["algorithm.critic=head"]),
     (3, ["model.lora_rank=4"]), (2, [OFFLOAD]), (3, [OFFLOAD])],
    ids=["zero0", "zero1", "zero2", "zero2-value-head", "zero3", "zero3-value-head", "zero3-lora",
         "zero2-offload", "zero3-offload"],
)
def test_update_matches_torch_backend(stage: int, overrides: list[str]) -> None:
    # Two optimizer steps (online_k=2) of 4 micro-batches each; starpo has a separate critic and a KL reference.
    common = ["trainer.online_k=2", *overrides]
    batch = make_batch(n_groups=4)
    states, norms = {}, {}
    for name, backend in (("torch", []), ("deepspeed", _ds(stage))):
        cfg = make_cfg("starpo", *common, *backend)
        states[name] = init_state(cfg)
        trained_params = [q for q in states[name].models.actor.parameters() if q.requires_grad]
        versions = [q._version for q in trained_params]
        stats = update(states[name], batch, cfg)
        norms[name] = {k: v for k, v in stats.metrics.items() if k.endswith(("grad_norm", "grad_norm_max"))}
        if name == "torch" or stage < 3:  # the generator sees updates by these; fused AdamW and ZeRO-1/2 leave them
            assert all(q._version > v for q, v in zip(trained_params, versions, strict=True)), name
    ref, got = states["torch"], states["deepspeed"]
    assert type(got.actor_engine).__name__ == "DeepSpeedEngine"
    assert norms["torch"].keys() == norms["deepspeed"].keys() and len(norms["torch"]) >= 2
    for k, v in norms["torch"].items():
        assert norms["deepspeed"][k] == pytest.approx(v, rel=RTOL), k
    moved = max(float((a - b).abs().max()) for a, b in zip(_weights(ref).values(), _weights(init_state(
        make_cfg("starpo", *common))).values(), strict=True))
    assert moved > 1e-4  # the comparison below is not between two untrained models
    _assert_close(_weights(got), _weights(ref))
    _assert_same_optimizer_state(got.actor_engine.state_dict()["optimizer"],
                                 ref.actor_engine.state_dict()["optimizer"])
    if ref.critic_engine is not None:
        _assert_same_optimizer_state(got.critic_engine.state_dict()["optimizer"],
                                     ref.critic_engine.state_dict()["optimizer"])
    assert got.actor_engine.lr == ref.actor_engine.lr and got.actor_engine.skipped == 0


@pytest.mark.usefixtures("deepspeed_installed")
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_checkpoint_resumes_exactly_and_also_under_the_torch_backend(tmp_path: Path, stage: int) -> None:
    cfg = make_cfg("starpo", *_ds(stage))
    first, second = make_batch(seed=1), make_batch(seed=2)
    state = init_state(cfg)
    update(state, first, cfg)
    state.iteration = 1
    save_checkpoint(state, tmp_path / "ckpt")
    update(state, second, cfg)
    want = _weights(state)
    want_opt = state.actor_engine.state_dict()["optimizer"]

    resumed = load_checkpoint(tmp_path / "ckpt", cfg)
    assert resumed.iteration == 1
    # Right after loading, ZeRO's fp32 master copy must hold the loaded weights, not the fresh ones:
    # the next update continues from the checkpoint exactly as the uninterrupted run did.
    update(resumed, second, cfg)
    _assert_close(_weights(resumed), want, atol=1e-7, rtol=1e-6)
    _assert_same_optimizer_state(resumed.actor_engine.state_dict()["optimizer"], want_opt)

    # The optimizer state has the torch backend's layout: the same checkpoint resumes under trainer.backend=torch.
    torch_cfg = make_cfg("starpo")
    as_torch = load_checkpoint(tmp_path / "ckpt", torch_cfg)
    update(as_torch, second, torch_cfg)
    _assert_close(_weights(as_torch), want)


@pytest.mark.usefixtures("deepspeed_installed")
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_non_finite_gradient_skips_the_step(stage: int) -> None:
    state = init_state(make_cfg("grpo", *_ds(stage)))
    engine, before = state.actor_engine, _weights(state)
    ids = torch.arange(1, 9)[None]  # a forward through the engine (ZeRO-3 holds only slices of the weights outside)
    engine.backward(engine.forward(lambda: state.models.actor(input_ids=ids).logits.sum() * float("nan")))
    norm = engine.step()
    assert math.isnan(norm) or norm == math.inf  # NaN (stage 0, as TorchEngine) or inf (ZeRO's overflow value)
    assert engine.skipped == 1
    _assert_close(_weights(state), before, atol=0.0, rtol=0.0)
    assert not engine.state_dict()["optimizer"]["state"]  # AdamW never stepped


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.usefixtures("deepspeed_installed")
@pytest.mark.parametrize("stage", [0, pytest.param(1, marks=pytest.mark.slow), 2, 3])
def test_two_process_update_equals_one_process(tmp_path: Path, stage: int) -> None:
    # torchrun starts 2 ranks; each trains its half of every mini-batch (10 rows, online_k=2, micro-batches
    # of 2: rank 1 also runs a zero-weighted stand-in for the last block) and rank 0 saves the result.
    out = tmp_path / "rank0.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), str(WORKER), str(out), str(stage), *_ds(stage)[2:]]
    # PYTHONPATH: the ranks import this checkout's ragen_core, not whichever one the venv installed (a worktree)
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = torch.load(out, weights_only=True)
    want = trained(["trainer.backend=torch"])  # the same update in this one process, the plain torch engine
    for part in ("actor", "critic"):
        _assert_close(got[part], want[part])
    assert got["grad_norms"] == pytest.approx(want["grad_norms"], rel=RTOL)  # ×W undone would halve them
    assert got["metrics"] == pytest.approx(want["metrics"], rel=RTOL, abs=1e-6)  # the whole batch's, not rank 0's


@pytest.mark.usefixtures("deepspeed_installed")
def test_zero3_rollouts_see_the_trained_weights_and_leave_them_partitioned(monkeypatch: pytest.MonkeyPatch) -> None:
    # Rollouts call the actor directly (not through the engine), inside generation_weights: ZeRO-3 gathers
    # every weight once there and its per-layer hooks fetch nothing. Same seed, same tokens as the torch
    # backend, before and after an update, and the update after a generation trains as the torch one does.
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

    fetched: list[int] = []
    fetch = PartitionedParameterCoordinator.fetch_sub_module

    def counted(self: PartitionedParameterCoordinator, *args: object, **kwargs: object) -> object:
        fetched.append(1)
        return fetch(self, *args, **kwargs)

    monkeypatch.setattr(PartitionedParameterCoordinator, "fetch_sub_module", counted)
    tokenizer = load_tokenizer(TINY)
    prompts = [list(range(5, 17)), list(range(30, 39))]
    params = SamplingParams(temperature=1.0, max_new_tokens=6, seed=3)
    runs = {}
    for name, backend in (("torch", []), ("zero3", _ds(3))):
        cfg = make_cfg("starpo", *backend)
        state = init_state(cfg)
        generator = make_generator("hf", state.models.actor, tokenizer)
        fetched.clear()
        with state.generation_weights():
            before = generator.generate(prompts, params)
        assert not fetched, f"{name}: {len(fetched)} per-layer fetches while generating"
        stats = update(state, make_batch(), cfg)
        assert not name == "zero3" or fetched  # the training forwards gather through the hooks again
        with state.full_weights():
            generator.update_weights(state.models.actor)
        with state.generation_weights():
            after = generator.generate(prompts, params)
        runs[name] = (before, after, state, stats.metrics["actor/grad_norm"])
    for (want, got) in zip(runs["torch"][:2], runs["zero3"][:2], strict=True):
        assert [g.token_ids for g in got] == [g.token_ids for g in want]
        for g, w in zip(got, want, strict=True):
            assert g.logprobs == pytest.approx(w.logprobs, abs=1e-5)
    assert runs["zero3"][3] == pytest.approx(runs["torch"][3], rel=RTOL)
    assert runs["torch"][0][0].token_ids != runs["torch"][1][0].token_ids or \
        runs["torch"][0][0].logprobs != runs["torch"][1][0].logprobs  # the update changed what is sampled
    zero3 = runs["zero3"][2]
    assert all(p.numel() == 0 for p in zero3.models.actor.parameters())  # partitioned again after the rollouts
    fetched.clear()
    again = generator.generate(prompts, params)  # outside the block the per-layer hooks gather, as before
    assert fetched and [g.token_ids for g in again] == [g.token_ids for g in runs["zero3"][1]]
    with zero3.full_weights():
        assert zero3.models.actor.get_input_embeddings().weight.shape == (len(tokenizer), 64)


@pytest.mark.usefixtures("deepspeed_installed")
def test_zero3_trains_on_after_a_generation_that_raised() -> None:
    # DeepSpeed's unwrap_model_for_generation takes ZeRO-3's hooks off and puts them back only when its block ends
    # normally; generation_weights puts them back either way, so the update after a failed rollout still gathers.
    runs = {}
    for name, backend in (("torch", []), ("zero3", _ds(3))):
        cfg = make_cfg("starpo", *backend)
        state = init_state(cfg)
        with pytest.raises(RuntimeError, match="a rollout failed"), state.generation_weights():
            raise RuntimeError("a rollout failed")
        runs[name] = (state, update(state, make_batch(), cfg).metrics["actor/grad_norm"])
    assert runs["zero3"][1] == pytest.approx(runs["torch"][1], rel=RTOL)
    assert all(p.numel() == 0 for p in runs["zero3"][0].models.actor.parameters())


def test_deepspeed_config_cannot_override_what_the_update_math_relies_on() -> None:
    with pytest.raises(ConfigError, match="gradient_clipping, train_micro_batch_size_per_gpu come from ragen"):
        make_cfg("grpo", *_ds(2), "trainer.deepspeed.gradient_clipping=5",
                 "trainer.deepspeed.train_micro_batch_size_per_gpu=1")
    with pytest.raises(ConfigError, match=r"zero_optimization\.stage come from"):
        make_cfg("grpo", *_ds(2), "trainer.deepspeed.zero_optimization.stage=3")


def test_missing_deepspeed_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # makes `import deepspeed` raise ImportError
    with pytest.raises(ConfigError, match="deepspeed is not importable"):
        init_state(make_cfg("grpo", *_ds(0)))


@pytest.mark.usefixtures("deepspeed_installed")
def test_a_lock_file_left_in_the_shm_op_build_keeps_no_start_waiting(tmp_path: Path) -> None:
    """DeepSpeed's CPU start builds its shared-memory op under torch's owner-less lock file; one left by a process
    killed during that (planted here, in a copy of the built op's folder) would keep every later start waiting
    forever: a start removes it and goes on."""
    from torch.utils.cpp_extension import _get_build_directory

    from ragen_core.trainer.deepspeed_engine import init_distributed

    init_distributed(torch.device("cpu"))  # the op built (or found built) in its usual folder
    built = Path(_get_build_directory("deepspeed_shm_comm", verbose=False))
    folder = tmp_path / built.name
    shutil.copytree(built, folder, ignore=shutil.ignore_patterns("lock", "ragen.lock"))  # mtimes kept: up to date
    (folder / "lock").touch()
    code = ("import torch; from ragen_core.trainer.deepspeed_engine import init_distributed; "
            "init_distributed(torch.device('cpu')); print('started')")
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
                         check=False)
    assert out.returncode == 0 and out.stdout.strip().endswith("started"), out.stderr[-2000:]
    assert not (folder / "lock").exists()


def test_trainer_package_imports_without_deepspeed() -> None:
    code = "import sys, ragen_core.trainer; assert 'deepspeed' not in sys.modules, 'deepspeed imported eagerly'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
