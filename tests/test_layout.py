"""The package's layout: no import cycle among ``elastic_runner``'s modules (``TYPE_CHECKING``
imports and imports inside functions included: a lower module must not import the trainer,
not even for its types), every subpackage says what it holds, and the public API resolves."""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

import elastic_runner

PACKAGE = Path(elastic_runner.__file__).parent


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, modules: set[str]) -> set[str]:
    """The package's modules that ``path`` imports, anywhere in it."""
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            for a in node.names:
                for candidate in (f"{module}.{a.name}", module):
                    if candidate in modules:
                        found.add(candidate)
                        break
    return found - {here}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10_000))
    try:
        for v in sorted(graph):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return out


def package_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    parents = {name.rpartition(".")[0] for name in files}
    # importing a submodule runs its package's __init__: not an edge of the code's design
    return {name: imports(path, set(files)) - parents for name, path in files.items()}


def test_no_import_cycle_among_the_modules():
    assert cycles(package_graph()) == []


def test_the_cycle_check_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_every_subpackage_says_what_it_holds():
    for init in PACKAGE.rglob("__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc) > 40, init


def test_the_public_api_resolves_lazily():
    for name in elastic_runner.__all__:
        assert getattr(elastic_runner, name) is not None, name
    assert importlib.import_module("elastic_runner").fault_tolerant.__module__ == \
        "elastic_runner.own_loop"
