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

Beside it: the hardened YAML loader and the bounds on hostile input (:mod:`.config_yaml`),
pydantic's errors as those one-line messages (:mod:`.config_errors`) and the task registry
(:mod:`.task_registry`; its public names are importable from here too).
"""

from __future__ import annotations

import hashlib
import json
import types
from pathlib import Path
from typing import Any

import yaml
from pydantic import (
    ConfigDict,
    Field,
    SerializeAsAny,
    StrictInt,
    TypeAdapter,
    ValidationError,
    create_model,
    model_validator,
)
from pydantic_core import ErrorDetails

from .agent.config import PreemptionConfig, RestartsConfig
from .checkpoint.config import CheckpointConfig
from .config_base import ConfigError, Section, invalid
from .config_errors import error_message, first_error
from .config_yaml import MAX_STRING_CHARS, check_bounds, clip, clip_path, parse_yaml, read_yaml
from .data.config import AuditConfig, DataConfig
from .observe.config import LoggingConfig, MetricsConfig, WatchdogConfig
from .parallel.config import DDPConfig, FSDPConfig
from .protocol import env as runner_env
from .recovery.config import RecoveryConfig
from .task_registry import (
    available_tasks,
    load_task_module,
    section_types,
)
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
    "WatchdogConfig", "build_key", "config_schema", "dump_yaml", "fingerprint", "from_dict",
    "load_config",
]

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


# ---------------------------------------------------------------- loading


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """Load ``path`` (YAML), apply ``key.path=value`` overrides, validate.

    Hostile input is bounded (:mod:`.config_yaml`): a file of more than ``MAX_FILE_BYTES``
    bytes (1 MiB), a string key or value (or an override's value) of more than
    ``MAX_STRING_CHARS`` characters (64 Ki), nesting deeper than ``MAX_DEPTH`` and YAML aliases
    adding more than ``MAX_ALIAS_NODES`` nodes are errors; messages show at most the first 40
    characters of a value.

    Raises:
        ConfigError: unreadable file, bad YAML, empty file, a bound above exceeded (naming the
            key path or line and the limit), unknown key, wrong type or invalid value, missing
            ``task``.
    """
    raw = read_yaml(path) if path is not None else {}
    for item in [*(overrides or []), *_env_faults()]:
        apply_override(raw, item)
    check_bounds(raw, "")
    return from_dict(raw)


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
        raise ConfigError(f"{clip_path(key.rstrip('+'))}: override {what} of {len(text)} "
                          f"characters, more than the limit of {MAX_STRING_CHARS}: {clip(text)}")
    if not sep or not key:
        raise ConfigError(f"override {clip(item, 80)}: expected key.path=value")
    append = key.endswith("+")
    key = key.rstrip("+")
    parts = key.split(".")
    node = raw
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {clip(item, 80)}: "
                              f"{clip_path('.'.join(parts[: i + 1]))} is not a section")
        node = child
    try:
        parsed = parse_yaml(value)
    except ConfigError as e:
        raise ConfigError(f"override {clip(item, 80)}: invalid value at {e}") from e
    if append:  # key+=[...] extends a list
        if not isinstance(parsed, list):
            raise ConfigError(f"override {clip(item, 80)}: += needs a YAML list")
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
        raise ConfigError(error_message(first_error(errors, raw), sections, Config))
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


# ---------------------------------------------------------------- output


def dump_yaml(cfg: Config) -> str:
    """The resolved config as YAML, sections in declaration order."""
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


def config_schema(task: str | None = None) -> dict[str, Any]:
    """JSON Schema (draft 2020-12) of a config file. Without ``task`` the ``data`` and ``model``
    sections are the base classes, open to further keys (tasks type them); with it, that task's.

    Raises:
        ConfigError: ``task`` cannot be loaded (see :func:`~.task_registry.load_task_module`).
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
