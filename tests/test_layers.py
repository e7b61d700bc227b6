"""The package's layers import one way only, and no module imports itself in a circle.

Layers, bottom up (docs/architecture.md): errors, rules, providers, config, ledger,
telemetry, callpath, ingress, testing, ops. A module may import its own layer and the
layers below it; ``effectguard/__init__.py`` and ``__main__.py`` are the public face
and may import anything.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "effectguard"
LAYERS = [
    "errors",
    "rules",
    "providers",
    "config",
    "ledger",
    "telemetry",
    "callpath",
    "ingress",
    "testing",
    "ops",
]
FACE = {"effectguard", "effectguard.__main__"}


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imports(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """Every effectguard module ``path`` imports (lazy and TYPE_CHECKING imports too)."""
    tree = ast.parse(path.read_text())
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name.split(".") if is_package else name.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join([*pkg, base] if base else pkg)
            # ``from pkg import mod`` imports the submodule; ``from pkg import name``, pkg.
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names
            ]
        for target in targets:
            if target in modules and target != name:
                out.add(target)
    return out


def _layer(module: str) -> int:
    parts = module.split(".")
    assert parts[0] == "effectguard" and len(parts) > 1, module
    return LAYERS.index(parts[1])


GRAPH = {name: _imports(path, name, _modules()) for name, path in _modules().items()}


def _edge_ok(src: str, dst: str) -> bool:
    if src in FACE:
        return True
    if dst == "effectguard":  # the public face re-exports; nothing inside imports it
        return False
    return _layer(dst) <= _layer(src)


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if m not in FACE))
def test_imports_point_down(module: str) -> None:
    """A module imports only its own layer and the layers below it."""
    bad = sorted(dst for dst in GRAPH[module] if not _edge_ok(module, dst))
    assert not bad, f"{module} imports a layer above it: {bad}"


def test_rules_import_nothing_but_errors() -> None:
    """The pure rules import nothing internal except the errors and each other."""
    for module, targets in GRAPH.items():
        if module.startswith("effectguard.rules"):
            outside = {t for t in targets if not t.startswith("effectguard.rules")}
            assert outside <= {"effectguard.errors"}, (module, outside)


def test_prepare_does_not_import_the_ledger() -> None:
    """Preparing a request is pure: it never reaches the ledger package."""
    assert not {t for t in GRAPH["effectguard.callpath.prepare"] if "ledger" in t}


def test_no_import_circles() -> None:
    """No module reaches itself through its imports."""
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(GRAPH.get(node, ())):
            if nxt in FACE:
                continue
            if state.get(nxt) == 1:
                cycle = [*path[path.index(nxt) :], nxt]
                raise AssertionError("import circle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for module in sorted(GRAPH):
        if module not in state and module not in FACE:
            visit(module)


def test_checker_sees_a_violation() -> None:
    """The checker itself works: an upward import is reported."""
    assert not _edge_ok("effectguard.rules.money", "effectguard.ledger")
    assert _edge_ok("effectguard.ops.cli", "effectguard.ledger")
