"""Benchmark of the trainer update with the default model (SmolLM2-135M-Instruct), on CPU or GPU.

Three ratios and peak memory:

- ``p2`` = our update's tokens/s ÷ a raw forward+backward+AdamW (fused, as ours) loop's tokens/s, same model,
  same rows × length, same micro-batches (``--micro`` rows and ``--micro-tokens`` token positions at most,
  default the config's ``trainer.micro_batch_tokens``: 512, so 384-token rows go one by one) (target ≥ 0.85).
  The update is actor-only here (GRPO, no KL, no critic) so both sides train one model; the raw loop computes the full
  [B, T, V] logits and a masked next-token log-likelihood. Our side adds entropy, the PPO loss
  and its statistics, and skips the output layer on the prompt. Each side first runs one untimed
  step at the full shape; then ``--repeats`` timed steps each, interleaved, the fastest counting.
- ``p5`` = seconds of filter_batch + update with filter_value 0.25 ÷ filter_value 1.0 on the same
  rollout batch, StarPO-S (separate critic, no KL). The paper's ratio is about 0.35.
- ``p3`` = seconds per GRPO step (rollout + update) of ours ÷ TRL's ``GRPOTrainer`` on the
  single-turn Bandit task: same model, 4 prompts × 4 generations, 32-token completions,
  KL 0.001 on both, no gradient checkpointing on both, forward/backward in micro-batches of
  ``--micro`` completions on both (TRL: per-device batch × gradient accumulation). TRL runs in its own interpreter (a
  venv under /tmp that reuses this venv's packages and adds ``trl``; made on first use, pass
  ``--no-trl`` to skip). The first step of each side is a warm-up and is not timed.
- ``peak_rss_gib``: peak resident memory of this process during each part (sampled every 50 ms). In
  p2 both sides' models and optimizers live in one process, so these include the other side's.
- ``mem``: the p2 update alone in a fresh process, for memory: ``mem_peak_gib`` (peak RSS over two
  steps at the p2 shape), ``mem_setup_gib`` (RSS once the model and optimizer exist, before the first
  step) and ``mem_step_s`` (the second step's wall time), for our update and the raw loop, each
  without and with activation checkpointing of the backbone (``model.gradient_checkpointing``).
  ``p2_ckpt`` = raw ÷ ours step time, both checkpointed (separate processes, run one after another).
- ``loss``: the output layer and its log-prob/entropy loss, forward + backward, on the demo's micro-batch
  (8 x 40 positions): ``loss_speedup`` = autograd's chain (einsum entropy) ÷ ``losses.logprobs_and_entropy``
  with its gradient written out, interleaved 12 times, the median of the best 6; ``loss_fused_speedup`` (fp32) and
  ``loss_fused_speedup_bf16`` (under bf16 autocast) = the written-out pass ÷ the trainer's fused CPU kernel.
- ``pack``: one prompt group's forward + backward with its replies packed into one row vs padded to the
  longest (``forward.hidden_states``), for four shapes of group; ``pack_speedup`` per case and
  ``pack_model_right``: whether ``forward.pack_pays`` chose the faster layout in each.

Run:  .venv/bin/python bench/update.py [--rows 16 --seq-len 384] [--no-trl]
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Self

import psutil
import torch

from ragen_core import memory
from ragen_core.config import TrainerConfig

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = "smollm2-135m-instruct"
TRL_VERSION = "1.16.0"


# --------------------------------------------------------------------------- helpers


class PeakRSS:
    """Peak resident set size of this process while the block runs (a 50 ms sampling thread)."""

    def __init__(self) -> None:
        self.peak = 0

    @contextlib.contextmanager
    def measure(self) -> Iterator[None]:
        proc, stop = psutil.Process(), threading.Event()

        def sample() -> None:
            while not stop.is_set():
                self.peak = max(self.peak, proc.memory_info().rss)
                stop.wait(0.05)

        thread = threading.Thread(target=sample, daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
            self.peak = max(self.peak, proc.memory_info().rss)

    @property
    def gib(self) -> float:
        return round(self.peak / 2**30, 2)


class Clock:
    """Wall and process CPU seconds of a block. On a shared machine CPU seconds are the steadier
    measure (other processes' load stretches wall time, much less this process's own CPU time)."""

    def __enter__(self) -> Self:
        self._wall, self._cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self._wall
        self.cpu = time.process_time() - self._cpu


def _release_memory() -> None:
    """Return freed heap to the OS (glibc keeps it otherwise), so a following subprocess has room."""
    import ctypes
    import gc

    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _cfg(preset: str, *overrides: str):
    from ragen_core.config import PRESETS, ExperimentConfig, apply_overrides, build_config

    raw = apply_overrides({}, [f"model.name={DEFAULT_MODEL}", *overrides])
    algo = {**PRESETS[preset].get("algorithm", {}), **raw.get("algorithm", {})}
    return build_config(ExperimentConfig, {**raw, "preset": preset, "algorithm": algo})


def synthetic_batch(rows: int, seq_len: int, group_size: int, vocab: int, seed: int = 0, shared_prompt: bool = False):
    """A full-length multi-turn batch: a prompt (96 tokens, at most a quarter of the row), then replies
    of 48 tokens (trained) alternating with 24 env tokens (masked), until ``seq_len``; reward 0/1 on
    the last reply token. ``shared_prompt``: the rows of a group share their prompt, as a rollout's do
    (the update then runs it once per micro-batch); otherwise every token is random."""
    from ragen_core.types import TokenBatch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, seq_len), generator=g)
    if shared_prompt:
        n_prompt = min(96, seq_len // 4)
        ids[:, :n_prompt] = ids[(torch.arange(rows) // group_size) * group_size, :n_prompt]
    pattern = torch.zeros(seq_len, dtype=torch.bool)
    turn_ids = torch.zeros(seq_len, dtype=torch.long)
    turn_ends = torch.zeros(seq_len, dtype=torch.bool)
    pos, turn = min(96, seq_len // 4), 0
    while pos < seq_len:
        end = min(pos + 48, seq_len)
        pattern[pos:end] = True
        turn_ids[pos:end] = turn
        turn_ends[end - 1] = True
        turn_ids[end:end + 24] = turn + 1
        pos, turn = end + 24, turn + 1
    loss_mask = pattern.expand(rows, -1).clone()
    returns = torch.randint(0, 2, (rows,), generator=g).float()
    rewards = torch.zeros(rows, seq_len)
    last = int(pattern.nonzero().max())
    rewards[:, last] = returns
    old_logprobs = torch.where(loss_mask, torch.full((rows, seq_len), -2.0), torch.zeros(rows, seq_len))
    return TokenBatch(ids, torch.ones(rows, seq_len, dtype=torch.bool), loss_mask, old_logprobs, rewards,
                      turn_ids.expand(rows, -1).clone(), turn_ends.expand(rows, -1).clone(),
                      torch.arange(rows) // group_size, returns)


# --------------------------------------------------------------------------- p2


def raw_blocks(cfg, batch) -> list[slice]:
    """The raw loop's micro-batches: ``update.micro_blocks`` with our row and token limits, counting every row
    whole (the raw loop shares no prompt). Without ``--shared-prompt`` these are exactly our micro-batches."""
    from ragen_core.trainer.update import micro_blocks

    return micro_blocks(batch.input_ids, batch.attention_mask, cfg.trainer.micro_batch_size,
                        cfg.trainer.micro_batch_tokens, share=False, pack=False)


def raw_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch, blocks: list[slice]) -> None:
    """The baseline: forward with full logits, masked next-token log-likelihood, backward, clip, AdamW."""
    n_loss = float(batch.loss_mask[:, 1:].sum())
    for s in blocks:
        ids, mask = batch.input_ids[s], batch.loss_mask[s, 1:]
        logits = model(input_ids=ids, attention_mask=batch.attention_mask[s].long()).logits
        logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        (-(logp * mask).sum() / n_loss).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def bench_p2(args: argparse.Namespace) -> dict[str, Any]:
    from ragen_core.trainer import init_state, update

    cfg = _cfg("grpo", "algorithm.kl_coef=0.0", f"trainer.micro_batch_size={args.micro}",
               f"trainer.micro_batch_tokens={args.micro_tokens}",
               f"trainer.logprob_chunk={args.chunk}", f"rollout.responses_per_prompt={args.group_size}")
    state = init_state(cfg)
    vocab = int(state.models.actor.config.vocab_size)
    batch = synthetic_batch(args.rows, args.seq_len, args.group_size, vocab)
    blocks = raw_blocks(cfg, batch)
    raw_state = init_state(cfg)  # an identical, separate model for the raw loop
    raw_model = raw_state.models.actor
    raw_opt = torch.optim.AdamW(raw_model.parameters(), lr=cfg.trainer.actor_lr, weight_decay=0.01, fused=True)
    mem_ours, mem_raw = PeakRSS(), PeakRSS()
    # One untimed step of each side at the full shape first: whichever side first meets the full
    # shape pays the allocator's first growth (measured: 20-25% slower, either side), which is not
    # update speed. The first-step wall time is still reported.
    with mem_ours.measure(), Clock() as first_ours:
        update(state, batch, cfg)
    with mem_raw.measure(), Clock() as first_raw:
        raw_step(raw_model, raw_opt, batch, blocks)
    ours_s, raw_s, ours_cpu, raw_cpu = [], [], [], []

    for r in range(args.repeats):  # interleaved, the order alternating, so load changes hit both sides alike
        for ours_side in ((True, False) if r % 2 == 0 else (False, True)):
            with (mem_ours if ours_side else mem_raw).measure(), Clock() as clock:
                if ours_side:
                    update(state, batch, cfg)
                else:
                    raw_step(raw_model, raw_opt, batch, blocks)
            (ours_s if ours_side else raw_s).append(clock.wall)
            (ours_cpu if ours_side else raw_cpu).append(clock.cpu)
    tokens = float(batch.attention_mask.sum())
    ours, raw = min(ours_s), min(raw_s)
    print(f"p2: ours {ours:.1f}s ({tokens / ours:.1f} tok/s)  raw {raw:.1f}s ({tokens / raw:.1f} tok/s)  "
          f"cpu-s ours {min(ours_cpu):.1f} raw {min(raw_cpu):.1f}", flush=True)
    del state, raw_state, raw_model, raw_opt
    return {"p2": round(raw / ours, 3), "p2_cpu": round(min(raw_cpu) / min(ours_cpu), 3),
            "p2_first_step_s": {"ours": round(first_ours.wall, 2), "raw": round(first_raw.wall, 2)},
            "p2_update_tokens_per_s": round(tokens / ours, 1),
            "p2_raw_tokens_per_s": round(tokens / raw, 1), "p2_update_s": round(ours, 2), "p2_raw_s": round(raw, 2),
            "p2_shape": [args.rows, args.seq_len], "peak_rss_gib_update": mem_ours.gib,
            "peak_rss_gib_raw": mem_raw.gib}


# --------------------------------------------------------------------------- mem


MEM_SIDES = ("ours", "ours_ckpt", "raw", "raw_ckpt")


def mem_worker(args: argparse.Namespace) -> None:
    """One side of the memory part, alone in this process: prints one JSON line."""
    from ragen_core.trainer import init_state, update

    side = args.mem_worker
    ckpt = side.endswith("_ckpt")
    mem = PeakRSS()
    with mem.measure():
        cfg = _cfg("grpo", "algorithm.kl_coef=0.0", f"trainer.micro_batch_size={args.micro}",
                   f"trainer.micro_batch_tokens={args.micro_tokens}",
                   f"trainer.logprob_chunk={args.chunk}", f"rollout.responses_per_prompt={args.group_size}",
                   f"model.gradient_checkpointing={str(ckpt).lower()}")
        state = init_state(cfg)
        vocab = int(state.models.actor.config.vocab_size)
        batch = synthetic_batch(args.rows, args.seq_len, args.group_size, vocab, shared_prompt=args.shared_prompt)
        if side.startswith("raw"):
            model = state.models.actor
            opt = torch.optim.AdamW(model.parameters(), lr=cfg.trainer.actor_lr, weight_decay=0.01, fused=True)
            # AdamW's moments exist from the first step on, as they do for our side after its first step
            step = lambda: raw_step(model, opt, batch, raw_blocks(cfg, batch))  # noqa: E731
        else:
            step = lambda: update(state, batch, cfg)  # noqa: E731
        setup = psutil.Process().memory_info().rss
        step()
        with Clock() as clock:
            step()
    print(json.dumps({"side": side, "peak_gib": mem.gib, "setup_gib": round(setup / 2**30, 2),
                      "step_s": round(clock.wall, 2)}))


def bench_mem(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for side in MEM_SIDES:
        _release_memory()
        proc = subprocess.run([sys.executable, __file__, "--mem-worker", side, "--rows", str(args.rows),
                               "--seq-len", str(args.seq_len), "--micro", str(args.micro), "--chunk", str(args.chunk),
                               "--micro-tokens", args.micro_tokens,
                               "--group-size", str(args.group_size)],
                              check=True, capture_output=True, text=True, cwd=REPO)
        row = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"mem {side}: peak {row['peak_gib']} GiB (setup {row['setup_gib']}), step {row['step_s']} s", flush=True)
        for key in ("peak_gib", "setup_gib", "step_s"):
            out.setdefault(f"mem_{key}", {})[side] = row[key]
    out["p2_ckpt"] = round(out["mem_step_s"]["raw_ckpt"] / out["mem_step_s"]["ours_ckpt"], 3)
    return out


# --------------------------------------------------------------------------- loss


def _autograd_logprobs_entropy(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same values as ``losses.logprobs_and_entropy``, differentiated by autograd (what it replaced)."""
    top = logits.detach().amax(dim=-1, keepdim=True)
    e = (logits - top).exp_()
    total = e.sum(dim=-1)
    lse = top.squeeze(-1) + total.log()
    picked = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    dot = torch.einsum("...v,...v->...", e, logits)
    return picked - lse, lse - dot / total


