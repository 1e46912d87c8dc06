"""DataError has a module of its own, so that no two modules of keel.data import each other
(files read saved datasets and conversations; those raise DataError)."""

from __future__ import annotations

import ast
from pathlib import Path

from keel.data import errors, files

DATA = Path(__file__).resolve().parents[2] / "src" / "keel" / "data"


def imports_of(path: Path) -> set[str]:
    """The keel.data modules `path` imports (lazy imports inside functions too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name.startswith("keel.data.")}


def test_no_two_modules_of_keel_data_import_each_other():
    graph = {
        f"keel.data.{p.stem}": imports_of(p) for p in DATA.glob("*.py") if p.stem != "__init__"
    }
    circles = sorted(
        (a, b) for a, targets in graph.items() for b in targets if a < b and a in graph.get(b, ())
    )
    assert circles == []


def test_data_error_is_the_same_class_from_either_module():
    assert files.DataError is errors.DataError
    assert issubclass(errors.DataError, ValueError)
