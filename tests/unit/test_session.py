"""Run-level rules of ragen_core.session that no flow test would notice going wrong."""

from __future__ import annotations

import sys

import pytest

from ragen_core.config import ConfigError, EvalConfig, ExperimentConfig
from ragen_core.rollout.evaluate import heldout_seeds
from ragen_core.session import TRAIN_SEED_OFFSET, train_seeds


def test_training_seeds_never_meet_heldout_seeds() -> None:
    # 200 iterations x P=8 x Online-k 10: far more than any run uses
    used = set(train_seeds(0, 200 * 8 * 10))
    assert used.isdisjoint(heldout_seeds(256, 123))
    assert min(used) == TRAIN_SEED_OFFSET
    # consecutive iterations continue where the last stopped, without overlap
    assert train_seeds(0, 8)[-1] + 1 == train_seeds(8, 8)[0]


def test_heldout_range_reaching_training_seeds_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"eval\.seed_start"):
        ExperimentConfig(eval=EvalConfig(seed_start=TRAIN_SEED_OFFSET - 10, seeds=256))


def test_collapse_diagnostics_every_k_iterations_with_an_ema_kept_in_checkpoints(tmp_path, monkeypatch) -> None:
    # collapse/ metrics every diagnostics.collapse_every iterations, on the policy that sampled the
    # rollouts; mi_zscore_ema divides MI by an EMA (decay 0.9) of the marginal std, carried across a resume.
    import json
    from pathlib import Path

    from ragen_core.algos.collapse import MI_ZSCORE_EPS
    from ragen_core.config import load_experiment
    from ragen_core.rollout.scripted import ScriptedGenerator
    from ragen_core.session import open_session, run_iteration
    from ragen_core.tracking import NullLogger

    monkeypatch.setenv("RAGEN_DATA_DIR", str(tmp_path))
    smoke = Path(__file__).resolve().parents[2] / "experiments" / "smoke.yaml"
    cfg = load_experiment(smoke, ["diagnostics.collapse_every=2", "trainer.iterations=5", "eval.every=0",
                                  "trainer.checkpoint_every=2", "rollout.max_new_tokens=40"])

    def scripted(sess):  # the tiny random model never closes a think block: script replies that do
        sess.generator = ScriptedGenerator(sess.tokenizer, lambda c, r, p: f"<think>plan {r % 3}</think>"
                                                                           "<answer>Dragon</answer>")
        return sess

    sess = scripted(open_session(cfg, NullLogger(), say=lambda line: None))
    rows = [run_iteration(sess) for _ in range(3)]  # iterations 0, 1, 2: measured at 0 and 2
    assert ["collapse/first_turn/mi" in r for r in rows] == [True, False, True]
    first, third = rows[0], rows[2]
    assert first["collapse/first_turn/marginal_std_ema"] == first["collapse/first_turn/marginal_std"]
    ema = 0.9 * first["collapse/first_turn/marginal_std"] + 0.1 * third["collapse/first_turn/marginal_std"]
    assert third["collapse/first_turn/marginal_std_ema"] == pytest.approx(ema)
    assert third["collapse/first_turn/mi_zscore_ema"] == pytest.approx(
        third["collapse/first_turn/mi"] / (ema + MI_ZSCORE_EPS))
    assert first["collapse/first_turn/valid_share"] == 1.0 and "collapse/later_turns/mi" not in first  # one turn
    # the checkpoint after iteration 2 holds the EMA; a resumed session continues from it
    saved = json.loads((sess.run_dir / "checkpoints" / "iter=000002" / "health.json").read_text())
    assert saved["collapse_ema"]["first_turn"] == pytest.approx(first["collapse/first_turn/marginal_std"])
    resumed = open_session(cfg, NullLogger(), sess.run_dir, say=lambda line: None)
    assert resumed.collapse_ema == pytest.approx(saved["collapse_ema"])


@pytest.mark.parametrize("critic", ["head", "separate"])
def test_a_value_heads_old_values_come_from_the_rollout(tmp_path, monkeypatch, critic: str) -> None:
    # With critic: head the hf generator records the head's values as it samples, so the update needs
    # no forward for its old values; they are what that forward gives (1e-4). A separate critic records none.
    from pathlib import Path

    import torch

    from ragen_core.config import load_experiment
    from ragen_core.session import collect_rollouts, open_session, tokenize_and_filter
    from ragen_core.tracking import NullLogger
    from ragen_core.trainer.models import critic_values

    monkeypatch.setenv("RAGEN_DATA_DIR", str(tmp_path))
    smoke = Path(__file__).resolve().parents[2] / "experiments" / "smoke.yaml"
    cfg = load_experiment(smoke, [f"algorithm.critic={critic}", "eval.every=0", "algorithm.filter_strategy=none",
                                  "rollout.max_new_tokens=12"])
    sess = open_session(cfg, NullLogger(), tmp_path / "run", say=lambda line: None)
    batch = tokenize_and_filter(sess, collect_rollouts(sess)).batch
    if critic == "separate":
        assert batch.old_values is None
        return
    assert batch.old_values is not None
    assert batch.batch_size == cfg.prompts_per_rollout * cfg.rollout.responses_per_prompt
    with torch.no_grad():
        values = critic_values(sess.state.models, batch.input_ids, batch.attention_mask.long())
    torch.testing.assert_close(batch.old_values[batch.loss_mask], values[batch.loss_mask], rtol=0, atol=1e-4)
    assert not batch.old_values[~batch.loss_mask].any()


