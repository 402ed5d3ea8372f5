"""GPU probe: the trainer at the paper's model shapes on a borrowed GPU, in minutes, with nothing to download.

Sized for a machine that has torch, transformers and peft but no vLLM, Prefect, MLflow or DeepSpeed and no
network: every model is built with random weights on the device (Qwen2.5-0.5B's and 1.5B's shapes; no hub),
and nothing but this checkout is needed. Sections (each on ``--device``, each reporting on its own, so one
failure does not hide the others):

  matmul    the device's matmul rate, fp32 (TF32 on CUDA) and bf16, best of a few products: the roofline the
            update's model FLOPs utilisation is measured against.
  update    one real PPO update (StarPO-S: critic, no KL) of a mini-batch of ``rows`` trajectories, per shape x
            precision (fp32, bf16 mixed) x activation checkpointing (off, on): seconds, token positions per
            second, peak memory (CUDA), and model FLOPs utilisation = 6 x trained parameters x positions /
            seconds / the matmul rate of that precision (the extra forward of checkpointing is not counted).
  lr_1e6    one step at the paper's lr 1e-6 at the smaller shape: the summed |dw| of bf16 mixed precision
            against fp32 (fp32 master weights: their ratio is ~1) and against AdamW on bf16 weights (~0).
  rollout   the hf generator (ragen's KV caches and fast decode step) at the smaller shape: generated tokens
            per second for a batch of prompts.
  train     short ``ragen_core.session`` runs of experiments/smoke.yaml on a tiny Qwen2 on the device, bf16:
            StarPO-S, and vanilla StarPO under LoRA (:data:`TRAIN_VARIANTS`) (needs the envs' dependencies:
            gymnasium, pyarrow, rich, pyyaml, pydantic).

Run:  python bench/gpu_probe.py [--device cuda] [--budget-s 480]        (all of it within 8 minutes on an H100)
      python bench/gpu_probe.py --device cpu                            (small shapes, < 3 minutes: the tests run it)
The last line printed is one JSON object: {"pass": bool, "device": ..., "sections": {name: {...}}}.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from matmul import matmul_rate

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout, with or without the package installed
    sys.path.insert(0, str(ROOT))

SHAPES = {  # Qwen2.5 configs (hidden, layers, heads, kv heads, intermediate, vocab, tied head)
    "qwen2.5-0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                         intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True),
}
CPU_SHAPES = {  # the same code at sizes a CPU runs in seconds
    "small": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=256, vocab_size=2048, tie_word_embeddings=True),
    "small-untied": dict(hidden_size=192, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
                         intermediate_size=384, vocab_size=2048, tie_word_embeddings=False),
}

Result = dict[str, Any]


def qwen2(shape: dict[str, Any], device: torch.device, seed: int = 0) -> torch.nn.Module:
    """A Qwen2 causal LM of ``shape`` with random weights, built on ``device`` in fp32."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**shape, max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1e6)
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen2ForCausalLM(config)
    return model.float().eval()


def batch(rows: int, prompt: int, reply: int, vocab: int, seed: int = 0) -> Any:
    """A rollout-shaped TokenBatch: ``rows`` trajectories of a ``prompt``-token prompt and a ``reply``-token reply,
    in prompt groups of 8, random tokens, rollout log-probs and 0/1 rewards."""
    from ragen_core.types import TokenBatch

    g = torch.Generator().manual_seed(seed)
    t = prompt + reply
    ids = torch.randint(1, vocab, (rows, t), generator=g)
    group = torch.arange(rows) // 8
    for r in range(rows):  # a group shares its prompt
        ids[r, :prompt] = ids[int(group[r]) * 8, :prompt]
    attention = torch.ones(rows, t, dtype=torch.bool)
    loss = torch.zeros(rows, t, dtype=torch.bool)
    loss[:, prompt:] = True
    ends = torch.zeros(rows, t, dtype=torch.bool)
    ends[:, -1] = True
    turn_ids = torch.zeros(rows, t, dtype=torch.long)
    returns = torch.randint(0, 2, (rows,), generator=g).float()
    rewards = torch.zeros(rows, t)
    rewards[:, -1] = returns
    old = torch.where(loss, -torch.rand(rows, t, generator=g) * 3 - 1.0, torch.zeros(rows, t))
    return TokenBatch(ids, attention, loss, old, rewards, turn_ids, ends, group, returns)


def config(device: torch.device, *overrides: str) -> Any:
    from ragen_core.config import ExperimentConfig, apply_overrides, build_config

    raw = apply_overrides({}, ["preset=starpo-s", "model.name=tiny-qwen2", f"model.device={device.type}",
                               "trainer.micro_batch_size=8", "trainer.micro_batch_tokens=8192",
                               "trainer.mini_batch_rows=null", *overrides])
    from ragen_core.config import PRESETS

    algo = {**PRESETS["starpo-s"].get("algorithm", {}), **raw.get("algorithm", {})}
    return build_config(ExperimentConfig, {**raw, "preset": "starpo-s", "algorithm": algo})


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def section_matmul(device: torch.device, small: bool) -> Result:
    n = 1024 if small else 8192
    return {"n": n, "fp32_tflops": matmul_rate(torch.float32, n, device=device) / 1e12,
            "bf16_tflops": matmul_rate(torch.bfloat16, n, device=device) / 1e12}


