"""One rank's side of in-place recovery, for either loop: the built-in
:class:`~elastic_runner.trainer.loop.Trainer` and a script's
:class:`~elastic_runner.own_loop.FaultTolerantLoop` hand it their
:class:`~elastic_runner.recovery.recoverable.Recoverable` side and a way to discard the step in
flight; it joins the job (at the start, or as a spare that takes a failed worker's place),
recovers after a failed collective, moves the rank to another group (nodes left or joined), and
reports a recovery once the first step after it is committed. Neither loop carries recovery
code of its own, so a fix lands once (as nvidia-resiliency-ext's ``inprocess.Wrapper`` takes
small swappable parts and runs them in one place).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from ..dist import DistInfo
from ..dist import init_distributed as init_group
from ..logs import setup_logging
from ..protocol import env
from ..protocol.torchrun_env import TorchrunEnv, set_rank
from ..protocol.torchrun_env import take_place as assume
from ..train.callbacks import Callbacks
from ..train.consensus import StepConsensus
from ..train.session import TrainingFailed, TrainingSession
from ..train.straggler import StragglerMonitor
from .background import Stoppable
from .group_sockets import Sockets
from .outcomes import Regroup
from .recoverable import Recoverable, RecoveryHooks
from .rejoin import RecoveryReport, rejoin

log = logging.getLogger("elastic_runner.recovery")


class RecoveryService(RecoveryHooks, Protocol):
    """This process's recovery as both loops and the runtime (``recovery/runtime.py``) use it:
    :class:`~elastic_runner.recovery.inplace.InPlaceRecovery` (in place) and its null object
    :class:`~elastic_runner.recovery.inplace.NoRecovery` (off: every error propagates, the
    group-forming calls are never reached) implement it."""

    active: bool
    generation: int
    backend: str
    sockets: Sockets

    def copy_due(self, step: int) -> bool: ...

    def job_global_batch(self) -> int | None: ...

    def keep_copy(self, loop: Recoverable) -> None: ...

    def announce_built(self, rank: int) -> None: ...

    def announce_finished(self, rank: int) -> None: ...

    def announce_recovered(self, rank: int, report: RecoveryReport) -> None: ...

    def keep_rank0_state(self, blob: bytes) -> None: ...

    def rank0_state(self) -> bytes | None: ...

    def recover(self, error: BaseException, loop: Recoverable) -> RecoveryReport | None: ...

    def regroup_due(self, loop: Recoverable) -> None: ...

    def leave(self, loop: Recoverable) -> None: ...

    def bind(self, loop: Recoverable) -> None: ...

    def watch(self) -> Stoppable: ...

    def group_store(self, rank: int | None = None, world_size: int | None = None) -> Any: ...

    def form_group(self, rank: int, world_size: int, generation: int) -> None: ...

    def wait_assignment(self, spare: str) -> dict[str, str]: ...


# ------------------------------------------------------------ joining the job

def spare_name(recovery: RecoveryService) -> str | None:
    """This process's name as a spare (the agent's :data:`~elastic_runner.protocol.env.
    SPARE_ENV`; a joining node's worker is named by its local rank), or None: it is a worker
    of the job's start (or recovery is off)."""
    spare = env.spare_name() if recovery.active else None
    if spare is not None and spare.endswith("."):
        spare += str(TorchrunEnv.read().local_rank)
    return spare


def take_place(recovery: RecoveryService, spare: str, verbose: bool = False) -> TorchrunEnv:
    """A warm spare (its task built) waits until its agent hands it a failed worker's place;
    that worker's environment (RANK, LOCAL_RANK, ...) becomes this process's. Returns it read.

    Raises:
        RuntimeError: the recovery store is gone (its agent died, or the store moved on).
    """
    t0 = time.time()
    place = assume(recovery.wait_assignment(spare))
    setup_logging(place.rank, verbose)
    log.warning("spare %s replaces rank %s (local_rank %s) in generation %d, after standing by "
                "%.1f s", spare, place.rank, place.local_rank, recovery.generation,
                time.time() - t0)
    return place


