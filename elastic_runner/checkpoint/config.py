"""The ``checkpoint`` section of a config file."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, StrictBool, StrictInt

from ..config_base import Float, Section


class CheckpointConfig(Section):
    """Checkpoints: when they are taken, where they go, which are kept, and whether a start resumes
    from the newest valid one. Every commit is atomic (written under a temporary name, checked by
    sha256, published by a rename or a manifest written last) and guarded by a fencing token."""

    dir: str = "runs/checkpoints"
    """Where checkpoints go: a local or shared path, or an fsspec URL (`s3://bucket/run`); every
    node must reach the same one."""
    every_steps: StrictInt = Field(50, ge=0)
    """Save every this many optimizer steps; 0: by steps never (only at epoch ends and
    `every_seconds`)."""
    at_epoch_end: StrictBool = True
    """Also save after the last step of every epoch."""
    every_seconds: Float | None = Field(None, gt=0)
    """Also save when this much wall-clock time (seconds) passed since the last save (rank 0 decides
    for all); null: off."""
    format: Literal["auto", "rank0", "dcp"] = "auto"
    """`rank0`: rank 0 writes one `state.pt` of the whole state; `dcp`: every rank writes its
    part through torch.distributed.checkpoint (DCP: sharded state as sharded, replicated tensors
    spread over the ranks) and rank 0 the rest, all under the same commit protocol; `auto`: `dcp`
    with `distributed.strategy: fsdp`, else `rank0`. Either format resumes at any world size, and
    a `dcp` checkpoint under either strategy."""
    async_save: StrictBool = True
    """Snapshot into reused host buffers and write in a background thread, so training stalls only
    for the snapshot."""
    keep_last: StrictInt = Field(3, ge=1)
    """Valid step checkpoints kept; older ones are deleted after each commit (never the one resumed
    from)."""
    keep_best: StrictBool = True
    """Also keep `best-step-N`, the checkpoint of the best value of `early_stopping.metric` so far
    (tracked when early stopping is off too)."""
    resume: StrictBool = True
    """Load the newest valid checkpoint on every (re)start."""
