"""Typed run configuration, loaded from YAML in exactly one place.

A config file is a YAML mapping whose sections map onto the dataclasses below. The ``data`` and
``model`` sections are typed by the task: a task module may define ``DataConfig`` (a subclass of
:class:`DataConfig`) and ``ModelConfig`` dataclasses, and those are used to validate the sections.

Errors are :class:`ConfigError` and always name the key path (``optimizer.lr``), what was expected
and what was found; the CLI turns them into a one-line message and exit code 2.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import importlib
import json
import os
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

BUILTIN_TASKS = {
    "digits": "elastic_runner.tasks.digits:build",
    "char_lm": "elastic_runner.tasks.char_lm:build",
}


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the key path."""


@dataclass
class DataConfig:
    """Data loading shared by all tasks; tasks subclass it for their own fields."""

    num_workers: int = 0  # DataLoader worker processes per rank
    pin_memory: bool = False


@dataclass
class OptimizerConfig:
    name: Literal["adamw", "sgd"] = "adamw"
    lr: float = 1e-3  # peak learning rate (after warm-up)
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    momentum: float = 0.9  # sgd only


@dataclass
class ScheduleConfig:
    """Learning-rate schedule: linear warm-up, then cosine decay to ``min_lr_ratio * lr``.

    The cosine runs over the optimizer steps left after warm-up until ``training.max_steps`` (or
    ``max_epochs`` worth of steps), as in SGDR (Loshchilov & Hutter, 2017) without restarts.
    """

    name: Literal["cosine", "constant"] = "cosine"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1


@dataclass
class BatchConfig:
    """Batch sizes in samples. Global batch = world_size * micro_batch_size * grad_accum_steps.

    With ``global_batch_size`` set, ``grad_accum_steps`` is derived from it and the current world
    size (``global / (world_size * micro_batch_size)``), so the optimisation trajectory does not
    change when nodes come and go; ``optimizer.lr`` is then the LR of that fixed global batch.
    Without it, the per-rank batch is fixed and the global batch (and so the effective LR per
    sample) changes with the world size; the LR is not rescaled automatically.
    """

    micro_batch_size: int = 32  # per rank, per forward/backward
    grad_accum_steps: int = 1  # micro-batches per optimizer step (ignored with global_batch_size)
    global_batch_size: int | None = None  # samples per optimizer step, constant across resizes

    def accumulation_for(self, world_size: int) -> int:
        """Micro-batches per optimizer step at ``world_size``.

        Raises:
            ConfigError: ``global_batch_size`` is not a multiple of world_size x micro_batch_size;
                the message lists the world sizes (up to 64) that divide it.
        """
        if self.global_batch_size is None:
            return self.grad_accum_steps
        per_step = world_size * self.micro_batch_size
        if self.global_batch_size % per_step:
            valid = [w for w in range(1, 65)
                     if self.global_batch_size % (w * self.micro_batch_size) == 0]
            raise ConfigError(
                f"batch.global_batch_size: {self.global_batch_size} is not divisible by "
                f"world_size {world_size} x micro_batch_size {self.micro_batch_size}; "
                f"valid world sizes: {valid or 'none'}")
        return self.global_batch_size // per_step


@dataclass
class TrainingConfig:
    max_epochs: int = 10
    max_steps: int | None = None  # optimizer steps; stops at whichever limit comes first
    grad_clip_norm: float | None = 1.0
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"  # fp16 uses a GradScaler (CUDA only)
    log_every_steps: int = 10
    max_bad_steps: int = 3  # non-finite steps in a row before rolling back to the last checkpoint


@dataclass
class EvalConfig:
    every_steps: int = 0  # 0: evaluate at the end of each epoch only
    max_batches: int | None = None  # per rank; None = the whole validation split


@dataclass
class CheckpointConfig:
    dir: str = "runs/checkpoints"
    every_steps: int = 50  # 0: only at epoch ends
    every_seconds: float | None = None  # also save when this much wall-clock time has passed
    async_save: bool = True  # snapshot to reused host buffers, write in the background
    keep_last: int = 3
    keep_best: bool = True
    resume: bool = True  # load the newest valid checkpoint on every (re)start


@dataclass
class EarlyStoppingConfig:
    enabled: bool = False
    metric: str = "val_loss"
    mode: Literal["min", "max"] = "min"
    patience: int = 3  # evaluations without improvement before stopping
    min_delta: float = 0.0


@dataclass
class DDPConfig:
    bucket_cap_mb: float = 25.0
    static_graph: bool = False
    find_unused_parameters: bool = False


