"""The protocol stays in one place (issue 55): outside :mod:`elastic_runner.protocol` no code
builds a store key string, names an ``ELASTIC_RUNNER_*`` variable, or reads (or writes) one of
torchrun's variables through ``os.environ``/``os.getenv``. AST-based: docstrings and comments
may name them; code may not."""

from __future__ import annotations

import ast
from pathlib import Path

import elastic_runner
from elastic_runner.protocol.keys import NAMES as KEY_NAMES
from elastic_runner.protocol.torchrun_env import NAMES as TORCHRUN_NAMES

PACKAGE = Path(elastic_runner.__file__).parent
PROTOCOL = PACKAGE / "protocol"
STORE_OPS = {"set", "get", "add", "check", "wait", "compare_set", "delete_key", "multi_get",
             "multi_set", "key", "PrefixStore"}
KEY_FUNCTIONS = {"key"}  # an attempt's key function: its parts are keys even without a "/"
TORCHRUN_PREFIXES = ("TORCHELASTIC_", "PET_")


def _torchrun_name(node: ast.AST) -> str | None:
    """The torchrun variable ``node`` names (a string constant, or a name imported from
    ``protocol.torchrun_env`` such as ``RANK``), else None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        text = node.value
    elif isinstance(node, ast.Name):
        text = node.id
    else:
        return None
    return text if text in TORCHRUN_NAMES or text.startswith(TORCHRUN_PREFIXES) else None


def _is_environ(node: ast.AST) -> bool:
    """``os.environ`` (or a bare ``environ``)."""
    return ((isinstance(node, ast.Attribute) and node.attr == "environ")
            or (isinstance(node, ast.Name) and node.id == "environ"))


def _key_like(node: ast.AST, bare: bool = False) -> bool:
    """A string constant or f-string that reads as one of the protocol's keys (``gen/3``,
    ``f"node/{n}/beat"``; ``bare``: also a key's first part alone, ``"view"``)."""
    if isinstance(node, ast.JoinedStr):
        head = node.values[0] if node.values else None
        return (isinstance(head, ast.Constant) and isinstance(head.value, str)
                and head.value.split("/")[0] in KEY_NAMES and "/" in head.value)
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value.split("/")[0] in KEY_NAMES and (bare or "/" in node.value)
    return False


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def _call_name(call: ast.Call) -> str:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def _environ_reads(node: ast.AST) -> bool:
    """Whether ``node`` reads or writes a torchrun variable through ``os.environ`` or
    ``os.getenv`` (a subscript, ``in``, ``.get``/``.pop``/``.update(RANK=...)``, ...)."""
    found: list[ast.AST] = []
    if isinstance(node, ast.Subscript) and _is_environ(node.value):
        found.append(node.slice)
    elif isinstance(node, ast.Compare) and any(_is_environ(c) for c in node.comparators):
        found.append(node.left)
    elif isinstance(node, ast.Call):
        f = node.func
        on_environ = isinstance(f, ast.Attribute) and _is_environ(f.value)
        getenv = isinstance(f, ast.Attribute) and f.attr == "getenv"
        if on_environ or getenv:
            found += node.args[:1] + [ast.Name(k.arg) for k in node.keywords if k.arg]
            found += [k for a in node.args if isinstance(a, ast.Dict) for k in a.keys if k]
    return any(_torchrun_name(n) for n in found)


def violations(path: Path, source: str | None = None) -> list[str]:
    """What ``path`` (or ``source``, as if it were ``path``) says outside the protocol."""
    text = path.read_text() if source is None else source
    tree, lines = ast.parse(text), text.splitlines()
    docs, out = _docstrings(tree), []

    def say(node: ast.AST, what: str) -> None:
        line = lines[node.lineno - 1].strip()
        out.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {what}: {line}")

    for node in ast.walk(tree):
        if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                and id(node) not in docs):
            if node.value.startswith("ELASTIC_RUNNER_"):
                say(node, "an ELASTIC_RUNNER_* name")
            elif node.value.startswith(TORCHRUN_PREFIXES) or node.value in TORCHRUN_NAMES:
                say(node, "a torchrun variable's name")
            elif "/" in node.value and _key_like(node):
                say(node, "a store key")
        if isinstance(node, ast.Call) and _call_name(node) in STORE_OPS:
            bare = _call_name(node) in KEY_FUNCTIONS
            for arg in [*node.args, *(k.value for k in node.keywords)]:
                parts = arg.elts if isinstance(arg, (ast.List, ast.Tuple)) else [arg]
                for part in parts:
                    if _key_like(part, bare):
                        say(part, "a store key")
        if _environ_reads(node):
            say(node, "os.environ and a torchrun variable")
    return out


def _outside() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if PROTOCOL not in p.parents)


def test_no_store_key_or_protocol_variable_outside_the_protocol() -> None:
    found = [v for path in _outside() for v in violations(path)]
    assert not found, "\n".join(found)


def test_the_check_finds_a_planted_violation() -> None:
    """Each kind of violation, planted in a module outside the protocol, is found (the test
    above can fail); the same text in a docstring is not."""
    path = PACKAGE / "worker.py"
    planted = {
        'store.set(f"gen/{g}", text)': "a store key",
        'store.check([key("view")])': "a store key",
        'store.add("elastic_runner/attempt/clock", 1)': "a store key",
        'NAME = "ELASTIC_RUNNER_SOMETHING"': "an ELASTIC_RUNNER_* name",
        'rank = int(os.environ.get("RANK", 0))': "a torchrun variable's name",
        'launched = WORLD_SIZE in os.environ': "os.environ and a torchrun variable",
        'os.environ.update(RANK=str(rank))': "os.environ and a torchrun variable",
        'os.environ[LOCAL_RANK] = "0"': "os.environ and a torchrun variable",
    }
    for line, what in planted.items():
        found = violations(path, f"import os\n{line}\n")
        assert any(what in v for v in found), (line, found)
    assert violations(path, '"""RANK, gen/<g> and ELASTIC_RUNNER_INPLACE."""\n') == []
    assert violations(path, 'x = {"failed": [1]}.get("failed")\n') == []
