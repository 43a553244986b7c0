"""Fault tolerance for your own training loop, in a few changed lines.

    loader = elastic_dataloader(train_set, micro_batch_size=16, seed=0)
    ft = fault_tolerant(model, optimizer, loader, checkpoint_dir="runs/ckpt", every_steps=50)
    step, epoch = ft.resume()                   # newest valid checkpoint, or step 0
    while step < max_steps:
        loader.elastic_sampler.set_epoch(epoch)
        for x, y in loader:                     # this rank's remaining micro-batches
            optimizer.zero_grad()
            ft.backward(loss_fn(model(x), y))   # instead of loss.backward()
            if ft.should_commit():              # same answer on every rank
                optimizer.step()
            step = ft.step_done()               # cursor, metrics, checkpoint cadence, SIGTERM
            ...                                 # your work after the step (evaluate, log)
        epoch += 1
    ft.close()                                  # final checkpoint, committed

Under ``torchrun`` or ``elastic-runner run`` every (re)start resumes from the newest valid
checkpoint at the exact next step, at any world size (the sampler's global cursor); SIGTERM
(preemption) discards the step in flight on every rank, commits a checkpoint of the last applied
step and exits 143 (put an LR scheduler's ``step()`` inside ``if ft.should_commit():``); per-rank
metrics are recorded (served by ``elastic-runner run``'s agent, or on ``metrics.port +
local_rank`` under plain torchrun); a hang past the watchdog budget dumps stacks and exits. A
streak of non-finite steps fails the process, and the restart resumes from the last checkpoint.

The checkpoint of step N holds all of step N, the loop's own work after ``step_done()`` too (an
evaluation, early-stopping bookkeeping kept in ``state=``): ``step_done()`` decides whether step
N is checkpointed, and the snapshot is taken at the next boundary the loop reaches, the loader's
next batch, the next :meth:`FaultTolerantLoop.backward` or :meth:`FaultTolerantLoop.close`,
where the next step begins (its RNG streams reseeded, its watchdog budget armed). Between
``step_done()`` and that boundary the watchdog allows ``long_op_timeout_seconds``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import yaml
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from . import compat
from .checkpoint import storage
from .checkpoint.manager import CheckpointManager
from .data.loader import ElasticDataLoader
from .data.sampler import ElasticSampler
from .dist import DistInfo, current_rank, release_groups_of
from .exit_codes import EXIT_PREEMPTED
from .logs import setup_logging
from .observe.config import MetricsConfig
from .observe.metrics import RankMetrics
from .observe.reporting import Budgets, FaultInjection, runner_callbacks
from .parallel.base import total_norm
from .preempt import Preempted, PreemptionFlag
from .recovery.inplace import InPlaceRecovery, NoRecovery, Regroup, StepRedo
from .recovery.rejoin import RecoveryReport, rejoin
from .recovery.script import NoScriptRecovery, ScriptRecovery
from .recovery.script import current as current_process
from .script_env import FAULTS_ENV, FAULTS_TRIGGER_ENV, NO_RESUME_ENV, TRACE_DIR_ENV
from .train.callbacks import JOINING, Callback, Callbacks
from .train.config import EarlyStoppingConfig, FaultConfig, FaultSpec
from .train.consensus import CommHook, StepConsensus, make_consensus
from .train.early_stop import EarlyStopping
from .train.faults import FaultInjector
from .train.session import RollbackRequested, SessionOptions, TrainingFailed, TrainingSession
from .train.state import RNGState, TrainState
from .train.stop import StopPolicy
from .train.straggler import StragglerMonitor

log = logging.getLogger(__name__)

DEFAULT_EVERY_SECONDS = 300.0  # fault_tolerant's checkpoint cadence when none is given


class FaultTolerantLoop:
    """What :func:`fault_tolerant` returns: the session's step protocol in loop-sized calls.

    Attributes:
        session: the underlying :class:`~elastic_runner.train.session.TrainingSession`.
    """

    # what in-place recovery reads (recovery.rejoin.Recoverable): a script's batch is its own
    # (its micro-batch at any world size), no HSDP, and nodes join and leave in place
    # (:meth:`_regroup`)
    batch = None
    hsdp_replicas = 1

    def __init__(self, session: TrainingSession, params: list[nn.Parameter],
                 closing: list[Any], parts: _LoopParts) -> None:
        self.session, self._params, self._closing = session, params, closing
        self._parts = parts
        self.info, self.preempt, self.fingerprint = parts.info, parts.preempt, parts.fingerprint
        self.recovery: InPlaceRecovery | NoRecovery = parts.process.recovery
        self.after_done = 0  # the last step whose post-step work (the loop's own) is done
        self._loss: torch.Tensor | None = None
        self._saved_step = -1
        self._due = False  # step_done() asked for a checkpoint, taken at the next boundary
        self._begun = False  # the next step has begun (begin_step at the boundary)
        self._discarded = False  # an in-place recovery discarded the step in flight
        self._recovering: RecoveryReport | None = None  # done at the next committed step
        self._t_recovered = 0.0
        self._epoch: int | None = None  # of the last step, and where its cursor ended
        self._end_cursor = 0
        self._closed = False

    @property
    def regroups(self) -> bool:
        """Whether nodes may leave and join in place: an FSDP2 loop's shards cannot take
        another world size in its process (those take torch's restart path)."""
        return not self.checkpoints.sharded

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

    def resume(self) -> tuple[int, int]:
        """Load the newest valid checkpoint on every rank (collective); returns ``(step,
        epoch)`` to continue from ((0, 0) without one). A replacement that joins a running
        group in place (``elastic-runner run``) receives a survivor's state instead."""
        if self._parts.process.joining:
            self.session.callbacks.on_phase("recovering", JOINING, True)
            rejoin(self, joining=True)  # the reporting opens at the group's step
            self._saved_step = self.step
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
        self._begin_step()
        if self._discarded:  # a recovery at the step's boundary discarded it: no vote
            return
        if self._epoch is not None and self.epoch != self._epoch:
            self._epoch_ended()
        self._epoch = self.epoch
        self._loss = (loss if step_loss is None else step_loss).detach()
        self._collective(self.session.backward, loss, step_loss, scaler)

    def should_commit(self, grad_norm: torch.Tensor | None = None,
                      overflow_ok: bool = False) -> bool:
        """True when every rank may apply this step's update (no non-finite loss anywhere,
        finite gradients, no stop requested); the same answer on all ranks. ``grad_norm``: the
        total gradient norm if you have it (``clip_grad_norm_``'s result); otherwise it is
        computed (on DDP the step's vote travels in it, see ``train/consensus.py``).
        ``overflow_ok``: fp16 with a GradScaler, whose ``step`` skips an overflowing update
        itself; such a step is then not counted as non-finite."""
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

        return self._collective(decide) and decided[0]

    def step_done(self) -> int:
        """The step is over (after ``optimizer.step()``): move the cursor, report, and decide
        whether this step is checkpointed; the snapshot is taken at the next boundary, after
        the loop's own work on this step (module docstring). Returns the new global step.

        Raises:
            SystemExit(143): preemption: every rank discarded this step, and the checkpoint of
                the last applied one is committed.
            TrainingFailed: ``max_bad_steps`` non-finite steps in a row (a restart resumes from
                the last checkpoint).
        """
        if self._discarded:  # redone from its first micro-batch, after the new boundary
            self._discarded, self._begun = False, False
            return self.step
        try:
            if not self._collective(self.session.end_step, self._loss):
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
        if self._recovering is not None:
            self._recovered()
        self._due, self._begun = self.session.checkpoint_due(), False
        # the loop's own work on this step (an evaluation) gets the long budget
        self.session.callbacks.on_phase("training", f"the loop's work after step {step}", True)
        return step

    def _begin_step(self) -> None:
        """The loop reached the next step (its first batch, or its backward): commit the
        checkpoint ``step_done()`` asked for, then begin the step."""
        if self._begun:
            return
        self._begun = True
        if self._due:
            self._due = False
            while not self._collective(self.session.checkpoint):
                pass  # recovered in place: the same step's checkpoint, in the new group
            self._saved_step = self.step
        # FSDP2: the peer copies of this step (none of step 0: the optimizer has no state yet,
        # and DCP's state_dict would make it with a step of AdamW)
        if self.step and self.recovery.copy_due(self.step):
            self._collective(self.recovery.keep_copy, self)
        self._discarded = False  # a recovery here found no step in flight
        self.after_done = self.step
        self.session.begin_step()

    def close(self) -> None:
        """Checkpoint the last step (unless just saved), wait for the commit, stop reporting;
        a sharded model's process groups are left to ``destroy_process_group`` to free
        (:func:`~elastic_runner.dist.release_groups_of`); a second call does nothing."""
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

    # ------------------------------------------------------------ in-place recovery

    def _collective(self, call: Callable[..., Any], *args: Any) -> bool:
        """``call(*args)``; when one of its collectives fails because a peer died (in-place
        recovery on): the group is re-formed without leaving this process and False is
        returned: the step in flight is discarded on every rank, and its micro-batches come
        again from the loader.

        Raises:
            RuntimeError: the error, when no peer died or recovery is off (torch's restart
                path).
        """
        try:
            try:
                call(*args)
            except RuntimeError as e:
                if isinstance(e, TrainingFailed) or not self.recovery.active:
                    raise
                self._recover(e)
                return False
        except Regroup as r:  # nodes left or joined: this rank goes on in another group
            self._regroup(r)
            return False
        except StepRedo:  # a membership boundary that changed nothing: the step is redone
            self._forget_step()
            self._parts.loader.restart()
            return False
        return True

    def guard_forward(self, ddp: DDP) -> None:
        """The script's DDP forward carries collectives of its own (the buffers' broadcast,
        the buckets' rebuild after a new reducer): when one fails because a peer died, the
        group is re-formed there (:meth:`_collective`) and the forward returns the local
        module's output without autograd, for a step that is discarded anyway (its
        :meth:`backward` does nothing, :meth:`should_commit` answers False)."""
        forward = ddp.forward

        def guarded(*args: Any, **kwargs: Any) -> Any:
            out: list[Any] = []
            if self._collective(lambda: out.append(forward(*args, **kwargs))):
                return out[0]
            with torch.no_grad():
                return ddp.module(*args, **kwargs)

        ddp.forward = guarded  # type: ignore[method-assign]

    def guard_call(self, module: nn.Module) -> None:
        """The script's FSDP2 root module gathers its shards in forward hooks: when a
        collective of its call fails because a peer died, the group is re-formed there
        (:meth:`_collective`) and the call returns zeros shaped as this process's last output,
        for a step that is discarded anyway. Its class becomes a subclass with that
        ``__call__``, as ``fully_shard`` itself swaps the class."""
        cls, loop = type(module), self
        last: list[Any] = []

        def guarded(mod: nn.Module, *args: Any, **kwargs: Any) -> Any:
            out: list[Any] = []
            if loop._collective(lambda: out.append(cls.__call__(mod, *args, **kwargs))):
                last[:] = [_each_tensor(_meta, out[0])]
                return out[0]
            if not last:  # recovered before any output: nothing to stand in for it
                loop.recovery.ask_restart()
                raise RuntimeError("a peer died in this process's first forward: every "
                                   "worker restarts from the newest checkpoint")
            return _each_tensor(_zeros, last[0])

        module.__class__ = type(cls.__name__, (cls,), {"__call__": guarded,
                                                      "__module__": cls.__module__})

    def _forget_step(self) -> None:
        self.session.abandon_step()
        for p in self._params:  # the step's partial gradients
            p.grad = None

    def _recover(self, error: RuntimeError) -> None:
        """A collective failed: re-form the group in place (or re-raise ``error``).

        Raises:
            Regroup: a node left or joined meanwhile (:meth:`_regroup` follows).
        """
        self._forget_step()
        report = self.recovery.recover(error, self)
        if report is None:
            raise error
        self._go_on(report)

    def _go_on(self, report: RecoveryReport) -> None:
        """The group agreed on the state: the step in flight is discarded on every rank and
        its micro-batches come again (the first committed step completes ``report``)."""
        self._recovering, self._t_recovered = report, time.perf_counter()
        self._discarded = True
        self._mark_epoch()
        self._parts.loader.restart()

    def _regroup(self, r: Regroup) -> None:
        """Go on as rank ``r.rank`` of ``r.world_size`` (nodes left, or joined at a step
        boundary), in this process: the group re-formed, this rank's place (sampler split,
        reporting, checkpoint writer) moved to it, the script's DDP reduces over it, and the
        members agree on the state (a joining node's ranks receive it). The sampler's global
        cursor keeps every sample once; the micro-batch stays, so the global batch follows the
        world size."""
        self._forget_step()
        report = r.report or RecoveryReport(r.generation, [], self.step)
        if r.world_size == self.info.world_size:  # FSDP2's replacements (recover())
            joining = list(report.failed_ranks)
        else:  # a join's ranks follow the members'
            joining = list(range(self.info.world_size, r.world_size))
        if self.checkpoints.sharded and r.world_size != self.info.world_size:
            self.recovery.ask_restart()
            raise RuntimeError(f"an FSDP2 loop cannot go on at world size {r.world_size} in "
                               "its process: every worker restarts from the newest checkpoint")
        t0 = time.perf_counter()
        self.recovery.form_group(r.rank, r.world_size, r.generation)
        t1 = time.perf_counter()
        self._place(r.rank, r.world_size)
        self.recovery.bind(self)
        self.group_formed(joining)
        rejoin(self, joining=False, report=report)
        report.phases.update(group=t1 - t0, state=time.perf_counter() - t1)
        self._go_on(report)

    def _place(self, rank: int, world_size: int) -> None:
        """This process is ``rank`` of ``world_size`` now: its environment, the sampler's
        split, the session's numbers, the checkpoint writer and the rank-bound reporting."""
        parts = self._parts
        if rank != self.info.rank and parts.own_logging:
            setup_logging(rank)
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size))
        self.info = parts.info = dataclasses.replace(self.info, rank=rank,
                                                     world_size=world_size)
        sampler = self.sampler  # its committed geometry stays the old group's until a step
        sampler.rank, sampler.world_size = rank, world_size
        self.session.rank, self.session.world_size = rank, world_size
        self.checkpoints.renumber(rank)
        parts.metrics.world(world_size)
        old, parts.reporting = parts.reporting, parts.runner(rank, world_size)
        self.session.callbacks.swap(old, parts.reporting)

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

    def _recovered(self) -> None:
        """The first step after an in-place recovery is committed: report the recovery."""
        report, self._recovering = self._recovering, None
        assert report is not None
        report.phases["first step"] = time.perf_counter() - self._t_recovered
        log.warning("in-place recovery %d done: step %d committed %.3f s after %s (%s)",
                    report.generation, self.step, report.seconds, report.cause,
                    ", ".join(f"{k} {v:.3f} s" for k, v in report.phases.items()))
        self.session.callbacks.on_recovery_report(report)

    def group_formed(self, joining: list[int]) -> None:
        """The new group exists; a replacement constructs its DDP now (the script's line
        after ``init_distributed``): run the collectives of that construction with it. Under
        FSDP2 it makes its checkpoint group: so does this rank."""
        model = self._parts.model
        if joining and isinstance(model, DDP) and self.info.rank not in joining:
            compat.ddp_construction_collectives(model, src_is_peer=0 in joining)
        if self.checkpoints.sharded:  # as a replacement's CheckpointManager makes it
            with self.recovery.sockets.forming(subgroups=True):
                self.checkpoints.renew_group()

    def rewrap(self) -> None:
        """On the new group: the script's DDP object reduces over it (its reducer rebuilt in
        place, so the ``model`` the loop holds stays the one to call), or its FSDP2 modules
        gather and scatter over it; and the vote and the straggler exchange that go with it."""
        parts, info = self._parts, self.info
        if isinstance(parts.model, DDP):
            compat.ddp_reattach(parts.model)
        elif self.checkpoints.sharded:
            compat.fsdp_reattach(parts.model)
        self.session.consensus = parts.vote()
        self.session.straggler = StragglerMonitor(0.0, info.rank, info.world_size, info.device)

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


