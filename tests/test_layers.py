"""The layer rule of docs/architecture.md: a module imports only from its own package and from
packages of lower layers (lazy imports inside functions included)."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "keel"
LAYERS = {
    "config": 0, "types": 0, "jsonlines": 0,
    "algo": 1, "rewards": 1,
    "data": 2, "models": 2, "monitor": 2, "report": 2, "guard": 2,
    "engine": 3, "rollout": 3, "checkpoint": 3,
    "workers": 4,
    "controller": 5, "recipes": 5,
    "cli": 6,
}  # fmt: skip


def _package(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "keel" and len(parts) > 1 else None


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
    return out


def test_every_package_has_a_layer():
    packages = {p.stem if p.is_file() else p.name for p in SRC.iterdir()}
    packages -= {"__init__", "__pycache__", "py"}
    packages = {p for p in packages if not p.startswith(".")}
    assert packages <= set(LAYERS), packages - set(LAYERS)


def test_no_module_imports_a_higher_layer():
    violations = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC)
        own = rel.parts[0].removesuffix(".py")
        if own not in LAYERS:
            continue
        for module in _imports(path):
            other = _package(module)
            if other and other != own and LAYERS.get(other, 99) > LAYERS[own]:
                violations.append(f"{rel} (L{LAYERS[own]}) imports {module} (L{LAYERS[other]})")
    assert not violations, "\n".join(violations)