def one_update(base: torch.nn.Module, device: torch.device, tokens: Any, *overrides: str) -> Result:
    """Build a StarPO-S state on a copy of ``base`` and time its second update (the first warms up)."""
    from ragen_core.trainer import init_state, update

    cfg = config(device, *overrides)
    state = init_state(cfg, base)
    update(state, tokens, cfg)  # kernels, allocator and autotuning settle
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    sync(device)
    start = time.perf_counter()
    stats = update(state, tokens, cfg)
    sync(device)
    seconds = time.perf_counter() - start
    trained = sum(p.numel() for m in (state.models.actor, state.models.critic, state.models.value_head)
                  if m is not None for p in m.parameters() if p.requires_grad)
    out = {"seconds": round(seconds, 4), "positions": int(tokens.attention_mask.sum()), "trained_params": trained,
           "grad_norm": stats.metrics.get("actor/grad_norm")}
    if device.type == "cuda":
        out["peak_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    del state
    return out


def section_update(device: torch.device, shapes: dict[str, dict[str, Any]], rows: int, prompt: int, reply: int,
                   rates: Result, deadline: float) -> Result:
    out: Result = {}
    for name, shape in shapes.items():
        base = qwen2(shape, device)
        tokens = batch(rows, prompt, reply, shape["vocab_size"])
        for precision in ("fp32", "bf16"):
            for ckpt in (False, True):
                key = f"{name}/{precision}/{'ckpt' if ckpt else 'no-ckpt'}"
                if time.monotonic() > deadline:
                    out[key] = {"skipped": "time budget"}
                    continue
                try:
                    r = one_update(base, device, tokens, f"trainer.precision={precision}",
                                   f"model.gradient_checkpointing={str(ckpt).lower()}")
                    rate = rates[f"{precision}_tflops"] * 1e12
                    r["tokens_per_s"] = round(r["positions"] / r["seconds"], 1)
                    r["mfu"] = round(6 * r["trained_params"] * r["positions"] / r["seconds"] / rate, 4)
                    out[key] = r
                except torch.cuda.OutOfMemoryError as e:
                    out[key] = {"oom": str(e).splitlines()[0]}
                    torch.cuda.empty_cache()
        del base
        if device.type == "cuda":
            torch.cuda.empty_cache()
    ran = [r for r in out.values() if "seconds" in r]
    out["pass"] = bool(ran) and all(math.isfinite(r["grad_norm"]) for r in ran)
    return out


def moved(base: torch.nn.Module, device: torch.device, tokens: Any, *overrides: str,
          masters: bool = True) -> float:
    """Summed |dw| of the actor after one update at lr 1e-6."""
    from ragen_core.trainer import init_state, update
    from ragen_core.trainer import models as trainer_models

    keep = trainer_models.fp32_masters
    if not masters:  # the trap: AdamW straight on bf16 weights
        trainer_models.fp32_masters = lambda *modules: None  # type: ignore[assignment]
    try:
        cfg = config(device, "trainer.actor_lr=1e-6", "trainer.critic_lr=1e-6", *overrides)
        state = init_state(cfg, base)
    finally:
        trainer_models.fp32_masters = keep  # type: ignore[assignment]
    params = [p for p in state.models.actor.parameters() if p.requires_grad]
    before = [p.detach().float().clone() for p in params]
    update(state, tokens, cfg)
    return float(sum((p.detach().float() - b).abs().sum() for p, b in zip(params, before, strict=True)))


def section_lr(device: torch.device, shape: dict[str, Any], rows: int, prompt: int, reply: int) -> Result:
    base = qwen2(shape, device)
    tokens = batch(rows, prompt, reply, shape["vocab_size"], seed=1)
    fp32 = moved(base, device, tokens)
    bf16 = moved(base, device, tokens, "model.dtype=bfloat16", "trainer.precision=bf16")
    trap = moved(base.to(torch.bfloat16), device, tokens, "model.dtype=bfloat16", "trainer.precision=bf16",
                 masters=False)
    ratio, trap_ratio = bf16 / fp32, trap / fp32
    return {"fp32_dw": fp32, "bf16_mixed_dw": bf16, "bf16_weights_dw": trap, "bf16_over_fp32": round(ratio, 4),
            "trap_over_fp32": round(trap_ratio, 4), "pass": 0.9 < ratio < 1.1 and trap_ratio < 0.5}


def section_rollout(device: torch.device, shape: dict[str, Any], rows: int, prompt: int, new: int) -> Result:
    from ragen_core.models.tiny import tiny_tokenizer
    from ragen_core.rollout.generators.base import SamplingParams
    from ragen_core.rollout.generators.hf import HFGenerator

    model = qwen2(shape, device)
    gen = HFGenerator(model, tiny_tokenizer())  # the tokenizer gives eos/pad ids; prompts are random ids
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, shape["vocab_size"], (prompt,), generator=g).tolist() for _ in range(rows)]
    params = SamplingParams(max_new_tokens=new, temperature=1.0, seed=0)
    gen.generate(prompts[:2], SamplingParams(max_new_tokens=4, temperature=1.0, seed=0))  # warm-up
    sync(device)
    start = time.perf_counter()
    out = gen.generate(prompts, params)
    sync(device)
    seconds = time.perf_counter() - start
    made = sum(len(o.token_ids) for o in out)
    return {"rows": rows, "prompt": prompt, "generated": made, "seconds": round(seconds, 3),
            "tok_s": round(made / seconds, 1), "fast_decode": gen._step is not None}


