"""Typed run configuration, loaded from YAML in exactly one place.

A config file is a YAML mapping whose sections map onto pydantic models (unknown keys are
errors): :class:`Config` here assembles them, and each section's model lives with its concern
(``train/config.py``, ``checkpoint/config.py``, ``recovery/config.py``, ...; all importable from
here). The ``data`` and ``model`` sections are typed by the task: a task module may define
``DataConfig`` (a subclass of :class:`DataConfig`) and ``ModelConfig`` (a subclass of
:class:`ModelConfig`) models, and those validate the sections. ``elastic-runner schema`` prints the
JSON Schema of the file (:func:`config_schema`).

Errors are :class:`ConfigError` and always name the key path (``optimizer.lr``), what was expected
and what was found; the CLI turns them into a one-line message and exit code 2.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import importlib
import importlib.metadata
import json
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializeAsAny,
    StrictInt,
    TypeAdapter,
    ValidationError,
    create_model,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails

from .agent.config import PreemptionConfig, RestartsConfig
from .checkpoint.config import CheckpointConfig
from .config_base import ConfigError, Hint, Section, invalid
from .data.config import AuditConfig, DataConfig
from .observe.config import LoggingConfig, MetricsConfig, WatchdogConfig
from .parallel.config import DDPConfig, FSDPConfig
from .protocol import env as runner_env
from .recovery.config import RecoveryConfig
from .train.config import (
    BatchConfig,
    DistributedConfig,
    EarlyStoppingConfig,
    EvalConfig,
    FaultConfig,
    FaultSpec,
    ModelConfig,
    OptimizerConfig,
    ScheduleConfig,
    TrainingConfig,
)

# the file's model and its loader, and every section's model (each defined with its concern)
__all__ = [
    "AuditConfig", "BatchConfig", "CheckpointConfig", "Config", "ConfigError", "DDPConfig",
    "DataConfig", "DistributedConfig", "EarlyStoppingConfig", "EvalConfig", "FaultConfig",
    "FaultSpec", "FSDPConfig", "LoggingConfig", "MetricsConfig", "ModelConfig", "OptimizerConfig",
    "PreemptionConfig", "RecoveryConfig", "RestartsConfig", "ScheduleConfig", "TrainingConfig",
    "WatchdogConfig", "available_tasks", "build_key", "config_schema", "dump_yaml",
    "fingerprint", "from_dict", "load_config", "task_builder", "task_target",
]

BUILTIN_TASKS = {
    "digits": "elastic_runner.tasks.digits:build",
    "char_lm": "elastic_runner.tasks.char_lm:build",
    "text_classification": "elastic_runner.tasks.text_classification:build",  # [hf] extra
    "causal_lm": "elastic_runner.tasks.causal_lm:build",  # [hf] extra
}
TASK_ENTRY_POINTS = "elastic_runner.tasks"  # importlib.metadata group: name = "pkg.module:build"


class Config(Section):
    """A whole config file. Build it with :func:`load_config` or :func:`from_dict`, which type
    ``data`` and ``model`` with the task's classes."""

    task: str
    """The task: a built-in name (`digits`, `char_lm`, `text_classification`, `causal_lm`), the name
    of an installed `elastic_runner.tasks` entry point, or an import path `package.module:build`."""
    seed: StrictInt = 1234
    """Seeds Python's, NumPy's and torch's generators before the task is built, and the sampler's
    permutation of each epoch."""
    data: SerializeAsAny[DataConfig] = Field(default_factory=DataConfig)
    model: dict[str, Any] | SerializeAsAny[ModelConfig] = Field(
        default_factory=dict, union_mode="left_to_right")
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    batch: BatchConfig = Field(default_factory=BatchConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    early_stopping: EarlyStoppingConfig = Field(default_factory=EarlyStoppingConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    audit: AuditConfig = Field(default_factory=AuditConfig)
    watchdog: WatchdogConfig = Field(default_factory=WatchdogConfig)
    preemption: PreemptionConfig = Field(default_factory=PreemptionConfig)
    recovery: RecoveryConfig = Field(default_factory=RecoveryConfig)
    restarts: RestartsConfig = Field(default_factory=RestartsConfig)
    faults: FaultConfig = Field(default_factory=FaultConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)

    @model_validator(mode="after")
    def _lagged_vote_without_trace(self) -> Config:
        if self.training.lagged_vote is True and self.audit.trace_dir is not None:
            raise invalid("cannot be true with audit.trace_dir set (the sample trace reads "
                          "every step's loss and records each step's vote as it is taken); "
                          "use auto or false", "training.lagged_vote")
        return self

    @model_validator(mode="after")
    def _shrink_keeps_the_global_batch(self) -> Config:
        if self.recovery.continue_shrunk and self.batch.follows_world_size:
            raise invalid("needs a global batch that stays the same at the smaller world size "
                          "(batch.global_batch_size, or batch.keep_global_batch: true)",
                          "recovery.continue_shrunk")
        return self

    def to_dict(self) -> dict[str, Any]:
        """Plain YAML/JSON-able values (tuples as lists), sections in declaration order."""
        return _plain(self.model_dump())

    def fingerprint(self) -> str:
        return fingerprint(self.to_dict())


_NOT_MODEL = ("checkpoint", "logging", "audit", "watchdog", "preemption", "recovery", "restarts",
              "faults", "metrics")


# keys added after checkpoints of earlier releases were written: left out of the fingerprint
# while they hold these defaults, so those checkpoints still match their config
_LATER_KEYS: dict[tuple[str, str], Any] = {("optimizer", "fused"): "auto",
                                           ("training", "lagged_vote"): "auto",
                                           ("training", "deterministic"): False,
                                           ("batch", "keep_global_batch"): True,
                                           ("distributed", "strategy"): "ddp",
                                           ("distributed", "eager_init"): True,
                                           ("distributed", "fsdp"): FSDPConfig().model_dump()}


def fingerprint(config: dict[str, Any]) -> str:
    """sha256 (hex, 16 chars) of what determines the trained model, from a config dict: excludes
    the checkpoint, logging, audit, watchdog, preemption, recovery, restarts, fault-injection
    and metrics sections, so moving the checkpoint dir keeps resume working, and keys added in
    later releases while they hold their defaults (:data:`_LATER_KEYS`)."""
    d = {k: v for k, v in config.items() if k not in _NOT_MODEL}
    for (section, key), default in _LATER_KEYS.items():
        if isinstance(d.get(section), dict) and d[section].get(key, default) == default:
            d[section] = {k: v for k, v in d[section].items() if k != key}
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


_BUILD_SECTIONS = ("task", "seed", "data", "model")
_LOADER_KEYS = ("num_workers", "pin_memory")  # how data is loaded, not which data


def build_key(config: dict[str, Any]) -> str:
    """sha256 (hex, 16 chars) of what a task's ``build`` may depend on, from a config dict: the
    task, the seed and the data and model sections (without the loader settings), so changing
    the optimizer, the schedule or the batch keeps the task's build and its job artifacts."""
    d = {k: config.get(k) for k in _BUILD_SECTIONS}
    if isinstance(d["data"], dict):
        d["data"] = {k: v for k, v in d["data"].items() if k not in _LOADER_KEYS}
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def _plain(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_plain(v) for v in obj]
    return obj


# ---------------------------------------------------------------- task resolution


def _entry_point_tasks() -> dict[str, str]:
    """Tasks registered by installed packages: ``[project.entry-points."elastic_runner.tasks"]
    mytask = "mypkg.mytask:build"``."""
    return {ep.name: ep.value for ep in importlib.metadata.entry_points(group=TASK_ENTRY_POINTS)}


def available_tasks() -> list[str]:
    """Built-in task names and those of the ``elastic_runner.tasks`` entry points."""
    return sorted({*BUILTIN_TASKS, *_entry_point_tasks()})


def task_target(task: str) -> str:
    """``module:function`` of a task name: built-in, entry point, or the import path itself."""
    if task in BUILTIN_TASKS:
        return BUILTIN_TASKS[task]
    if ":" not in task:
        return _entry_point_tasks().get(task, task)
    return task


def load_task_module(task: str, path: str = "task") -> types.ModuleType:
    """Import the module of ``task`` as is (nothing is added to ``sys.path``).

    Raises:
        ConfigError: unknown task name, module not importable (says what to check), or the module
            has no callable of that name.
    """
    target = task_target(task)
    if ":" not in target:
        raise ConfigError(
            f"{path}: unknown task {task!r}; expected one of {available_tasks()} "
            "or an import path 'package.module:build'"
        )
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(_import_failure(path, module_name, e)) from e
    if not callable(getattr(module, attr, None)):
        raise ConfigError(f"{path}: module {module_name!r} has no callable {attr!r}")
    return module


def _import_failure(path: str, module_name: str, e: ImportError) -> str:
    missing = e.name or ""
    if isinstance(e, ModuleNotFoundError) and missing and (
            module_name == missing or module_name.startswith(missing + ".")):
        return (f"{path}: cannot import task module {module_name!r} (no module named "
                f"{missing!r}); check that the directory holding it is on PYTHONPATH (e.g. "
                "PYTHONPATH=. when it sits in the current directory) or that its package is "
                "installed (pip install)")
    if missing.partition(".")[0] in ("transformers", "tokenizers"):
        return (f"{path}: task module {module_name!r} needs {missing!r}, which is not "
                "installed; install the Hugging Face extra: pip install 'elastic-runner[hf]' "
                "(from a checkout: pip install -e '.[hf]')")
    return (f"{path}: importing task module {module_name!r} failed: {e}; check that its "
            "dependencies are installed (pip install)")


def task_builder(task: str) -> typing.Callable[..., Any]:
    """The ``build`` function of ``task``.

    Raises:
        ConfigError: as :func:`load_task_module`.
    """
    return getattr(load_task_module(task), task_target(task).partition(":")[2])


def section_types(module: types.ModuleType) -> tuple[type[DataConfig], type[ModelConfig] | None]:
    """The ``data`` and ``model`` section classes a task module declares (``DataConfig`` and
    ``ModelConfig``); ``None`` for ``model``: the section stays a plain mapping.

    Raises:
        ConfigError: a declared class does not subclass this module's base class.
    """
    data_cls = getattr(module, "DataConfig", DataConfig)
    model_cls = getattr(module, "ModelConfig", None)
    for name, cls, base in (("DataConfig", data_cls, DataConfig),
                            ("ModelConfig", model_cls, ModelConfig)):
        if cls is not None and not (isinstance(cls, type) and issubclass(cls, base)):
            kind = "a dataclass" if dataclasses.is_dataclass(cls) else repr(cls)
            raise ConfigError(
                f"task: {module.__name__}.{name} must subclass elastic_runner.config.{name} "
                f"(a pydantic model), got {kind}")
    return data_cls, None if model_cls is ModelConfig else model_cls


# ---------------------------------------------------------------- loading

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
            shown = _clip(node.value) if isinstance(node, yaml.ScalarNode) else node.tag
            raise yaml.constructor.ConstructorError(
                None, None, f"cannot convert {shown}: {_clip(str(e), 120)}",
                node.start_mark) from e


def _clip(text: str | bytes, limit: int = 40) -> str:
    """The ``repr`` of ``text``'s first ``limit`` characters, ``...`` when it is longer: what an
    error message shows of a value (one line, short)."""
    return repr(text[:limit]) + ("..." if len(text) > limit else "")


def _clip_path(path: str, limit: int = 100) -> str:
    """A key path cut to ``limit`` characters for an error message."""
    return path if len(path) <= limit else path[:limit] + "..."


def _parse_yaml(text: str | bytes) -> Any:
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


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """Load ``path`` (YAML), apply ``key.path=value`` overrides, validate.

    Hostile input is bounded: a file of more than :data:`MAX_FILE_BYTES` bytes (1 MiB), a
    string key or value (or an override's value) of more than :data:`MAX_STRING_CHARS`
    characters (64 Ki), nesting deeper than :data:`MAX_DEPTH` and YAML aliases adding more than
    :data:`MAX_ALIAS_NODES` nodes are errors; messages show at most the first 40 characters of
    a value.

    Raises:
        ConfigError: unreadable file, bad YAML, empty file, a bound above exceeded (naming the
            key path or line and the limit), unknown key, wrong type or invalid value, missing
            ``task``.
    """
    raw = _read_yaml(path) if path is not None else {}
    for item in [*(overrides or []), *_env_faults()]:
        apply_override(raw, item)
    _check_bounds(raw, "")
    return from_dict(raw)


def _read_yaml(path: str | Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)  # never more: a huge file is refused unread
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from e
    if len(data) > MAX_FILE_BYTES:
        raise ConfigError(f"{path}: config file larger than the limit of {MAX_FILE_BYTES} "
                          "bytes (1 MiB)")
    try:
        raw = _parse_yaml(data)  # bytes: the YAML reader checks the encoding (UTF-8/16)
    except ConfigError as e:
        raise ConfigError(f"{path}: invalid YAML at {e}") from e
    if raw is None:
        raise ConfigError(f"{path}: the config file is empty; 'task' is required")
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(raw).__name__}")
    return raw


def _check_bounds(value: Any, path: str, depth: int = 0) -> None:
    """Refuse a string (or bytes) key or value of more than :data:`MAX_STRING_CHARS`, and nesting
    deeper than :data:`MAX_DEPTH` (overrides such as ``a.a.a...=1`` nest too).

    Raises:
        ConfigError: naming the key path and the limit; the value is shown cut to 40 chars.
    """
    where = _clip_path(path or "config")
    if isinstance(value, str | bytes) and len(value) > MAX_STRING_CHARS:
        raise ConfigError(f"{where}: value of {len(value)} characters, more than the limit of "
                          f"{MAX_STRING_CHARS}: {_clip(value)}")
    if not isinstance(value, dict | list):
        return
    if depth >= MAX_DEPTH:
        raise ConfigError(f"{where}: nested deeper than {MAX_DEPTH} levels")
    if isinstance(value, list):
        for i, item in enumerate(value):
            _check_bounds(item, f"{path}[{i}]", depth + 1)
        return
    for key, item in value.items():
        if isinstance(key, str) and len(key) > MAX_STRING_CHARS:
            raise ConfigError(f"{where}: key of {len(key)} characters, more than the limit of "
                              f"{MAX_STRING_CHARS}: {_clip(key)}")
        _check_bounds(item, _join(path, str(key)), depth + 1)


def _env_faults() -> list[str]:
    """:data:`~elastic_runner.protocol.env.FAULTS_ENV` as an override appending to
    ``faults.inject`` (for drills)."""
    text = runner_env.faults()
    return [f"faults.inject+={text}"] if text else []


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Apply one ``a.b.c=value`` override; the value is parsed as YAML (``1e-3``, ``[1, 2]``).

    Raises:
        ConfigError: no ``=``, a parent key that is not a section, bad YAML, ``+=`` without a list.
    """
    key, sep, value = item.partition("=")
    if len(key) > MAX_STRING_CHARS or len(value) > MAX_STRING_CHARS:  # before echoing or parsing
        what, text = ("key", key) if len(key) > MAX_STRING_CHARS else ("value", value)
        raise ConfigError(f"{_clip_path(key.rstrip('+'))}: override {what} of {len(text)} "
                          f"characters, more than the limit of {MAX_STRING_CHARS}: {_clip(text)}")
    if not sep or not key:
        raise ConfigError(f"override {_clip(item, 80)}: expected key.path=value")
    append = key.endswith("+")
    key = key.rstrip("+")
    parts = key.split(".")
    node = raw
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {_clip(item, 80)}: "
                              f"{_clip_path('.'.join(parts[: i + 1]))} is not a section")
        node = child
    try:
        parsed = _parse_yaml(value)
    except ConfigError as e:
        raise ConfigError(f"override {_clip(item, 80)}: invalid value at {e}") from e
    if append:  # key+=[...] extends a list
        if not isinstance(parsed, list):
            raise ConfigError(f"override {_clip(item, 80)}: += needs a YAML list")
        parsed = [*(node.get(parts[-1]) or []), *parsed]
    node[parts[-1]] = parsed


_PLAIN_MAPPING = TypeAdapter(dict[str, Any])


def from_dict(raw: dict[str, Any]) -> Config:
    """Validate a config mapping (as read from YAML); ``data``/``model`` use the task's classes.

    Raises:
        ConfigError: the first problem, in file order, as one line that names the key path.
    """
    if not isinstance(raw, dict):
        raise ConfigError(f"config: expected a mapping, got {type(raw).__name__}")
    sections = dict(zip(("data", "model"), section_types(load_task_module(_task_name(raw))),
                        strict=True))
    values = {k: v for k, v in raw.items() if k not in sections}
    errors: list[ErrorDetails] = []
    for name, cls in sections.items():
        try:
            values[name] = _task_section(cls, raw.get(name))
        except ValidationError as e:
            errors += [{**err, "loc": (name, *err["loc"])} for err in e.errors()]
    try:
        cfg = Config.model_validate(values)
    except ValidationError as e:
        errors += e.errors()
    if errors:
        raise ConfigError(_message(_first(errors, raw), sections))
    return cfg


def _task_section(cls: type[Section] | None, value: Any) -> Any:
    """A ``data``/``model`` section validated with the task's class (``None``: a plain mapping).

    Raises:
        ValidationError: the section does not fit the class.
    """
    if cls is None:
        return _PLAIN_MAPPING.validate_python({} if value is None else value)
    return cls.model_validate(value)


def _task_name(raw: dict[str, Any]) -> str:
    task = raw.get("task")
    if task is None:
        raise ConfigError(
            f"task: required; name the task: one of {available_tasks()} or an import path "
            "'package.module:build'")
    if not isinstance(task, str):
        raise ConfigError(f"task: expected str, got {type(task).__name__} {task!r}")
    return task


# ---------------------------------------------------------------- error messages


_EXPECTED = {"int_type": "int", "int_parsing": "int", "int_from_float": "int",
             "float_type": "float", "float_parsing": "float", "bool_type": "bool",
             "bool_parsing": "bool", "string_type": "str", "list_type": "a list",
             "tuple_type": "a list"}
_MAPPING = ("model_type", "model_attributes_type", "dict_type")
_BOUNDS = ("greater_than_equal", "greater_than", "less_than_equal", "less_than")
_OPS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}


def _first(errors: list[ErrorDetails], raw: dict[str, Any]) -> ErrorDetails:
    """Unknown top-level keys first, then the error of the earliest section in the file."""
    order = {k: i for i, k in enumerate(raw)}

    def rank(err: ErrorDetails) -> tuple[bool, int]:
        loc = err["loc"]
        unknown_section = len(loc) == 1 and err["type"] == "extra_forbidden"
        return not unknown_section, order.get(loc[0], len(order)) if loc else -1

    return min(errors, key=rank)


def _message(err: ErrorDetails, sections: dict[str, Any]) -> str:
    """One line for a pydantic error: key path, what was expected, what was found."""
    loc, kind, value = err["loc"], err["type"], err.get("input")
    path = _loc_path(loc) or "config"
    ctx = err.get("ctx") or {}
    tp, info = _field_at(loc, sections)
    if kind == "extra_forbidden":
        parent = _model_of(_field_at(loc[:-1], sections)[0])
        valid = list(parent.model_fields) if parent else []
        return _unknown_key(_loc_path(loc[:-1]), str(loc[-1]), valid)
    if kind == "config":
        key = ctx["key"]
        path = (_join(path, key) if loc else key) if key else path
        return f"{path}: {ctx['message']}"
    if kind == "literal_error":
        return _literal_message(path, _literal_args(tp), value, ctx)
    if kind == "missing" and loc and isinstance(loc[-1], int):  # a fixed-size tuple too short
        size = len(typing.get_args(_strip_none(_field_at(loc[:-1], sections)[0])))
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
    full = _join(path, key)
    close = difflib.get_close_matches(str(key), valid, n=1, cutoff=0.5)
    hint = f"; did you mean {_join(path, close[0])!r}?" if close else ""
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
        path = f"{path}[{part}]" if isinstance(part, int) else _join(path, part)
    return path


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else str(key)


def _field_at(loc: tuple[int | str, ...], sections: dict[str, Any]) -> tuple[Any, FieldInfo | None]:
    """The annotation and field at ``loc`` (``(None, None)`` where the path leaves the models)."""
    tp: Any = Config
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


# ---------------------------------------------------------------- output


def dump_yaml(cfg: Config) -> str:
    """The resolved config as YAML, sections in declaration order."""
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


def config_schema(task: str | None = None) -> dict[str, Any]:
    """JSON Schema (draft 2020-12) of a config file. Without ``task`` the ``data`` and ``model``
    sections are the base classes, open to further keys (tasks type them); with it, that task's.

    Raises:
        ConfigError: ``task`` cannot be loaded (see :func:`load_task_module`).
    """
    if task is None:
        data_cls: Any = _open_section(DataConfig)
        model_cls: Any = _open_section(ModelConfig)
    else:
        data_cls, model_cls = section_types(load_task_module(task))
        model_cls = model_cls or dict[str, Any]
    model_default = dict if model_cls == dict[str, Any] else model_cls
    model = create_model(
        "Config", __base__=Config, __doc__=Config.__doc__,
        data=(data_cls, Field(default_factory=data_cls)),
        model=(model_cls, Field(default_factory=model_default)))
    return {"$schema": "https://json-schema.org/draft/2020-12/schema",
            **model.model_json_schema()}


def _open_section(cls: type[Section]) -> type[Section]:
    """``cls`` accepting unknown keys, for the task-independent schema."""
    return types.new_class(cls.__name__, (cls,), {},
                           lambda ns: ns.update(model_config=ConfigDict(extra="allow"),
                                                __doc__=cls.__doc__, __module__=__name__))
