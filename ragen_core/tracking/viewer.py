"""Read a run's dialogues as people do: in the terminal (``ragen show``) and as one HTML page per iteration.

    ragen show RUN                       # the last iteration's trajectories, every group
    ragen show RUN --iter 3 --group 1    # one prompt group of iteration 3
    ragen show RUN --kept                # only what the StarPO-S filter kept (--dropped: the rest)
    ragen show RUN --html page.html      # the same selection as a static page

The terminal view draws each state the way ``ragen play`` does (envs/play.py :func:`state_panel`), with the
reply, the actions and the reward under it. The HTML page (:func:`iteration_html`) is self-contained (no
script, no external style): grid states as preformatted text, thoughts, actions, rewards and the kept flag.
The training run logs one per artifact step as ``viewer/iteration=N.html``. Every string from the model or
the env is escaped. The trajectories come from the run's Parquet shards (store/parquet.py).

Tests: ``.venv/bin/python -m pytest tests/unit/tracking/test_viewer.py -q``.
"""

from __future__ import annotations

import html
import os
from collections.abc import Sequence
from dataclasses import dataclass

from rich.console import Console, Group
from rich.panel import Panel
from rich.text import Text

from ragen_core.envs.play import state_panel
from ragen_core.rollout.parse import parse_response
from ragen_core.types import Trajectory

__all__ = ["Selection", "html_for_iteration", "iteration_html", "select", "show"]


@dataclass(frozen=True)
class Selection:
    """The trajectories of one iteration of a run that a view shows, with their kept flags."""

    run: str
    iteration: int
    trajectories: list[Trajectory]
    kept: list[bool]


def select(run: str | os.PathLike[str], iteration: int | None = None, group: int | None = None,
           kept: bool | None = None) -> Selection:
    """Iteration ``iteration`` of ``run`` (default: its last), optionally one prompt group and only the kept
    (``kept=True``) or dropped (``False``) trajectories. Raises ValueError naming what is missing."""
    from ragen_core.store.parquet import read_run, read_trajectories  # pyarrow and pandas only when reading

    frame = read_run(run)
    if frame.empty:
        raise ValueError(f"run {os.fspath(run)!r} has no trajectory shards yet")
    iterations = sorted(int(i) for i in frame["iteration"].unique())
    it = iterations[-1] if iteration is None else iteration
    if it not in iterations:
        raise ValueError(f"run {os.fspath(run)!r} has no iteration {it}; it has {iterations[0]}..{iterations[-1]}")
    rows = frame[frame["iteration"] == it]
    if group is not None:
        groups = sorted(int(g) for g in rows["group_id"].unique())
        if group not in groups:
            raise ValueError(f"iteration {it} has no group {group}; its groups are {groups}")
        rows = rows[rows["group_id"] == group]
    if kept is not None:
        rows = rows[rows["kept"] == kept]
    return Selection(os.fspath(run), it, read_trajectories(rows), [bool(k) for k in rows["kept"]])


def _thought(turn_text: str) -> str:
    return parse_response(turn_text).think


def show(selection: Selection, console: Console | None = None) -> None:
    """Print the selection's dialogues: per trajectory a header, then per turn the state, reply and reward."""
    console = console or Console()
    if not selection.trajectories:
        console.print(Text(f"iteration {selection.iteration}: nothing selected"))
        return
    for traj, kept in zip(selection.trajectories, selection.kept, strict=True):
        member = traj.meta.get("member", "?")
        head = Text(f"{traj.env_tag}  seed {traj.seed}  group {traj.group_id}  member {member}  "
                    f"{'KEPT' if kept else 'dropped'}  success {traj.success}  return {traj.total_return:+.3f}",
                    style="bold")
        console.print(head)
        for k, turn in enumerate(traj.turns, start=1):
            reply = Text(turn.response_text)
            line = Text(f"actions: {' || '.join(turn.actions) or '(none)'}   reward {turn.reward:+g}"
                        f"   penalty {turn.penalty:+g}   format {'ok' if turn.parse_ok else 'FAULT'}")
            console.print(state_panel(turn.observation, f"turn {k}"))
            console.print(Panel(Group(reply, line), title=Text("reply"), expand=False))
        console.print()


_STYLE = """body{font-family:sans-serif;margin:1.5em;max-width:70em}
table{border-collapse:collapse;margin:.3em 0 1.2em}td,th{border:1px solid #ccc;padding:.3em .5em;vertical-align:top}
pre{margin:0;font-family:monospace;line-height:1.1}.kept{background:#e8f5e9}.dropped{background:#fafafa;color:#555}
.fault{color:#b71c1c}h2{font-size:1.05em;margin:1em 0 .2em}"""


def iteration_html(selection: Selection, title: str | None = None) -> str:
    """One self-contained HTML page of the selection (module docstring); every model or env string escaped."""
    e = html.escape
    title = title or f"{os.path.basename(selection.run)}: iteration {selection.iteration}"
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{e(title)}</title>"
             f"<style>{_STYLE}</style></head><body><h1>{e(title)}</h1>",
             f"<p>{len(selection.trajectories)} trajectories, {sum(selection.kept)} kept by the filter.</p>"]
    for traj, kept in zip(selection.trajectories, selection.kept, strict=True):
        member = traj.meta.get("member", "?")
        parts.append(f"<h2 class='{'kept' if kept else 'dropped'}'>{e(traj.env_tag)} seed {traj.seed}, "
                     f"group {traj.group_id}, member {e(str(member))}: {'kept' if kept else 'dropped'}, "
                     f"success {traj.success}, return {traj.total_return:+.3f}</h2>")
        parts.append("<table><tr><th>turn</th><th>state</th><th>thought</th><th>actions</th><th>reward</th>"
                     "<th>reply</th></tr>")
        for k, turn in enumerate(traj.turns, start=1):
            fault = "" if turn.parse_ok else " <span class='fault'>(format fault)</span>"
            parts.append(
                f"<tr class='{'kept' if kept else 'dropped'}'><td>{k}</td><td><pre>{e(turn.observation)}</pre></td>"
                f"<td>{e(_thought(turn.response_text))}</td><td>{e(' || '.join(turn.actions)) or '(none)'}{fault}</td>"
                f"<td>{turn.reward:+g}<br>penalty {turn.penalty:+g}</td>"
                f"<td><pre>{e(turn.response_text)}</pre></td></tr>")
        parts.append("</table>")
    parts.append("</body></html>")
    return "\n".join(parts)


def html_for_iteration(trajectories: Sequence[Trajectory], kept: Sequence[bool], run: str, iteration: int) -> str:
    """The page of a live iteration (what the training run logs), without reading the shards back."""
    return iteration_html(Selection(run, iteration, list(trajectories), [bool(k) for k in kept]))