def bench_loss(args: argparse.Namespace) -> dict[str, Any]:
    """The output layer and its log-prob/entropy loss, forward + backward, on the demo's micro-batch (8 x 40
    positions), interleaved: ``losses.logprobs_and_entropy`` (gradient written out) vs autograd's chain
    (``loss_speedup``), and the trainer's fused CPU kernel (``forward._FusedLogprobsEntropy``) vs the written-out
    pass (``loss_fused_speedup``, in fp32, and under bf16 autocast as the trainer runs on a CPU with bf16 products:
    ``loss_fused_speedup_bf16``)."""
    from ragen_core.algos import losses
    from ragen_core.models import load_model
    from ragen_core.rollout.generators import cpu_attention
    from ragen_core.trainer.forward import _FusedLogprobsEntropy, decoder_and_head

    _, head = decoder_and_head(load_model(DEFAULT_MODEL))
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(8, 40, head.weight.shape[1], generator=g)
    labels = torch.randint(0, head.weight.shape[0], (8, 40), generator=g)
    ops = cpu_attention.loss_ops()

    def fused(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lp, ent = _FusedLogprobsEntropy.apply(logits.flatten(0, -2), labels.flatten(), 1.0, ops)
        return lp.view(labels.shape), ent.view(labels.shape)

    out: dict[str, Any] = {}
    for precision in ("fp32", "bf16"):
        sides = {"written_out": losses.logprobs_and_entropy, "autograd": _autograd_logprobs_entropy}
        if ops is not None:
            sides["fused"] = fused
        times: dict[str, list[float]] = {k: [] for k in sides}
        for r in range(12):
            for name in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
                h = hidden.clone().requires_grad_(True)
                with Clock() as clock:
                    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
                        logits = head(h)
                    if name == "autograd" or precision == "fp32":
                        logits = logits.float()
                    lp, ent = sides[name](logits, labels)
                    (lp.sum() + 0.01 * ent.sum()).backward()
                head.weight.grad = None
                times[name].append(clock.wall)
        best = {k: sorted(v)[:6][3] for k, v in times.items()}  # median of the best 6
        print(f"loss ({precision}): " + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in best.items()), flush=True)
        suffix = "" if precision == "fp32" else "_bf16"
        out[f"loss_ms{suffix}"] = {k: round(v * 1e3, 1) for k, v in best.items()}
        if precision == "fp32":
            out["loss_speedup"] = round(best["autograd"] / best["written_out"], 3)
        if "fused" in best:
            out[f"loss_fused_speedup{suffix}"] = round(best["written_out"] / best["fused"], 3)
    return out


