"""ragen_core stays free of Prefect and MLflow (STYLE.md rule 7): only tracking/ may import mlflow,
and nothing in ragen_core imports prefect; tracking/ and store/ import nothing above them (session,
compare, evaluation, sweeps). Checked on the source, so lazy imports count too."""

from __future__ import annotations

import ast
from pathlib import Path

CORE = Path(__file__).resolve().parents[2] / "ragen_core"


def imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


def test_no_prefect_in_core_and_mlflow_only_in_tracking() -> None:
    offenders = []
    for path in CORE.rglob("*.py"):
        rel = path.relative_to(CORE).as_posix()
        roots = imported_roots(path)
        if rel == "cli.py":  # the command line calls the flows (lazily): it is an edge, not the library
            roots -= {"flows"}
        if "prefect" in roots or "flows" in roots or "tasks" in roots:
            offenders.append(f"{rel} imports prefect/flows/tasks")
        if "mlflow" in roots and not rel.startswith("tracking/"):
            offenders.append(f"{rel} imports mlflow")
    assert not offenders, offenders


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
    return names


def test_tracking_and_store_do_not_import_upwards() -> None:
    """tracking/ and store/ sit below the session and the comparison: they import neither (issue 17)."""
    above = ("ragen_core.session", "ragen_core.compare", "ragen_core.evaluation", "ragen_core.sweeps")
    offenders = sorted({f"{path.relative_to(CORE).as_posix()} imports {top}"
                        for folder in ("tracking", "store") for path in (CORE / folder).rglob("*.py")
                        for name in imported_modules(path) for top in above
                        if name == top or name.startswith(top + ".")})
    assert not offenders, offenders
