"""Code shape: every module reads in one sitting and every function fits on a screen."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "effectguard"
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60

#: ``path:qualified.name`` -> why it may be longer for now. Keep this short.
FUNCTION_EXEMPTIONS: dict[str, str] = {}
MODULE_EXEMPTIONS: dict[str, str] = {}


def _functions(tree: ast.AST, prefix: str = "") -> Iterator[tuple[str, int]]:
    """Every function and method with its qualified name and its length in lines."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            name = prefix + node.name
            assert node.end_lineno is not None
            yield name, node.end_lineno - node.lineno + 1
            yield from _functions(node, name + ".")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, prefix + node.name + ".")
        else:
            yield from _functions(node, prefix)


def _modules() -> Iterator[tuple[str, str]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(PACKAGE).as_posix(), path.read_text(encoding="utf-8")


def test_no_module_is_over_500_lines() -> None:
    """Every module of effectguard/ is at most 500 lines, unless exempted with a reason."""
    long = {
        name: len(text.splitlines())
        for name, text in _modules()
        if len(text.splitlines()) > MAX_MODULE_LINES and name not in MODULE_EXEMPTIONS
    }
    assert long == {}


def test_no_function_is_over_60_lines() -> None:
    """Every function of effectguard/ is at most 60 lines, unless exempted with a reason."""
    long = {
        f"{name}:{function}": length
        for name, text in _modules()
        for function, length in _functions(ast.parse(text))
        if length > MAX_FUNCTION_LINES
    }
    assert {k: v for k, v in long.items() if k not in FUNCTION_EXEMPTIONS} == {}


def test_exemptions_are_still_needed() -> None:
    """An exemption whose function or module got short is removed, so the list only shrinks."""
    functions = {
        f"{name}:{function}": length
        for name, text in _modules()
        for function, length in _functions(ast.parse(text))
    }
    stale = [k for k in FUNCTION_EXEMPTIONS if functions.get(k, 0) <= MAX_FUNCTION_LINES]
    lines = {name: len(text.splitlines()) for name, text in _modules()}
    stale += [k for k in MODULE_EXEMPTIONS if lines.get(k, 0) <= MAX_MODULE_LINES]
    assert stale == []
