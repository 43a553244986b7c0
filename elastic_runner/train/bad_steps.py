"""The non-finite guard's count: a step whose update was skipped (a non-finite loss or gradient
on some rank) adds to the streak that triggers a rollback at ``max_bad_steps``."""

from __future__ import annotations

import logging

from .callbacks import Callbacks
from .state import TrainState

log = logging.getLogger("elastic_runner.train.session")  # the session's lines, by its name


def count_bad(state: TrainState, callbacks: Callbacks, committed: bool, step: int,
              limit: int) -> bool:
    """Count ``step`` (``committed``: its update was applied) in ``state``'s streak and totals,
    reporting a skipped one; True when the streak reached ``limit`` steps."""
    if committed:
        state.bad_in_row = 0
        return False
    state.bad_in_row += 1
    state.bad_steps += 1
    callbacks.on_skipped_step(step, state.bad_in_row, limit)
    log.warning("step %d: non-finite loss or gradient on at least one rank: update skipped "
                "on all ranks (%d in a row, limit %d)", step, state.bad_in_row, limit)
    return state.bad_in_row >= limit


def warn_if_global_batch_changed(old_batch: int, new_batch: int, world_size: int) -> None:
    """A resumed run's global batch (samples) differs from its checkpoint's: say so (the
    learning rate is not rescaled)."""
    if old_batch != new_batch:
        log.warning("global batch changed from %d to %d samples (world size now %d); the "
                    "learning rate is not rescaled. Set batch.keep_global_batch: true (or "
                    "batch.global_batch_size) to keep the global batch constant.", old_batch,
                    new_batch, world_size)