@dataclass
class DistributedConfig:
    backend: Literal["auto", "gloo", "nccl"] = "auto"  # auto: nccl on CUDA, gloo on CPU
    timeout_seconds: float = 600.0  # collective and store timeout
    ddp: DDPConfig = field(default_factory=DDPConfig)


@dataclass
class LoggingConfig:
    progress_bar: bool = True  # rank 0 only
    tensorboard_dir: str | None = None  # rank 0 writes scalars when set


@dataclass
class AuditConfig:
    trace_dir: str | None = None  # per-rank JSONL sample trace (see audit.py); None: off


@dataclass
class FaultSpec:
    """One injected fault: rank ``rank`` does ``kind`` when it completes global optimizer step
    ``step`` (or its ``after_steps``-th step of the current restart attempt), in restart attempts
    ``0 .. attempts-1``. ``nan`` poisons the loss of ``count`` consecutive steps starting at that
    step; with ``repeat`` it fires again when those steps are replayed after a rollback. ``slow``
    makes ``count`` consecutive steps take ``seconds`` longer on the rank (a straggler)."""

    kind: Literal["sigkill", "sigterm", "raise", "hang", "nan", "slow"] = "sigkill"
    rank: int = 0
    step: int | None = None
    after_steps: int | None = None
    attempts: int = 1
    count: int = 1
    repeat: bool = False
    seconds: float = 0.0  # ``slow``: extra time each of ``count`` steps takes on this rank


@dataclass
class FaultConfig:
    """Off-by-default fault injection for tests and drills (see ``faults.py``). The environment
    variable ``ELASTIC_RUNNER_FAULTS`` (a YAML list of fault specs) is appended to ``inject``."""

    inject: list[FaultSpec] = field(default_factory=list)
    once_dir: str | None = None  # marker files here make each fault fire once per job
    planted_metric: list[float] | None = None  # replaces the early-stopping metric, one per eval
    perturb_rank: int | None = None  # this rank's weights diverge after loading a checkpoint


@dataclass
class PreemptionConfig:
    """How long workers have, after SIGTERM reaches the agent, to checkpoint and exit before the
    agent SIGKILLs them (``run`` passes it as torchrun's ``--shutdown-timeout``; under plain
    torchrun use that flag or ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``). Keep a pod's
    ``terminationGracePeriodSeconds`` above it."""

    grace_seconds: int = 30


@dataclass
class WatchdogConfig:
    """Hang detection: a rank whose step (or long operation) exceeds its budget dumps the stack
    traces of all its threads to the log and exits, so torchrun restarts the group."""

    hang_timeout_seconds: float | None = 300.0  # one optimizer step; None: off
    long_op_timeout_seconds: float = 1800.0  # first step of an attempt, checkpoint I/O, eval
    dump_grace_seconds: float = 2.0  # wait before exiting, so stuck peers dump their stacks too


@dataclass
class MetricsConfig:
    """Prometheus metrics and health endpoints (see ``metrics.py`` and ``health.py``)."""

    enabled: bool = True  # record per-rank series (off: no recording, no endpoint)
    port: int | None = None  # the node's endpoint, served by `run`; plain torchrun workers serve
    #                          port + local_rank themselves; None: no endpoint
    address: str = "127.0.0.1"  # bind address; 0.0.0.0 to be scraped from other hosts (pods)
    job: str = ""  # `job` label; empty: the rendezvous id
    node: str = ""  # `node` label; empty: the hostname (the pod name on Kubernetes)
    heartbeat_timeout_seconds: float | None = None  # silence of a training rank before it is
    #   unhealthy; None: watchdog.hang_timeout_seconds, or 300 when the watchdog is off
    straggler_threshold: float = 1.5  # log a rank whose step time exceeds this x the median;
    #   0: no exchange of step times
    linger_seconds: float = 0.0  # keep serving after the job ended, for a final scrape


