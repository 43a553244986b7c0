"""Reference pages generated from the code, never written by hand (a Sphinx extension).

Directives:

* ``er-config``: every key of the config file, with its type, default, constraint and
  description, from the pydantic models (:class:`elastic_runner.config.Config` and the sections
  it assembles; the descriptions are the fields' docstrings), and the ``data``/``model`` keys of
  each built-in task;
* ``er-exit-codes``: :func:`elastic_runner.exit_codes.described`;
* ``er-metrics``: the Prometheus series a worker (:class:`~elastic_runner.observe.metrics.RankMetrics`)
  and a node's agent (:class:`~elastic_runner.observe.node_metrics.AgentMonitor`) register, with
  their type, labels and help;
* ``er-api``: autodoc entries for every name of ``elastic_runner.__all__`` (in an rST page);
* ``er-diff OLD NEW``: the unified diff of two Python files' code (paths relative to the page;
  the module docstrings left out), named by their paths in the repository (Sphinx's
  ``literalinclude :diff:`` prints absolute paths and cannot leave the docstrings out).

The first three write Markdown tables and parse them in place (MyST).
"""

from __future__ import annotations

import types
import typing
from typing import Any

import annotated_types
from docutils import nodes
from docutils.statemachine import StringList
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined
from sphinx.application import Sphinx
from sphinx.util.docutils import SphinxDirective


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- config


def _strip_annotated(tp: Any) -> tuple[Any, list[Any]]:
    meta: list[Any] = []
    while typing.get_origin(tp) is typing.Annotated:
        meta += list(tp.__metadata__)
        tp = tp.__origin__
    return tp, meta


def type_name(tp: Any) -> str:
    """A reader's name for a field's type: ``int``, ``float or null``, ``one of a, b``."""
    tp, _ = _strip_annotated(tp)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        names = [type_name(a) for a in args if a is not type(None)]
        return " or ".join(names) + (" or null" if type(None) in args else "")
    if origin is typing.Literal:
        return "one of " + ", ".join(f"`{a}`" for a in args)
    if origin in (list, tuple):
        inner = [type_name(a) for a in args if a is not Ellipsis]
        return (f"list of {inner[0]}" if origin is list else "[" + ", ".join(inner) + "]")
    if origin is dict:
        return "mapping"
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return "section"
    name = getattr(tp, "__name__", str(tp))
    return {"StrictInt": "int", "StrictBool": "bool", "str": "string"}.get(name, name)


def constraint(info: FieldInfo) -> str:
    """The bounds of a field (``>= 0``), or its error hint, from its metadata."""
    _, meta = _strip_annotated(info.annotation)
    meta = [*meta, *info.metadata]
    hint = next((m.text for m in meta if type(m).__name__ == "Hint"), None)
    if hint:
        return hint
    ops = {annotated_types.Ge: (">=", "ge"), annotated_types.Gt: (">", "gt"),
           annotated_types.Le: ("<=", "le"), annotated_types.Lt: ("<", "lt")}
    return ", ".join(f"{op} {getattr(m, attr)}" for m in meta for cls, (op, attr) in ops.items()
                     if isinstance(m, cls))


def default(info: FieldInfo) -> str:
    if info.default_factory is not None:
        value = info.default_factory()  # type: ignore[call-arg]
        return "(defaults)" if isinstance(value, BaseModel) else f"`{value!r}`"
    if info.default is PydanticUndefined:
        return "required"
    value = info.default
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, tuple):
        return f"`{list(value)}`"
    return f'`"{value}"`' if isinstance(value, str) else f"`{value}`"


def _section_model(tp: Any) -> type[BaseModel] | None:
    tp, _ = _strip_annotated(tp)
    for candidate in (tp, *typing.get_args(tp)):
        candidate, _ = _strip_annotated(candidate)
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _list_item_model(tp: Any) -> type[BaseModel] | None:
    tp, _ = _strip_annotated(tp)
    if typing.get_origin(tp) is list:
        return _section_model(typing.get_args(tp)[0])
    return None


def field_rows(model: type[BaseModel], prefix: str) -> list[list[str]]:
    """One row per key of ``model`` under ``prefix`` (nested sections and list items too)."""
    rows = []
    for name, info in model.model_fields.items():
        key = f"{prefix}{name}"
        nested, item = _section_model(info.annotation), _list_item_model(info.annotation)
        if nested is not None and typing.get_origin(info.annotation) is not typing.Union \
                and type_name(info.annotation) == "section":
            rows += field_rows(nested, f"{key}.")
            continue
        rows.append([f"`{key}`", type_name(info.annotation), default(info), constraint(info),
                     info.description or ""])
        if item is not None:
            rows += field_rows(item, f"{key}[].")
    return rows


