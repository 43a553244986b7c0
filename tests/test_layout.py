"""The package's layout: no import cycle among ``elastic_runner``'s modules (``TYPE_CHECKING``
imports and imports inside functions included: a lower module must not import the trainer,
not even for its types), no two folders importing each other, the floors below, every
subpackage says what it holds, and the public API resolves.

A *folder* is a subpackage (``train/``, ``trainer/``, ...) or a top-level module
(``config.py``, ``worker.py``, ...). The folders stand on floors, from the bottom up:

1. the base: ``config_base``, ``dist`` (the process's place, its group), ``exit_codes``,
   ``logs``, ``preempt``, ``compat`` (every reliance on torch internals), ``nested`` (the one walk
   over nested state), ``host_buffers`` (the one pool of host buffers) and ``protocol/`` (what
   agents and workers say through the recovery store and the environment); they know no
   training;
2. the parts a step holds: ``checkpoint/``, ``data/`` (the sampler, the loader, a position's
   seed), ``parallel/`` (DDP and FSDP2);
3. the step protocol any loop follows: ``train/`` (the session, the vote, the stop policy, the
   state, the callback events, the straggler timing, fault injection);
4. what plugs into the step: ``observe/`` (the reporting callbacks, metrics, goodput, the
   watchdog), ``recovery/`` (the workers' side of in-place recovery and membership) and
   ``rank_session`` (one rank's session assembled with its checkpoints and reporting, for
   either loop);
5. the node agent: ``agent/`` (launch, in-place replacement, the recovery store it hosts, the
   restart budget and its patch of torch's agent); it starts the workers as processes and
   imports no loop, no task and no config schema;
6. a run: ``config`` (the config file's schema, composing each folder's own section, the
   agent's too; its hardened YAML loader ``config_yaml`` and pydantic's errors as one-line
   messages ``config_errors``), ``task_registry`` (a task's name to its module, its build
   function and its sections) and ``tasks/`` (the task interface and the built-in tasks);
7. the loops: ``trainer/`` (the built-in trainer: its step engine, its loop, its assembly from a
   config), ``worker`` (one rank's process under ``elastic-runner run``) and ``own_loop/`` (a user's
   own loop made fault-tolerant);
8. the command line: ``cli``, ``__main__``.

A folder imports its own floor or lower ones; an import that runs up (from a lower floor to a
higher one) is named in :data:`IMPORTS_UP`, at most 3 of them. The package's ``__init__`` (the
lazy public names) stands outside the floors.
"""

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


FLOORS: tuple[tuple[str, ...], ...] = (  # bottom up; see the module docstring
    ("config_base", "dist", "exit_codes", "logs", "preempt", "compat", "nested", "host_buffers",
     "protocol"),
    ("checkpoint", "data", "parallel"),
    ("train",),
    ("observe", "recovery", "rank_session"),
    ("agent",),
    ("config", "config_yaml", "config_errors", "task_registry", "tasks"),
    ("trainer", "worker", "own_loop"),
    ("cli", "__main__"),
)
IMPORTS_UP: tuple[str, ...] = ()  # "importer -> imported" modules; at most 3
MAX_IMPORTS_UP = 3


def folder(name: str) -> str | None:
    """The folder of module ``name``: its subpackage, or itself at the top (None: the package)."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else None


def folder_imports(files: dict[str, Path] | None = None) -> dict[tuple[str, str], list[str]]:
    """(importer's folder, imported folder) -> its imports, as "module -> module"."""
    if files is None:
        files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    edges: dict[tuple[str, str], list[str]] = {}
    for name, path in files.items():
        for target in imports(path, set(files)):
            a, b = folder(name), folder(target)
            if a and b and a != b:
                edges.setdefault((a, b), []).append(f"{name} -> {target}")
    return edges


def mutual_pairs(edges: dict[tuple[str, str], list[str]]) -> dict[tuple[str, str], list[str]]:
    """The folder pairs that import each other, with the imports both ways."""
    return {(a, b): sorted(edges[a, b] + edges[b, a]) for (a, b) in sorted(edges)
            if a < b and (b, a) in edges}


def imports_up(edges: dict[tuple[str, str], list[str]],
               floors: tuple[tuple[str, ...], ...] = FLOORS) -> list[str]:
    level = {f: i for i, names in enumerate(floors) for f in names}
    return sorted(imp for (a, b), imps in edges.items() if level[a] < level[b] for imp in imps)


def test_every_folder_stands_on_one_floor():
    placed = [f for names in FLOORS for f in names]
    assert len(placed) == len(set(placed))
    folders = {folder(module_name(p)) for p in PACKAGE.rglob("*.py")} - {None}
    assert folders - set(placed) == set(), "put each new folder on a floor (module docstring)"
    assert set(placed) - folders == set(), "a floor names a folder that is gone"


def test_no_two_folders_import_each_other():
    assert mutual_pairs(folder_imports()) == {}


def test_at_most_3_imports_run_up_each_named():
    assert len(IMPORTS_UP) <= MAX_IMPORTS_UP
    assert imports_up(folder_imports()) == sorted(IMPORTS_UP)


def test_the_folder_checks_find_a_pair_and_an_import_up():
    edges = {("a", "b"): ["x.a.m -> x.b.n"], ("b", "a"): ["x.b.n -> x.a.k"],
             ("c", "a"): ["x.c -> x.a.m"]}
    assert mutual_pairs(edges) == {("a", "b"): ["x.a.m -> x.b.n", "x.b.n -> x.a.k"]}
    assert imports_up(edges, (("a",), ("b",), ("c",))) == ["x.a.m -> x.b.n"]


MAX_CLASS_LINES = 300  # the recovery's classes (agent/, recovery/): each one job


def class_lengths(folders: tuple[str, ...] = ("agent", "recovery")) -> dict[str, int]:
    """``module.Class`` -> lines, for the classes of ``folders``."""
    out = {}
    for name in folders:
        for path in (PACKAGE / name).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef):
                    out[f"{module_name(path)}.{node.name}"] = node.end_lineno - node.lineno + 1
    return out


def test_no_class_of_the_agent_or_the_recovery_is_over_300_lines():
    lengths = class_lengths()
    assert "elastic_runner.agent.inplace_agent.InPlaceAgent" in lengths  # the walk sees them
    assert {c: n for c, n in lengths.items() if n > MAX_CLASS_LINES} == {}
