"""The loop-sized calls of a script's fault-tolerant loop (:func:`elastic_runner.fault_tolerant`
returns one): the session's step protocol, the checkpoint of step N taken at the boundary where
step N+1 begins (the package docstring), and in-place recovery through
:class:`~elastic_runner.own_loop.in_place.LoopRecovery`."""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..checkpoint import storage
from ..checkpoint.fencing import FencedOut
from ..checkpoint.manager import CheckpointManager
from ..data.sampler import ElasticSampler
from ..dist import DistInfo, release_groups_of
from ..exit_codes import EXIT_PREEMPTED
from ..parallel.base import total_norm
from ..preempt import Preempted
from ..protocol import env
from ..protocol.torchrun_env import TorchrunEnv
from ..recovery.rejoin import rejoin
from ..recovery.runtime import RecoveryService
from ..recovery.script import ScriptRecovery
from ..train.callbacks import JOINING
from ..train.endings import expected_exit
from ..train.session import RollbackRequested, TrainingFailed, TrainingSession
from ..train.state import TrainState
from .in_place import LoopRecovery
from .parts import LoopParts
from .script_collectives import Guards, ScriptCollectives, install

log = logging.getLogger("elastic_runner.own_loop")

_F = TypeVar("_F", bound=Callable[..., Any])