def config_markdown() -> str:
    from elastic_runner import config as c
    from elastic_runner import task_registry as tasks

    out = []
    top = [[f"`{n}`", type_name(i.annotation), default(i), constraint(i), i.description or ""]
           for n, i in c.Config.model_fields.items()
           if _section_model(i.annotation) is None]
    out += ["## Top level\n", _table(["key", "type", "default", "constraint", "description"],
                                     top)]
    for name, info in c.Config.model_fields.items():
        model = _section_model(info.annotation)
        if model is None or name in ("data", "model"):
            continue
        out.append(f"## `{name}`\n")
        if model.__doc__ and model.__doc__ is not c.Section.__doc__:
            out.append(" ".join(model.__doc__.split()) + "\n")
        out.append(_table(["key", "type", "default", "constraint", "description"],
                          field_rows(model, f"{name}.")))
    out.append("## `data` and `model`: typed by the task\n")
    out.append("Every task's `data` section has these keys; a task may add its own (below). A "
               "task without a `model` model takes the `model` section as a plain mapping.\n")
    out.append(_table(["key", "type", "default", "constraint", "description"],
                      field_rows(c.DataConfig, "data.")))
    for task in sorted(tasks.BUILTIN_TASKS):
        module = tasks.load_task_module(task)
        data_cls, model_cls = tasks.section_types(module)
        rows = [r for r in field_rows(data_cls, "data.")
                if r[0].strip("`").split(".", 1)[1] not in c.DataConfig.model_fields]
        if model_cls is not None:
            rows += field_rows(model_cls, "model.")
        out.append(f"### task `{task}`\n")
        out.append(_table(["key", "type", "default", "constraint", "description"], rows)
                   if rows else "No keys of its own.\n")
    return "\n".join(out)


# ---------------------------------------------------------------- exit codes, metrics


def exit_codes_markdown() -> str:
    from elastic_runner.exit_codes import described

    return _table(["code", "name", "meaning"],
                  [[f"`{code}`", f"`{name}`", text] for name, code, text in described()])


def _families(registry: Any) -> list[tuple[str, str, list[str], str]]:
    out = []
    for collector in list(registry._collector_to_names):  # noqa: SLF001 - the docs only
        declared = list(getattr(collector, "_labelnames", ()))
        for family in collector.collect() if not declared else collector.describe():
            labels = declared
            if not labels:  # a custom collector's family: the labels of its samples
                names = {k for s in family.samples for k in s.labels if k != "le"}
                labels = sorted(names, key=lambda k: (k not in ("job", "node", "rank",
                                                                "local_rank"), k))
            suffix = "_total" if family.type == "counter" else ""
            out.append((family.name + suffix, family.type, labels, family.documentation))
    return out


def metrics_markdown() -> str:
    from prometheus_client import CollectorRegistry

    from elastic_runner.config import MetricsConfig
    from elastic_runner.observe.metrics import RankMetrics
    from elastic_runner.observe.node_metrics import AgentMonitor

    rank = RankMetrics(MetricsConfig(), 0, 0, cuda=True, registry=CollectorRegistry())
    agent = CollectorRegistry()
    agent.register(AgentMonitor("job", "node", 1))
    out = ["## Each worker (rank)\n",
           "Served by the node's agent under `elastic-runner run` (the workers write them in "
           "prometheus-client's multiprocess mode), by each worker on `metrics.port + "
           "local_rank` under plain torchrun. The CUDA series exist on CUDA only.\n"]
    header = ["series", "type", "labels", "help"]
    out.append(_table(header, [[f"`{n}`", t, ", ".join(f"`{x}`" for x in labels), doc]
                               for n, t, labels, doc in _families(rank.registry)]))
    out.append("## Each node's agent (`elastic-runner run`)\n")
    out.append(_table(header, [[f"`{n}`", t, ", ".join(f"`{x}`" for x in labels), doc]
                               for n, t, labels, doc in _families(agent)]))
    return "\n".join(out)


class _Markdown(SphinxDirective):
    make: Any = None

    def run(self) -> list[nodes.Node]:
        return self.parse_text_to_nodes(type(self).make())


class ConfigReference(_Markdown):
    make = staticmethod(config_markdown)


class ExitCodes(_Markdown):
    make = staticmethod(exit_codes_markdown)


class Metrics(_Markdown):
    make = staticmethod(metrics_markdown)


class Api(SphinxDirective):
    """autodoc entries for ``elastic_runner.__all__``, each at its defining module (rST)."""

    def run(self) -> list[nodes.Node]:
        import inspect

        import elastic_runner

        lines = []
        for name in elastic_runner.__all__:
            obj = getattr(elastic_runner, name)
            kind = "autoclass" if inspect.isclass(obj) else "autofunction"
            lines += [f".. {kind}:: {obj.__module__}.{name}", ""]
        container = nodes.container()
        self.state.nested_parse(StringList(lines, source="er-api"), self.content_offset,
                                container)
        return container.children


def _code(path: Any) -> str:
    """A Python file's text after its module docstring."""
    text = path.read_text()
    return text.split('"""', 2)[2].lstrip("\n") if text.startswith('"""') else text


class Diff(SphinxDirective):
    """``er-diff OLD NEW``: a ``diff`` code block from two files of the repository."""

    required_arguments = 2

    def run(self) -> list[nodes.Node]:
        import difflib
        from pathlib import Path

        here = Path(self.env.doc2path(self.env.docname)).parent
        old, new = (here / a for a in self.arguments)
        root = Path(self.env.srcdir).parent
        for path in (old, new):
            self.env.note_dependency(str(path))
        text = "".join(difflib.unified_diff(
            _code(old).splitlines(keepends=True), _code(new).splitlines(keepends=True),
            str(old.resolve().relative_to(root)), str(new.resolve().relative_to(root))))
        block = nodes.literal_block(text, text)
        block["language"] = "diff"
        return [block]


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_directive("er-config", ConfigReference)
    app.add_directive("er-exit-codes", ExitCodes)
    app.add_directive("er-metrics", Metrics)
    app.add_directive("er-api", Api)
    app.add_directive("er-diff", Diff)
    return {"parallel_read_safe": True, "version": "1"}
