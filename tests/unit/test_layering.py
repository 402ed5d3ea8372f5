"""The layers stay apart (STYLE.md rule 7, DESIGN §1): ``ragen_core`` is the library and imports
neither the orchestration layer (``tasks``, ``flows``, where the ``ragen`` command lives too) nor
Prefect; only ``ragen_core/tracking/`` may import MLflow. Checked on the source of every module, so
lazy (function-local) imports count too; there is no exception list."""

from __future__ import annotations

import ast
from pathlib import Path

CORE = Path(__file__).resolve().parents[2] / "ragen_core"
NEVER_IN_CORE = {"prefect", "flows", "tasks"}


def imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


def offenders() -> list[str]:
    found = []
    for path in sorted(CORE.rglob("*.py")):
        rel = path.relative_to(CORE).as_posix()
        roots = imported_roots(path)
        found += [f"{rel} imports {root}" for root in sorted(roots & NEVER_IN_CORE)]
        if "mlflow" in roots and not rel.startswith("tracking/"):
            found.append(f"{rel} imports mlflow")
    return found


def test_core_imports_no_prefect_flows_or_tasks_and_mlflow_only_in_tracking() -> None:
    assert not offenders()


def test_the_check_sees_lazy_imports(tmp_path: Path) -> None:
    # the rule must not miss an import hidden inside a function (how the old cli.py reached the flows)
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from flows.train import train\n    import tasks.train_steps\n")
    assert imported_roots(module) >= {"flows", "tasks"}



def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
    return names


def test_tracking_and_store_do_not_import_upwards() -> None:
    """tracking/ and store/ sit below the session and the comparison: they import neither."""
    above = ("ragen_core.session", "ragen_core.compare", "ragen_core.evaluation", "ragen_core.sweeps")
    offenders = sorted({f"{path.relative_to(CORE).as_posix()} imports {top}"
                        for folder in ("tracking", "store") for path in (CORE / folder).rglob("*.py")
                        for name in imported_modules(path) for top in above
                        if name == top or name.startswith(top + ".")})
    assert not offenders, offenders
