"""flows/_ui.py: the progress bars survive being restarted in any order (a multi-turn rollout reports
done = 0 after its first turn, which restarts its bar while the evaluation's bar still exists)."""

from __future__ import annotations

import io

from rich.console import Console

from flows._ui import Reporter


def test_bars_restart_in_any_order_without_losing_track() -> None:
    console = Console(file=io.StringIO(), force_terminal=True, width=80)
    with Reporter(iterations=3, console=console) as ui:
        ui.progress("evaluate", 0, 32)
        ui.progress("evaluate", 32, 32)
        for _ in range(3):  # each iteration: a rollout of 16 episodes, none done after turn 1
            for done in (0, 4, 16):
                ui.progress("rollout", done, 16)
        ui.progress("evaluate", 0, 32)  # a second evaluation restarts its own bar
        ui.progress("evaluate", 8, 32)
        ui.say("iter 3/3 | success 0.50")
        tasks = {task.description: task for task in ui._progress.tasks}
    assert sorted(tasks) == ["evaluate", "rollout"]
    assert (tasks["rollout"].completed, tasks["evaluate"].completed) == (16, 8)
    assert "iter 3/3" in console.file.getvalue()