def fault_tolerant(model: nn.Module, optimizer: torch.optim.Optimizer,
                   loader: ElasticDataLoader, *, checkpoint_dir: str, every_steps: int = 0,
                   every_seconds: float | None = None, async_save: bool = True,
                   keep_last: int = 3, state: Mapping[str, Stateful] | None = None,
                   log_every_steps: int = 10, max_bad_steps: int = 3,
                   hang_timeout_seconds: float | None = 300.0,
                   long_op_timeout_seconds: float = 1800.0,
                   metrics: MetricsConfig | None = None, trace_dir: str | None = None,
                   comm_hook: CommHook | None = None, hook_state: Any = None,
                   callbacks: list[Callback] | None = None) -> FaultTolerantLoop:
    """Make a user's DDP or FSDP2 loop fault-tolerant (see the module docstring).

    Args:
        model: the model as trained: a ``DistributedDataParallel`` (its step vote then rides on
            the gradient all-reduce), a module sharded with ``fully_shard`` (FSDP2: checkpoints
            are sharded through DCP, every rank writes its part, a resume reshards to the world
            size; the vote travels in the gradients as on DDP) or a plain module (world size 1,
            or a vote by all-reduce).
        optimizer: its optimizer (checkpointed).
        loader: an :class:`~elastic_runner.data.loader.ElasticDataLoader` (its cursor is
            checkpointed and only finished steps move it).
        checkpoint_dir: local path or fsspec URL shared by all nodes.
        every_steps, every_seconds, async_save, keep_last: checkpoint cadence and retention;
            with neither ``every_steps`` nor ``every_seconds`` given, a checkpoint every
            :data:`DEFAULT_EVERY_SECONDS` seconds (logged once), so a crash never resumes
            from step 0 after a long run.
        state: more ``Stateful`` objects to checkpoint (an LR scheduler, a GradScaler, ...).
        log_every_steps: the loss is read from the device, averaged and logged this often.
        max_bad_steps: non-finite steps in a row before the process fails (and resumes).
        hang_timeout_seconds: a step that takes longer is a hang (None: no watchdog limit);
            the first step of an attempt and checkpoint I/O get ``long_op_timeout_seconds``.
        metrics: the ``metrics`` section (port, address, labels); default: recorded, not served.
        trace_dir: write the sample audit trace (``elastic-runner audit DIR``) there
            (``elastic-runner run script.py --trace-samples DIR`` sets another).
        comm_hook, hook_state: your own DDP comm hook, wrapped rather than replaced (the vote
            then costs one small all-reduce per step; without it, none).
        callbacks: your own :class:`~elastic_runner.train.callbacks.Callback` objects.

    The runner logs to stderr (rank 0: INFO, others: WARNING) unless the program configured
    logging (a handler on the root or the ``elastic_runner`` logger) before this call.

    Raises:
        TypeError: a value of ``state`` is not ``Stateful``.
    """
    trace_dir = os.environ.get(TRACE_DIR_ENV) or trace_dir
    inner = model.module if isinstance(model, DDP) else model
    device = next(inner.parameters()).device
    rank, sampler = current_rank(), loader.elastic_sampler
    own_logging = (not logging.getLogger("elastic_runner").handlers
                   and not logging.getLogger().handlers)
    if own_logging:
        setup_logging(rank)  # the runner's lines (resumed from, checkpoints) unless you log
    preempt = PreemptionFlag()
    preempt.install()
    rank_metrics, closing = _metrics(metrics or MetricsConfig())
    injection = _faults(rank)
    budgets = Budgets(hang_timeout_seconds, long_op_timeout_seconds)

    def runner(rank: int, world_size: int) -> list[Callback]:
        return runner_callbacks(rank_metrics, budgets, rank, world_size, sampler.num_samples,
                                0, trace_dir, last_step=sampler.last_step)

    ours = runner(rank, sampler.world_size)
    reporting = Callbacks([*ours, *(callbacks or []), *([injection] if injection else [])])
    if not every_steps and every_seconds is None:
        every_seconds = DEFAULT_EVERY_SECONDS
        if rank == 0:
            log.info("fault_tolerant: no checkpoint cadence given (every_steps, "
                     "every_seconds): a checkpoint every %g s", every_seconds)
    process = _in_place_process(model)
    fingerprint = model_fingerprint(inner, sampler)
    closing_flag = [False]  # the manifest's "finished": the checkpoint of close()
    train_state = TrainState()
    checkpoints = CheckpointManager(
        checkpoint_dir, {"model": inner, "optimizer": optimizer, "sampler": sampler,
                         "train_state": train_state, "rng": RNGState(), **(state or {})},
        every_steps=every_steps, every_seconds=every_seconds, async_save=async_save,
        keep_last=keep_last, keep_best=False, listener=reporting, rank=rank,
        meta=lambda: {"epoch": sampler.epoch, "cursor": sampler.cursor,
                      "world_size": sampler.world_size,
                      "global_batch_size": sampler.global_batch_size,
                      "config_hash": fingerprint, "finished": closing_flag[0]})
    def vote() -> StepConsensus:  # a membership change's step boundary stops it too
        return make_consensus(model, lambda: preempt.stop_asked, comm_hook, hook_state)

    session = TrainingSession(
        state=train_state, sampler=sampler, checkpoints=checkpoints, consensus=vote(),
        stop=StopPolicy(None, sys.maxsize, EarlyStopping(EarlyStoppingConfig())),
        callbacks=reporting,
        straggler=StragglerMonitor(0.0, rank, sampler.world_size, device), device=device,
        rank=rank, world_size=sampler.world_size,
        options=SessionOptions(sampler.seed, log_every_steps, max_bad_steps),
        lr=lambda: optimizer.param_groups[0]["lr"],
        poisoned=injection.poisoned if injection else (lambda step: False),
        fetched=loader.take_fetched)
    params = [p for p in inner.parameters() if p.requires_grad]
    info = _dist_info(rank, sampler.world_size, device)
    parts = _LoopParts(info, preempt, fingerprint, process, model, loader, vote, closing_flag,
                       rank_metrics, runner, ours, own_logging)
    loop = FaultTolerantLoop(session, params, closing, parts)
    loop.recovery.bind(loop)
    session.leave = lambda: loop.recovery.leave(loop)  # nodes leave and join in place
    if isinstance(process, ScriptRecovery):
        if isinstance(model, DDP):
            loop.guard_forward(model)
        elif checkpoints.sharded:
            loop.guard_call(model)
    loader.before_hand_out = loop._begin_step  # the next step's first batch: its boundary
    return loop


