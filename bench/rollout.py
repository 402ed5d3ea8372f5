"""Rollout generation benchmark: hf backend throughput, cross-turn cache reuse, vLLM speed-up.

Run:   .venv/bin/python bench/rollout.py            (default model, ~5-10 min on 2 idle CPU cores)
       .venv/bin/python bench/rollout.py --quick    (smaller rollout, for a smoke check)
The vLLM part runs in a child process of the same Python (``--vllm-python`` to choose another; vLLM binds
threads, so it stays out of the hf measurement's process); without vLLM ``vllm_speedup`` is null with the reason.

The last line printed is one JSON object:
  p1             multi-turn rollout generated tok/s (whole ``run_rollouts`` wall time: envs, rendering,
                 parsing, sampling) / raw batched ``model.generate`` tok/s on the same prompts and
                 lengths: every generate call of the rollout is replayed with ``model.generate`` on the
                 same left-padded prompts (full re-prefill, as generate has no cross-call cache), run for
                 exactly as many steps as the call's longest reply (``min_new_tokens = max_new_tokens``),
                 counting the same useful tokens. Target >= 0.90.
  p4             prefill seconds of the 5-turn FrozenLake rollout with naive re-prefill / with cache
                 reuse (same sampling seed, so the same dialogue). Target >= 2.0.
  vllm_speedup   rollout generated tok/s with the vllm backend / hf, same rollout settings and env
                 seeds (engine start excluded). Target >= 1.8.
  tok_s_b8/32/64 hf generated tok/s at batch 8/32/64: 239-token prompts, 64 new tokens, no stop token
                 (a fixed measurement setup), prefill included; decode_tok_s_b*: the decode steps alone.
  decode_roofline_frac  tok_s at the largest batch / (matmul FLOP/s / FLOPs per generated token):
                 the matmul rate is measured in this run (best fp32 1536^3 product, ``matmul_gflops``), a token
                 costs 2 FLOPs per weight (``flops_per_token``). Target >= 0.5. ``decode_only_roofline_frac``
                 leaves the prefill out; ``fast_decode_speedup`` = decode steps' tok/s / the same through
                 ``model.forward`` (decode_step.py off). ``grouped_*``: the same at the largest batch made of
                 prompt groups of ``--group-size`` rows (default 8), as a rollout's N responses per prompt come:
                 prefilled once, and the decode steps read each prompt's keys once per group (cascade
                 attention, decode_step.SharedPrefix).
  hf_vs_vllm     hf rollout tok/s / vLLM's on the same rollout (1 / vllm_speedup). Target >= 1.2.
                 ``--precision bf16``: both engines compute in bf16 (hf: bf16 matmuls over fp32 weights, as a
                 study with ``trainer.precision`` bf16 or auto samples on a CPU with AVX512-BF16 or AMX; vLLM:
                 ``dtype=bfloat16``); fp32 (the default) for both otherwise. ``--engines-only``: only the two
                 rollouts (no re-prefill, replay or batch measurements).
  cpu_capability the vector code torch ran (AVX512, AVX2, DEFAULT); ``ATEN_CPU_CAPABILITY=avx2`` lowers it, and
                 with ``ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2`` the run stands in for a CPU with
                 AVX2 only (the decode attention kernel is then built for AVX2; vLLM keeps its own dispatch).
  vllm_sync_memory_s, vllm_sync_disk_s  one iteration's weight sync into the vLLM engine (the default model's
                 fp32 state dict): handed over in memory, against a safetensors file written and reloaded (what an
                 engine in another process needs); ``sync_disk_over_memory`` is their ratio.
  cache_reuse_max_logprob_diff  largest |logprob difference| between the reuse and the naive rollout
                 over the same sampled tokens (must be <= 1e-4), plus counters of both runs.
Timings depend on machine load: other processes on the same cores slow everything, ratios less so.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
ENV_PARAMS = {"size": 4, "p_frozen": 0.8, "slippery": True}


@dataclass
class Recorder:
    """A Generator that forwards to ``inner`` and records each call's prompts and reply lengths."""

    inner: Any
    calls: list[tuple[list[list[int]], list[int], Any]] = field(default_factory=list)
    generations: list[list[Any]] = field(default_factory=list)

    def generate(
        self, prompts: Sequence[Sequence[int]], params: Any, session_ids: Sequence[Hashable] | None = None
    ):
        out = self.inner.generate(prompts, params, session_ids)
        self.calls.append(([list(p) for p in prompts], [len(g.token_ids) for g in out], params))
        self.generations.append(out)
        return out

    def end_sessions(self, session_ids: Iterable[Hashable]) -> None:
        self.inner.end_sessions(session_ids)

    def update_weights(self, model: Any) -> None:
        self.inner.update_weights(model)

    @property
    def stats(self) -> dict[str, float]:
        return self.inner.stats


