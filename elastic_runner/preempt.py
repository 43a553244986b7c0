"""Preemption: turn SIGTERM into a checkpoint at the next step boundary.

Kubernetes evicts a pod by sending SIGTERM to its main process (torchrun's agent), which forwards
SIGTERM to its workers and SIGKILLs them ``--shutdown-timeout`` seconds later (torch 2.13; a
fixed 30 s before, pytorch issue 119856; ``run`` passes ``preemption.grace_seconds``). Each worker only records the signal here; the training loop reduces the flag across
ranks through the step consensus (so one rank's signal stops all: every rank discards the step in
flight), writes a checkpoint of the last applied step,
and exits with :data:`EXIT_PREEMPTED` (128 + SIGTERM), which a PyTorchJob with
``restartPolicy: ExitCode`` treats as retryable.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from types import FrameType

log = logging.getLogger(__name__)


class Preempted(Exception):  # noqa: N818 - a control-flow signal, not an error
    """Raised after the preemption checkpoint is committed; the worker exits 143."""


class PreemptionFlag:
    """Records SIGTERM (and SIGINT) instead of dying, once :meth:`install`-ed by the worker."""

    def __init__(self) -> None:
        self.signum: int | None = None
        # a step boundary that a membership change (a node joining) asks for: the vote stops
        # every rank there as for a preemption, and the recovery takes the node in instead of
        # stopping (inplace.InPlaceRecovery.leave)
        self.membership: Callable[[], bool] = lambda: False

    def install(self) -> None:
        """Handle SIGTERM/SIGINT in this process (call from the main thread)."""
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, self._handle)

    @property
    def requested(self) -> bool:
        """This process got SIGTERM or SIGINT."""
        return self.signum is not None

    @property
    def stop_asked(self) -> bool:
        """What this rank puts in the step vote's stop flag: a signal, or a membership
        change's step boundary."""
        return self.signum is not None or self.membership()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            log.warning("received %s: will checkpoint and stop at the next step boundary",
                        signal.Signals(signum).name)
        self.signum = signum

    @staticmethod
    def ignore_in_child(worker_id: int = 0) -> None:
        """DataLoader ``worker_init_fn``: loader workers ignore SIGTERM/SIGINT, so a signal sent
        to the whole process group reaches the trainer's handler without killing the loaders
        the preemption checkpoint still waits on."""
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
