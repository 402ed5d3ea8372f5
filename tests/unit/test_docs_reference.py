"""The generated reference pages (docs/gen_reference.py) name everything they are made from: every config field
with its default, every visible `ragen` command and flag, every catalogued metric, every Parquet column."""

from __future__ import annotations

import dataclasses
import importlib.util
import typing
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gen() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_reference", REPO / "docs" / "gen_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # __name__ is 'gen_reference': nothing is written
    return module


def test_config_page_has_every_field_with_its_type_default_and_doc(gen: ModuleType) -> None:
    from ragen_core.config import ExperimentConfig, SweepConfig, field_docs

    page = gen.config_page()
    experiment, sweep = page.split("\n## Sweep and study files")
    for part, cls in ((experiment, ExperimentConfig), (sweep, SweepConfig)):
        for key, doc in field_docs(cls).items():
            row = next((line for line in part.splitlines() if line.startswith(f"| `{key}` |")), None)
            assert row is not None, key
            assert " ".join(doc.replace("|", "\\|").split())[:40] in row, key
    row = next(line for line in page.splitlines() if line.startswith("| `trainer.mini_batch_rows` |"))
    assert row.split(" | ")[1:3] == ["`int` \\| `None`", "`32`"] and "(≥ 1)" in row
    row = next(line for line in page.splitlines() if line.startswith("| `rollout.backend` |"))
    assert row.split(" | ")[1:3] == ["`hf` \\| `vllm`", "`'hf'`"]
    assert "| `starpo-s` |" in page and "`algorithm.filter_value=0.25`" in page


def test_config_sections_are_all_there(gen: ModuleType) -> None:
    from ragen_core.config import ExperimentConfig

    page = gen.config_page()
    hints = typing.get_type_hints(ExperimentConfig)
    sections = [f.name for f in dataclasses.fields(ExperimentConfig) if dataclasses.is_dataclass(hints[f.name])]
    assert sections and all(f"\n## `{s}`\n" in page for s in sections)


def test_cli_page_has_every_visible_command_and_option(gen: ModuleType) -> None:
    import typer

    from flows.cli import app

    page = gen.cli_page()
    root = typer.main.get_command(app)

    def walk(cmd, path):  # type: ignore[no-untyped-def]
        if hasattr(cmd, "list_commands"):
            ctx = cmd.context_class(cmd)
            for name in cmd.list_commands(ctx):
                sub = cmd.get_command(ctx, name)
                heading = f"## `{path} {name}" + (" " if hasattr(sub, "list_commands") else "`")
                assert (heading in page) != sub.hidden, f"{path} {name}"
                if not sub.hidden:
                    walk(sub, f"{path} {name}")
            return
        for param in cmd.params:
            if param.param_type_name == "option" and not param.hidden:
                assert f"`{param.opts[0]}`" in page.split(f"## `{path}`")[1].split("\n## ")[0], (path, param.opts)

    walk(root, "ragen")
    study = page.split("## `ragen study`")[1].split("\n## ")[0]
    assert "| `--workers` | int range (≥ 1) |" in study
    assert "train-rank" not in page  # hidden commands stay out


def test_metrics_page_has_every_catalogued_metric(gen: ModuleType) -> None:
    from ragen_core.tracking.metrics import METRICS

    page = gen.metrics_page()
    for name, meaning in METRICS.items():
        assert f"| `{name}` | {meaning.replace('|', chr(92) + '|')} |" in page, name


def test_parquet_page_has_every_column_and_turn_field(gen: ModuleType) -> None:
    from ragen_core.store.parquet import SCHEMA, TURN_TYPE

    page = gen.parquet_page()
    assert all(f"| `{name}` |" in page for name in SCHEMA.names)
    assert all(f"| `{name}` |" in page.split("## `turns` fields")[1] for name in TURN_TYPE.names)


def test_cell_escapes_table_syntax(gen: ModuleType) -> None:
    assert gen._cell("a | b\nc") == "a \\| b c"


def test_the_script_writes_the_pages_into_a_folder(tmp_path: Path) -> None:
    import subprocess
    import sys

    subprocess.run([sys.executable, str(REPO / "docs" / "gen_reference.py"), str(tmp_path)], check=True, cwd=REPO)
    assert sorted(p.name for p in (tmp_path / "reference").iterdir()) == ["cli.md", "config.md", "metrics.md",
                                                                          "parquet.md"]