def test_the_one_loop_runs_the_given_steps_in_order_and_a_hook_may_end_it_at_an_evaluation() -> None:
    # run_to_end is the only iteration loop: the flow hands it its tasks and hooks, the other ranks the plain steps.
    # Here a recording stand-in session and steps: 3 iterations, evaluations every 2, a checkpoint every iteration.
    from types import SimpleNamespace

    from ragen_core.session import Hooks, Steps, run_to_end

    calls: list[str] = []

    class Stand(SimpleNamespace):
        @property
        def done(self) -> bool:
            return self.stop_reason is not None or self.iteration >= 3

    sess = Stand(iteration=0, stop_reason=None, history=[], main=True, say=calls.append, progress=None,
                 logger=SimpleNamespace(log_metrics=lambda *a, **k: None),
                 folder=SimpleNamespace(append_history=lambda row: None),
                 cfg=SimpleNamespace(eval=SimpleNamespace(every=2),
                                     trainer=SimpleNamespace(iterations=3, checkpoint_every=1, stall_seconds=60),
                                     diagnostics=SimpleNamespace(collapse_every=0)))

    def step(name: str, result: object = None):
        def run(s, *args):
            calls.append(f"{name}{s.iteration}")
            if name == "record":
                s.iteration += 1
            return result if result is not None else {}
        return run

    steps = Steps(evaluate=step("evaluate", {"val/success": 0.5}), rollout=step("rollout"), diagnose=step("diagnose"),
                  filter=step("filter"), update=step("update"), record=step("record"), checkpoint=step("checkpoint"))
    hooks = Hooks(after_iteration=lambda s, m: calls.append(f"after{s.iteration}"),
                  after_final_eval=lambda s, v: calls.append("final"))
    run_to_end(sess, steps, hooks)
    one = ["rollout", "filter", "update", "record"]
    assert [c for c in calls if not c.startswith("final evaluation")] == [
        "evaluate0", *[f"{n}0" for n in one], "checkpoint1", "after1",
        *[f"{n}1" for n in one], "checkpoint2", "after2",
        "evaluate2", *[f"{n}2" for n in one], "checkpoint3", "after3",
        "evaluate3", "final"]

    calls.clear()
    sess.iteration, sess.history = 0, []
    stop = Hooks(after_eval=lambda s, v: setattr(s, "stop_reason", "pruned by optuna"))
    run_to_end(sess, steps, stop)  # the first evaluation ends the run and is recorded as its last
    assert [c for c in calls if not c.startswith("final evaluation")] == ["evaluate0"]
    assert sess.history == [{"iteration": 0, "val/success": 0.5}]


def test_the_gradient_analysis_runs_every_k_iterations_on_the_unfiltered_batch(tmp_path, monkeypatch) -> None:
    # diagnostics.grad_buckets_every: grad/<bucket>/<term> on iterations 0 and 2, over every group, the ones the
    # StarPO-S filter drops included: the rows of the buckets add up to the whole batch when each fits the cap
    from pathlib import Path

    from ragen_core.config import load_experiment
    from ragen_core.session import open_session, run_iteration
    from ragen_core.tracking import NullLogger

    monkeypatch.setenv("RAGEN_DATA_DIR", str(tmp_path))
    smoke = Path(__file__).resolve().parents[2] / "experiments" / "smoke.yaml"
    cfg = load_experiment(smoke, ["diagnostics.grad_buckets_every=2", "diagnostics.grad_bucket_rows=64",
                                  "trainer.iterations=3", "eval.every=0", "diagnostics.collapse_every=0"])
    sess = open_session(cfg, NullLogger(), say=lambda line: None)
    rows = [run_iteration(sess) for _ in range(3)]
    assert ["grad/zero/rows" in r for r in rows] == [True, False, True]
    total = cfg.rollout.prompts_per_iter * cfg.rollout.responses_per_prompt
    for r in (rows[0], rows[2]):
        assert sum(r[f"grad/{b}/rows"] for b in ("zero", "le_0.2", "gt_0.2")) == total
        assert r["timing/grad_buckets_s"] > 0
        assert all(r[k] >= 0 for k in r if k.startswith("grad/") and not k.endswith("/rows"))