@dataclass
class _LoopParts:
    """What a :class:`FaultTolerantLoop` holds besides its session: where it runs, its
    preemption flag, the fingerprint of what it trains, this process's in-place recovery, the
    script's model object (DDP, FSDP2 or plain) and loader, how to make its step vote, and
    what a regroup rebuilds for another rank (the rank-bound reporting)."""

    info: DistInfo
    preempt: PreemptionFlag
    fingerprint: str
    process: ScriptRecovery | NoScriptRecovery
    model: nn.Module
    loader: ElasticDataLoader
    vote: Callable[[], StepConsensus]
    closing: list[bool]  # [True] once close() checkpoints: the manifest's "finished"
    metrics: RankMetrics
    runner: Callable[[int, int], list[Callback]]  # the runner's callbacks for a rank, world size
    reporting: list[Callback]  # those of this rank now
    own_logging: bool  # the runner set up logging (a renumbered rank sets it up again)


def _in_place_process(model: nn.Module) -> ScriptRecovery | NoScriptRecovery:
    """This process's in-place recovery (``recovery/script.py``), for a DDP, FSDP2 or plain
    model; the agents are asked for torch's restart path at once where the model cannot move to
    a re-formed group: an FSDP2 mesh that is not 1-D over the default group, or a torch on
    which compat fix 14 (DDP) or 15 (FSDP2) does not apply."""
    process = current_process()
    if not isinstance(process, ScriptRecovery):
        return process
    if _sharded(model):
        why = compat.fsdp_reattach_refusal(model)
        if why is None:
            return process
    elif not compat.ddp_reattach_supported():
        why = f"torch {torch.__version__} cannot move a DDP to a new group (compat fix 14)"
    else:
        return process
    log.warning("%s: a failed worker restarts every worker (torch's restart path)", why)
    process.recovery.ask_restart()
    process.close()
    return NoScriptRecovery()


