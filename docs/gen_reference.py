"""The reference pages of the documentation site, made from the code at build time so they cannot drift.

mkdocs-gen-files runs this file during ``mkdocs build`` (mkdocs.yml) and writes, without touching the tree:

- ``reference/config.md``: every config field with its type, default and one-line doc (``ragen_core.config``);
- ``reference/cli.md``: every ``ragen`` command and flag (the typer app of ``flows/cli.py``);
- ``reference/metrics.md``: every metric name with its meaning (``ragen_core.tracking.metrics.METRICS``);
- ``reference/parquet.md``: the trajectory shards' columns (``ragen_core.store.parquet``).

``python docs/gen_reference.py OUT_DIR`` writes the same pages into a folder. Tests:
tests/unit/test_docs_reference.py.
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

__all__ = ["PAGES", "cli_page", "config_page", "metrics_page", "parquet_page"]

GENERATED = "<!-- Generated from the code by docs/gen_reference.py at build time: edit the code, not this page. -->\n\n"


def _cell(text: str) -> str:
    """Text made safe for one Markdown table cell."""
    return text.replace("|", "\\|").replace("\n", " ").strip()


def _type_name(hint: Any) -> str:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if origin in (types.UnionType, typing.Union):
        return " \\| ".join(_type_name(a) for a in args)
    if hint is type(None):
        return "`None`"
    if origin is not None:
        inner = ", ".join("..." if a is Ellipsis else _type_name(a).strip("`") for a in args)
        return f"`{getattr(origin, '__name__', str(origin))}[{inner}]`"
    return f"`{getattr(hint, '__name__', str(hint))}`"


def _default(f: dataclasses.Field[Any]) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "required"
    if dataclasses.is_dataclass(value):
        return ""
    if isinstance(value, str):
        return f"`{value!r}`" if len(value) < 60 else f"`{value[:57]!r}...`"
    return f"`{value!r}`"


def _bounds(f: dataclasses.Field[Any]) -> str:
    signs = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<"}
    return ", ".join(f"{signs[k]} {f.metadata[k]}" for k in signs if k in f.metadata)


def _section_rows(cls: type, prefix: str) -> list[str]:
    hints = typing.get_type_hints(cls)
    rows = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            continue
        doc = f.metadata.get("doc", "")
        bounds = _bounds(f)
        rows.append(f"| `{prefix}{f.name}` | {_type_name(hints[f.name])} | {_cell(_default(f))} | "
                    f"{_cell(doc)}{f' ({bounds})' if bounds else ''} |")
    return rows


def config_page() -> str:
    from ragen_core.config import PRESETS, ExperimentConfig, SweepConfig

    out = [GENERATED, "# Configuration reference\n\n",
           "An experiment file is YAML with the sections below; each key can also be set with "
           "`--set section.key=value`. Resolution order (later wins): these defaults, then `preset`, then the "
           "`extends` file, then the file itself, then `--set`. `ragen config show FILE` prints a resolved "
           "configuration with each field's doc beside it.\n\n"]
    hints = typing.get_type_hints(ExperimentConfig)
    out.append("## Top level\n\n| key | type | default | meaning |\n|---|---|---|---|\n")
    out += [row + "\n" for row in _section_rows(ExperimentConfig, "")]
    for f in dataclasses.fields(ExperimentConfig):
        section = hints[f.name]
        if not isinstance(section, type) or not dataclasses.is_dataclass(section):
            continue
        out.append(f"\n## `{f.name}`\n\n")
        if section.__doc__:
            out.append(_cell(section.__doc__.strip().splitlines()[0]) + "\n\n")
        out.append("| key | type | default | meaning |\n|---|---|---|---|\n")
        out += [row + "\n" for row in _section_rows(section, f"{f.name}.")]
    out.append("\n## Presets\n\n`preset:` applies these values under the file's own.\n\n"
               "| preset | settings |\n|---|---|\n")
    for name, sections in PRESETS.items():
        settings = ", ".join(f"`{section}.{k}={v}`" for section, values in sections.items()
                             for k, v in values.items())
        out.append(f"| `{name}` | {_cell(settings) or '(none)'} |\n")
    out.append("\n## Sweep and study files\n\n`ragen sweep` and `ragen study` read these keys.\n\n"
               "| key | type | default | meaning |\n|---|---|---|---|\n")
    out += [row + "\n" for row in _section_rows(SweepConfig, "")]
    return "".join(out)


def _param_row(param: Any, ctx: Any) -> str:
    shown_type = param.display_type(ctx).strip("<>")
    bounds = " ".join(b for b in (f"≥ {param.min}" if param.min is not None else "",
                                  f"≤ {param.max}" if param.max is not None else "") if b)
    if param.param_type_name == "argument":
        name = f"`{param.name.upper()}`"
        kind = f"argument: {shown_type}" + (", required" if param.required else "")
    else:
        name = ", ".join(f"`{o}`" for o in (*param.opts, *param.secondary_opts))
        kind = "flag" if param.is_flag else shown_type
    if bounds:
        kind += f" ({bounds})"
    default = param.default
    shown = "" if default in (None, (), [], False) or callable(default) else f"`{default}`"
    help_text = getattr(param, "help", None) or ""
    return f"| {name} | {_cell(kind)} | {_cell(shown)} | {_cell(help_text)} |"


def cli_page() -> str:
    import typer

    from flows.cli import app

    root = typer.main.get_command(app)
    out = [GENERATED, "# `ragen` command reference\n\n",
           f"{_cell(root.help or '')}\n\nEvery command takes `--help`. A bad configuration exits with status 2 "
           "before anything is written; an error during a run exits with status 1 (`RAGEN_DEBUG=1` prints the "
           "traceback).\n"]

    def walk(cmd: Any, path: str) -> None:  # typer's own click classes: a group is what lists commands
        if hasattr(cmd, "list_commands"):
            ctx = cmd.context_class(cmd)
            for name in sorted(cmd.list_commands(ctx)):
                sub = cmd.get_command(ctx, name)
                if sub is not None and not sub.hidden:
                    walk(sub, f"{path} {name}")
            return
        out.append(f"\n## `{path}`\n\n{(cmd.help or '').strip()}\n\n")
        params = [p for p in cmd.params if not p.hidden and p.name != "help"]
        if params:
            ctx = cmd.context_class(cmd)
            out.append("| parameter | kind | default | meaning |\n|---|---|---|---|\n")
            out.extend(_param_row(p, ctx) + "\n" for p in params)

    walk(root, "ragen")
    return "".join(out)


def metrics_page() -> str:
    from ragen_core.tracking.logger import NAMESPACES
    from ragen_core.tracking.metrics import METRICS

    out = [GENERATED, "# Metric reference\n\n",
           "Every metric a run, a sweep or a study logs to MLflow (and to the run's `history.jsonl`). In a name, "
           "`<tag>` is an env's label, `<bucket>` a reward-std bucket, `<term>` a loss term, `<scope>` "
           "`first_turn` or `later_turns`, `<rule>` and `<group>` a rule's or a study group's name, `<N>` and "
           "`<k>` whole numbers. A test fails when a run logs a name this page does not describe.\n"]
    for namespace in NAMESPACES:
        names = [n for n in METRICS if n.split("/", 1)[0] == namespace]
        if not names:
            continue
        out.append(f"\n## `{namespace}/`\n\n| metric | meaning |\n|---|---|\n")
        out.extend(f"| `{_cell(n)}` | {_cell(METRICS[n])} |\n" for n in names)
    return "".join(out)


def parquet_page() -> str:
    from ragen_core.store.parquet import COLUMN_DOCS, SCHEMA, SCHEMA_VERSION, TURN_TYPE

    out = [GENERATED, "# Trajectory Parquet schema\n\n",
           f"Schema version {SCHEMA_VERSION}. A run's trajectories are one shard per iteration, "
           "`runs/<run>/rollouts/iteration=N/part-0.parquet` (hive-partitioned: `iteration` is an integer "
           "column when read as a dataset), one row per trajectory with its turns nested.\n\n"
           "```python\nfrom ragen_core.store import read_run\ndf = read_run(\"data/runs/<run>\")\n```\n\n"
           "## Columns\n\n| column | Arrow type | meaning |\n|---|---|---|\n"]
    out.extend(f"| `{f.name}` | `{_cell(str(f.type))}` | {_cell(COLUMN_DOCS[f.name])} |\n" for f in SCHEMA)
    out.append("\n## `turns` fields\n\n| field | Arrow type | meaning |\n|---|---|---|\n")
    for i in range(TURN_TYPE.num_fields):
        f = TURN_TYPE.field(i)
        out.append(f"| `{f.name}` | `{_cell(str(f.type))}` | {_cell(COLUMN_DOCS['turns.' + f.name])} |\n")
    return "".join(out)


PAGES: dict[str, Callable[[], str]] = {
    "reference/config.md": config_page,
    "reference/cli.md": cli_page,
    "reference/metrics.md": metrics_page,
    "reference/parquet.md": parquet_page,
}


def _write_with_mkdocs() -> None:
    import mkdocs_gen_files

    for path, make in PAGES.items():
        with mkdocs_gen_files.open(path, "w") as f:
            f.write(make())


if __name__ == "__main__" and len(sys.argv) == 2:
    for rel, make in PAGES.items():
        target = Path(sys.argv[1]) / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(make(), encoding="utf-8")
elif __name__ in ("__main__", "<run_path>"):  # mkdocs-gen-files runs the script with runpy
    _write_with_mkdocs()
