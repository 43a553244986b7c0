"""The config file's hardened YAML loader: a ``yaml.SafeLoader`` that refuses what a small
document could blow up into (alias bombs, recursive aliases, deep nesting, unconvertible
scalars), the bounds on hostile input (file size in bytes, string length in characters,
nesting depth) and the short values an error message shows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from .config_base import ConfigError
from .config_errors import join_key

# Bounds on hostile input (a config is a few KiB; these are far above any real one), so a bad
# file or override is refused fast, in bounded memory, with a short message.
MAX_FILE_BYTES = 1 << 20  # a config file, in bytes (1 MiB)
MAX_STRING_CHARS = 64 << 10  # one string key or value, and one override's value (64 Ki chars)
MAX_ALIAS_NODES = 10_000  # YAML nodes that aliases (*name) may add, in all, per document
MAX_DEPTH = 32  # nesting of mappings and lists


class _BoundedLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses, as a YAML error naming the line, what a small document
    could blow up into: aliases adding more than :data:`MAX_ALIAS_NODES` nodes (a "billion
    laughs" bomb; refused at the alias that crosses the bound, before anything is built), an
    alias inside its own anchor (a recursive value), nesting deeper than :data:`MAX_DEPTH`, and
    a scalar that Python cannot convert (an integer of more than 4300 digits, a date 2001-13-45).
    Anchors and aliases stay usable within the bound."""

    def __init__(self, stream: str | bytes) -> None:
        super().__init__(stream)
        self._alias_nodes = 0
        self._open: list[str | None] = []  # anchors of the nodes being composed, outermost first
        self._sizes: dict[int, int] = {}  # id(node) -> its node count with aliases expanded

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            self._count_alias(event)
            return super().compose_node(parent, index)
        if len(self._open) >= MAX_DEPTH:
            raise yaml.composer.ComposerError(
                None, None, f"nested deeper than {MAX_DEPTH} levels", event.start_mark)
        self._open.append(event.anchor)
        try:
            return super().compose_node(parent, index)
        finally:
            self._open.pop()

    def _count_alias(self, event: Any) -> None:
        node = self.anchors.get(event.anchor)
        if node is None:
            return  # undefined: the composer raises its own error
        if event.anchor in self._open:
            raise yaml.composer.ComposerError(
                None, None, f"alias *{event.anchor} inside its own anchor (a recursive value)",
                event.start_mark)
        self._alias_nodes += self._size(node)
        if self._alias_nodes > MAX_ALIAS_NODES:
            raise yaml.composer.ComposerError(
                None, None, f"aliases expand to more than {MAX_ALIAS_NODES} nodes (an alias "
                "bomb?); write the values out", event.start_mark)

    def _size(self, node: yaml.Node) -> int:
        """Nodes in ``node`` with aliases expanded (memoised: linear in the distinct nodes)."""
        if id(node) not in self._sizes:
            children: list[Any] = []
            if isinstance(node, yaml.SequenceNode):
                children = node.value
            elif isinstance(node, yaml.MappingNode):
                children = [n for pair in node.value for n in pair]
            self._sizes[id(node)] = 1 + sum(self._size(c) for c in children)
        return self._sizes[id(node)]

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep)
        except (ValueError, OverflowError) as e:  # int("9" * 5000), date(2001, 13, 45)
            shown = clip(node.value) if isinstance(node, yaml.ScalarNode) else node.tag
            raise yaml.constructor.ConstructorError(
                None, None, f"cannot convert {shown}: {clip(str(e), 120)}",
                node.start_mark) from e


def clip(text: str | bytes, limit: int = 40) -> str:
    """The ``repr`` of ``text``'s first ``limit`` characters, ``...`` when it is longer: what an
    error message shows of a value (one line, short)."""
    return repr(text[:limit]) + ("..." if len(text) > limit else "")


def clip_path(path: str, limit: int = 100) -> str:
    """A key path cut to ``limit`` characters for an error message."""
    return path if len(path) <= limit else path[:limit] + "..."


def parse_yaml(text: str | bytes) -> Any:
    """One YAML document through :class:`_BoundedLoader`.

    Raises:
        ConfigError: invalid or refused YAML; one line naming the line and column.
    """
    try:
        return yaml.load(text, Loader=_BoundedLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        raise ConfigError(_yaml_problem(e)) from e


def _yaml_problem(e: yaml.YAMLError) -> str:
    """``line L, column C: problem (context)``: a YAML error on one line, without the snippet."""
    if isinstance(e, yaml.MarkedYAMLError) and e.problem_mark is not None:
        context = f" ({e.context})" if e.context else ""
        mark = e.problem_mark
        return f"line {mark.line + 1}, column {mark.column + 1}: {e.problem}{context}"
    return " ".join(str(e).split())



def read_yaml(path: str | Path) -> dict[str, Any]:
    """The mapping in the YAML file at ``path`` (at most :data:`MAX_FILE_BYTES` bytes read).

    Raises:
        ConfigError: unreadable, too large, invalid YAML, empty, or not a mapping.
    """
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)  # never more: a huge file is refused unread
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from e
    if len(data) > MAX_FILE_BYTES:
        raise ConfigError(f"{path}: config file larger than the limit of {MAX_FILE_BYTES} "
                          "bytes (1 MiB)")
    try:
        raw = parse_yaml(data)  # bytes: the YAML reader checks the encoding (UTF-8/16)
    except ConfigError as e:
        raise ConfigError(f"{path}: invalid YAML at {e}") from e
    if raw is None:
        raise ConfigError(f"{path}: the config file is empty; 'task' is required")
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(raw).__name__}")
    return raw


def check_bounds(value: Any, path: str, depth: int = 0) -> None:
    """Refuse a string (or bytes) key or value of more than :data:`MAX_STRING_CHARS`, and nesting
    deeper than :data:`MAX_DEPTH` (overrides such as ``a.a.a...=1`` nest too).

    Raises:
        ConfigError: naming the key path and the limit; the value is shown cut to 40 chars.
    """
    where = clip_path(path or "config")
    if isinstance(value, str | bytes) and len(value) > MAX_STRING_CHARS:
        raise ConfigError(f"{where}: value of {len(value)} characters, more than the limit of "
                          f"{MAX_STRING_CHARS}: {clip(value)}")
    if not isinstance(value, dict | list):
        return
    if depth >= MAX_DEPTH:
        raise ConfigError(f"{where}: nested deeper than {MAX_DEPTH} levels")
    if isinstance(value, list):
        for i, item in enumerate(value):
            check_bounds(item, f"{path}[{i}]", depth + 1)
        return
    for key, item in value.items():
        if isinstance(key, str) and len(key) > MAX_STRING_CHARS:
            raise ConfigError(f"{where}: key of {len(key)} characters, more than the limit of "
                              f"{MAX_STRING_CHARS}: {clip(key)}")
        check_bounds(item, join_key(path, str(key)), depth + 1)
