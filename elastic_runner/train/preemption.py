"""The preemption stop: some rank was asked to stop (SIGTERM or SIGINT), so every rank commits
a checkpoint of the last applied step and leaves with 143; across nodes, only the nodes asked
to stop may leave while the others go on in place."""

from __future__ import annotations

import logging
from collections.abc import Callable

from ..dist import barrier
from ..preempt import Preempted
from .callbacks import Callbacks
from .state import TrainState
from .stop import StopReason

log = logging.getLogger("elastic_runner.train.session")  # the session's lines, by its name


def stop_for_preemption(state: TrainState, discarded: bool, leave: Callable[[], None],
                        callbacks: Callbacks, checkpoint: Callable[[], None],
                        wait: Callable[[], None]) -> None:
    """All ranks: discard the step in flight (``discarded``), ``checkpoint`` the last applied
    step and ``wait`` for its commit, then stop. ``leave`` first lets whole nodes leave in
    place (or takes joining nodes in); it returns when all stop.

    Raises:
        Preempted: this rank stops (or leaves; the others go on).
        inplace.Regroup: this rank goes on in a smaller group (from ``leave``).
    """
    leave()
    step = state.step
    log.warning("preemption: checkpointing step %d, then stopping (SIGTERM or SIGINT on at "
                "least one rank; %s)", step, f"step {step + 1} discarded, redone after the "
                "restart" if discarded else "no step in flight")
    callbacks.on_phase("checkpointing", "preemption checkpoint", True)
    callbacks.on_finish(StopReason.PREEMPTED, "preempted")
    checkpoint()
    wait()
    barrier()  # rank 0 has committed before any rank exits
    raise Preempted(f"preempted by signal after step {step}; checkpoint "
                    f"step-{step:08d} committed")
