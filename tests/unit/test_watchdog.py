"""The stall watchdog (ragen_core/watchdog.py) and the run loop's progress reports to it (session.run_to_end): a
process that stops making progress exits with status 1 and every thread's traceback; one that reports in time, or
whose watchdog is off, runs on. Each case runs in a process of its own: the watchdog ends its process."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ragen_core.watchdog import stall_watchdog

ROOT = Path(__file__).resolve().parents[2]

STAND_IN = textwrap.dedent("""
    import sys, time
    from types import SimpleNamespace
    from ragen_core.session import Steps, run_to_end

    stall, update_s, rollout_turns = float(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])

    class Stand(SimpleNamespace):
        @property
        def done(self):
            return self.iteration >= 2

    reports = []
    sess = Stand(iteration=0, stop_reason=None, history=[], main=True, say=print,
                 progress=lambda what, done, total: reports.append(what),
                 cfg=SimpleNamespace(eval=SimpleNamespace(every=0),
                                     trainer=SimpleNamespace(iterations=2, checkpoint_every=0, stall_seconds=stall),
                                     diagnostics=SimpleNamespace(collapse_every=0)))

    def rollout(s):  # a long rollout whose turns report progress, as run_rollouts does through sess.progress
        for turn in range(rollout_turns):
            time.sleep(0.5)
            s.progress("rollout", turn + 1, rollout_turns)

    def update_that_waits(s, selection):
        time.sleep(update_s)

    def record(s, *args):
        s.iteration += 1
        return {}

    none = lambda *args: {}
    run_to_end(sess, Steps(evaluate=none, rollout=rollout, diagnose=none, filter=none, update=update_that_waits,
                           record=record, checkpoint=none))
    assert sess.progress.__name__ == "<lambda>", "the session's own progress callback is back"
    print("done", len(reports), flush=True)
""")


def _run(tmp_path: Path, code: str, *args: object) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "run.py"
    script.write_text(code)
    return subprocess.run([sys.executable, str(script), *map(str, args)], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})


def test_a_step_that_outlasts_the_watchdog_ends_the_process_with_every_threads_traceback(tmp_path: Path) -> None:
    out = _run(tmp_path, STAND_IN, 1, 30, 0)
    assert out.returncode == 1, out.stderr
    assert "Timeout (0:00:01)!" in out.stderr
    assert "in update_that_waits" in out.stderr  # where the main thread waits
    assert "done" not in out.stdout


def test_turns_that_report_progress_keep_a_long_step_alive_and_the_block_cancels_it(tmp_path: Path) -> None:
    # a 4 s rollout reporting every 0.5 s under a 2 s watchdog, a 1 s update; then 3 s after the loop has ended
    out = _run(tmp_path, STAND_IN + "time.sleep(3)\nprint('after', flush=True)\n", 2, 1, 8)
    assert out.returncode == 0, out.stderr
    assert "done 16" in out.stdout and "after" in out.stdout  # 2 iterations x 8 turns reached the run's callback


def test_stall_seconds_0_is_no_watchdog(tmp_path: Path) -> None:
    out = _run(tmp_path, STAND_IN, 0, 2, 0)
    assert out.returncode == 0, out.stderr
    assert "done 0" in out.stdout


def test_the_watchdog_itself(tmp_path: Path) -> None:
    code = textwrap.dedent("""
        import sys, time
        from ragen_core.watchdog import stall_watchdog
        with stall_watchdog(float(sys.argv[1])) as progress:
            for _ in range(int(sys.argv[2])):
                progress()
                time.sleep(0.5)
            time.sleep(float(sys.argv[3]))
        time.sleep(2)
        print("after", flush=True)
    """)
    kept = _run(tmp_path, code, 2, 6, 0)  # 3 s of reports every 0.5 s under 2 s, then 2 s after the block
    assert kept.returncode == 0 and "after" in kept.stdout, kept.stderr
    stalled = _run(tmp_path, code, 1, 1, 20)
    assert stalled.returncode == 1 and "Timeout (0:00:01)!" in stalled.stderr and "after" not in stalled.stdout


def test_without_a_descriptor_for_stderr_the_watchdog_is_off_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    lines: list[str] = []
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    monkeypatch.setattr(sys, "__stderr__", io.StringIO())
    with stall_watchdog(1, lines.append) as progress:
        progress()
    assert lines == ["stall watchdog off: stderr has no file descriptor for faulthandler to write to"]