def _each_tensor(fn: Callable[[Any], Any], x: Any) -> Any:
    """``x`` (a model's output: a tensor, or tuples, lists and dicts of them) with ``fn``
    applied to each tensor or :class:`_Meta`."""
    if isinstance(x, (torch.Tensor, _Meta)):
        return fn(x)
    if isinstance(x, dict):  # a ModelOutput too
        return type(x)({k: _each_tensor(fn, v) for k, v in x.items()})
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # a namedtuple
        return type(x)(*(_each_tensor(fn, v) for v in x))
    if isinstance(x, (list, tuple)):
        return type(x)(_each_tensor(fn, v) for v in x)
    return x


def _meta(x: torch.Tensor) -> _Meta:
    """A tensor's shape, dtype and device (what :func:`_zeros` makes again)."""
    return _Meta(x.shape, x.dtype, x.device)


def _zeros(x: _Meta) -> torch.Tensor:
    return torch.zeros(x.shape, dtype=x.dtype, device=x.device)


@dataclass(frozen=True)
class _Meta:
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device


def _fresh_start() -> bool:
    """``--no-resume``, in the job's first attempt (:data:`NO_RESUME_ENV`)."""
    return (os.environ.get(NO_RESUME_ENV) == "1"
            and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) == 0)


def _sharded(model: nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in model.parameters())