def test_the_gradient_analysis_leaves_training_untouched(tmp_path, monkeypatch) -> None:
    # Nothing is stepped and no random state is drawn: with and without the analysis a run logs the same
    # losses, returns and gradient norms, iteration by iteration (StarPO-S with a value head under LoRA, in
    # the trainer's precision as the studies run it)
    from pathlib import Path

    from ragen_core.config import load_experiment
    from ragen_core.session import open_session, run_iteration
    from ragen_core.tracking import NullLogger

    smoke = Path(__file__).resolve().parents[2] / "experiments" / "smoke.yaml"
    common = ["preset=starpo-s", "algorithm.critic=head", "model.lora_rank=8", "trainer.precision=auto",
              "trainer.iterations=3", "eval.every=0", "diagnostics.collapse_every=0"]
    runs = []
    for every in (0, 1):
        monkeypatch.setenv("RAGEN_DATA_DIR", str(tmp_path / f"every{every}"))
        cfg = load_experiment(smoke, [*common, f"diagnostics.grad_buckets_every={every}"])
        sess = open_session(cfg, NullLogger(), say=lambda line: None)
        runs.append([run_iteration(sess) for _ in range(3)])
    plain, analysed = runs
    assert all("grad/zero/rows" in r for r in analysed) and not any("grad/zero/rows" in r for r in plain)
    for a, b in zip(plain, analysed, strict=True):
        same = {k: v for k, v in a.items() if not k.startswith(("timing/", "grad/", "perf/"))}
        assert {k: b[k] for k in same} == pytest.approx(same, rel=0, abs=0, nan_ok=True)  # bit for bit
        assert {"actor/pg_loss", "actor/grad_norm", "rollout/success"} <= same.keys()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the peak is reset only on Linux (clear_refs)")
def test_peak_memory_is_measured_and_starts_afresh_with_each_run() -> None:
    """perf/peak_rss_gib: a run's peak resident memory, reset when a run opens, so that a sweep worker's second
    trial does not inherit the first one's peak. In a fresh process: in a long one (the whole suite) the allocator
    may keep a freed block resident, and the reset then rightly finds the memory still held."""
    import subprocess

    script = """
import numpy as np
from ragen_core.memory import peak_rss_bytes, reset_peak_rss
reset_peak_rss()
before = peak_rss_bytes()
block = np.ones(300 * 2**20 // 8)  # 300 MiB, every page written
high = peak_rss_bytes()
del block
after_free = peak_rss_bytes()
reset_peak_rss()
print(before, high, after_free, peak_rss_bytes())
"""
    out = subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True).stdout
    before, high, after_free, after_reset = map(int, out.split())
    assert high >= before + 250 * 2**20
    # the peak stays when the memory is freed (the kernel's counts are per-CPU and lag by up to a few hundred kB)
    assert after_free >= high - 16 * 2**20
    assert after_reset <= high - 250 * 2**20


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the peak is reset only on Linux (clear_refs)")
def test_each_step_logs_its_own_peak_memory_and_the_run_the_largest() -> None:
    """perf/peak_rss_gib/<step>: a step's own peak, not one an earlier step left (each step resets the process's
    peak); perf/peak_rss_gib, the run's, stays the largest. In a fresh process (see the test above)."""
    import subprocess

    script = """
import numpy as np
from ragen_core.memory import PeakMemory
memory = PeakMemory()
with memory.step("big") as big:
    block = np.ones(300 * 2**20 // 8)  # 300 MiB, every page written, freed before the step ends
    del block
with memory.step("small") as small:
    pass
print(big["perf/peak_rss_gib/big"], small["perf/peak_rss_gib/small"], memory.run_peak() / 2**30)
"""
    out = subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True).stdout
    big, small, run = map(float, out.split())
    assert big >= small + 250 / 1024
    assert run >= big - 16 / 2**10


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_freed_heap_goes_back_to_the_system() -> None:
    """release_free_memory: blocks freed below glibc's mmap threshold stay resident in the heap (a small block
    after each keeps the heap from shrinking at its top) until malloc_trim gives their pages back. In a fresh
    process, with the C allocator called directly so that no Python allocator stands between."""
    import subprocess

    script = """
import ctypes, ctypes.util
from ragen_core.memory import release_free_memory
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def rss():
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmRSS:"))
blocks, pins = [], []
for _ in range(4000):  # 4000 x 64 KiB = 250 MiB, below the 128 KiB mmap threshold: from the heap
    block = libc.malloc(64 * 1024)
    ctypes.memset(block, 1, 64 * 1024)
    blocks.append(block)
    pins.append(libc.malloc(64))
for block in blocks:
    libc.free(block)
held = rss()
given = release_free_memory()
print(held, rss(), int(given))
"""
    out = subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True).stdout
    held, after, given = map(int, out.split())
    assert given == 1
    assert after <= held - 200 * 2**20, (held, after)