# --------------------------------------------------------------------------- pack

PACK_CASES = {  # (shared prefix, each row's own tokens): one prompt group of 8
    "bandit": (190, [48, 10, 20, 30, 25, 25, 30, 20]),  # the demo's single-turn replies
    "uneven_multi_turn": (300, [60, 500, 120, 500, 300, 200, 250, 70]),  # episodes ending at different turns
    "even_multi_turn": (300, [400, 500, 450, 500, 420, 480, 460, 440]),  # the cost model should refuse this
    "mixed": (200, [100, 20, 150, 40, 160, 30, 90, 60]),
}


def bench_pack(args: argparse.Namespace) -> dict[str, Any]:
    """Forward + backward of one shared-prefix group, its replies packed into one row vs padded, against the
    decision of ``forward.pack_pays``: ``pack_speedup`` = padded s / packed s per case (fastest of 2 each,
    interleaved), ``pack_model_right`` whether the cost model picked the faster layout in every case."""
    from unittest import mock

    from ragen_core.models import load_model
    from ragen_core.trainer import forward

    torch.manual_seed(0)
    model = load_model(DEFAULT_MODEL)
    model.train()
    decoder, _ = forward.decoder_and_head(model)
    speedup, decided = {}, {}
    for name, (prefix, tails) in PACK_CASES.items():
        g = torch.Generator().manual_seed(len(tails) * prefix)
        ids = torch.zeros(len(tails), prefix + max(tails), dtype=torch.long)
        mask = torch.zeros_like(ids, dtype=torch.bool)
        ids[:, :prefix] = torch.randint(100, 40000, (prefix,), generator=g)
        for row, n in enumerate(tails):
            ids[row, prefix:prefix + n] = torch.randint(100, 40000, (n,), generator=g)
            mask[row, :prefix + n] = True
        best = {True: float("inf"), False: float("inf")}
        for _ in range(2):
            for pack in (True, False):
                with mock.patch.object(forward, "pack_pays", lambda tails, prefix, pack=pack: pack), Clock() as clock:
                    (forward.hidden_states(decoder, ids, mask) * mask[..., None]).sum().backward()
                model.zero_grad(set_to_none=True)
                best[pack] = min(best[pack], clock.wall)
        speedup[name] = round(best[False] / best[True], 3)
        decided[name] = forward.pack_pays(tails, prefix)
        print(f"pack {name}: packed {best[True]:.2f} s, padded {best[False]:.2f} s; the cost model packs: "
              f"{decided[name]}", flush=True)
    right = all(decided[name] == (speedup[name] > 1.0) for name in PACK_CASES)
    return {"pack_speedup": speedup, "pack_decided": decided, "pack_model_right": right}


