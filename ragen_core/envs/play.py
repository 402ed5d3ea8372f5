"""Play an env by hand in the terminal (``ragen play ENV --seed N``) and list envs (``ragen envs``).

``play`` shows the instruction, the legend, the observation and the numbered actions, reads
one action per line (a name, free text for WebShop/Countdown, or the number of a listed
action), and prints the reward of each step and the running total. ``q`` quits. Env text is
printed as plain ``rich.text.Text``, so brackets such as ``click[buy now]`` are never read as
rich markup.

    .venv/bin/python -c "from ragen_core.envs.play import play; play('Sokoban', seed=3)"
"""

from __future__ import annotations

from collections.abc import Callable

from rich.console import Console
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from ragen_core.envs.registry import env_spec, list_envs, make

__all__ = ["describe_envs", "play", "state_panel"]

_QUIT = {"q", "quit", "exit"}


def state_panel(observation: str, title: str) -> Panel:
    """An env state as ``ragen play`` draws it (``ragen show`` draws a run's states the same way)."""
    return Panel(Text(observation), title=Text(title), expand=False)


def describe_envs() -> list[tuple[str, str]]:
    """(name, one-line description) of every registered env."""
    return [(name, env_spec(name).description) for name in list_envs()]


def _resolve(choice: str, names: list[str]) -> str:
    """A listed action's number stands for that action (placeholders like search[<query>] excluded)."""
    if choice.strip().isdigit():
        k = int(choice.strip())
        if 1 <= k <= len(names) and "<" not in names[k - 1]:
            return names[k - 1]
    return choice


def play(name: str, seed: int, console: Console | None = None, input_fn: Callable[[str], str] = input) -> None:
    """Run one episode of env ``name`` from ``seed`` with a person choosing the actions."""
    console = console or Console()
    env = make(name)
    obs, _ = env.reset(seed=seed)
    console.print(Panel(Text(env.instruction), title=Text(f"{env.name}  seed {seed}"), expand=False))
    if env.legend:
        table = Table(title="Legend", show_header=False)
        for symbol, meaning in env.legend.items():
            table.add_row(Text(symbol), Text(meaning))
        console.print(table)
    total, steps = 0.0, 0
    while True:
        console.print(state_panel(obs, f"step {steps}"))
        names = env.action_names
        listing = "  ".join(f"{i}) {n}" for i, n in enumerate(names, 1))
        console.print(Text(f"Actions: {listing}   (q quits)"))
        try:
            choice = input_fn("action> ")
        except (EOFError, KeyboardInterrupt):
            console.print(Text("Bye."))
            return
        if choice.strip().casefold() in _QUIT:
            console.print(Text(f"Quit after {steps} steps, total reward {total:+.2f}."))
            return
        obs, reward, terminated, truncated, info = env.step(_resolve(choice, names))
        steps += 1
        total += reward
        notes = []
        if info.get("invalid_action"):
            notes.append("invalid action, nothing happened")
        elif not info.get("action_is_effective"):
            notes.append("no effect")
        line = f"reward {reward:+.2f}   total {total:+.2f}" + (f"   ({'; '.join(notes)})" if notes else "")
        console.print(Text(line, style="bold"))
        if terminated or truncated:
            console.print(state_panel(obs, "final"))
            verdict = "success!" if info.get("success") else ("out of steps" if truncated else "episode over")
            console.print(Text(f"{verdict}  {steps} steps, total reward {total:+.2f}", style="bold"))
            return
