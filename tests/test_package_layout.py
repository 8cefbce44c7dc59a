"""The package's shape holds: no import circle between its modules (imports inside functions
count), no module over 500 lines, no function over 80, and no module importing another module's
private (underscore) names. Read from the source with ``ast``; nothing is imported."""

from __future__ import annotations

import ast
import os

import pytest

PKG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "foxhunt_stream")
PKG = "foxhunt_stream"
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80


def _modules() -> dict[str, tuple[str, bool]]:
    """Dotted module name -> (path, is a package's __init__)."""
    out = {}
    for root, _, files in os.walk(PKG_DIR):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(root, f)
                parts = os.path.relpath(path, os.path.dirname(PKG_DIR))[:-3].split(os.sep)
                is_init = parts[-1] == "__init__"
                out[".".join(parts[:-1] if is_init else parts)] = (path, is_init)
    return out


MODULES = _modules()


def _target(module: str, node: ast.ImportFrom, is_init: bool) -> str | None:
    if node.level == 0:
        return node.module
    base = module.split(".") if is_init else module.split(".")[:-1]
    if node.level > 1:
        base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str) -> tuple[set[str], list[str]]:
    """The package modules ``module`` imports anywhere in it, and the private names it takes."""
    path, is_init = MODULES[module]
    tree = ast.parse(open(path).read())
    edges, private = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            edges.update(a.name for a in node.names if a.name.startswith(PKG + "."))
        elif isinstance(node, ast.ImportFrom):
            target = _target(module, node, is_init)
            if not target or not (target == PKG or target.startswith(PKG + ".")):
                continue
            for a in node.names:
                full = f"{target}.{a.name}"
                if full in MODULES:
                    edges.add(full)
                else:
                    edges.add(target)
                    if a.name.startswith("_") and not a.name.startswith("__"):
                        private.append(f"{module}: from {target} import {a.name}")
    return {e for e in edges if e in MODULES and e not in (module, PKG)}, private


def test_no_import_circles():
    graph = {m: _imports(m)[0] for m in MODULES}
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(v: str) -> None:   # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))
    for v in graph:
        if v not in index:
            visit(v)
    assert circles == []


def test_no_private_names_taken_across_modules():
    assert [p for m in MODULES for p in _imports(m)[1]] == []


@pytest.mark.parametrize("module", sorted(MODULES))
def test_modules_and_functions_stay_small(module):
    path, _ = MODULES[module]
    source = open(path).read()
    assert len(source.splitlines()) <= MAX_MODULE_LINES
    long = [f"{node.name}: {node.end_lineno - node.lineno + 1} lines" for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert long == []