def join_group(recovery: RecoveryService, backend: str, timeout_s: float,
               eager_init: bool = False) -> DistInfo:
    """Form the default process group: the recovery store's current generation when recovery
    is on (its sockets recorded, so a failure can cut them), else torchrun's own.

    Raises:
        JobFinished: a replacement ready after the job's last step (it leaves with exit 0).
        TimeoutError: the group did not form within ``recovery.join_timeout_seconds``.
    """
    store = recovery.group_store()  # None: torchrun's (recovery off)
    with recovery.sockets.forming():
        info = init_group(backend, timeout_s, store, eager_init)
    recovery.backend = info.backend
    return info


# ------------------------------------------------------------ a recovery's tail

def renew_exchanges(session: TrainingSession, consensus: StepConsensus, info: DistInfo,
                    straggler_threshold: float = 0.0) -> None:
    """On a re-formed group (either loop's ``rewrap``): the step vote ``consensus`` and a new
    straggler exchange over it, for rank ``info.rank`` of ``info.world_size`` (the threshold:
    ``metrics.straggler_threshold``; 0: measured, never warned of)."""
    session.consensus = consensus
    session.straggler = StragglerMonitor(straggler_threshold, info.rank, info.world_size,
                                         info.device)


class RecoveryTail:
    """What follows a failure on this rank, for either loop: the group re-formed (or this rank
    moved to another one), the first committed step after it reported (its log line, the
    agents told, the ``on_recovery_report`` callbacks).

    Args:
        recovery: this process's recovery (in place, or :class:`~elastic_runner.recovery.
            inplace.NoRecovery`: every error propagates).
    """

    def __init__(self, recovery: RecoveryService) -> None:
        self.recovery = recovery
        self._report: RecoveryReport | None = None
        self._t_recovered = 0.0

    @property
    def pending(self) -> bool:
        """A recovery waits for its first committed step."""
        return self._report is not None

    def recovered_at(self, report: RecoveryReport) -> None:
        """The group is re-formed: the first committed step completes ``report``."""
        self._report, self._t_recovered = report, time.perf_counter()

    def committed(self, step: int, rank: int, callbacks: Callbacks) -> None:
        """Step ``step`` is committed on rank ``rank``: the first one after a recovery completes
        its report (the ``first step`` phase, seconds since the group re-formed)."""
        report, self._report = self._report, None
        if report is None:
            return
        report.phases["first step"] = time.perf_counter() - self._t_recovered
        self.recovery.announce_recovered(rank, report)
        log.warning("%s", report.done(step))
        callbacks.on_recovery_report(report)

    def recover(self, error: RuntimeError, loop: Recoverable,
                discard: Callable[[], None]) -> RecoveryReport:
        """A collective failed: ``discard`` the step in flight (its gradients too), then
        re-form the group in place.

        Raises:
            RuntimeError: ``error``, when it is the run's own failure (``TrainingFailed``), no
                peer died or recovery is off (torch's restart path).
            Regroup: nodes left or joined meanwhile: the caller moves the rank
                (:meth:`regroup`).
        """
        if isinstance(error, TrainingFailed) or not self.recovery.active:
            raise error
        discard()
        report = self.recovery.recover(error, loop)
        if report is None:
            raise error
        self.recovered_at(report)
        return report

    def regroup(self, r: Regroup, report: RecoveryReport | None, old_rank: int,
                moved: Callable[[], Recoverable], own_logging: bool = True) -> Recoverable:
        """Go on as rank ``r.rank`` of ``r.world_size`` in generation ``r.generation``'s group:
        form it, move this process's place to it (its environment, its log prefix when the
        runner set up logging and the rank changed from ``old_rank``, then the loop's holders:
        ``moved``, which returns the loop as it goes on), and agree with the members on the
        state (``rejoin``). ``report``: this recovery's (None: a membership change at a step
        boundary, not reported).

        Raises:
            TimeoutError, JobFinished, RuntimeError: the group did not form
                (:meth:`~elastic_runner.recovery.inplace.InPlaceRecovery.form_group`).
        """
        t0 = time.perf_counter()
        self.recovery.form_group(r.rank, r.world_size, r.generation)
        t1 = time.perf_counter()
        set_rank(r.rank, r.world_size)
        if own_logging and r.rank != old_rank:  # a new rank 0 logs what rank 0 logs
            setup_logging(r.rank)
        loop = moved()
        rejoin(loop, joining=False, report=report)
        if report is not None:
            report.phases.update(group=t1 - t0, state=time.perf_counter() - t1)
            self.recovered_at(report)
        return loop
