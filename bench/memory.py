"""Benchmark: a run's resident memory per step, with the free heap given back after each step and without.

Runs a case of bench/iteration.py (default ``frozenlake``: StarPO-S at studies/echo-trap-frozenlake.yaml's
multi-turn setting) for ``--iterations`` iterations through ``ragen_core.session`` (no Prefect, no MLflow), every
step each iteration (evaluation, collapse diagnostics, gradient analysis), twice, each side in a fresh process:
``release`` (each step ends with ``malloc_trim``, ragen_core/memory.py, as runs do) and ``keep`` (freed heap stays
resident). Same seeds, so both sides sample the same episodes as far as their arithmetic agrees.

Per side: the run's peak resident memory (``perf/peak_rss_gib``), each step's largest peak
(``perf/peak_rss_gib/<step>``), the resident memory after the last iteration, and the mean iteration seconds
(the first iteration left out). ``peak_keep_over_release`` is how much higher the peak is when freed memory stays;
``time_release_over_keep`` what giving it back costs in time (pages faulted in again). Two runs fit at a time
where twice the ``release`` peak fits in the memory available (flows/sweep.py ``study_workers``).

Run:  .venv/bin/python bench/memory.py [--case frozenlake|vanilla|demo] [--iterations 3] [--set key=value ...]
The last line printed is one JSON object: {"release": {...}, "keep": {...}, "peak_keep_over_release": ...,
"time_release_over_keep": ...}
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from iteration import CASES, case_setting

STEPS = ("rollout", "diagnose", "grad_buckets", "update", "eval")


def one_side(experiment: str, overrides: list[str], release: bool) -> dict[str, object]:
    """Open a session, run its iterations, and report its memory (this process, one side)."""
    from ragen_core import session
    from ragen_core.config import load_experiment
    from ragen_core.tracking import NullLogger

    cfg = load_experiment(experiment, overrides)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        sess = session.open_session(cfg, NullLogger(), Path(tmp) / "run", say=lambda line: None)
        sess.memory.release = release
        while not sess.done:
            started = time.perf_counter()
            row = session.run_iteration(sess)
            rows.append({**row, "seconds": time.perf_counter() - started})
        resident = next(int(line.split()[1]) * 1024 for line in Path("/proc/self/status").read_text().splitlines()
                        if line.startswith("VmRSS:"))
    timed = [r["seconds"] for r in rows[1:]] or [r["seconds"] for r in rows]
    return {
        "peak_gib": round(max(r["perf/peak_rss_gib"] for r in rows), 2),
        "step_peak_gib": {s: round(max(r.get(f"perf/peak_rss_gib/{s}", 0.0) for r in rows), 2) for s in STEPS},
        "resident_after_gib": round(resident / 2**30, 2),
        "iteration_s": round(sum(timed) / len(timed), 1),
        "val_success": [round(r["val/success"], 3) for r in rows if "val/success" in r],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=sorted(CASES), default="frozenlake")
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="config override key=value")
    parser.add_argument("--side", choices=["release", "keep"], help=argparse.SUPPRESS)  # one side, in its process
    args = parser.parse_args()
    experiment, case_overrides = case_setting(args.case)
    overrides = [*case_overrides, f"trainer.iterations={args.iterations}", "trainer.checkpoint_every=0",
                 "eval.every=1", "diagnostics.collapse_every=1", "diagnostics.grad_buckets_every=1", *args.overrides]
    if args.side:
        print(json.dumps(one_side(experiment, overrides, args.side == "release")), flush=True)
        return
    print(f"case {args.case}: {experiment} " + " ".join(f"--set {o}" for o in overrides), flush=True)
    out: dict[str, object] = {}
    for side in ("release", "keep"):
        cmd = [sys.executable, __file__, "--case", args.case, "--iterations", str(args.iterations), "--side", side]
        for item in args.overrides:
            cmd += ["--set", item]
        done = subprocess.run(cmd, check=True, capture_output=True, text=True)
        out[side] = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"{side}: {out[side]}", flush=True)
    release, keep = out["release"], out["keep"]
    assert isinstance(release, dict) and isinstance(keep, dict)
    out["peak_keep_over_release"] = round(keep["peak_gib"] / release["peak_gib"], 2)
    out["time_release_over_keep"] = round(release["iteration_s"] / keep["iteration_s"], 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
