"""What a person watching a run sees: rich progress bars for rollouts and evaluation,
and one summary line per iteration (printed above the bars)."""

from __future__ import annotations

from types import TracebackType
from typing import Self

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn


class Reporter:
    """Context manager owning a rich Progress; ``say`` prints a line, ``progress`` moves a bar."""

    def __init__(self, iterations: int, console: Console | None = None) -> None:
        self.console = console or Console(stderr=True)
        self._progress = Progress(TextColumn("{task.description:<10}"), BarColumn(), MofNCompleteColumn(),
                                  TimeElapsedColumn(), console=self.console, transient=True,
                                  disable=not self.console.is_terminal)
        self._bars: dict[str, int] = {}
        self.iterations = iterations

    def __enter__(self) -> Self:
        self._progress.start()
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self._progress.stop()

    def say(self, line: str) -> None:
        self._progress.console.print(line, highlight=False, soft_wrap=True)

    def progress(self, what: str, done: int, total: int) -> None:
        """Move the ``what`` bar to ``done`` of ``total``; ``done == 0`` after progress starts it afresh
        (a new rollout or evaluation)."""
        bar = self._bars.get(what)
        if bar is None or (done == 0 and self._completed(bar)):
            if bar is not None:
                self._progress.remove_task(bar)
            bar = self._bars[what] = self._progress.add_task(what, total=total)
        self._progress.update(bar, completed=done, total=total)

    def _completed(self, bar: TaskID) -> float:
        # by id: Progress.tasks is a list in insertion order, and a removed bar shifts the positions
        return next(task.completed for task in self._progress.tasks if task.id == bar)
