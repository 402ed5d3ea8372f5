"""Checkpoints: save a TrainState atomically and restore it so the next update is the same.

    save_checkpoint(state, run.checkpoint_path(10))        # run: a store.run_dir.RunDir (checkpoints/iter=000010)
    state = load_checkpoint(run.latest_checkpoint(), cfg)

A checkpoint directory holds:

- ``actor.safetensors``: the actor's trainable parameters (all weights under
  full fine-tuning, only the LoRA adapters under LoRA; frozen weights come back
  from ``cfg.model.name``), and the value head's when the critic is a head;
- ``critic.safetensors``: the separate critic's trainable parameters;
- ``optimizer.pt``: optimizer states of the actor and critic engines;
- ``rng.pt``: python ``random``, numpy and torch (CPU, CUDA) RNG states;
- ``state.json``: iteration, env seed counter, the model facts the weights
  depend on, and the resolved config (for reading).

The files are written into a temporary sibling directory that is renamed into
place (``os.replace``), so a crash never leaves a half-written checkpoint under
the final name. Everything is loaded with ``torch.load(weights_only=True)``.

A checkpoint holds whole tensors whatever the world size and ZeRO stage it was saved under (the engines
gather their partitions), so a run saved by N processes resumes under M. Every rank of a multi-process run
calls both functions; rank 0 alone writes, every rank reads (a shared ``$RAGEN_DATA_DIR``).

Run the tests with ``python -m pytest tests/unit/trainer -q``.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ragen_core import distributed
from ragen_core.config import ExperimentConfig, to_dict
from ragen_core.store.files import fsync_dir, fsync_file
from ragen_core.trainer.state import TrainState, init_state

__all__ = ["CHECKPOINT_FORMAT", "load_checkpoint", "rng_state", "save_checkpoint", "set_rng_state"]

CHECKPOINT_FORMAT = 1


def _trainable_tensors(*named: tuple[str, nn.Module | None]) -> dict[str, torch.Tensor]:
    """prefix.name -> detached contiguous copy of every trainable parameter (tied weights once)."""
    out: dict[str, torch.Tensor] = {}
    for prefix, module in named:
        if module is None:
            continue
        for name, p in module.named_parameters():
            if p.requires_grad:
                out[f"{prefix}.{name}"] = p.detach().contiguous().cpu()
    return out


def _load_trainable(tensors: dict[str, torch.Tensor], *named: tuple[str, nn.Module | None]) -> None:
    """Copy saved tensors into the matching trainable parameters; every one must be present."""
    expected = set()
    with torch.no_grad():
        for prefix, module in named:
            if module is None:
                continue
            for name, p in module.named_parameters():
                if not p.requires_grad:
                    continue
                key = f"{prefix}.{name}"
                expected.add(key)
                if key not in tensors:
                    raise ValueError(f"checkpoint lacks parameter {key!r}; "
                                     "was it saved with another model or LoRA setting?")
                if tensors[key].shape != p.shape:
                    raise ValueError(f"checkpoint parameter {key!r} has shape {tuple(tensors[key].shape)}, "
                                     f"the model's is {tuple(p.shape)}: another base model?")
                p.copy_(tensors[key].to(p.device, p.dtype))
    extra = set(tensors) - expected
    if extra:
        raise ValueError(f"checkpoint has parameters this model does not: {sorted(extra)[:5]}")


def rng_state() -> dict[str, Any]:
    """The global RNG states (python, numpy, torch CPU and CUDA) as tensors and plain values."""
    numpy_state = np.random.get_state(legacy=True)
    assert isinstance(numpy_state, tuple)  # legacy=True: (kind, keys, pos, has_gauss, cached), never the dict
    kind, keys, pos, has_gauss, cached = numpy_state
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore :func:`rng_state`."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _model_facts(cfg: ExperimentConfig) -> dict[str, Any]:
    """What the saved tensors' layout depends on; a restore under other values cannot be right.

    The model spec itself is recorded (``model`` in state.json) but not compared: the same base can
    be named differently (a warm-up copy's absolute path moves with $RAGEN_DATA_DIR), and a
    different architecture is caught anyway by the parameter names and shapes.
    """
    return {"lora_rank": cfg.model.lora_rank, "lora_target": cfg.model.lora_target, "critic": cfg.algorithm.critic}


def save_checkpoint(state: TrainState, directory: str | os.PathLike[str], write: bool | None = None,
                    extra_files: dict[str, str] | None = None) -> Path:
    """Write ``state`` (and the global RNG states) to ``directory`` atomically; returns the directory.

    In a multi-process run every rank calls it (gathering ZeRO partitions is a collective) and only the one
    that writes (``write``; default: rank 0) touches the disk: the ranks hold the same state.
    ``extra_files`` (name -> text, e.g. the session's health.json) are published with it, in the same rename.
    Durable as well as atomic: every file and the folder are fsynced before the rename that publishes them,
    and state.json, written last, lists every file's size (store.run_dir.checkpoint_problem checks them).
    """
    target = Path(directory)
    m = state.models
    with state.full_weights():
        actor = _trainable_tensors(("actor", m.actor), ("value_head", m.value_head))
        critic = _trainable_tensors(("critic", m.critic)) if m.critic is not None else None
    engines = {"actor": state.actor_engine.state_dict()}
    if state.critic_engine is not None:
        engines["critic"] = state.critic_engine.state_dict()
    if not (distributed.is_main() if write is None else write):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".tmp-{target.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        save_file(actor, tmp / "actor.safetensors")
        if critic is not None:
            save_file(critic, tmp / "critic.safetensors")
        torch.save(engines, tmp / "optimizer.pt")
        torch.save(rng_state(), tmp / "rng.pt")
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
        files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir())}
        meta = {"format": CHECKPOINT_FORMAT, "iteration": state.iteration, "env_seed_counter": state.env_seed_counter,
                "model": state.cfg.model.name, **_model_facts(state.cfg), "config": to_dict(state.cfg),
                "files": files}
        (tmp / "state.json").write_text(json.dumps(meta, indent=2))
        for path in tmp.iterdir():
            fsync_file(path)
        fsync_dir(tmp)
        old = target.with_name(f".old-{target.name}-{os.getpid()}")
        if target.exists():  # os.replace cannot overwrite a non-empty directory: move the old one aside
            os.replace(target, old)
        os.replace(tmp, target)
        fsync_dir(target.parent)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def load_checkpoint(
    directory: str | os.PathLike[str], cfg: ExperimentConfig, base: nn.Module | None = None
) -> TrainState:
    """A TrainState rebuilt for ``cfg`` and filled from ``directory``; also restores the global RNG states.

    ``base`` as for :func:`init_state` (the frozen weights under LoRA come from it,
    or from ``cfg.model.name``). Raises ValueError when the checkpoint was made
    for another LoRA setting or critic kind, or its tensors do not fit the model.
    """
    path = Path(directory)
    meta_file = path / "state.json"
    if not meta_file.is_file():
        raise FileNotFoundError(f"{path} is not a checkpoint (no state.json)")
    meta = json.loads(meta_file.read_text())
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{path}: checkpoint format {meta.get('format')}, this version reads {CHECKPOINT_FORMAT}")
    mismatched = {k: (meta.get(k), v) for k, v in _model_facts(cfg).items() if meta.get(k) != v}
    if mismatched:
        detail = ", ".join(f"{k}: checkpoint {a!r} vs config {b!r}" for k, (a, b) in mismatched.items())
        raise ValueError(f"{path}: checkpoint does not match the config ({detail})")
    state = init_state(cfg, base)
    m = state.models
    with state.full_weights(modify=True):
        _load_trainable(load_file(path / "actor.safetensors"), ("actor", m.actor), ("value_head", m.value_head))
        if m.critic is not None:
            _load_trainable(load_file(path / "critic.safetensors"), ("critic", m.critic))
    engines = torch.load(path / "optimizer.pt", weights_only=True)
    state.actor_engine.load_state_dict(engines["actor"])
    if state.critic_engine is not None:
        state.critic_engine.load_state_dict(engines["critic"])
    set_rng_state(torch.load(path / "rng.pt", weights_only=True))
    state.iteration = int(meta["iteration"])
    state.env_seed_counter = int(meta["env_seed_counter"])
    return state
