"""What a person watching a run sees, in the terminal and in the Prefect UI.

Terminal: rich progress bars for rollouts and evaluation, and one summary line per iteration (printed
above the bars). Prefect UI (:class:`RunArtifacts`, inside a flow run): the same lines through the flow
run's logger (its Logs tab), a progress artifact over the iterations, a table artifact of the
per-iteration metrics that grows as the run goes, and a link to the run's MLflow page. The evaluation,
compare and sweep flows publish their result tables as Markdown artifacts (:func:`publish_markdown`).
"""

from __future__ import annotations

import re
from types import TracebackType
from typing import Any, Self

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


def artifact_key(*parts: str) -> str:
    """A Prefect artifact key from ``parts``: lowercase letters, digits and dashes only, at most 100 chars."""
    return re.sub(r"[^a-z0-9-]+", "-", "-".join(parts).lower()).strip("-")[:100] or "result"


def publish_markdown(key: str, markdown: str, description: str) -> str | None:
    """``markdown`` as a Markdown artifact of the current flow run (its Artifacts tab), under ``key``
    (:func:`artifact_key`); returns the key, or None outside a flow run (nothing to attach it to)."""
    from prefect.context import FlowRunContext

    if FlowRunContext.get() is None:
        return None
    from prefect.artifacts import create_markdown_artifact

    key = artifact_key(key)
    # the flows' summaries are lines of text around Markdown tables: keep each text line a line of its own
    lines = markdown.splitlines()
    text = "\n".join(line if line.startswith("|") or not line.strip() else f"{line}  " for line in lines)
    create_markdown_artifact(text, key=key, description=description)
    return key


TABLE_COLUMNS = ("val/success", "rollout/reward_std_all", "actor/entropy", "actor/grad_norm", "rollout/kept_groups",
                 "response/length_mean", "timing/rollout_s", "timing/update_s")
"""The per-iteration table's columns after the iteration and the env's success (the comparison's curves first)."""


class RunArtifacts:
    """The training run as Prefect artifacts and run-logger lines (module docstring); inert outside a flow run.

    Artifact keys are ``<kind>-<run name>`` in Prefect's alphabet (lowercase letters, digits, dashes), so each
    new version of the table replaces the previous one in the UI and keeps the history.
    """

    def __init__(self, run_name: str, iterations: int) -> None:
        from prefect.context import FlowRunContext

        self.active = FlowRunContext.get() is not None
        self.key = artifact_key(run_name)[:60]
        self.iterations = iterations
        self.rows: list[dict[str, Any]] = []
        self._progress_id: Any = None

    def say(self, line: str) -> None:
        """One line to the flow run's logger (the Logs tab)."""
        if self.active:
            from prefect import get_run_logger

            get_run_logger().info(line)

    def link(self, url: str | None, tracking_uri: str, run_id: str | None) -> None:
        """A link artifact to the run's MLflow page; for a local store (no UI of its own), how to open it."""
        if not self.active or not (url or run_id):
            return
        from prefect.artifacts import create_link_artifact, create_markdown_artifact

        if url:
            create_link_artifact(url, link_text="MLflow run", key=f"mlflow-{self.key}",
                                 description="The run's metrics, charts and artifacts in MLflow")
        else:
            create_markdown_artifact(f"MLflow run `{run_id}` in `{tracking_uri}`: open it with "
                                     f"`mlflow ui --backend-store-uri {tracking_uri}`", key=f"mlflow-{self.key}")

    def iteration(self, done: int, env_label: str, metrics: dict[str, Any]) -> None:
        """After each recorded iteration: move the progress artifact, and publish the table with one more row."""
        if not self.active:
            return
        from prefect.artifacts import create_progress_artifact, create_table_artifact, update_progress_artifact

        percent = 100.0 * done / max(self.iterations, 1)
        if self._progress_id is None:
            self._progress_id = create_progress_artifact(percent, key=f"progress-{self.key}",
                                                         description=f"iterations done of {self.iterations}")
        else:
            update_progress_artifact(self._progress_id, percent)
        row: dict[str, Any] = {"iteration": done - 1}
        success = metrics.get(f"env/{env_label}/success")
        row["success"] = None if success is None else round(float(success), 4)
        for key in TABLE_COLUMNS:
            value = metrics.get(key)
            row[key] = None if value is None else round(float(value), 4)
        self.rows.append(row)
        create_table_artifact(self.rows, key=f"iterations-{self.key}",
                              description=f"per-iteration metrics of {self.key} (one row per iteration)")

    def markdown(self, kind: str, text: str, description: str) -> None:
        """A Markdown artifact (evaluation table, final summary)."""
        if self.active:
            from prefect.artifacts import create_markdown_artifact

            create_markdown_artifact(text, key=f"{kind}-{self.key}", description=description)
