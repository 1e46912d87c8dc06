"""The layer rule of docs/architecture.md: a module imports only from its own package and from
packages of lower layers. Every import counts: absolute and relative, at module level and lazy
ones inside functions, `from keel import x` as an import of `keel.x`."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "keel"
LAYERS = {
    "config": 0, "types": 0, "durable": 0,
    "algo": 1, "rewards": 1, "jsonlines": 1,
    "data": 2, "models": 2, "monitor": 2, "report": 2, "guard": 2, "engine": 2, "recipes": 2,
    "rollout": 3, "checkpoint": 3, "chatapi": 3, "plan": 3,
    "envs": 4,
    "workers": 5,
    "controller": 6,
    "serve": 7,
    "cli": 8,
}  # fmt: skip


def module_name(root: Path, path: Path) -> str:
    """`keel.a.b` for root/a/b.py, `keel.a` for root/a/__init__.py (root is the keel folder)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([root.name, *parts])


def imported_modules(source: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in `source`, the text of module `module`.

    Relative imports are resolved against the module's package; `from pkg import name` also
    yields `pkg.name` (name may be a submodule). Imports inside functions count too."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                if node.level > len(package):
                    raise ValueError(f"{module}: relative import beyond the top package")
                base = package[: len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.append((node.lineno, target))
            out.extend((node.lineno, f"{target}.{a.name}") for a in node.names if a.name != "*")
    return out


def _package(module: str, top: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == top and len(parts) > 1 else None


def layer_violations(root: Path, layers: dict[str, int]) -> list[str]:
    """One line `file:line (package Ln) imports module (package Lm)` per import of a package that
    is neither the module's own nor of a lower layer. root: the top package's folder."""
    violations = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        own = rel.parts[0].removesuffix(".py")
        if own not in layers:
            continue
        name = module_name(root, path)
        text = path.read_text(encoding="utf-8")
        seen = set()
        for line, module in imported_modules(text, name, path.name == "__init__.py"):
            other = _package(module, root.name)
            if other is None or other == own or other not in layers:
                continue  # third-party, the top package itself, or a name that is no package
            if layers[other] < layers[own] or (line, other) in seen:
                continue
            seen.add((line, other))
            violations.append(
                f"{rel}:{line} ({own} L{layers[own]}) imports {module} ({other} L{layers[other]})"
            )
    return violations


def test_every_package_has_a_layer():
    packages = {p.stem if p.is_file() else p.name for p in SRC.iterdir()}
    packages -= {"__init__", "__pycache__", "py"}
    packages = {p for p in packages if not p.startswith(".")}
    assert packages <= set(LAYERS), packages - set(LAYERS)


def test_every_module_imports_only_its_own_package_and_lower_layers():
    violations = layer_violations(SRC, LAYERS)
    assert not violations, "\n".join(violations)


def test_the_layer_table_in_the_architecture_page_is_the_one_checked_here():
    page = (SRC.parents[1] / "docs" / "architecture.md").read_text(encoding="utf-8")
    table = {}
    for line in page.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0][:1] == "L" and cells[0][1:].isdigit():
            table[cells[1].strip("`").removeprefix("keel.")] = int(cells[0][1:])
    assert table == LAYERS


# A fake top package written under tmp_path (a fixture module that exists only for the test):
# each case is one module with one bad import, reported with its file, line and import.
CASES = {
    "absolute": ("algo/loss.py", "from keel.workers.actor import A\n", "keel.workers.actor"),
    "relative": ("algo/loss.py", "from ..workers import actor\n", "keel.workers"),
    "relative in a package": ("algo/__init__.py", "from ..controller import rl\n",
                              "keel.controller"),
    "lazy": ("algo/loss.py", "def f():\n    import keel.workers.actor\n", "keel.workers.actor"),
    "same layer": ("workers/a.py", "from keel.rollout import x\n", "keel.rollout"),
    "same layer, relative": ("workers/a.py", "from ..rollout.hf import x\n", "keel.rollout.hf"),
    "from the top package": ("algo/loss.py", "from keel import workers\n", "keel.workers"),
    "top-level module": ("types.py", "from .algo import masked\n", "keel.algo"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_violation_is_reported_with_its_file_line_and_import(tmp_path, case):
    rel, code, module = CASES[case]
    layers = {"types": 0, "algo": 1, "rollout": 2, "workers": 2, "controller": 3}
    root = tmp_path / "keel"
    for pkg in ("algo", "workers", "rollout", "controller"):
        (root / pkg).mkdir(parents=True)
        (root / pkg / "__init__.py").write_text("")
    (root / "__init__.py").write_text("")
    (root / "algo" / "masked.py").write_text("from .loss import f\nfrom keel.types import Batch\n")
    (root / rel).write_text("import torch\n" + code)
    line = 3 if case == "lazy" else 2
    (violation,) = layer_violations(root, layers)
    assert violation.startswith(f"{rel}:{line} ")
    assert f"imports {module} " in violation


def test_own_package_lower_layers_and_third_party_pass(tmp_path):
    root = tmp_path / "keel"
    (root / "algo").mkdir(parents=True)
    (root / "algo" / "__init__.py").write_text("from .loss import f\nfrom . import loss\n")
    (root / "algo" / "loss.py").write_text(
        "import torch\nfrom keel.types import Batch\nfrom keel import types\n"
        "def f():\n    from ..types import Batch\n    from .masked import g\n"
    )
    (root / "types.py").write_text("from __future__ import annotations\nimport keel\n")
    assert layer_violations(root, {"types": 0, "algo": 1}) == []
