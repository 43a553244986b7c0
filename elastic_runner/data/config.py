"""The data sections of a config file: ``data`` (the base of a task's) and ``audit``."""

from __future__ import annotations

from pydantic import Field, StrictBool, StrictInt

from ..config_base import Section


class DataConfig(Section):
    """Data loading shared by all tasks; tasks subclass it for their own fields."""

    num_workers: StrictInt = Field(0, ge=0)
    """DataLoader worker processes per rank."""
    pin_memory: StrictBool = False


class AuditConfig(Section):
    trace_dir: str | None = None
    """Per-rank JSONL sample trace (see data/audit.py); None: off."""
