"""Benchmark: where the seconds of a training iteration go, on the demo with its defaults (plain session).

Runs ``experiments/demo.yaml`` (or another experiment) for ``--iterations`` iterations through
``ragen_core.session`` without Prefect or MLflow (a NullLogger), and times each step the flow chains:
evaluation, rollout, collapse diagnostics, filter, update, record (health checks, Parquet shard,
summary line) and checkpoint. The diagnostics run every ``diagnostics.collapse_every`` iterations, so
their share is reported per measuring iteration and amortised over the run (target: at most 10%).

With ``--flow`` the same experiment then runs as ``ragen train`` does: the Prefect flow (an
ephemeral server under a temporary PREFECT_HOME), MLflow tracking (sqlite in a temporary data dir),
artifacts, the Prefect artifacts and logs. Each recorded iteration carries its wall time
(``timing/iteration_s``, from one record to the next); the first iteration of each side is left out
(warm-up). ``orchestration_tracking_share`` = 1 - plain iteration s / flow iteration s (target < 5%).
The same rollout and update vary by about 10% between iterations on a shared 2-core machine, more than that
target, so ``orchestration_tracking_share_outside`` also gives the difference of the seconds each side spends
outside its timed steps (rollout, update, evaluation, collapse matrices), over the flow's iteration: the
overhead without the steps' noise. ``plain_vs_flow_step_s`` compares the steps themselves (CPU contention).

Cases (``--case``): ``demo`` (the default: experiments/demo.yaml), and the studies' settings, read from the study
files so they cannot drift: ``vanilla`` (StarPO, ``preset=starpo``, on studies/echo-trap-bandit.yaml's Bandit
setting) and ``frozenlake`` (StarPO-S on studies/echo-trap-frozenlake.yaml's multi-turn setting). Each reports the
share of every step of the loop, the update's no-grad passes apart (``update_prepass``: reference log-probs and a
separate critic's old values; ``update_recompute``: old log-probs recomputed), and ``update_roofline_frac``: the
FLOPs of one update as torch's FlopCounterMode counts them on a batch of one more rollout, over the seconds the
same update takes uncounted times the matmul rate of the run's precision measured in this run: the larger of the
rates measured before the iterations and right after that update, so that one unlucky measurement on a shared
machine does not flatter the fraction. The bf16 rate is measured only for a run that computes in bf16 (on a CPU
with no bf16 hardware one 2048-cubed product takes about a minute). That update runs as the loop's do on an
iteration that logs no KL. The count is the model's FLOPs: every matrix product (weights, adapters, output layer;
the fused LoRA's in-place ``addmm_`` too) and attention's products on the query-key pairs its mask lets through,
forward and backward, whichever kernel ran them (torch's CPU flash attention or the segment kernel, for which
FlopCounterMode has no formula of its own: bench/matmul.py's ``model_flop_mapping``). ``update_attention_flops_g``
is attention's part, and ``update_products_roofline_frac`` the fraction over the products' FLOPs alone.

The counted update also records its matrix products (bench/matmul.py's ProductRecorder: the op and its operands'
shapes, strides and dtypes) and times them where they run (``update_products_s``); they are then replayed alone, in
their order, on operands of their layouts (``update_products_replayed_s``, the best of 3). The products' FLOPs over
that replay's seconds times the same rate is ``update_roofline_ceiling_frac``: what ``update_products_roofline_frac``
would be if everything else in the update (attention, norms, casts, the optimizer, Python) took no time, with torch's
matrix products as they are.

To compare with an older checkout (side by side on one machine), run that checkout's bench with the same
``--set`` overrides the case prints (``overrides``), e.g. from a git worktree: PYTHONPATH=<worktree>.

Run:  .venv/bin/python bench/iteration.py [--case demo|vanilla|frozenlake] [--iterations 5] [--flow]
                                          [--set key=value ...] [experiment.yaml]

Two codes that sample differently train on different rows: another rounding draws other tokens, and the update's
kept rows come out longer or shorter. So each step's work is counted too (``work_tokens``: the tokens the
evaluation and the rollouts sampled, the trained tokens of the rows the update ran on), with its seconds per
thousand of them (``s_per_1k_tokens``), to compare two runs' steps on the same work. An older checkout's bench
may not count them: its session's evaluate_policy, collect_rollouts and tokenize_and_filter can be wrapped to.

The last line printed is one JSON object: {"seconds": {...}, "share": {...}, "diagnostics_share": ...,
"update_roofline_frac": ..., "update_roofline_ceiling_frac": ...,
"val_success": [[iteration, validation success], ...], "work_tokens": {...},
"s_per_1k_tokens": {...}}
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from matmul import ATTENTION_OPS, ProductRecorder, matmul_rate, model_flop_mapping

from ragen_core import memory, session
from ragen_core.config import load_experiment, load_sweep
from ragen_core.rollout.generators import cpu_attention
from ragen_core.tracking import NullLogger
from ragen_core.trainer import update
from ragen_core.trainer.engine import compute_precision

ROOT = Path(__file__).resolve().parents[1]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

CASES = {  # name: (study file or None for experiments/demo.yaml, preset)
    "demo": (None, None),
    "vanilla": ("studies/echo-trap-bandit.yaml", "starpo"),
    "frozenlake": ("studies/echo-trap-frozenlake.yaml", "starpo-s"),
}


def case_setting(case: str) -> tuple[str, list[str]]:
    """(experiment file, overrides) of a case: a study's base and overrides, with the case's preset."""
    study, preset = CASES[case]
    if study is None:
        return str(ROOT / "experiments" / "demo.yaml"), []
    sweep = load_sweep(ROOT / study)
    base = (ROOT / study).parent / str(sweep.base)
    return str(base.resolve()), [*sweep.overrides, f"preset={preset}"]


def update_roofline(sess: session.Session, rates: dict[str, float]) -> dict[str, float]:
    """One more rollout; its update once under FlopCounterMode (the FLOPs) and once plain (the seconds), as an
    iteration that logs no KL runs it; FLOPs / (seconds x the matmul rate of the run's precision)."""
    from torch.utils.flop_counter import FlopCounterMode

    rollouts = session.collect_rollouts(sess)
    selection = session.tokenize_and_filter(sess, rollouts)
    if selection.batch.batch_size == 0:
        return {}

    def run() -> float:
        t = time.perf_counter()
        update(sess.state, selection.batch, sess.cfg, think_tokens=selection.think_tokens,
               advantage_scale=selection.advantage_scale, kl_metric=False)
        return time.perf_counter() - t

    counter, products = FlopCounterMode(display=False, custom_mapping=model_flop_mapping()), ProductRecorder()
    # the counter, entered last, sees each op first and hands it on to the recorder: the products' seconds leave
    # out the counter's bookkeeping
    with products, counter:
        run()
    flops = counter.get_total_flops()
    attention = sum(n for op, n in counter.get_flop_counts()["Global"].items() if str(op).endswith(ATTENTION_OPS))
    seconds = run()
    replayed = products.replay_seconds()
    precision = compute_precision(sess.cfg)
    rate_after = matmul_rate(DTYPES[precision]) / 1e9
    rate = max(rates[precision], rate_after)
    return {"update_flops_g": round(flops / 1e9, 1), "update_s": round(seconds, 3), "precision": precision,
            "update_gflop_per_s": round(flops / seconds / 1e9, 1),
            "matmul_gflop_per_s_after_update": round(rate_after, 1),
            "update_roofline_frac": round(flops / seconds / 1e9 / rate, 3),
            "update_attention_flops_g": round(attention / 1e9, 1),
            "update_products_roofline_frac": round((flops - attention) / seconds / 1e9 / rate, 3),
            "update_products": len(products.calls), "update_products_flops_g": round(products.flops() / 1e9, 1),
            "update_products_s": round(products.seconds, 3), "update_products_replayed_s": round(replayed, 3),
            "update_roofline_ceiling_frac": round((flops - attention) / replayed / 1e9 / rate, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("experiment", nargs="?", default=None, help="an experiment file instead of the case's")
    parser.add_argument("--case", choices=sorted(CASES), default="demo")
    parser.add_argument("--iterations", type=int, default=5, help="iterations timed (default: one collapse period)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="config override key=value")
    parser.add_argument("--flow", action="store_true", help="also run it through the Prefect flow with MLflow")
    parser.add_argument("--no-roofline", action="store_true", help="skip the counted update at the end")
    args = parser.parse_args()
    memory.use_huge_pages()  # as the ragen command runs (ragen_core/memory.py), before the first large tensor
    experiment, case_overrides = case_setting(args.case)
    experiment = args.experiment or experiment
    overrides = [*case_overrides, f"trainer.iterations={args.iterations}", "trainer.checkpoint_every=0",
                 *args.overrides]
    print(f"case {args.case}: {experiment} " + " ".join(f"--set {o}" for o in overrides), flush=True)
    cpu_attention.kernel_available()  # the decode kernel is compiled once per environment: before anything is timed
    cfg = load_experiment(experiment, overrides)
    # the format-warmed model the run starts from: trained once per checkout (minutes), before anything is timed
    session.base_model_spec(cfg, say=lambda line: print(line, flush=True))
    rates = {p: matmul_rate(DTYPES[p]) / 1e9 for p in sorted({"fp32", compute_precision(cfg)})}  # GFLOP/s
    seconds: dict[str, float] = defaultdict(float)
    work: dict[str, float] = defaultdict(float)  # tokens each step sampled or trained on (work_tokens)
    measured: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        sess = session.open_session(cfg, NullLogger(), Path(tmp) / "run", say=lambda line: None)
        started = time.perf_counter()
        while not sess.done:
            t0, g0 = time.perf_counter(), sess.generator.stats["generated_tokens"]
            val = session.evaluate_policy(sess) if session.eval_due(sess) else None
            t1, g1 = time.perf_counter(), sess.generator.stats["generated_tokens"]
            rollouts = session.collect_rollouts(sess)
            t2, g2 = time.perf_counter(), sess.generator.stats["generated_tokens"]
            diag = session.diagnose(sess, rollouts) if session.collapse_due(sess) else None
            t3 = time.perf_counter()
            selection = session.tokenize_and_filter(sess, rollouts)
            t4 = time.perf_counter()
            stats = session.update_policy(sess, selection)
            t5 = time.perf_counter()
            session.record_iteration(sess, rollouts, selection, stats, val, diag)
            t6 = time.perf_counter()
            for key, a, b in (("evaluate", t0, t1), ("rollout", t1, t2), ("diagnostics", t2, t3), ("filter", t3, t4),
                              ("update", t4, t5), ("record", t5, t6)):
                seconds[key] += b - a
            work["evaluate"] += g1 - g0
            work["rollout"] += g2 - g1
            work["update"] += float(selection.batch.loss_mask.sum())
            analysis = selection.metrics.get("timing/grad_buckets_s", 0.0)  # the gradient analysis, out of filter's
            seconds["grad_buckets"] += analysis
            seconds["filter"] -= analysis
            for key in ("prepass", "recompute"):  # the update's no-grad passes, out of its seconds
                part = stats.metrics.get(f"timing/update_{key}_s", 0.0)
                seconds[f"update_{key}"] += part
                seconds["update"] -= part
            if diag is not None:
                measured.append(t3 - t2)
                print(f"iteration {rollouts.iteration}: diagnostics {t3 - t2:.2f} s of {t6 - t0:.2f} s "
                      f"(MI {diag.get('collapse/first_turn/mi', float('nan')):.3f}, "
                      f"{int(diag.get('collapse/first_turn/n_reasonings', 0))} reasonings, "
                      f"{int(diag.get('collapse/first_turn/n_prompts', 0))} prompts)", flush=True)
        total = time.perf_counter() - started
        plain_rows = [row for row in sess.history if "timing/iteration_s" in row]
        # the seeded result, to check that a faster iteration trains as well
        val_success = [[row["iteration"], round(row["val/success"], 4)] for row in sess.history if "val/success" in row]
        train_success = [round(row["rollout/success"], 4) for row in sess.history if "rollout/success" in row]
        roofline = {} if args.no_roofline else update_roofline(sess, rates)
    share = {k: v / total for k, v in seconds.items()}
    every = cfg.diagnostics.collapse_every
    result = {
        "case": args.case, "experiment": Path(experiment).name, "overrides": overrides,
        "iterations": args.iterations, "collapse_every": every, "iteration_s": round(total / args.iterations, 2),
        "seconds": {k: round(v, 2) for k, v in seconds.items()}, "total_s": round(total, 2),
        "share": {k: round(v, 4) for k, v in share.items()},
        "diagnostics_share": round(share["diagnostics"], 4),
        "diagnostics_s_per_measurement": round(sum(measured) / max(len(measured), 1), 2),
        "val_success": val_success, "train_success": train_success,
        "work_tokens": {k: int(v) for k, v in work.items()},
        "s_per_1k_tokens": {k: round(seconds[k] / v * 1000, 3) for k, v in work.items() if v},
        "matmul_gflop_per_s": {k: round(v, 1) for k, v in rates.items()}, **roofline,
    }
    for k, v in sorted(share.items(), key=lambda kv: -kv[1]):
        print(f"{k:12s} {seconds[k]:8.2f} s  {v:6.1%}")
    print(f"diagnostics share of the run: {share['diagnostics']:.1%} "
          f"(measured every {every} iterations; target <= 10%)")
    print(f"iteration {total / args.iterations:.2f} s; matmul " + ", ".join(f"{p} {r:.0f}" for p, r in rates.items())
          + " GFLOP/s")
    if roofline:
        print(f"update ({roofline['precision']}): {roofline['update_flops_g']:.0f} GFLOP in "
              f"{roofline['update_s']:.2f} s, {roofline['update_gflop_per_s']:.0f} GFLOP/s: "
              f"roofline fraction {roofline['update_roofline_frac']:.2f} (attention "
              f"{roofline['update_attention_flops_g']:.0f} GFLOP of it; the products alone "
              f"{roofline['update_products_roofline_frac']:.2f})")
        print(f"its {roofline['update_products']} matrix products: {roofline['update_products_s']:.2f} s in the "
              f"counted update, {roofline['update_products_replayed_s']:.2f} s replayed alone: the products' "
              f"fraction's ceiling, were the rest free, {roofline['update_roofline_ceiling_frac']:.2f}")
    if args.flow:
        flow_rows = run_flow(experiment, overrides)
        plain_s, flow_s = _mean_of(plain_rows[1:], ITERATION), _mean_of(flow_rows[1:], ITERATION)
        result.update(plain_iteration_s=round(plain_s, 3), flow_iteration_s=round(flow_s, 3),
                      plain_iterations_s=[round(row[ITERATION], 2) for row in plain_rows],
                      flow_iterations_s=[round(row[ITERATION], 2) for row in flow_rows],
                      orchestration_tracking_share=round(1 - plain_s / flow_s, 4))
        # Where the flow's extra seconds go: inside the rollout and update themselves (the same work, so a
        # difference there is noise or CPU contention, e.g. with the flow process's Prefect threads), or between.
        inside = {key: [round(_mean_of(plain_rows[1:], key), 3), round(_mean_of(flow_rows[1:], key), 3)]
                  for key in STEP_TIMES}
        result["plain_vs_flow_step_s"] = inside
        # The same work in the steps varies by 10-18% between iterations on a shared 2-core machine,
        # more than the target. The seconds outside the timed steps are the orchestration and tracking
        # themselves (plus the plain side's own record and filter), so their difference is the overhead
        # measured without the steps' noise.
        plain_out, flow_out = _mean([_outside(r) for r in plain_rows[1:]]), _mean([_outside(r) for r in flow_rows[1:]])
        result.update(plain_outside_steps_s=round(plain_out, 3), flow_outside_steps_s=round(flow_out, 3),
                      orchestration_tracking_share_outside=round((flow_out - plain_out) / flow_s, 4))
        print(f"iteration: plain {plain_s:.2f} s, flow with Prefect and MLflow {flow_s:.2f} s: orchestration and "
              f"tracking {1 - plain_s / flow_s:.1%} (target < 5%)")
        for key, (p, f) in inside.items():
            print(f"  {key}: plain {p:.2f} s, flow {f:.2f} s")
        print(f"  outside the timed steps: plain {plain_out:.2f} s, flow {flow_out:.2f} s: "
              f"{(flow_out - plain_out) / flow_s:.1%} of the flow's iteration")
    print(json.dumps(result))


ITERATION = "timing/iteration_s"
STEP_TIMES = ("timing/rollout_s", "timing/update_s")
"""Per-step seconds both sides record in their history (after the first iteration)."""


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def _mean_of(rows: list[dict[str, float]], key: str) -> float:
    return _mean([row[key] for row in rows if key in row])


def _outside(row: dict[str, float]) -> float:
    """An iteration's wall seconds outside its rollout, update, evaluation and collapse matrices."""
    steps = sum(row.get(key, 0.0) for key in (*STEP_TIMES, "timing/eval_s"))
    steps += sum(v for k, v in row.items() if k.startswith("collapse/") and k.endswith("/seconds"))
    return row[ITERATION] - steps


def run_flow(experiment: str, overrides: list[str]) -> list[dict[str, float]]:
    """The experiment through the training flow (ephemeral Prefect, MLflow in a temporary data dir); the
    run's history rows of recorded iterations (wall seconds and step timings)."""
    import os
    from unittest import mock

    from flows.cli import QUIET_DEFAULTS  # the environment `ragen train` sets
    from ragen_core.config import data_dir

    models = data_dir() / "models"
    models.mkdir(parents=True, exist_ok=True)

    with tempfile.TemporaryDirectory() as tmp, mock.patch.dict(
        os.environ, {**QUIET_DEFAULTS, "RAGEN_DATA_DIR": f"{tmp}/data", "PREFECT_HOME": f"{tmp}/prefect"}
    ):
        os.environ.pop("MLFLOW_TRACKING_URI", None)  # restored with the rest when the block ends
        # the same models as the plain side (converted model, cached warm-up): a fresh warm-up here is
        # another model, with other reply lengths, and the two iteration times would not compare
        Path(f"{tmp}/data").mkdir()
        Path(f"{tmp}/data/models").symlink_to(models, target_is_directory=True)
        from flows.train import train  # Prefect and MLflow: only for this part

        result = train(experiment=experiment, overrides=overrides)
        rows = [json.loads(line) for line in (Path(result.run_dir) / "history.jsonl").read_text().splitlines()]
    return [row for row in rows if ITERATION in row]


if __name__ == "__main__":
    main()