TRAIN_VARIANTS = {  # name: overrides of experiments/smoke.yaml on a tiny Qwen2
    "starpo-s": [],
    # vanilla under LoRA: the k1 KL in the loss (its reference forward only on the iterations that log it,
    # diagnostics.kl_every) and LoRA layers that hand autocast their bf16 inputs uncast
    "starpo-lora": ["preset=starpo", "model.lora_rank=8", "diagnostics.kl_every=2"],
}


def section_train(device: torch.device, iterations: int) -> Result:
    from ragen_core import session
    from ragen_core.config import load_experiment
    from ragen_core.tracking import NullLogger

    out: Result = {}
    for name, overrides in TRAIN_VARIANTS.items():
        with tempfile.TemporaryDirectory(prefix="ragen-gpu-probe-") as data:
            os.environ["RAGEN_DATA_DIR"] = data
            cfg = load_experiment(ROOT / "experiments" / "smoke.yaml",
                                  ["model.name=tiny-qwen2", f"model.device={device.type}", "rollout.backend=hf",
                                   "trainer.backend=torch", f"trainer.iterations={iterations}", "eval.every=0",
                                   "trainer.checkpoint_every=0", "tracking.backend=none", "trainer.precision=bf16",
                                   *overrides])
            sess = session.open_session(cfg, NullLogger(record=False), say=lambda line: None)
            start = time.perf_counter()
            rows = [session.run_iteration(sess) for _ in range(iterations)]
            seconds = time.perf_counter() - start
            on_device = next(sess.state.models.actor.parameters()).device.type == device.type
        # losses, grad norms and entropy (explained variance is NaN when the returns do not vary: the tiny model's)
        checked = ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "critic/value_loss", "critic/grad_norm")
        finite = all(math.isfinite(r[k]) for r in rows for k in checked if k in r)
        kl_logged = [i for i, r in enumerate(rows) if "actor/kl_ref" in r]
        out[name] = {"iterations": len(rows), "seconds_per_iteration": round(seconds / len(rows), 3),
                     "on_device": on_device, "finite": finite, "kl_ref_logged_at": kl_logged,
                     "pass": on_device and finite and len(rows) == iterations}
    out["pass"] = all(r["pass"] for r in out.values())
    return out


def run(name: str, fn: Callable[[], Result], sections: dict[str, Result], deadline: float) -> Result | None:
    if time.monotonic() > deadline:
        sections[name] = {"skipped": "time budget"}
        return None
    print(f"[gpu_probe] {name} ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001 -- every section reports; one failure must not hide the others
        result = {"pass": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
    result["section_s"] = round(time.perf_counter() - start, 1)
    sections[name] = result
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--budget-s", type=float, default=480.0, help="sections left when this runs out are skipped")
    p.add_argument("--only", default="matmul,update,lr_1e6,rollout,train")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    small = device.type == "cpu"
    if device.type == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"pass": False, "error": "no CUDA device"}))
        return 1
    started = time.monotonic()
    deadline = started + args.budget_s
    only = set(args.only.split(","))
    shapes = CPU_SHAPES if small else SHAPES
    first = next(iter(shapes.values()))
    rows, prompt, reply = (8, 48, 16) if small else (16, 512, 256)
    sections: Result = {}
    rates = {"fp32_tflops": 1.0, "bf16_tflops": 1.0}
    if "matmul" in only:
        rates = run("matmul", lambda: section_matmul(device, small), sections, deadline) or rates
    if "update" in only:
        run("update", lambda: section_update(device, shapes, rows, prompt, reply, rates, deadline), sections,
            deadline)
    if "lr_1e6" in only:
        run("lr_1e6", lambda: section_lr(device, first, rows, prompt, reply), sections, deadline)
    if "rollout" in only:
        run("rollout", lambda: section_rollout(device, first, 16 if small else 64, prompt if small else 256,
                                                16 if small else 128), sections, deadline)
    if "train" in only:
        run("train", lambda: section_train(device, 2 if small else 3), sections, deadline)
    failed = [name for name, r in sections.items() if r.get("pass") is False or "error" in r]
    env = {"torch": torch.__version__, "cuda": torch.version.cuda,
           "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None}
    print(json.dumps({"pass": not failed, "failed": failed, "device": str(device), "env": env,
                      "seconds": round(time.monotonic() - started, 1), "sections": sections}, default=str))
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
