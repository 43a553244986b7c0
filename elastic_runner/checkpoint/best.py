"""Best weights: the names a save commits (``step-N`` and/or ``best-step-N``) and loading only
a checkpoint's model weights (the best checkpoint, for the test split)."""

from __future__ import annotations

from typing import Any

from . import dcp_format
from . import storage as ckpt
from .layout import is_sharded


def checkpoint_names(step: int, *, best: bool, keep_best: bool,
                     step_checkpoint: bool) -> list[str]:
    """The directory names one save of ``step`` commits (none: nothing to save)."""
    names = [f"step-{step:08d}"] if step_checkpoint else []
    if best and keep_best:
        names.append(f"best-step-{step:08d}")
    return names


def load_weights(model: Any, path: str) -> None:
    """Load only the model weights of the checkpoint at ``path`` into ``model`` (collective
    when either the checkpoint or the model is sharded).

    Raises:
        CheckpointError / OSError: the checkpoint cannot be read."""
    if ckpt.is_sharded(path):
        dcp_format.load_shards(path, model, None)
    elif is_sharded(model):
        dcp_format.set_full_model(model, ckpt.load_state(path)["model"])
    else:
        model.load_state_dict(ckpt.load_state(path)["model"])