# --------------------------------------------------------------------------- p5


def bench_p5(args: argparse.Namespace) -> dict[str, Any]:
    from ragen_core.trainer import filter_batch, init_state, update

    n = args.p5_groups * args.p5_group_size
    seconds, cpu, peak = {}, {}, {}
    for keep in (1.0, 0.25):
        cfg = _cfg("starpo-s", f"algorithm.filter_value={keep}", f"trainer.micro_batch_size={args.micro}",
                   f"trainer.logprob_chunk={args.chunk}", f"rollout.responses_per_prompt={args.p5_group_size}")
        state = init_state(cfg)
        vocab = int(state.models.actor.config.vocab_size)
        batch = synthetic_batch(n, args.p5_seq_len, args.p5_group_size, vocab, seed=1)
        env_returns = torch.rand(n, generator=torch.Generator().manual_seed(2))  # distinct in-group stds
        update(state, synthetic_batch(min(args.micro, n), 64, args.p5_group_size, vocab), cfg)  # warm-up
        mem = PeakRSS()
        with mem.measure(), Clock() as clock:
            kept = filter_batch(batch, env_returns, cfg.algorithm)
            update(state, kept.batch, cfg)
        seconds[keep], cpu[keep] = clock.wall, clock.cpu
        peak[keep] = mem.gib
        print(f"p5: keep {keep}: {kept.batch.batch_size}/{n} rows, {seconds[keep]:.1f}s", flush=True)
        del state
    return {"p5": round(seconds[0.25] / seconds[1.0], 3), "p5_cpu": round(cpu[0.25] / cpu[1.0], 3),
            "p5_keep1_s": round(seconds[1.0], 2),
            "p5_keep025_s": round(seconds[0.25], 2), "p5_shape": [n, args.p5_seq_len],
            "peak_rss_gib_starpo_s_update": peak[1.0]}


