"""The data sections of a config file: ``data`` (the base of a task's) and ``audit``."""

from __future__ import annotations

from pydantic import Field, StrictBool, StrictInt

from ..config_base import Section


class DataConfig(Section):
    """Data loading shared by all tasks; tasks subclass it for their own fields."""

    num_workers: StrictInt = Field(0, ge=0)
    """DataLoader worker processes per rank (0: load in the training process)."""
    pin_memory: StrictBool = False
    """The DataLoader's `pin_memory` (page-locked host batches, for faster copies to a GPU)."""


class AuditConfig(Section):
    """The sample trace, which the sample audit reads."""

    trace_dir: str | None = None
    """A directory for the per-rank JSONL sample trace: the dataset indices each committed step
    trained on, which `elastic-runner audit` checks (see `data/audit.py`); null: off."""
