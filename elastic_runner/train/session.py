"""One rank's fault-tolerant training session: the per-step protocol any loop can follow.

Per optimizer step (the built-in trainer and ``examples/own_loop.py`` alike)::

    session.begin_step()                 # heartbeat, per-step RNG seed, injected hangs
    ...forward, and backward of all but the last micro-batch...
    session.backward(loss)               # the last backward carries the step's vote
    if session.optimizer_step(optimizer, grad_norm):  # the update where the vote allows it
        scheduler.step()                 # (or: if session.should_commit(grad_norm): ...)
    session.end_step()                   # cursor and counters, reporting, non-finite guard,
                                         # preemption: checkpoint the last step, exit 143

What it composes (each usable alone): the :class:`~elastic_runner.checkpoint.manager.CheckpointManager`,
the sampler's global cursor, the :class:`~elastic_runner.train.consensus.StepConsensus`, the
:class:`~elastic_runner.train.stop.StopPolicy` and the reporting :class:`~elastic_runner.train.callbacks.Callbacks`.
No host synchronisation in the step except the decision's one read in :meth:`should_commit`,
and the loss's at logging steps; with a :class:`~elastic_runner.train.consensus.LaggedConsensus` and a
fused optimizer, :meth:`optimizer_step` has none: the decision is applied on the device and read
one step later, and :meth:`settle` reads it where every rank must know it (evaluation, a
checkpoint by steps, the limits, an epoch's end).

Its parts of one job each: the step's report (:mod:`.step_report`), the non-finite count
(:mod:`.bad_steps`), applying the update (:mod:`.updates`), the preemption stop
(:mod:`.preemption`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..checkpoint.manager import CheckpointManager
from ..data.sampler import ElasticSampler, step_seed
from .bad_steps import count_bad, warn_if_global_batch_changed
from .callbacks import Callbacks
from .consensus import StepConsensus, StepDecision, Verdict, skips_on_device
from .preemption import stop_for_preemption
from .state import TrainState, seed_step
from .step_report import StepReport
from .stop import StopPolicy, StopReason
from .straggler import StragglerMonitor
from .updates import apply_update, lagged_update

log = logging.getLogger(__name__)


class TrainingFailed(RuntimeError):
    """Training cannot continue (e.g. non-finite steps recurred after a rollback)."""


class RollbackRequested(Exception):  # noqa: N818 - control flow: the loop reloads and goes on
    """``max_bad_steps`` non-finite steps in a row: roll back to the last checkpoint."""


@dataclass
class SessionOptions:
    """Per-step policy. ``seed``: base of the per-step RNG streams (dropout), reseeded from
    ``(seed, epoch, step, rank)`` before every step when ``reseed``; ``log_every_steps``:
    logging cadence (the loss is read from the device only then); ``max_bad_steps``:
    non-finite steps in a row before a rollback."""

    seed: int = 0
    log_every_steps: int = 10
    max_bad_steps: int = 3
    reseed: bool = True


@dataclass
class TrainingSession:
    """See the module docstring. Assembled for either loop (the trainer's ``trainer/build.py``,
    :func:`elastic_runner.fault_tolerant` for a user's own loop) by
    :func:`elastic_runner.rank_session.assemble_session`."""

    state: TrainState
    sampler: ElasticSampler
    checkpoints: CheckpointManager
    consensus: StepConsensus
    stop: StopPolicy
    callbacks: Callbacks
    straggler: StragglerMonitor
    device: torch.device
    options: SessionOptions = field(default_factory=SessionOptions)
    lr: Callable[[], float] = lambda: 0.0
    poisoned: Callable[[int], bool] = lambda step: False
    save: Callable[[], None] | None = None  # the checkpoint of this step (default: step-N)
    # the loader's record of what it handed out (ElasticDataLoader.take_fetched): the dataset
    # indices of each micro-batch since the last call; None: steps report the sampler's plan
    fetched: Callable[[], list[list[int]]] | None = None
    # at a preemption stop, before the checkpoint: whole nodes may leave in place, or nodes
    # that asked to join are taken in (inplace.InPlaceRecovery.leave raises for every rank
    # then); returns when all stop
    leave: Callable[[], None] = lambda: None
    steps_this_attempt: int = 0
    _t0: float = 0.0  # perf_counter seconds: the step's begin, its data ready, its vote sent
    _t_data: float = 0.0
    _t_sync: float = 0.0
    _cursor: int = 0  # the step's place in the data (backward)
    _epoch: int = 0
    _decision: StepDecision | None = None
    _verdicts: list[Verdict] = field(default_factory=list)  # lagged: collected, not yet acted on
    _report: StepReport = field(default_factory=StepReport)
    _poison: bool = False

    # ------------------------------------------------------------ start

    def resume(self) -> bool:
        """Load the newest valid checkpoint on all ranks (collective); True if one was found."""
        self.callbacks.on_phase("loading", "checkpoint load", True)
        raw = self.checkpoints.load_latest(self.device)
        if raw is None:
            return False
        gbs = self.sampler.global_batch_size
        warn_if_global_batch_changed(raw.get("sampler", {}).get("global_batch_size", gbs), gbs,
                                     self.sampler.world_size)
        log.info("resumed from %s: step %d, epoch %d, %d samples into the epoch",
                 self.checkpoints.resumed_from, self.state.step, self.sampler.epoch,
                 self.sampler.cursor)
        self.stop.reopen(self.state.step, self.sampler.epoch)
        return True

    def start(self) -> None:
        """Training (re)starts at the current step: reporting opens (trace rewound)."""
        self.callbacks.on_resumed(self.state.step)

    # ------------------------------------------------------------ one step

    def begin_step(self) -> None:
        """Before the step's data: heartbeat, injected faults, the step's RNG streams."""
        self._t0 = self._t_data = time.perf_counter()
        step = self.state.step + 1
        self.callbacks.on_step_begin(step, self.steps_this_attempt + 1)
        self._poison = self.poisoned(step)
        if self.options.reseed:
            seed_step(step_seed(self.options.seed, self.sampler.epoch, self.state.step,
                                self.sampler.rank), self.device)

    def data_ready(self) -> None:
        """The step's micro-batches are fetched (splits data time from compute time)."""
        self._t_data = time.perf_counter()

    def backward(self, loss: torch.Tensor, step_loss: torch.Tensor | None = None,
                 scaler: torch.amp.GradScaler | None = None) -> None:
        """The step's synchronising backward (its last micro-batch's), carrying the vote.

        Args:
            loss: the micro-batch loss to differentiate (scalar tensor).
            step_loss: the step's loss over all its micro-batches, for the non-finite check
                (default: ``loss``).
            scaler: a GradScaler (fp16) that scales ``loss``.
        """
        if self._poison:  # fault injection: a NaN loss (and so NaN gradients)
            loss = loss * float("nan")
            step_loss = None if step_loss is None else step_loss * float("nan")
        # the step's place in the data, taken here: an own loop may call set_epoch() after
        # begin_step()
        self._cursor, self._epoch = self.sampler.cursor, self.sampler.epoch
        loss = self.consensus.propose(loss, step_loss)  # may carry the step's signal
        self._t_sync = time.perf_counter()
        (scaler.scale(loss) if scaler is not None else loss).backward()

    def should_commit(self, grad_norm: torch.Tensor | None = None,
                      overflow_ok: bool = False) -> bool:
        """Whether to apply this step's update: the same answer on every rank. ``grad_norm``:
        the reduced gradients' total norm (required on DDP, see ``train/consensus.py``);
        ``overflow_ok``: fp16 with a GradScaler, which skips overflowing steps itself."""
        self._decision = self.consensus.decide(grad_norm, overflow_ok)
        return self._decision.commit

    def optimizer_step(self, optimizer: torch.optim.Optimizer, grad_norm: torch.Tensor,
                       scaler: torch.amp.GradScaler | None = None) -> bool:
        """Apply this step's update where the vote allows it, on every rank alike: the
        :meth:`should_commit` decision, then ``optimizer.step()`` (``scaler.step`` and
        ``scaler.update`` with a GradScaler); or, with a lagged consensus and a fused optimizer
        (:func:`~elastic_runner.train.consensus.skips_on_device`), the update queued on the device
        behind its own verdict, with no host synchronisation (the verdict is acted on a step
        later, see :class:`~elastic_runner.train.consensus.LaggedConsensus`).

        Args:
            grad_norm: the reduced gradients' total norm (``clip_grad_norm_``'s result).
            scaler: an enabled GradScaler (fp16) whose ``unscale_`` already ran; it skips an
                overflowing step itself, which the vote then does not count as bad.

        Returns:
            False when the step is discarded (a stop): step no LR scheduler then.
        """
        overflow_ok = scaler is not None
        if not (self.consensus.lagged and skips_on_device(optimizer)):
            if self.should_commit(grad_norm, overflow_ok):
                apply_update(optimizer, scaler)
            elif scaler is not None:
                scaler.update()
            return not self.discarding
        self._verdicts += self.consensus.collect()
        self._decision = lagged_update(self.consensus, self._verdicts, optimizer, grad_norm,
                                       scaler, self.state.step + 1)
        return self._decision.commit

    def settle(self) -> None:
        """Act now on a vote the lagged consensus has not read yet; called at boundaries every
        rank reaches at the same step (evaluation, a checkpoint by steps, the limits, an
        epoch's end; a rollback drops the pending verdict instead, its step is undone). Nothing
        to do for the other consensus kinds.

        Raises:
            Preempted, RollbackRequested, TrainingFailed: as :meth:`end_step`.
        """
        verdicts, self._verdicts = [*self._verdicts, *self.consensus.collect()], []
        stop = any(v.stop for v in verdicts)
        for v in verdicts:
            self._count_bad(v.commit, v.step, may_raise=not stop)
        if stop:  # the last step carried it and applied: nothing is in flight to discard
            self._stop_for_preemption(discarded=False)

    def abandon_step(self) -> None:
        """A collective of the step in flight failed (a peer died): forget the step's vote and
        the pending logging collective; the step is redone after the group is re-formed, with
        the first step's watchdog budget."""
        self._decision, self._report.pending, self._verdicts = None, None, []
        if self.fetched is not None:
            self.fetched()  # its micro-batches were not trained on: forget them
        self.consensus.reset()
        self.straggler.reset()
        self.steps_this_attempt = 0

    @property
    def discarding(self) -> bool:
        """The step in flight is discarded (a stop): nothing of it may be applied, not even an
        LR scheduler step, so the checkpoint that follows is that of the last applied step."""
        return self._decision is not None and self._decision.stop

    def end_step(self, loss: torch.Tensor) -> int:
        """The step is over: move the cursor, count, report; returns the new global step.

        Raises:
            RollbackRequested: the non-finite streak reached ``max_bad_steps``.
            TrainingFailed: it did again after a rollback.
            Preempted: some rank was asked to stop; this step was discarded and the checkpoint
                of the last applied one is committed.
        """
        decision, self._decision = self._decision, None
        if decision is None:
            raise RuntimeError("end_step() without should_commit() for this step")
        fetched = self.fetched() if self.fetched is not None else None  # this step's batches
        self.flush_log()
        verdicts, self._verdicts = self._verdicts, []  # earlier steps' (lagged consensus)
        for v in verdicts:
            self._count_bad(v.commit, v.step, may_raise=not decision.stop)
        if decision.stop:
            self._stop_for_preemption()
        self.straggler.add(self._t_sync - self._t0)
        cursor, epoch = self._cursor, self._epoch
        self.sampler.advance()
        step = self.state.step = self.state.step + 1
        self.state.samples += self.sampler.global_batch_size
        self.steps_this_attempt += 1
        self.callbacks.on_step_end(self._report.event(
            loss=loss, step=step, epoch=epoch, cursor=cursor, committed=decision.commit,
            fetched=fetched, t0=self._t0, t_data=self._t_data, sampler=self.sampler,
            callbacks=self.callbacks, straggler=self.straggler, world_size=self.sampler.world_size,
            log_every_steps=self.options.log_every_steps, lr=self.lr, device=self.device))
        if decision.final:  # a provisional one is counted when its verdict is read
            self._count_bad(decision.commit, step)
        return step

    def flush_log(self) -> None:
        """Report the pending logging step (all ranks, at the same point: it completes a
        collective). Called at the next step's end, before checkpoints and at the end."""
        self._report.flush(self.callbacks, self.straggler)

    # ------------------------------------------------------------ guards

    def _count_bad(self, committed: bool, step: int, may_raise: bool = True) -> None:
        """NaN/Inf guard: skipped updates in a row trigger one rollback, then a failure
        (``may_raise`` False: count only, a stop is being handled)."""
        s, limit = self.state, self.options.max_bad_steps
        if not count_bad(s, self.callbacks, committed, step, limit) or not may_raise:
            return
        if s.rollbacks >= 1:
            self.finish(StopReason.FAILED, f"failed: {limit} non-finite steps in a row at step "
                        f"{s.step}, again after rolling back to the last checkpoint")
            self.checkpoint()
            self.checkpoints.wait()
            raise TrainingFailed(self.stop.message)
        raise RollbackRequested

    def rollback(self) -> None:
        """Reload the newest valid checkpoint on all ranks (once per run).

        Raises:
            TrainingFailed: there is no checkpoint to roll back to.
        """
        self.checkpoints.wait()  # the newest checkpoint may still be in flight
        self.flush_log()
        self.consensus.reset()  # a verdict still pending is of a step the reload undoes
        self._verdicts = []
        rollbacks = self.state.rollbacks + 1
        log.warning("rolling back to the last valid checkpoint after %d non-finite steps",
                    self.options.max_bad_steps)
        if not self.resume():
            raise TrainingFailed("non-finite steps and no checkpoint to roll back to")
        self.state.rollbacks, self.state.bad_in_row = rollbacks, 0
        self.callbacks.on_rollback(self.state.step)

    def _stop_for_preemption(self, discarded: bool = True) -> None:
        """All ranks: :func:`~.preemption.stop_for_preemption` at the current step.

        Raises:
            Preempted: this rank stops (or leaves; the others go on).
            inplace.Regroup: this rank goes on in a smaller group.
        """
        stop_for_preemption(self.state, discarded, self.leave, self.callbacks,
                            self.checkpoint, self.checkpoints.wait)

    # ------------------------------------------------------------ checkpoints and the end

    def checkpoint(self) -> None:
        """Checkpoint the current step (all ranks call it; rank 0 writes)."""
        self.flush_log()
        self.callbacks.on_phase("checkpointing", "checkpointing", True)
        if self.save is not None:
            self.save()
        else:
            self.checkpoints.save(self.state.step)

    def checkpoint_due(self) -> bool:
        """Whether the cadence asks for a checkpoint of the current step; never during a
        non-finite streak (a rollback must return to a state without skipped updates). Every
        rank calls it at the same step (the decision of ``every_seconds`` is rank 0's, agreed
        by all)."""
        step = self.state.step
        if not self.checkpoints.due(step):
            return False
        if self.checkpoints.due_by_steps(step):
            self.settle()  # every rank is here at this step
        elif self.consensus.vetoed_pending():  # rank 0's clock: no rank-wide action here
            return False
        return not self.state.bad_in_row

    def finish(self, reason: StopReason, message: str) -> None:
        """Stop after the current step (every rank calls it at the same step)."""
        self.stop.stop(reason, message, self.state.step)
        self.callbacks.on_finish(reason, message)

    def check_limits(self) -> bool:
        """Finish if max_steps / max_epochs is reached; True once the run is stopped."""
        reached = None if self.stop.stopped else self.stop.limit_reached(self.state.step,
                                                                          self.sampler.epoch)
        if reached is not None:
            self.finish(*reached)
        return self.stop.stopped

    def close(self, extra: Iterable[Any] = ()) -> None:
        """Commit the in-flight checkpoint, then close the reporting (trace, bar, watchdog)."""
        try:
            self.flush_log()
            self.checkpoints.close()
        finally:
            self.callbacks.on_phase("finished", "", False)
            self.callbacks.close()
            for obj in extra:
                obj.close()