# --------------------------------------------------------------------------- p3 (ours)


def bench_p3_ours(args: argparse.Namespace) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Seconds per GRPO step (rollout of 4×4 Bandit episodes + token batch + update); also the prompts."""
    from ragen_core.models import load_tokenizer
    from ragen_core.rollout import build_token_batch, run_rollouts
    from ragen_core.rollout.generators import make_generator
    from ragen_core.trainer import init_state, update

    cfg = _cfg("grpo", "env.name=Bandit", f"rollout.prompts_per_iter={args.p3_prompts}",
               f"rollout.responses_per_prompt={args.p3_generations}", f"rollout.max_new_tokens={args.p3_tokens}",
               "rollout.max_turns=1", f"trainer.micro_batch_size={args.micro}")
    state = init_state(cfg)
    tokenizer = load_tokenizer(cfg.model.name)
    generator = make_generator("hf", state.models.actor, tokenizer)
    times, cpus, prompts, mem = [], [], [], PeakRSS()
    for step in range(args.p3_steps + 1):
        seeds = list(range(step * args.p3_prompts, (step + 1) * args.p3_prompts))
        with mem.measure(), Clock() as clock:
            trajs = run_rollouts(cfg.env, generator, tokenizer, cfg.rollout, seeds, args.p3_generations,
                                 sampling_seed=step)
            batch = build_token_batch(trajs, tokenizer, cfg.rollout)
            update(state, batch, cfg)
            generator.update_weights(state.models.actor)
        times.append(clock.wall)
        cpus.append(clock.cpu)
        print(f"p3 ours: step {step}: {times[-1]:.1f}s ({batch.batch_size} rows × {batch.input_ids.shape[1]})",
              flush=True)
        for t in trajs[:: args.p3_generations]:
            prompts.append({"prompt": tokenizer.decode(list(t.turns[0].prompt_ids)), "seed": t.seed,
                            "prompt_tokens": len(t.turns[0].prompt_ids)})
    timed, timed_cpu = times[1:], cpus[1:]
    return {"p3_ours_step_s": round(sum(timed) / len(timed), 2),
            "p3_ours_step_cpu_s": round(sum(timed_cpu) / len(timed_cpu), 2), "peak_rss_gib_grpo_step": mem.gib}, prompts


# --------------------------------------------------------------------------- p3 (TRL)


def ensure_trl_python(venv: Path) -> Path:
    """A venv that sees this interpreter's packages (a .pth with site.addsitedir) and adds trl."""
    python = venv / "bin" / "python"
    has_trl = python.exists() and subprocess.run([str(python), "-c", "import trl"], check=False,
                                                  capture_output=True).returncode == 0
    if has_trl:
        return python
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    Path(site, "ragen_parent_venv.pth").write_text(
        f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n")
    # Pin everything this venv already has, so pip only adds trl and its missing dependencies.
    frozen = subprocess.run([sys.executable, "-m", "pip", "freeze", "--exclude-editable"], check=True,
                            capture_output=True, text=True).stdout
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as pins:
        pins.write("\n".join(line for line in frozen.splitlines() if "@" not in line))
    subprocess.run([str(python), "-m", "pip", "install", "-q", "-c", pins.name, f"trl=={TRL_VERSION}"], check=True)
    return python


def bench_p3_trl(args: argparse.Namespace, prompts: list[dict[str, Any]]) -> dict[str, Any]:
    from ragen_core.models import resolve_model

    python = ensure_trl_python(Path(args.trl_venv))
    model_dir = resolve_model(DEFAULT_MODEL)  # resolved here: the worker runs in a temp dir
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp, "prompts.json")
        spec.write_text(json.dumps(prompts))
        cmd = [str(python), str(Path(__file__).resolve()), "--trl-worker", str(spec), "--model-dir", str(model_dir),
               "--p3-steps", str(args.p3_steps),
               "--p3-prompts", str(args.p3_prompts), "--p3-generations", str(args.p3_generations),
               "--micro", str(args.micro),
               "--p3-tokens", str(args.p3_tokens)]
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True, cwd=tmp)
    if proc.returncode != 0:
        raise RuntimeError(f"TRL worker failed:\n{proc.stderr[-3000:]}")
    for line in proc.stdout.splitlines():
        if line.startswith("p3 trl"):
            print(line, flush=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def trl_worker(args: argparse.Namespace) -> None:
    """Runs inside the TRL venv: GRPOTrainer on the same Bandit prompts; prints per-step seconds as JSON."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from ragen_core.envs import make
    from ragen_core.rollout.parse import parse_response

    prompts = json.loads(Path(args.trl_worker).read_text())
    need = (args.p3_steps + 1) * args.p3_prompts
    rows = [prompts[i % len(prompts)] for i in range(need)]

    def bandit_reward(prompts, completions, seed, **_: Any) -> list[float]:
        out = []
        for text, s in zip(completions, seed, strict=True):
            parsed = parse_response(text, think=True, max_actions=1)
            env = make("Bandit")
            env.reset(seed=int(s))
            arm = env.match_action(parsed.actions[0]) if parsed.ok and parsed.actions else None
            out.append(float(env.step(arm)[1]) if arm is not None else -0.1)
        return out

    class Timer(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.cpus: list[float] = []
            self.t0 = self.c0 = 0.0

        def on_step_begin(self, *a: Any, **k: Any) -> None:
            self.t0, self.c0 = time.perf_counter(), time.process_time()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            self.times.append(time.perf_counter() - self.t0)
            self.cpus.append(time.process_time() - self.c0)
            print(f"p3 trl: step {len(self.times) - 1}: {self.times[-1]:.1f}s", flush=True)

    path = args.model_dir
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    config = GRPOConfig(
        output_dir="trl-out", max_steps=args.p3_steps + 1, learning_rate=1e-6, beta=0.001,
        # 4 prompts × 4 generations per optimizer step, forward/backward 4 completions at a time (as ours)
        num_generations=args.p3_generations, per_device_train_batch_size=args.micro,
        gradient_accumulation_steps=args.p3_prompts * args.p3_generations // args.micro,
        max_completion_length=args.p3_tokens, temperature=1.0,
        gradient_checkpointing=False, use_cpu=not torch.cuda.is_available(), bf16=False, report_to="none",
        save_strategy="no", logging_steps=10_000, shuffle_dataset=False, disable_dropout=True, seed=0,
    )
    timer = Timer()
    trainer = GRPOTrainer(model=model, reward_funcs=bandit_reward, args=config, processing_class=tokenizer,
                          train_dataset=Dataset.from_list([{"prompt": r["prompt"], "seed": r["seed"]} for r in rows]),
                          callbacks=[timer])
    trainer.train()
    timed, timed_cpu = timer.times[1:], timer.cpus[1:]
    print(json.dumps({"p3_trl_step_s": round(sum(timed) / len(timed), 2),
                      "p3_trl_step_cpu_s": round(sum(timed_cpu) / len(timed_cpu), 2),
                      "trl_version": __import__("trl").__version__}))


# --------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16, help="p2: sequences in the update batch")
    parser.add_argument("--seq-len", type=int, default=384, help="p2: tokens per sequence")
    parser.add_argument("--micro", type=int, default=4, help="micro-batch rows at most (p2, mem, p5)")
    parser.add_argument("--micro-tokens", default=str(TrainerConfig.micro_batch_tokens),
                        help="p2, mem: trainer.micro_batch_tokens, a number or null (rows only)")
    parser.add_argument("--chunk", type=int, default=128, help="trainer.logprob_chunk")
    parser.add_argument("--group-size", type=int, default=4, help="p2: rows per prompt group")
    parser.add_argument("--shared-prompt", action="store_true",
                        help="mem worker: a group's rows share their 96-token prompt (run once per micro-batch)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="p2: timed runs per side after an untimed one (the fastest counts)")
    parser.add_argument("--p5-groups", type=int, default=8, help="p5: prompt groups in the rollout batch")
    parser.add_argument("--p5-group-size", type=int, default=4, help="p5: responses per group")
    parser.add_argument("--p5-seq-len", type=int, default=192, help="p5: tokens per sequence")
    parser.add_argument("--p3-prompts", type=int, default=4)
    parser.add_argument("--p3-generations", type=int, default=4)
    parser.add_argument("--p3-tokens", type=int, default=32, help="p3: completion tokens")
    parser.add_argument("--p3-steps", type=int, default=2, help="p3: timed steps per side (after one warm-up)")
    parser.add_argument("--trl-venv", default="/tmp/ragen-trl-venv", help="where the TRL interpreter lives")
    parser.add_argument("--no-trl", action="store_true", help="skip the TRL side of p3 (p3 is then null)")
    parser.add_argument("--only", nargs="*", choices=["p2", "mem", "pack", "loss", "p5", "p3"],
                        default=["p2", "mem", "pack", "loss", "p5", "p3"])
    parser.add_argument("--trl-worker", help=argparse.SUPPRESS)
    parser.add_argument("--mem-worker", choices=MEM_SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    memory.use_huge_pages()  # as the ragen command runs (ragen_core/memory.py), before the first large tensor
    if args.trl_worker:
        trl_worker(args)
        return
    if args.mem_worker:
        mem_worker(args)
        return

    from ragen_core.models import resolve_model

    resolve_model(DEFAULT_MODEL)  # provision once, outside the timings
    result: dict[str, Any] = {"model": DEFAULT_MODEL, "device": "cuda" if torch.cuda.is_available() else "cpu",
                              "threads": torch.get_num_threads(), "torch": torch.__version__}
    started = time.perf_counter()
    if "p2" in args.only:
        result.update(bench_p2(args))
    if "mem" in args.only:
        result.update(bench_mem(args))
    if "pack" in args.only:
        result.update(bench_pack(args))
    if "loss" in args.only:
        result.update(bench_loss(args))
    if "p5" in args.only:
        result.update(bench_p5(args))
    if "p3" in args.only:
        ours, prompts = bench_p3_ours(args)
        result.update(ours)
        result["p3"] = None
        _release_memory()  # the TRL worker is a second process: give our freed model memory back first
        if args.no_trl:
            result["p3_note"] = "TRL side skipped (--no-trl)"
        else:
            try:
                trl = bench_p3_trl(args, prompts)
                result.update(trl)
                result["p3"] = round(ours["p3_ours_step_s"] / trl["p3_trl_step_s"], 3)
                result["p3_cpu"] = round(ours["p3_ours_step_cpu_s"] / trl["p3_trl_step_cpu_s"], 3)
            except (RuntimeError, subprocess.CalledProcessError, OSError) as exc:
                result["p3_note"] = f"TRL side failed: {str(exc)[-500:]}"
        result["p3_prompt_tokens_mean"] = round(sum(p["prompt_tokens"] for p in prompts) / max(len(prompts), 1), 1)
    result["bench_s"] = round(time.perf_counter() - started, 1)
    result["loadavg_1m"] = round(os.getloadavg()[0], 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
