"""The task registry: a task name (built-in, an installed ``elastic_runner.tasks`` entry point,
or an import path ``package.module:build``) to its module, its ``build`` function and the
``data``/``model`` section classes it declares. Modules are imported as they are (nothing is
added to ``sys.path``)."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import types
import typing
from typing import Any

from .config_base import ConfigError
from .data.config import DataConfig
from .train.config import ModelConfig

BUILTIN_TASKS = {
    "digits": "elastic_runner.tasks.digits:build",
    "char_lm": "elastic_runner.tasks.char_lm:build",
    "text_classification": "elastic_runner.tasks.text_classification:build",  # [hf] extra
    "causal_lm": "elastic_runner.tasks.causal_lm:build",  # [hf] extra
}
TASK_ENTRY_POINTS = "elastic_runner.tasks"  # importlib.metadata group: name = "pkg.module:build"





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
