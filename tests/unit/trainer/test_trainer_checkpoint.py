"""Checkpoints: stopping, saving, loading into fresh objects and continuing gives bit-identical
weights and optimizer states; the save is atomic; a mismatched config is refused.

Run with ``python -m pytest tests/unit/trainer/test_trainer_checkpoint.py -q``.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import make_batch, make_cfg

from ragen_core.trainer import init_state, load_checkpoint, save_checkpoint, update
from ragen_core.trainer.state import TrainState


def _iteration(state: TrainState) -> None:
    """One training iteration whose batch depends on every global RNG (like a rollout would)."""
    seed = int(torch.randint(0, 10_000, (1,))) + random.randrange(1000) + int(np.random.randint(1000))
    update(state, make_batch(seed=seed), state.cfg)
    state.iteration += 1
    state.env_seed_counter += 8


def _snapshot(state: TrainState) -> dict[str, torch.Tensor]:
    out = {}
    for prefix, m in (("actor", state.models.actor), ("critic", state.models.critic),
                      ("head", state.models.value_head)):
        if m is not None:
            out.update({f"{prefix}.{k}": v.detach().clone() for k, v in m.state_dict().items()})
    for prefix, engine in (("actor_opt", state.actor_engine), ("critic_opt", state.critic_engine)):
        if engine is None:
            continue
        for pid, st in engine.state_dict()["optimizer"]["state"].items():
            out.update({f"{prefix}.{pid}.{k}": v.clone() for k, v in st.items()})
    return out


@pytest.mark.parametrize(
    "overrides",
    [
        ("starpo", []),                            # full fine-tuning, separate critic, frozen reference
        ("starpo", ["model.lora_rank=4"]),         # adapters only, reference = adapters disabled
        ("starpo-s", ["algorithm.critic=head"]),   # value head on the actor
    ],
    ids=["full", "lora", "head"],
)
def test_resume_is_bit_identical(tmp_path: Path, overrides, request) -> None:
    if os.environ.get("RAGEN_RESUME_TEST_INNER") != "1":
        # A resumed run is a new process, so the check runs in a fresh interpreter. Run in-process after
        # the whole suite, the full-fine-tuning case once differed in every actor weight while passing
        # alone: some state left by earlier tests changes the float results; cause not found yet.
        res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                              f"{__file__}::{request.node.name}"], capture_output=True, text=True, check=False,
                             env={**os.environ, "RAGEN_RESUME_TEST_INNER": "1"}, timeout=600)
        assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
        return
    preset, extra = overrides
    cfg = make_cfg(preset, *extra)

    straight = init_state(cfg)
    for _ in range(3):
        _iteration(straight)

    first = init_state(cfg)
    _iteration(first)
    ckpt = save_checkpoint(first, tmp_path / "iter=000001")
    del first
    torch.manual_seed(12345)  # a different process would have different RNG states; the load restores them
    random.seed(1)
    np.random.seed(2)
    resumed = load_checkpoint(ckpt, cfg)
    assert resumed.iteration == 1 and resumed.env_seed_counter == 8
    for _ in range(2):
        _iteration(resumed)

    a, b = _snapshot(straight), _snapshot(resumed)
    assert a.keys() == b.keys() and len(a) > 0
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, different[:5]
    assert resumed.iteration == straight.iteration == 3


def test_load_restores_the_saved_rng_streams(tmp_path: Path) -> None:
    # Control for the test above: the batches depend on the RNG, so if the checkpoint did not restore
    # it, continuing would not match. We check the RNG really is restored to the saved stream.
    cfg = make_cfg("starpo-s")
    state = init_state(cfg)
    _iteration(state)
    save_checkpoint(state, tmp_path / "c")
    expected = (torch.rand(3), random.random(), float(np.random.rand()))
    torch.manual_seed(999)
    load_checkpoint(tmp_path / "c", cfg)
    got = (torch.rand(3), random.random(), float(np.random.rand()))
    assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]


def test_save_is_atomic_and_replaces_an_old_checkpoint(tmp_path: Path) -> None:
    cfg = make_cfg("starpo-s")
    state = init_state(cfg)
    target = tmp_path / "ckpt"
    save_checkpoint(state, target)
    state.iteration = 7
    save_checkpoint(state, target)  # overwriting an existing checkpoint directory
    assert json.loads((target / "state.json").read_text())["iteration"] == 7
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temp or old dirs left behind
    assert {"actor.safetensors", "critic.safetensors", "optimizer.pt", "rng.pt", "state.json"} <= {
        p.name for p in target.iterdir()}


def test_failed_save_leaves_the_previous_checkpoint(tmp_path: Path, monkeypatch) -> None:
    cfg = make_cfg("starpo-s")
    state = init_state(cfg)
    target = save_checkpoint(state, tmp_path / "ckpt")
    state.iteration = 5

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("ragen_core.trainer.checkpoint.torch.save", boom)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(state, target)
    assert json.loads((target / "state.json").read_text())["iteration"] == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_lora_checkpoint_holds_only_adapters(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    cfg = make_cfg("starpo-s", "model.lora_rank=4")
    target = save_checkpoint(init_state(cfg), tmp_path / "c")
    names = load_file(target / "actor.safetensors").keys()
    assert names and all("lora_" in n for n in names)


def test_mismatched_config_is_refused(tmp_path: Path) -> None:
    target = save_checkpoint(init_state(make_cfg("starpo-s")), tmp_path / "c")
    with pytest.raises(ValueError, match="lora_rank"):
        load_checkpoint(target, make_cfg("starpo-s", "model.lora_rank=4"))
    with pytest.raises(FileNotFoundError):
        load_checkpoint(tmp_path / "missing", make_cfg("starpo-s"))


def test_another_base_architecture_is_refused_by_shape(tmp_path: Path) -> None:
    # tiny-random:1 has the same layout as :0 (loads fine: the spec name is not compared), so build
    # a mismatch by hand: a checkpoint whose critic head has the wrong width.
    from safetensors.torch import load_file, save_file

    cfg = make_cfg("starpo-s")
    target = save_checkpoint(init_state(cfg), tmp_path / "c")
    load_checkpoint(target, make_cfg("starpo-s", "model.name=tiny-random:1"))  # same shapes: accepted
    tensors = load_file(target / "critic.safetensors")
    tensors["critic.head.weight"] = torch.zeros(1, 3)
    save_file(tensors, target / "critic.safetensors")
    with pytest.raises(ValueError, match="shape"):
        load_checkpoint(target, cfg)


def test_checkpoint_lists_its_files_and_publishes_extra_files_with_them(tmp_path: Path) -> None:
    """state.json (written last) lists every file's size, so a copy or disk cut short is told from a
    whole checkpoint; the session's health.json goes in before the rename, not after it."""
    from ragen_core.store.run_dir import checkpoint_problem

    state = init_state(make_cfg("starpo"))
    ckpt = save_checkpoint(state, tmp_path / "iter=000001", extra_files={"health.json": '{"echo": {}}'})
    meta = json.loads((ckpt / "state.json").read_text())
    assert set(meta["files"]) == {p.name for p in ckpt.iterdir()} - {"state.json"}
    assert "health.json" in meta["files"] and checkpoint_problem(ckpt) is None
    rng = ckpt / "rng.pt"
    rng.write_bytes(rng.read_bytes() + b"\0")  # wrong size: caught by the listing even where the zip still reads
    assert "rng.pt" in (checkpoint_problem(ckpt) or "")
    assert not list(tmp_path.glob(".tmp-*"))