def _dist_info(rank: int, world_size: int, device: torch.device) -> DistInfo:
    return DistInfo(rank=rank, local_rank=int(os.environ.get("LOCAL_RANK", 0)),
                    world_size=world_size,
                    local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
                    node_rank=int(os.environ.get("GROUP_RANK", 0)),
                    restart_count=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
                    device=device,
                    backend=dist.get_backend() if dist.is_initialized() else "")


def model_fingerprint(model: nn.Module, sampler: ElasticSampler) -> str:
    """What a replacement must have built like the survivors: the model's parameter and
    buffer names, shapes and dtypes, and the data's size and order (samples, seed,
    micro-batch). Hex SHA-256."""
    parts = [f"{n}:{tuple(t.shape)}:{t.dtype}" for n, t in model.state_dict().items()
             if isinstance(t, torch.Tensor)]
    parts.append(f"data:{sampler.num_samples}:{sampler.seed}:{sampler.micro_batch_size}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _metrics(cfg: MetricsConfig) -> tuple[RankMetrics, list[Any]]:
    """This rank's series, served on ``port + local_rank`` when no elastic-runner agent serves
    the node's (plain torchrun)."""
    from .worker import worker_metrics

    metrics, server = worker_metrics(cfg)
    return metrics, [server] if server is not None else []


def _faults(rank: int) -> FaultInjection | None:
    """Fault drills through ``ELASTIC_RUNNER_FAULTS`` (a YAML list of fault specs) and
    ``ELASTIC_RUNNER_FAULTS_TRIGGER`` (a trigger file: ``faults.trigger_file``)."""
    text = os.environ.get(FAULTS_ENV)
    trigger = os.environ.get(FAULTS_TRIGGER_ENV) or None
    if not text and not trigger:
        return None
    specs = [FaultSpec(**spec) for spec in yaml.safe_load(text or "[]")]
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    return FaultInjection(FaultInjector(FaultConfig(inject=specs, trigger_file=trigger), rank,
                                        restart))
