"""The base of every config section (:class:`Section`), the field types the sections share, and
:class:`ConfigError`. The sections live with their concerns (``train/config.py``,
``checkpoint/config.py``, ...); :mod:`elastic_runner.config` assembles them into the file's
model and loads it, in one place."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictInt, model_validator
from pydantic_core import PydanticCustomError


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the key path."""


class Hint:
    """``Annotated`` metadata: the error text for a value outside the field's bounds."""

    def __init__(self, text: str) -> None:
        self.text = text


def _not_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise PydanticCustomError("float_type", "Input should be a valid number")
    return value


# A float field: ints and numeric strings (YAML 1.1 reads ``1e-3`` as a string) are accepted,
# booleans are not. Ints and booleans of the runner's own sections are strict (no "5", no 1.0).
Float = Annotated[float, BeforeValidator(_not_bool)]
Port = Annotated[StrictInt | None, Field(ge=1, le=65535),
                 Hint("must be a TCP port (1-65535) or null")]


def invalid(message: str, key: str = "") -> PydanticCustomError:
    """A validation error whose text is ``message``; ``key`` (a field) is appended to the path."""
    return PydanticCustomError("config", "{message}", {"message": message, "key": key})


class Section(BaseModel):
    """A config section: unknown keys are errors; an empty (``null``) section means defaults."""

    model_config = ConfigDict(extra="forbid", validate_assignment=False,
                              use_attribute_docstrings=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_defaults(cls, value: Any) -> Any:
        return {} if value is None else value