def rollout_settings(args: argparse.Namespace) -> tuple[Any, Any, list[int]]:
    from ragen_core.config import EnvConfig, RolloutConfig

    cfg = RolloutConfig(max_turns=5, max_new_tokens=args.max_new_tokens, temperature=1.0, top_p=1.0)
    seeds = list(range(1000, 1000 + args.groups))
    return EnvConfig(name="FrozenLake", params=dict(ENV_PARAMS)), cfg, seeds


def run_rollout(
    generator: Any, tokenizer: Any, args: argparse.Namespace, max_len: int
) -> tuple[Recorder, float]:
    from ragen_core.rollout import run_rollouts

    env_cfg, cfg, seeds = rollout_settings(args)
    rec = Recorder(generator)
    start = time.perf_counter()
    run_rollouts(
        env_cfg, rec, tokenizer, cfg, seeds, args.per_group, sampling_seed=args.seed, model_max_length=max_len
    )
    return rec, time.perf_counter() - start


def generated(rec: Recorder) -> int:
    return sum(sum(lengths) for _, lengths, _ in rec.calls)


def batch_throughput(model: Any, tokenizer: Any, batch: int, prompt_len: int = 239, new: int = 64,
                     fast_decode: bool = True, group: int = 1) -> tuple[float, float]:
    """hf backend generated tok/s on random prompts (no stop token: every row makes ``new`` tokens), prefill
    included, and the decode steps' own rate (tokens fed through decode steps / their seconds). ``group``:
    rows per distinct prompt (a rollout's N responses per prompt; 1 = every prompt distinct)."""
    import torch

    from ragen_core.rollout.generators import SamplingParams, make_generator

    gen = torch.Generator().manual_seed(batch)
    distinct = torch.randint(100, tokenizer.vocab_size - 100, (batch // group, prompt_len), generator=gen).tolist()
    prompts = [p for p in distinct for _ in range(group)]
    hf = make_generator("hf", model, tokenizer, fast_decode=fast_decode)
    start = time.perf_counter()
    out = hf.generate(prompts, SamplingParams(max_new_tokens=new, seed=0))
    seconds = time.perf_counter() - start
    stats = hf.stats
    return sum(len(g.token_ids) for g in out) / seconds, stats["decode_tokens"] / stats["decode_seconds"]


def replay_with_generate(model: Any, tokenizer: Any, rec: Recorder) -> float:
    """Seconds ``model.generate`` takes for the same calls (prompts, steps) as the recorded rollout."""
    import torch

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    seconds = 0.0
    for prompts, lengths, params in rec.calls:
        width = max(map(len, prompts))
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        steps = max(lengths)
        torch.manual_seed(0)
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=True,
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=0,
                min_new_tokens=steps,
                max_new_tokens=steps,
                pad_token_id=pad,
            )
        seconds += time.perf_counter() - start
    return seconds


def max_logprob_diff(a: Recorder, b: Recorder) -> tuple[float, int]:
    """Largest |logprob difference| over tokens both runs sampled identically after the same prompt,
    and rows whose replies diverged.

    Float rounding differs between the two prefill paths, so now and then a sampled token flips
    (a uniform draw right at a boundary); from there that episode's dialogue differs, and its later
    turns are not comparable: a row counts only when its prompt (the whole dialogue so far) is the
    same token for token in both runs.
    """
    worst, diverged = 0.0, 0
    for (prompts_a, _, _), (prompts_b, _, _), gens_a, gens_b in zip(
        a.calls, b.calls, a.generations, b.generations, strict=False
    ):
        for pa, pb, x, y in zip(prompts_a, prompts_b, gens_a, gens_b, strict=False):
            if pa != pb:
                continue
            n = 0
            while n < min(len(x.token_ids), len(y.token_ids)) and x.token_ids[n] == y.token_ids[n]:
                n += 1
            diverged += int(x.token_ids != y.token_ids)
            worst = max([worst, *(abs(p - q) for p, q in zip(x.logprobs[:n], y.logprobs[:n], strict=True))])
    return worst, diverged


def vllm_worker(args: argparse.Namespace) -> dict[str, Any]:
    """Run in the vLLM venv: the same rollout with the vllm backend; prints its own JSON line."""
    from ragen_core.models import DEFAULT_MODEL, load_tokenizer, resolve_model
    from ragen_core.rollout.generators.vllm_backend import VLLMGenerator

    tokenizer = load_tokenizer(DEFAULT_MODEL)
    start = time.perf_counter()
    gen = VLLMGenerator(resolve_model(DEFAULT_MODEL), tokenizer, max_model_len=args.max_len,
                        dtype="bfloat16" if args.precision == "bf16" else None)
    startup = time.perf_counter() - start
    rec, seconds = run_rollout(gen, tokenizer, args, args.max_len)
    result = {
        "vllm_startup_s": round(startup, 1),
        "vllm_rollout_s": round(seconds, 2),
        "vllm_generated_tokens": generated(rec),
        "vllm_rollout_tok_s": generated(rec) / seconds,
        "vllm_stats": gen.stats,
        **weight_sync_seconds(gen),
    }
    gen.close()
    return result


def weight_sync_seconds(gen: Any, repeats: int = 3) -> dict[str, Any]:
    """The trainer -> engine weight sync of one iteration, the default model's whole state dict in fp32: in memory
    (the tensors handed to the in-process engine's load_weights) against through the disk (a safetensors file
    written and reloaded, what a multi-process engine needs); best of ``repeats`` each, same engine."""
    from ragen_core.models import DEFAULT_MODEL, load_model

    model = load_model(DEFAULT_MODEL)
    best: dict[str, float] = {}
    for mode in ["memory", "disk"] * repeats:
        gen.weight_sync = mode
        before = gen.stats["sync_seconds"]
        gen.update_weights(model)
        best[mode] = min(best.get(mode, float("inf")), gen.stats["sync_seconds"] - before)
    return {"vllm_sync_memory_s": round(best["memory"], 3), "vllm_sync_disk_s": round(best["disk"], 3),
            "sync_disk_over_memory": round(best["disk"] / best["memory"], 2)}


def run_vllm(args: argparse.Namespace, max_len: int) -> tuple[dict[str, Any] | None, str | None]:
    python = Path(args.vllm_python)
    if not python.exists():
        return None, f"{python} not found"
    cmd = [str(python), str(Path(__file__).resolve()), "--vllm-worker", "--max-len", str(max_len)]
    cmd += ["--groups", str(args.groups), "--per-group", str(args.per_group)]
    cmd += ["--max-new-tokens", str(args.max_new_tokens), "--seed", str(args.seed), "--precision", args.precision]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        cmd, check=False, capture_output=True, text=True, env=env, cwd=ROOT, timeout=args.vllm_timeout
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return None, f"vllm worker failed (exit {proc.returncode}): {proc.stderr.strip()[-500:]}"
    return json.loads(lines[-1]), None


def say(msg: str) -> None:
    """Progress goes to stderr: stdout's last line is the JSON result."""
    print(msg, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--groups", type=int, default=4, help="FrozenLake prompt groups (initial states)")
    p.add_argument("--per-group", type=int, default=8, help="episodes per group")
    p.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per reply")
    p.add_argument("--seed", type=int, default=0, help="sampling seed of the rollouts")
    p.add_argument("--batches", default="8,32,64", help="batch sizes for the raw throughput numbers")
    p.add_argument("--group-size", type=int, default=8, help="rows per prompt in the grouped batch measurement")
    p.add_argument("--quick", action="store_true", help="2 groups x 4 episodes, 32 new tokens, batches 8")
    p.add_argument("--no-vllm", action="store_true", help="skip the vLLM part")
    p.add_argument("--vllm-python", default=sys.executable, help="Python with vLLM (default: this one)")
    p.add_argument("--vllm-timeout", type=int, default=900)
    p.add_argument("--vllm-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--max-len", type=int, default=2048, help=argparse.SUPPRESS)
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32", help="both engines' compute precision")
    p.add_argument("--engines-only", action="store_true", help="only the hf and vLLM rollouts: hf_vs_vllm")
    args = p.parse_args(argv)
    if args.quick:
        args.groups, args.per_group, args.max_new_tokens, args.batches = 2, 4, 32, "8"
    if args.vllm_worker:
        print(json.dumps(vllm_worker(args)), flush=True)
        return 0

    import torch

    from ragen_core.models import DEFAULT_MODEL, load_model, load_tokenizer
    from ragen_core.rollout.generators import cpu_attention, make_generator

    torch.manual_seed(0)
    model, tokenizer = load_model(DEFAULT_MODEL), load_tokenizer(DEFAULT_MODEL)
    max_len = args.max_len
    result: dict[str, Any] = {"model": DEFAULT_MODEL, "threads": torch.get_num_threads(), "precision": args.precision}
    result["rollout"] = {
        "env": "FrozenLake",
        "groups": args.groups,
        "per_group": args.per_group,
        "max_turns": 5,
        "max_new_tokens": args.max_new_tokens,
    }

    cpu_attention.kernel_available()  # the decode kernel is compiled once per environment: before anything is timed
    say("rollout with cache reuse ...")
    reuse = make_generator("hf", model, tokenizer, cache_reuse=True, max_length=max_len, fast_decode=True,
                           compute_dtype=torch.bfloat16 if args.precision == "bf16" else None)
    rec_reuse, t_reuse = run_rollout(reuse, tokenizer, args, max_len)
    hf_tok_s = generated(rec_reuse) / t_reuse
    say(f"  {generated(rec_reuse)} tokens in {t_reuse:.1f} s; {reuse.stats}")
    if args.engines_only:
        result.update(hf_rollout_tok_s=hf_tok_s, cpu_capability=str(torch.backends.cpu.get_cpu_capability()))
        return engines(args, max_len, hf_tok_s, result)

    say("rollout with naive re-prefill ...")
    naive = make_generator("hf", model, tokenizer, cache_reuse=False, max_length=max_len, fast_decode=True,
                           compute_dtype=torch.bfloat16 if args.precision == "bf16" else None)
    rec_naive, t_naive = run_rollout(naive, tokenizer, args, max_len)
    say(f"  {generated(rec_naive)} tokens in {t_naive:.1f} s; {naive.stats}")
    diff, diverged = max_logprob_diff(rec_reuse, rec_naive)

    say("replaying the reuse rollout's calls with model.generate ...")
    t_generate = replay_with_generate(model, tokenizer, rec_reuse)
    generate_tok_s = generated(rec_reuse) / t_generate

    result.update(
        p1=hf_tok_s / generate_tok_s,
        p4=naive.stats["prefill_seconds"] / reuse.stats["prefill_seconds"],
        hf_rollout_tok_s=hf_tok_s,
        generate_replay_tok_s=generate_tok_s,
        naive_rollout_tok_s=generated(rec_naive) / t_naive,
        cache_reuse_max_logprob_diff=diff,
        cache_reuse_diverged_rows=diverged,
        turn_calls=len(rec_reuse.calls),
        reuse_stats=reuse.stats,
        naive_stats=naive.stats,
    )
    for batch in (int(b) for b in args.batches.split(",") if b):
        say(f"raw hf throughput at batch {batch} ...")
        result[f"tok_s_b{batch}"], result[f"decode_tok_s_b{batch}"] = batch_throughput(model, tokenizer, batch)
    # the decode roofline: generated tok/s at the largest batch / (matmul FLOP/s / FLOPs per token)
    top = max(int(b) for b in args.batches.split(",") if b)
    from matmul import matmul_rate  # torch is imported only once the thread settings are made

    flops = matmul_rate(n=1536, repeats=10)
    per_token = 2 * sum(p.numel() for p in model.parameters())  # every weight once per token (tied head included)
    # as rollouts run: the batch in prompt groups of --group-size rows (prefilled once; cascade attention)
    say(f"raw hf throughput at batch {top} in prompt groups of {args.group_size} ...")
    grouped, grouped_decode = batch_throughput(model, tokenizer, top, group=args.group_size)
    say(f"model.forward decode at batch {top}, for comparison ...")
    slow, slow_decode = batch_throughput(model, tokenizer, top, fast_decode=False)
    result.update(
        cpu_capability=str(torch.backends.cpu.get_cpu_capability()),
        matmul_gflops=flops / 1e9,
        flops_per_token=per_token,
        roofline_tok_s=flops / per_token,
        roofline_batch=top,
        decode_roofline_frac=result[f"tok_s_b{top}"] / (flops / per_token),
        decode_only_roofline_frac=result[f"decode_tok_s_b{top}"] / (flops / per_token),
        group_size=args.group_size,
        grouped_tok_s=grouped,
        grouped_decode_tok_s=grouped_decode,
        grouped_roofline_frac=grouped / (flops / per_token),
        grouped_decode_only_roofline_frac=grouped_decode / (flops / per_token),
        model_forward_tok_s=slow,
        model_forward_decode_tok_s=slow_decode,
        fast_decode_speedup=result[f"decode_tok_s_b{top}"] / slow_decode,
    )
    return engines(args, max_len, hf_tok_s, result)


def engines(args: argparse.Namespace, max_len: int, hf_tok_s: float, result: dict[str, Any]) -> int:
    """The vLLM side of the same rollout, hf_vs_vllm, and the JSON line."""
    if args.no_vllm:
        result["vllm_speedup"], result["vllm_note"] = None, "skipped (--no-vllm)"
    else:
        say("the same rollout with the vllm backend (separate venv) ...")
        vllm, why = run_vllm(args, max_len)
        result["vllm_speedup"] = None if vllm is None else vllm["vllm_rollout_tok_s"] / hf_tok_s
        result["hf_vs_vllm"] = None if vllm is None else hf_tok_s / vllm["vllm_rollout_tok_s"]  # target >= 1.2
        if vllm is not None:
            result.update(vllm)
        else:
            result["vllm_note"] = why
    print(json.dumps(result, default=float), flush=True)
    return 0


if __name__ == "__main__":  # vLLM spawns processes: keep module import side-effect free
    sys.exit(main())