def _fenced_out_exits(method: _F) -> _F:
    """A newer group claimed the checkpoint directory (:class:`FencedOut`, from a claim or a
    commit): this process ends with exit 3 (``EXIT_FENCED``) and one line, as the built-in
    trainer's worker does, so the agent's restart budget does not restart a stale writer."""

    @functools.wraps(method)
    def checked(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except FencedOut as e:
            raise SystemExit(expected_exit(e, log)) from None

    return checked  # type: ignore[return-value]


class FaultTolerantLoop:
    """What :func:`~elastic_runner.own_loop.fault_tolerant` returns: the session's step
    protocol in loop-sized calls. In-place recovery sees it as a
    :class:`~elastic_runner.recovery.recoverable.Recoverable`.

    Attributes:
        session: the underlying :class:`~elastic_runner.train.session.TrainingSession`.
        in_place: its in-place recovery (the loop's collectives run through it).
    """

    def __init__(self, session: TrainingSession, params: list[nn.Parameter],
                 closing: list[Any], parts: LoopParts) -> None:
        self.session, self._params, self._closing, self._parts = session, params, closing, parts
        # what in-place recovery reads (recovery.recoverable.Recoverable)
        self.preempt, self.profile = parts.preempt, parts.profile
        self.recovery: RecoveryService = parts.process.recovery
        self.after_done = 0  # the last step whose post-step work (the loop's own) is done
        self.in_place = LoopRecovery(self, parts, params, self._step_discarded)
        self._loss: torch.Tensor | None = None
        self._saved_step = -1  # of the last checkpoint this loop took or resumed from
        self._due = False  # step_done() asked for a checkpoint, taken at the next boundary
        self._begun = False  # the next step has begun (begin_step at the boundary)
        self._discarded = False  # an in-place recovery discarded the step in flight
        self._epoch: int | None = None  # of the last step, and where its cursor ended
        self._end_cursor, self._closed = 0, False
        # where the loop is: "step" (from a boundary to step_done), "window" (the loop's own
        # work after step_done), "boundary" (the next step's checkpoint and peer copies): a
        # recovery at the boundary redoes nothing, elsewhere the window runs again
        self._phase = "step"
        self._joining = False  # a replacement inside resume()

    def attach(self, calls: ScriptCollectives | None) -> None:
        """Recover through this process's recovery: the loop's own collectives ``calls``
        (None: recovery off) guarded, nodes leaving and joining in place, the script's model
        guarded, and the loader's next batch this loop's step boundary."""
        self.recovery.bind(self)
        if calls is not None:
            install(calls)
            self.in_place.script_calls = calls
        self.session.leave = lambda: self.recovery.leave(self)
        if isinstance(self._parts.process, ScriptRecovery):
            self.in_place.guard(self._parts.model)
        self._parts.loader.before_hand_out = self._begin_step

    @property
    def _calls(self) -> Guards:  # script_collectives.py
        return self.in_place.script_calls

    @property
    def info(self) -> DistInfo:
        """This rank's place (a regroup moves it)."""
        return self._parts.info

    @property
    def step(self) -> int:
        """Optimizer steps completed (the global step)."""
        return self.session.state.step

    @property
    def epoch(self) -> int:
        return self.session.sampler.epoch

    @property
    def state(self) -> TrainState:
        return self.session.state

    @property
    def sampler(self) -> ElasticSampler:
        return self.session.sampler

    @property
    def checkpoints(self) -> CheckpointManager:
        return self.session.checkpoints

    def loss_weights(self) -> list[float]:
        """The factor for each of this step's micro-batch losses (a mean over its samples), in
        order, so that the update is the mean over the step's global batch: ``1 / K`` each at
        an even split of K micro-batches; each micro-batch's share where the loader keeps a
        global batch the world size does not divide (``elastic_dataloader(...,
        global_batch_size=...)``, ``data/sampler.py``). Read it per step: a recovery may
        change the world size."""
        return self.sampler.loss_weights()

    @_fenced_out_exits
    def resume(self) -> tuple[int, int]:
        """Load the newest valid checkpoint on every rank (collective); returns ``(step,
        epoch)`` to continue from ((0, 0) without one). A replacement that joins a running
        group in place (``elastic-runner run``) receives a survivor's state instead."""
        if self._parts.process.joining:
            self.session.callbacks.on_phase("recovering", JOINING, True)
            self._joining = True
            rejoin(self, joining=True)  # the reporting opens at the group's step
            self._joining = False
            self._saved_step = self.step
            if self.in_place.phantom:  # its first pass redoes the group's window, discarded
                self._discarded = self._begun = True
        else:
            if _fresh_start():
                log.info("--no-resume: not resuming from %s", self.checkpoints.directory)
            elif self.session.resume():
                self._saved_step = self.step
                self._say_if_finished()
            self.session.start()
        self._mark_epoch()
        self.after_done = self.step
        self.recovery.announce_built(self.info.rank)
        return self.step, self.epoch  # the next step begins at its first batch (or backward)

    def backward(self, loss: torch.Tensor, *, step_loss: torch.Tensor | None = None,
                 scaler: torch.amp.GradScaler | None = None) -> None:
        """``loss.backward()`` for the step's last (or only) micro-batch, carrying the vote.

        Args:
            loss: that micro-batch's loss (a scalar tensor, unscaled).
            step_loss: the step's loss over all its micro-batches (gradient accumulation), for
                the non-finite check and the reported loss; default: ``loss``.
            scaler: a GradScaler (fp16): ``loss`` is scaled by it here; then
                ``scaler.unscale_``, the norm, ``should_commit(norm, overflow_ok=True)``,
                ``scaler.step`` and ``scaler.update`` are yours.
        """
        self._calls.runner()
        self._begin_step()
        if self._discarded:  # a recovery at the step's boundary discarded it: no vote
            self._calls.after_backward(self.step + 1)
            return
        if self._epoch is not None and self.epoch != self._epoch:
            self._epoch_ended()
        self._epoch = self.epoch
        self._loss = (loss if step_loss is None else step_loss).detach()
        self.in_place.collective(self.session.backward, loss, step_loss, scaler)
        self._calls.after_backward(self.step + 1)  # clip_grad_norm_'s all-reduce: guarded

    def should_commit(self, grad_norm: torch.Tensor | None = None,
                      overflow_ok: bool = False) -> bool:
        """True when every rank may apply this step's update (no non-finite loss anywhere,
        finite gradients, no stop requested); the same answer on all ranks. ``grad_norm``: the
        total gradient norm if you have it (``clip_grad_norm_``'s result); otherwise it is
        computed (on DDP the step's vote travels in it, see ``train/consensus.py``).
        ``overflow_ok``: fp16 with a GradScaler, whose ``step`` skips an overflowing update
        itself; such a step is then not counted as non-finite."""
        self._calls.runner()
        if self._discarded:  # in-place recovery discarded the step: nobody applies it
            return False
        decided: list[bool] = []

        def decide() -> None:
            norm = grad_norm
            if norm is None:
                norm = total_norm(self._params, None)
            elif isinstance(norm, DTensor):  # FSDP2's clip_grad_norm_ result: the local part
                norm = norm.full_tensor()
            decided.append(self.session.should_commit(norm, overflow_ok))

        return self.in_place.collective(decide) and decided[0]

    @_fenced_out_exits
    def step_done(self) -> int:
        """The step is over (after ``optimizer.step()``): move the cursor, report, and decide
        whether this step is checkpointed; the snapshot is taken at the next boundary, after
        the loop's own work on this step (module docstring). Returns the new global step.

        Raises:
            SystemExit(143): preemption: every rank discarded this step, and the checkpoint of
                the last applied one is committed.
            SystemExit(3): fenced out: a newer group claimed the checkpoint directory (also
                from :meth:`resume`, :meth:`close` and the boundary's commit).
            TrainingFailed: ``max_bad_steps`` non-finite steps in a row (a restart resumes from
                the last checkpoint).
        """
        self._calls.runner()
        if self._discarded:  # redone from its first micro-batch, after the new boundary
            self._discarded, self._begun = False, False
            self.in_place.discarded_pass_done()
            self._phase = "window"  # the window of this step runs again
            self._calls.window(self.step)
            return self.step
        try:
            if not self.in_place.collective(self.session.end_step, self._loss):
                self._discarded, self._begun = False, False
                return self.step
            step = self.step
            self._end_cursor = self.session.sampler.cursor
        except Preempted as e:
            self._saved_step = self.step  # committed: a close() after this has nothing to save
            self._close_reporting()
            print(f"elastic-runner: {e}", file=sys.stderr, flush=True)
            raise SystemExit(EXIT_PREEMPTED) from None
        except RollbackRequested:
            raise TrainingFailed(f"{self.session.options.max_bad_steps} non-finite steps in a "
                                 f"row at step {self.step}; a restart resumes from the last "
                                 "checkpoint") from None
        self.in_place.committed(step)
        self._parts.script_state.committed(step)
        self._phase = "window"
        self._due, self._begun = self.session.checkpoint_due(), False
        # the loop's own work on this step (an evaluation) gets the long budget
        self.session.callbacks.on_phase("training", f"the loop's work after step {step}", True)
        self._calls.window(step)
        return step

    @_fenced_out_exits
    def _begin_step(self) -> None:
        """The loop reached the next step (its first batch, or its backward): commit the
        checkpoint ``step_done()`` asked for, then begin the step."""
        self._calls.runner()
        if self._begun:
            return
        self._begun = True
        self._parts.script_state.window_done(self.step)  # before the boundary's collectives
        self._phase = "boundary"
        if self._due:
            self._due = False
            while not self.in_place.collective(self.session.checkpoint):
                pass  # recovered in place: the same step's checkpoint, in the new group
            self._saved_step = self.step
        # FSDP2: the peer copies of this step (none of step 0: the optimizer has no state yet,
        # and DCP's state_dict would make it with a step of AdamW)
        if self.step and self.recovery.copy_due(self.step):
            self.in_place.collective(self.recovery.keep_copy, self)
        self._discarded = False  # a recovery here found no step in flight
        self.after_done = self.step
        self._phase = "step"
        self.session.begin_step()

    @_fenced_out_exits
    def close(self) -> None:
        """Checkpoint the last step (unless just saved), wait for the commit, stop reporting;
        a sharded model's process groups are left to ``destroy_process_group`` to free
        (:func:`~elastic_runner.dist.release_groups_of`); a second call does nothing."""
        self._calls.runner()
        if self._closed:
            return
        self._parts.closing[0] = True
        if self._saved_step != self.step:  # also what step_done() left pending
            self.session.checkpoint()
        if self._epoch is not None and self.session.sampler.steps_left_in_epoch() == 0:
            self._epoch_ended()
        self._close_reporting()
        self.recovery.announce_finished(self.info.rank)
        self._parts.process.close()
        release_groups_of(self.session.checkpoints.state["model"])

    def _say_if_finished(self) -> None:
        """A re-run of a finished job resumes its last checkpoint, written by ``close()``: say
        so, since a loop that ends at that step then does nothing more."""
        where = self.checkpoints.resumed_from
        if self.info.rank != 0 or where is None or not storage.inspect(where).finished:
            return
        log.warning("%s was written by ft.close(): the run had finished at step %d; a loop "
                    "that ends there does nothing more (start fresh: another checkpoint_dir, "
                    "or elastic-runner run --no-resume)", where, self.step)

    def group_formed(self, joining: list[int]) -> None:
        """In-place recovery formed a new group (``LoopRecovery.group_formed``)."""
        self.in_place.group_formed(joining)

    def rewrap(self, in_sync: bool) -> None:
        """The script's model on the new group (:meth:`LoopRecovery.rewrap
        <elastic_runner.own_loop.in_place.LoopRecovery.rewrap>`: it moves no values, so
        ``in_sync`` changes nothing), and every member's ``state=`` rank 0's
        (``own_loop/script_state.py``; collective): unless the failure came at a step's
        boundary, every rank runs the loop's window of the group's step again, a replacement
        in a discarded first pass."""
        self.in_place.rewrap()
        redo = self._parts.script_state.agree(self.info.rank, self._joining, self._phase,
                                              self.step)
        self.in_place.phantom = redo and self._joining and not self.checkpoints.sharded

    def _step_discarded(self) -> None:
        """An in-place recovery discarded the step in flight on every rank; the state it
        installed says where the last committed epoch ended."""
        self._discarded = True
        self._mark_epoch()

    def _mark_epoch(self) -> None:
        """The epoch of the last committed step, and its cursor, as the state (loaded, or
        received from a peer) says: the end of that epoch is recorded once the loop moves
        past it (:meth:`_epoch_ended`), also by a rank 0 that took over just before."""
        s = self.sampler
        if not self.step:
            return
        if s.cursor == 0 and s.epoch > 0:  # the loop had begun the next epoch: set_epoch()
            self._epoch, self._end_cursor = s.epoch - 1, s.previous_epoch_end()
        else:
            self._epoch, self._end_cursor = s.epoch, s.cursor

    def _epoch_ended(self) -> None:
        """The user's loop moved past epoch ``_epoch`` (its tail goes to the sample trace)."""
        epoch, cursor, sampler = self._epoch, self._end_cursor, self.session.sampler
        self.session.callbacks.on_epoch_end(
            epoch, self.step, lambda: sampler.permutation(epoch)[cursor:].tolist())
        self._epoch = None

    def _close_reporting(self) -> None:
        self._closed = True
        try:
            self.session.close()
        finally:
            for obj in self._closing:
                obj.close()


def _fresh_start() -> bool:
    """``--no-resume``, in the job's first attempt
    (:data:`~elastic_runner.protocol.env.NO_RESUME_ENV`)."""
    return env.no_resume() and TorchrunEnv.read().restart_count == 0
