"""DeepSpeed ZeRO stages 0-3 with the default model (SmolLM2-135M-Instruct), two processes under torchrun.

For each stage, ``torchrun --nproc_per_node 2`` runs this file as a worker: every rank builds the same
state (full fine-tuning, GRPO, no KL and no critic, so one model is trained), makes one untimed update
and one timed update on the same synthetic batch (``bench/update.py``'s), and reports its seconds, the
resident memory it holds between updates (after returning freed heap to the OS) and its peak during
the timed update. Rank 0 also saves the trained weights; the driver compares every stage's weights
with stage 0's (largest absolute difference), so the stages are checked to train alike, not only to run.

On one host the ranks share the CPU (one thread each here): the seconds compare stages, not machines.
ZeRO 1-3 keep a separate fp32 master copy of their partition, so with fp32 weights stage 1 can hold
more than stage 0; stage 3 also partitions the weights themselves.

Run:  .venv/bin/python bench/zero.py [--stages 0 1 2 3] [--rows 8 --seq-len 192]
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from update import DEFAULT_MODEL, PeakRSS, _cfg, _release_memory, synthetic_batch  # noqa: E402 -- after the sys.path line above


def worker(out: str, stage: int, rows: int, seq_len: int, micro: int) -> None:
    """One rank: build, warm up, time one update, report (rank 0 also saves the weights)."""
    from ragen_core.trainer import init_state, update

    cfg = _cfg("grpo", "algorithm.kl_coef=0.0", "trainer.backend=deepspeed", f"trainer.zero_stage={stage}",
               f"trainer.micro_batch_size={micro}", "rollout.responses_per_prompt=4", "trainer.actor_lr=1e-5")
    state = init_state(cfg)
    batch = synthetic_batch(rows, seq_len, 4, int(state.models.actor.config.vocab_size))
    update(state, batch, cfg)  # untimed: the allocator's first growth and DeepSpeed's lazy set-up
    _release_memory()  # what loading the full model left behind (ZeRO-3 has partitioned it since)
    held = psutil.Process().memory_info().rss / 2**30
    torch.distributed.barrier()
    mem = PeakRSS()
    with mem.measure():
        start = time.perf_counter()
        stats = update(state, batch, cfg)
        seconds = time.perf_counter() - start
    rank = torch.distributed.get_rank()
    report = {"rank": rank, "seconds": round(seconds, 2), "peak_rss_gib": mem.gib, "held_rss_gib": round(held, 2),
              "grad_norm": stats.metrics["actor/grad_norm"]}
    reports: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(reports, report)
    with state.full_weights():  # a collective under ZeRO-3: every rank enters
        weights = {k: v.detach().clone() for k, v in state.models.actor.state_dict().items()} if rank == 0 else None
    if rank == 0:
        torch.save({"reports": reports, "weights": weights}, out)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="*", default=[0, 1, 2, 3])
    parser.add_argument("--rows", type=int, default=8, help="sequences in the update batch")
    parser.add_argument("--seq-len", type=int, default=192, help="tokens per sequence")
    parser.add_argument("--micro", type=int, default=2, help="micro-batch rows per rank")
    parser.add_argument("--worker", nargs=2, metavar=("OUT", "STAGE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], int(args.worker[1]), args.rows, args.seq_len, args.micro)
        return

    from ragen_core.models import resolve_model

    resolve_model(DEFAULT_MODEL)  # provision once, before the ranks start
    started = time.perf_counter()
    result: dict[str, Any] = {"model": DEFAULT_MODEL, "world_size": 2, "shape": [args.rows, args.seq_len],
                              "torch": torch.__version__}
    base: dict[str, torch.Tensor] | None = None
    with tempfile.TemporaryDirectory() as tmp:
        for stage in args.stages:
            out = Path(tmp) / f"stage{stage}.pt"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                   "127.0.0.1", "--master_port", str(_free_port()), __file__, "--rows", str(args.rows),
                   "--seq-len", str(args.seq_len), "--micro", str(args.micro), "--worker", str(out), str(stage)]
            proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                                  check=False)
            if proc.returncode != 0:
                print(proc.stdout[-3000:] + proc.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"stage {stage}: torchrun exited with {proc.returncode}")
            got = torch.load(out, weights_only=True)
            reports = got["reports"]
            entry: dict[str, Any] = {
                "update_s": max(r["seconds"] for r in reports),
                "held_rss_gib_per_rank": [r["held_rss_gib"] for r in reports],
                "peak_rss_gib_per_rank": [r["peak_rss_gib"] for r in reports],
                "grad_norm": round(reports[0]["grad_norm"], 6)}
            if base is None:
                base = got["weights"]
            else:
                entry["max_weight_diff_vs_first"] = max(float((got["weights"][k] - base[k]).abs().max()) for k in base)
            result[f"zero{stage}"] = entry
            print(f"ZeRO-{stage}: {json.dumps(entry)}", flush=True)
    result["bench_s"] = round(time.perf_counter() - started, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
