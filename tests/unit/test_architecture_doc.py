"""docs/architecture.md stays true: every path it names exists, and every module of ragen_core is named
on it (a new module means a line on the page saying where it belongs)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
PATH = re.compile(r"`((?:ragen_core|flows|tasks|tests)/[\w/.]*)`")


def named_paths() -> set[str]:
    return set(PATH.findall(DOC.read_text(encoding="utf-8")))


def test_every_path_on_the_page_exists() -> None:
    paths = named_paths()
    assert len(paths) > 30
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"


def test_every_core_module_is_on_the_page() -> None:
    paths = named_paths()
    folders = {p.rstrip("/") for p in paths if p.endswith("/")}
    text = DOC.read_text(encoding="utf-8")
    unnamed = []
    for module in sorted((ROOT / "ragen_core").rglob("*.py")):
        rel = module.relative_to(ROOT).as_posix()
        if module.name == "__init__.py" or "/envs/webshop/" in rel:
            continue
        if rel in paths or any(rel.startswith(folder + "/") for folder in folders):
            continue
        if module.parent == ROOT / "ragen_core" and module.name in text:  # a top-level module named bare
            continue
        unnamed.append(rel)
    assert not unnamed, f"modules of ragen_core that docs/architecture.md does not place: {unnamed}"


def test_every_test_file_a_module_names_exists() -> None:
    """Module docstrings say where their tests are; a renamed test file must not leave them pointing nowhere."""
    named = re.compile(r"\btests/[\w/]+\.py\b")
    mentions = {(module.relative_to(ROOT).as_posix(), path)
                for folder in ("ragen_core", "flows", "tasks", "bench")
                for module in (ROOT / folder).rglob("*.py")
                for path in named.findall(module.read_text(encoding="utf-8"))}
    assert len(mentions) >= 20  # the modules do name their tests (23 when this was written)
    dangling = sorted(f"{module}: {path}" for module, path in mentions if not (ROOT / path).exists())
    assert not dangling, dangling
