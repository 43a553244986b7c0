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

import logging
import os
import sys
from collections.abc import Mapping
from typing import Any

import torch
import yaml
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from .checkpoint.manager import CheckpointManager
from .data.loader import ElasticDataLoader
from .dist import current_rank, release_groups_of
from .exit_codes import EXIT_PREEMPTED
from .logs import setup_logging
from .observe.config import MetricsConfig
from .observe.metrics import RankMetrics
from .observe.reporting import Budgets, FaultInjection, runner_callbacks
from .observe.straggler import StragglerMonitor
from .parallel.base import total_norm
from .preempt import Preempted, PreemptionFlag
from .train.callbacks import Callback, Callbacks
from .train.config import EarlyStoppingConfig, FaultConfig, FaultSpec
from .train.consensus import CommHook, make_consensus
from .train.early_stop import EarlyStopping
from .train.faults import FaultInjector
from .train.session import RollbackRequested, SessionOptions, TrainingFailed, TrainingSession
from .train.state import RNGState, TrainState
from .train.stop import StopPolicy

log = logging.getLogger(__name__)

DEFAULT_EVERY_SECONDS = 300.0  # fault_tolerant's checkpoint cadence when none is given


class FaultTolerantLoop:
    """What :func:`fault_tolerant` returns: the session's step protocol in loop-sized calls.

    Attributes:
        session: the underlying :class:`~elastic_runner.train.session.TrainingSession`.
    """

    def __init__(self, session: TrainingSession, params: list[nn.Parameter],
                 closing: list[Any]) -> None:
        self.session, self._params, self._closing = session, params, closing
        self._loss: torch.Tensor | None = None
        self._saved_step = -1
        self._due = False  # step_done() asked for a checkpoint, taken at the next boundary
        self._begun = False  # the next step has begun (begin_step at the boundary)
        self._epoch: int | None = None  # of the last step, and where its cursor ended
        self._end_cursor = 0
        self._closed = False

    @property
    def step(self) -> int:
        """Optimizer steps completed (the global step)."""
        return self.session.state.step

    @property
    def epoch(self) -> int:
        return self.session.sampler.epoch

    def resume(self) -> tuple[int, int]:
        """Load the newest valid checkpoint on every rank (collective); returns ``(step,
        epoch)`` to continue from ((0, 0) without one)."""
        if self.session.resume():
            self._saved_step = self.step
        self.session.start()
        self._begin_step()
        return self.step, self.epoch

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
        if self._epoch is not None and self.epoch != self._epoch:
            self._epoch_ended()
        self._epoch = self.epoch
        self._loss = (loss if step_loss is None else step_loss).detach()
        self.session.backward(loss, step_loss, scaler)

    def should_commit(self, grad_norm: torch.Tensor | None = None,
                      overflow_ok: bool = False) -> bool:
        """True when every rank may apply this step's update (no non-finite loss anywhere,
        finite gradients, no stop requested); the same answer on all ranks. ``grad_norm``: the
        total gradient norm if you have it (``clip_grad_norm_``'s result); otherwise it is
        computed (on DDP the step's vote travels in it, see ``train/consensus.py``).
        ``overflow_ok``: fp16 with a GradScaler, whose ``step`` skips an overflowing update
        itself; such a step is then not counted as non-finite."""
        if grad_norm is None:
            grad_norm = total_norm(self._params, None)
        elif isinstance(grad_norm, DTensor):  # FSDP2's clip_grad_norm_ result: the local part
            grad_norm = grad_norm.full_tensor()
        return self.session.should_commit(grad_norm, overflow_ok)

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
        try:
            step = self.session.end_step(self._loss)
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
            self.session.checkpoint()
            self._saved_step = self.step
        self.session.begin_step()

    def close(self) -> None:
        """Checkpoint the last step (unless just saved), wait for the commit, stop reporting;
        a sharded model's process groups are left to ``destroy_process_group`` to free
        (:func:`~elastic_runner.dist.release_groups_of`); a second call does nothing."""
        if self._closed:
            return
        if self._saved_step != self.step:  # also what step_done() left pending
            self.session.checkpoint()
        if self._epoch is not None and self.session.sampler.steps_left_in_epoch() == 0:
            self._epoch_ended()
        self._close_reporting()
        release_groups_of(self.session.checkpoints.state["model"])

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
        trace_dir: write the sample audit trace (``elastic-runner audit DIR``) there.
        comm_hook, hook_state: your own DDP comm hook, wrapped rather than replaced (the vote
            then costs one small all-reduce per step; without it, none).
        callbacks: your own :class:`~elastic_runner.train.callbacks.Callback` objects.

    The runner logs to stderr (rank 0: INFO, others: WARNING) unless the program configured
    logging (a handler on the root or the ``elastic_runner`` logger) before this call.

    Raises:
        TypeError: a value of ``state`` is not ``Stateful``.
    """
    inner = model.module if isinstance(model, DDP) else model
    device = next(inner.parameters()).device
    rank, sampler = current_rank(), loader.elastic_sampler
    if not logging.getLogger("elastic_runner").handlers and not logging.getLogger().handlers:
        setup_logging(rank)  # the runner's lines (resumed from, checkpoints) unless you log
    preempt = PreemptionFlag()
    preempt.install()
    rank_metrics, closing = _metrics(metrics or MetricsConfig())
    injection = _faults(rank)
    reporting = Callbacks([
        *runner_callbacks(rank_metrics, Budgets(hang_timeout_seconds, long_op_timeout_seconds),
                          rank, sampler.world_size, sampler.num_samples, 0, trace_dir,
                          last_step=sampler.last_step),
        *(callbacks or []), *([injection] if injection else [])])
    if not every_steps and every_seconds is None:
        every_seconds = DEFAULT_EVERY_SECONDS
        if rank == 0:
            log.info("fault_tolerant: no checkpoint cadence given (every_steps, "
                     "every_seconds): a checkpoint every %g s", every_seconds)
    train_state = TrainState()
    checkpoints = CheckpointManager(
        checkpoint_dir, {"model": inner, "optimizer": optimizer, "sampler": sampler,
                         "train_state": train_state, "rng": RNGState(), **(state or {})},
        every_steps=every_steps, every_seconds=every_seconds, async_save=async_save,
        keep_last=keep_last, keep_best=False, listener=reporting, rank=rank,
        meta=lambda: {"epoch": sampler.epoch, "cursor": sampler.cursor,
                      "world_size": sampler.world_size})
    session = TrainingSession(
        state=train_state, sampler=sampler, checkpoints=checkpoints,
        consensus=make_consensus(model, lambda: preempt.requested, comm_hook, hook_state),
        stop=StopPolicy(None, sys.maxsize, EarlyStopping(EarlyStoppingConfig())),
        callbacks=reporting,
        straggler=StragglerMonitor(0.0, rank, sampler.world_size, device), device=device,
        rank=rank, world_size=sampler.world_size,
        options=SessionOptions(sampler.seed, log_every_steps, max_bad_steps),
        lr=lambda: optimizer.param_groups[0]["lr"],
        poisoned=injection.poisoned if injection else (lambda step: False),
        fetched=loader.take_fetched)
    params = [p for p in inner.parameters() if p.requires_grad]
    loop = FaultTolerantLoop(session, params, closing)
    loader.before_hand_out = loop._begin_step  # the next step's first batch: its boundary
    return loop


def _metrics(cfg: MetricsConfig) -> tuple[RankMetrics, list[Any]]:
    """This rank's series, served on ``port + local_rank`` when no elastic-runner agent serves
    the node's (plain torchrun)."""
    from .worker import worker_metrics

    metrics, server = worker_metrics(cfg)
    return metrics, [server] if server is not None else []


def _faults(rank: int) -> FaultInjection | None:
    """Fault drills through ``ELASTIC_RUNNER_FAULTS`` (a YAML list of fault specs)."""
    text = os.environ.get("ELASTIC_RUNNER_FAULTS")
    if not text:
        return None
    specs = [FaultSpec(**spec) for spec in yaml.safe_load(text)]
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    return FaultInjection(FaultInjector(FaultConfig(inject=specs), rank, restart))