@dataclass
class Config:
    task: str = "digits"
    seed: int = 1234
    data: Any = field(default_factory=DataConfig)
    model: Any = field(default_factory=dict)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    early_stopping: EarlyStoppingConfig = field(default_factory=EarlyStoppingConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    audit: AuditConfig = field(default_factory=AuditConfig)
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    preemption: PreemptionConfig = field(default_factory=PreemptionConfig)
    faults: FaultConfig = field(default_factory=FaultConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    def to_dict(self) -> dict[str, Any]:
        return _plain(dataclasses.asdict(self))

    def fingerprint(self) -> str:
        return fingerprint(self.to_dict())


_NOT_MODEL = ("checkpoint", "logging", "audit", "watchdog", "preemption", "faults", "metrics")


def fingerprint(config: dict[str, Any]) -> str:
    """sha256 (hex, 16 chars) of what determines the trained model, from a config dict: excludes
    the checkpoint, logging, audit, watchdog, preemption, fault-injection and metrics sections, so moving the checkpoint dir keeps
    resume working."""
    d = {k: v for k, v in config.items() if k not in _NOT_MODEL}
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def _plain(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_plain(v) for v in obj]
    return obj


# ---------------------------------------------------------------- task resolution


def task_target(task: str) -> str:
    """``module:function`` of a task name (built-in name or import path)."""
    return BUILTIN_TASKS.get(task, task)


def load_task_module(task: str, path: str = "task") -> types.ModuleType:
    target = task_target(task)
    if ":" not in target:
        raise ConfigError(
            f"{path}: unknown task {task!r}; expected one of {sorted(BUILTIN_TASKS)} "
            "or an import path 'package.module:build'"
        )
    module_name, _, attr = target.partition(":")
    if task not in BUILTIN_TASKS and os.getcwd() not in sys.path:
        # as `python -m` does for the workers: user tasks next to the config are importable
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"{path}: cannot import task module {module_name!r}: {e}") from e
    if not callable(getattr(module, attr, None)):
        raise ConfigError(f"{path}: module {module_name!r} has no callable {attr!r}")
    return module


def task_builder(task: str) -> typing.Callable[..., Any]:
    return getattr(load_task_module(task), task_target(task).partition(":")[2])


# ---------------------------------------------------------------- loading


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """Load ``path`` (YAML), apply ``key.path=value`` overrides, validate.

    Raises:
        ConfigError: unreadable file, bad YAML, unknown key, wrong type or invalid value.
    """
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ConfigError(f"cannot read config file {path}: {e.strerror}") from e
        try:
            raw = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: invalid YAML: {e}") from e
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: top level must be a mapping, got {type(raw).__name__}")
    for item in [*(overrides or []), *_env_faults()]:
        apply_override(raw, item)
    return from_dict(raw)


def _env_faults() -> list[str]:
    """``ELASTIC_RUNNER_FAULTS`` as an override appending to ``faults.inject`` (for drills)."""
    text = os.environ.get("ELASTIC_RUNNER_FAULTS")
    return [f"faults.inject+={text}"] if text else []


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Apply one ``a.b.c=value`` override; the value is parsed as YAML (``1e-3``, ``[1, 2]``)."""
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {item!r}: expected key.path=value")
    append = key.endswith("+")
    key = key.rstrip("+")
    parts = key.split(".")
    node = raw
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {item!r}: {'.'.join(parts[: i + 1])} is not a section")
        node = child
    try:
        parsed = yaml.safe_load(value)
    except yaml.YAMLError as e:
        raise ConfigError(f"override {item!r}: invalid value: {e}") from e
    if append:  # key+=[...] extends a list
        if not isinstance(parsed, list):
            raise ConfigError(f"override {item!r}: += needs a YAML list")
        parsed = [*(node.get(parts[-1]) or []), *parsed]
    node[parts[-1]] = parsed


def from_dict(raw: dict[str, Any]) -> Config:
    raw = dict(raw)
    task = raw.get("task", Config.task)
    if not isinstance(task, str):
        raise ConfigError(f"task: expected str, got {type(task).__name__} {task!r}")
    module = load_task_module(task)
    data_cls = getattr(module, "DataConfig", DataConfig)
    model_cls = getattr(module, "ModelConfig", None)
    cfg: Config = _build(Config, raw, "", {"data": data_cls, "model": model_cls})
    _check_values(cfg)
    return cfg


def _build(cls: type, raw: Any, path: str, section_types: dict[str, Any] | None = None) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"{path or 'config'}: expected a mapping, got {type(raw).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    for key in raw:
        if key not in fields:
            raise ConfigError(_unknown_key(path, key, list(fields)))
    kwargs = {}
    for name, value in raw.items():
        sub = _join(path, name)
        override = (section_types or {}).get(name, ...)
        if override is None:  # task declares no typed section: pass the mapping through
            if not isinstance(value, dict):
                raise ConfigError(f"{sub}: expected a mapping, got {type(value).__name__}")
            kwargs[name] = value
        elif override is not ...:
            kwargs[name] = _build(override, value or {}, sub)
        else:
            kwargs[name] = _coerce(hints[name], value, sub)
    for name, override in (section_types or {}).items():
        if name not in kwargs and override is not None:
            kwargs[name] = override()
    return cls(**kwargs)


def _coerce(tp: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value if value is not None else {}, path)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(arg, value, path)
            except ConfigError as e:
                errors.append(e)
        raise errors[0]
    if origin is Literal:
        if value not in args:
            allowed = ", ".join(repr(a) for a in args)
            hint = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
            extra = f" (did you mean {hint[0]!r}?)" if hint else ""
            raise ConfigError(f"{path}: expected one of {allowed}, got {value!r}{extra}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{path}: expected a list, got {type(value).__name__} {value!r}")
        if origin is tuple and len(args) != len(value) and Ellipsis not in args:
            raise ConfigError(f"{path}: expected {len(args)} values, got {len(value)}")
        item_types = args if origin is tuple and Ellipsis not in args else (args[0],) * len(value)
        items = [_coerce(t, v, f"{path}[{i}]") for i, (t, v) in enumerate(zip(item_types, value, strict=True))]
        return tuple(items) if origin is tuple else items
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {type(value).__name__}")
        return value
    if tp is Any:
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):
        try:  # YAML 1.1 reads "1e-3" as a string
            return float(value)
        except ValueError:
            pass
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise ConfigError(
            f"{path}: expected {tp.__name__}, got {type(value).__name__} {value!r}"
        )
    return value


def _unknown_key(path: str, key: str, valid: list[str]) -> str:
    full = _join(path, key)
    close = difflib.get_close_matches(str(key), valid, n=1, cutoff=0.5)
    hint = f"; did you mean {_join(path, close[0])!r}?" if close else ""
    return f"{full}: unknown key{hint} (valid keys: {', '.join(valid)})"


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else str(key)


def _check_values(cfg: Config) -> None:
    checks = [
        (cfg.batch.micro_batch_size >= 1, "batch.micro_batch_size", "must be >= 1"),
        (cfg.batch.grad_accum_steps >= 1, "batch.grad_accum_steps", "must be >= 1"),
        (cfg.batch.global_batch_size is None
         or cfg.batch.global_batch_size % cfg.batch.micro_batch_size == 0,
         "batch.global_batch_size", "must be a multiple of batch.micro_batch_size"),
        (cfg.training.max_epochs >= 1, "training.max_epochs", "must be >= 1"),
        (cfg.training.max_steps is None or cfg.training.max_steps >= 1,
         "training.max_steps", "must be >= 1 or null"),
        (cfg.optimizer.lr > 0, "optimizer.lr", "must be > 0"),
        (cfg.schedule.warmup_steps >= 0, "schedule.warmup_steps", "must be >= 0"),
        (0 <= cfg.schedule.min_lr_ratio <= 1, "schedule.min_lr_ratio", "must be in [0, 1]"),
        (cfg.checkpoint.every_steps >= 0, "checkpoint.every_steps", "must be >= 0"),
        (cfg.checkpoint.every_seconds is None or cfg.checkpoint.every_seconds > 0,
         "checkpoint.every_seconds", "must be > 0 or null"),
        (cfg.checkpoint.keep_last >= 1, "checkpoint.keep_last", "must be >= 1"),
        (cfg.early_stopping.patience >= 1, "early_stopping.patience", "must be >= 1"),
        (cfg.distributed.timeout_seconds > 0, "distributed.timeout_seconds", "must be > 0"),
        (cfg.data.num_workers >= 0, "data.num_workers", "must be >= 0"),
        (cfg.training.log_every_steps >= 1, "training.log_every_steps", "must be >= 1"),
        (cfg.training.max_bad_steps >= 1, "training.max_bad_steps", "must be >= 1"),
        (cfg.preemption.grace_seconds >= 1, "preemption.grace_seconds", "must be >= 1"),
        (cfg.metrics.port is None or 1 <= cfg.metrics.port <= 65535, "metrics.port",
         "must be a TCP port (1-65535) or null"),
        (cfg.metrics.heartbeat_timeout_seconds is None or cfg.metrics.heartbeat_timeout_seconds > 0,
         "metrics.heartbeat_timeout_seconds", "must be > 0 or null"),
        (cfg.metrics.straggler_threshold == 0 or cfg.metrics.straggler_threshold > 1,
         "metrics.straggler_threshold", "must be > 1 (a ratio to the median) or 0 (off)"),
        (cfg.metrics.linger_seconds >= 0, "metrics.linger_seconds", "must be >= 0"),
    ]
    for ok, key, msg in checks:
        if not ok:
            raise ConfigError(f"{key}: {msg}")


def dump_yaml(cfg: Config) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
