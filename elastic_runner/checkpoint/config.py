"""The ``checkpoint`` section of a config file."""

from __future__ import annotations

from pydantic import Field, StrictBool, StrictInt

from ..config_base import Float, Section


class CheckpointConfig(Section):
    dir: str = "runs/checkpoints"
    every_steps: StrictInt = Field(50, ge=0)
    """0: only at epoch ends."""
    at_epoch_end: StrictBool = True
    """Also save after the last step of every epoch."""
    every_seconds: Float | None = Field(None, gt=0)
    """Also save after this much wall-clock time."""
    async_save: StrictBool = True
    """Snapshot to reused host buffers, write in the background."""
    keep_last: StrictInt = Field(3, ge=1)
    keep_best: StrictBool = True
    resume: StrictBool = True
    """Load the newest valid checkpoint on every (re)start."""
