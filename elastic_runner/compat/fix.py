"""A fix, and how one is judged on the installed torch: whether each private name it lists
resolves (:func:`resolves`) and its own check passes (:func:`problem`, :func:`applies`), and
the bytecode reading the checks use to see what a torch function does (:func:`mentions`,
:func:`mentions_name`). The area modules declare their fixes with :class:`Fix`; the registry
(:mod:`elastic_runner.compat.registry`) assembles them."""

from __future__ import annotations

import dis
import functools
import importlib
import inspect
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import CodeType
from typing import Any

from ..logs import first_line


@dataclass(frozen=True)
class Fix:
    """One reliance on torch's private behaviour: its name (in the start-up check's lines),
    the processes that check it, whether a missing internal stops the run, its own check
    (None: it applies; else what changed), and what happens without it."""

    name: str
    roles: tuple[str, ...]  # "agent" (elastic-runner run) and/or "worker" (each rank)
    required: bool
    check: Callable[[], str | None]
    without: str  # what happens when it cannot apply
    # every private torch name the fix (and the code it serves) relies on, as "module" or
    # "module:Name.attr" (an attribute of a class, or one its methods assign): the start-up
    # check verifies each, and tests/test_compat.py fails on a private torch name the package
    # uses that no fix lists
    internals: tuple[str, ...] = ()


def no_check() -> None:
    """The check of a fix whose listed internals are all it needs: returns None."""
    return None


@functools.cache
def applies(fix: Fix) -> bool:
    """Whether ``fix`` applies on the installed torch: each of its internals resolves and its
    own check passes. Every piece of code a fix serves gates on this, so a fix that
    :func:`~elastic_runner.compat.registry.check_torch` reports off is off
    (tests/test_compat.py takes each internal away and checks both). Decided once per process
    (torch does not change under a running process; some gates are asked every step)."""
    return problem(fix) is None


def problem(fix: Fix) -> str | None:
    """Why ``fix`` cannot apply on this torch (None: it can): a listed internal is gone, or
    its own check failed. Never raises: a check that fails to inspect torch is the problem."""
    try:
        gone = next((ref for ref in fix.internals if not resolves(ref)), None)
        return f"{gone} is gone" if gone is not None else fix.check()
    except Exception as e:  # an internal so changed that inspecting it fails
        return first_line(e)


def resolves(ref: str) -> bool:
    """Whether ``ref`` ("module" or "module:Name.attr") exists in this torch: the module
    imports, each name is an attribute, and the last is a class attribute or assigned by a
    method of the class (an instance attribute)."""
    module, _, path = ref.partition(":")
    try:
        obj: Any = importlib.import_module(module)
    except ImportError:
        return False
    *owners, name = path.split(".") if path else [""]
    for owner in owners:
        obj = getattr(obj, owner, None)
        if obj is None:
            return False
    if not name or hasattr(obj, name) or name in getattr(obj, "__annotations__", {}):
        return True
    return isinstance(obj, type) and any(
        assigns(inspect.unwrap(f), name) for klass in obj.__mro__
        for f in vars(klass).values() if inspect.isfunction(f))


def assigns(fn: Any, name: str) -> bool:
    """Whether ``fn`` assigns the attribute ``name`` (``self.name = ...``)."""
    return mentions_name(fn, name) and any(
        i.opname == "STORE_ATTR" and i.argval == name for i in dis.get_instructions(fn))


def mentions(fn: object, text: str) -> bool:
    """Whether the source of ``fn`` (unwrapped) has the string constant ``text``."""
    code = _code(fn)
    return code is not None and text in set(_constants(code))


def mentions_name(fn: object, name: str) -> bool:
    """Whether ``fn`` itself (not unwrapped), its comprehensions and lambdas included, uses the
    global or attribute ``name``."""
    code = getattr(fn, "__code__", None)
    return code is not None and _code_names(code, name)


def _code(fn: object) -> CodeType | None:
    fn = inspect.unwrap(fn) if callable(fn) else fn  # type: ignore[arg-type]
    return getattr(fn, "__code__", None)


def _constants(code: CodeType) -> Iterator[object]:
    yield from _flatten(code.co_consts)


def _flatten(consts: tuple[object, ...] | frozenset[object]) -> Iterator[object]:
    for c in consts:
        if isinstance(c, CodeType):
            yield from _constants(c)
        elif isinstance(c, (tuple, frozenset)):
            yield from _flatten(c)
        else:
            yield c


def _code_names(code: types.CodeType, name: str) -> bool:
    return name in code.co_names or any(
        _code_names(c, name) for c in code.co_consts if isinstance(c, types.CodeType))
