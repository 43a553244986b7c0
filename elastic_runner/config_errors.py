"""Pydantic's validation errors as the config's one-line messages: the key path, what was
expected and what was found (a close match for an unknown key or a literal), the first problem
in file order."""

from __future__ import annotations

import difflib
import types
import typing
from typing import Annotated, Any, Literal

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails

from .config_base import Hint

_EXPECTED = {"int_type": "int", "int_parsing": "int", "int_from_float": "int",
             "float_type": "float", "float_parsing": "float", "bool_type": "bool",
             "bool_parsing": "bool", "string_type": "str", "list_type": "a list",
             "tuple_type": "a list"}
_MAPPING = ("model_type", "model_attributes_type", "dict_type")
_BOUNDS = ("greater_than_equal", "greater_than", "less_than_equal", "less_than")
_OPS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}


def first_error(errors: list[ErrorDetails], raw: dict[str, Any]) -> ErrorDetails:
    """Unknown top-level keys first, then the error of the earliest section in the file."""
    order = {k: i for i, k in enumerate(raw)}

    def rank(err: ErrorDetails) -> tuple[bool, int]:
        loc = err["loc"]
        unknown_section = len(loc) == 1 and err["type"] == "extra_forbidden"
        return not unknown_section, order.get(loc[0], len(order)) if loc else -1

    return min(errors, key=rank)


def error_message(err: ErrorDetails, sections: dict[str, Any], root: type[BaseModel]) -> str:
    """One line for a pydantic error of ``root`` (the whole file's model; ``sections``: the
    task's ``data``/``model`` classes): key path, what was expected, what was found."""
    loc, kind, value = err["loc"], err["type"], err.get("input")
    path = _loc_path(loc) or "config"
    ctx = err.get("ctx") or {}
    tp, info = _field_at(loc, sections, root)
    if kind == "extra_forbidden":
        parent = _model_of(_field_at(loc[:-1], sections, root)[0])
        valid = list(parent.model_fields) if parent else []
        return _unknown_key(_loc_path(loc[:-1]), str(loc[-1]), valid)
    if kind == "config":
        key = ctx["key"]
        path = (join_key(path, key) if loc else key) if key else path
        return f"{path}: {ctx['message']}"
    if kind == "literal_error":
        return _literal_message(path, _literal_args(tp), value, ctx)
    if kind == "missing" and loc and isinstance(loc[-1], int):  # a fixed-size tuple too short
        size = len(typing.get_args(_strip_none(_field_at(loc[:-1], sections, root)[0])))
        return f"{_loc_path(loc[:-1])}: expected {size} values, got {len(value)}"
    if kind == "missing":
        return f"{path}: required key missing"
    if kind in ("too_long", "too_short") and ctx.get("field_type") == "Tuple":
        size = ctx.get("max_length", ctx.get("min_length"))
        return f"{path}: expected {size} values, got {ctx['actual_length']}"
    if kind in _BOUNDS:
        return f"{path}: {_bounds_message(info, ctx)}"
    if kind in _EXPECTED:
        return f"{path}: expected {_EXPECTED[kind]}, got {type(value).__name__} {value!r}"
    if kind in _MAPPING:
        return f"{path}: expected a mapping, got {type(value).__name__}"
    text = err["msg"].removeprefix("Value error, ")
    return f"{path}: {text} (got {type(value).__name__} {value!r})"


def _unknown_key(path: str, key: str, valid: list[str]) -> str:
    full = join_key(path, key)
    close = difflib.get_close_matches(str(key), valid, n=1, cutoff=0.5)
    hint = f"; did you mean {join_key(path, close[0])!r}?" if close else ""
    return f"{full}: unknown key{hint} (valid keys: {', '.join(valid)})"


def _literal_message(path: str, allowed: tuple[Any, ...], value: Any, ctx: dict[str, Any]
                     ) -> str:
    if not allowed:
        return f"{path}: expected {ctx.get('expected')}, got {value!r}"
    shown = ", ".join(repr(a) for a in allowed)
    close = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"{path}: expected one of {shown}, got {value!r}{hint}"


def _bounds_message(info: FieldInfo | None, ctx: dict[str, Any]) -> str:
    """``must be >= 1``, ``must be in [0, 1]``, ``... or null`` (from the field's metadata)."""
    metadata = info.metadata if info else []
    hint = next((m.text for m in metadata if isinstance(m, Hint)), None)
    if hint:
        return hint
    limits = ({k: getattr(m, k) for m in metadata for k in _OPS if hasattr(m, k)}
              or {k: v for k, v in ctx.items() if k in _OPS})
    if "ge" in limits and "le" in limits:
        text = f"must be in [{limits['ge']}, {limits['le']}]"
    else:
        text = "must be " + " and ".join(f"{_OPS[k]} {v}" for k, v in limits.items())
    nullable = info is not None and type(None) in typing.get_args(info.annotation)
    return text + (" or null" if nullable else "")


def _loc_path(loc: tuple[int | str, ...]) -> str:
    path = ""
    for part in loc:
        path = f"{path}[{part}]" if isinstance(part, int) else join_key(path, part)
    return path


def join_key(path: str, key: str) -> str:
    """``path.key`` (``key`` at the top)."""
    return f"{path}.{key}" if path else str(key)


def _field_at(loc: tuple[int | str, ...], sections: dict[str, Any], root: type[BaseModel]
              ) -> tuple[Any, FieldInfo | None]:
    """The annotation and field at ``loc`` under ``root`` (``(None, None)`` where the path
    leaves the models)."""
    tp: Any = root
    info: FieldInfo | None = None
    for i, part in enumerate(loc):
        if isinstance(part, int):
            tp, info = _item_type(tp, part), None
            continue
        model = _model_of(tp)
        if model is None or part not in model.model_fields:
            return None, None
        info = model.model_fields[part]
        tp = sections.get(part) if i == 0 and sections.get(part) else info.annotation
    return tp, info


def _strip_none(tp: Any) -> Any:
    if typing.get_origin(tp) is Annotated:
        return _strip_none(typing.get_args(tp)[0])
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and len(args) == 1:
        return _strip_none(args[0])
    return tp


def _item_type(tp: Any, index: int) -> Any:
    tp = _strip_none(tp)
    args = typing.get_args(tp)
    if typing.get_origin(tp) is tuple and args and Ellipsis not in args:
        return args[index] if index < len(args) else None
    return args[0] if args else None


def _model_of(tp: Any) -> type[BaseModel] | None:
    """The pydantic model in an annotation (through ``Optional``, ``Annotated``, unions)."""
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return tp
    return next((m for m in map(_model_of, typing.get_args(tp)) if m is not None), None)


def _literal_args(tp: Any) -> tuple[Any, ...]:
    tp = _strip_none(tp)
    return typing.get_args(tp) if typing.get_origin(tp) is Literal else ()
