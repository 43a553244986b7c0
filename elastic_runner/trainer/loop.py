"""The built-in trainer: the loop, evaluation and its policy, on the runner's components.

One optimizer step consumes one global batch (world_size x micro_batch_size x grad_accum_steps
samples) from the :class:`~elastic_runner.data.sampler.ElasticSampler`; the
:class:`~elastic_runner.trainer.engine.StepEngine` runs it, the
:class:`~elastic_runner.train.session.TrainingSession` keeps the cursor, the vote, the guards and the
reporting, the :class:`~elastic_runner.checkpoint.manager.CheckpointManager` the checkpoints. Every
cross-rank decision is taken at a step boundary by all ranks together, so all ranks leave the
loop after the same step. ``trainer/build.py`` assembles a trainer from a config.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Subset

from ..checkpoint.layout import is_sharded
from ..checkpoint.manager import CheckpointManager
from ..config import Config
from ..config_base import ConfigError
from ..data.loader import ElasticDataLoader
from ..data.sampler import ElasticSampler, shard_indices
from ..dist import DistInfo, all_reduce_sums, max_over_ranks, release_groups_of
from ..parallel.base import Parallelism, SingleProcess
from ..preempt import PreemptionFlag
from ..recovery.inplace import NoRecovery, StepRedo
from ..recovery.recoverable import RecoveryProfile
from ..recovery.runtime import RecoveryService, RecoveryTail
from ..tasks.base import TaskBundle, metric_sums
from ..train.faults import planted_metric
from ..train.session import RollbackRequested, TrainingFailed, TrainingSession
from ..train.state import TrainState
from ..train.stop import StopPolicy, StopReason
from .engine import StepEngine, precision_dtype
from .results import fmt_figures, report_results

__all__ = ["Trainer", "TrainingFailed", "lr_factor", "precision_dtype"]

# the step log keeps its name from before the trainer left train/: the benches, the docs' logs
# and users' log filters read it (observe/reporting.py and build.py log to it too)
log = logging.getLogger("elastic_runner.train.loop")


def lr_factor(step: int, warmup_steps: int, total_steps: int, min_ratio: float,
              cosine: bool = True) -> float:
    """Multiplier of the peak LR before optimizer step ``step`` (0-based): linear warm-up over
    ``warmup_steps``, then cosine decay to ``min_ratio`` at ``total_steps`` (SGDR without
    restarts, Loshchilov & Hutter 2017)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if not cosine:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass
class Trainer:
    """Everything one rank needs to train; built by
    :func:`elastic_runner.trainer.build.build_trainer`. In-place recovery sees it as a
    :class:`~elastic_runner.recovery.recoverable.Recoverable`."""

    cfg: Config
    info: DistInfo
    bundle: TaskBundle
    model: nn.Module  # unwrapped module (what checkpoints hold)
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    loader: ElasticDataLoader
    engine: StepEngine
    session: TrainingSession
    total_steps: int
    preempt: PreemptionFlag
    # what in-place recovery may do (recovery.recoverable): the fingerprint is the task's build
    # (tasks.base.task_fingerprint); nodes join and leave in place (worker.regroup rebuilds
    # the trainer)
    profile: RecoveryProfile
    results: dict[str, Any] = field(default_factory=dict)
    # the process's recovery tail (recovery/runtime.py): it outlives a regroup's new trainer
    tail: RecoveryTail = field(default_factory=lambda: RecoveryTail(NoRecovery()))
    # a new DDP (and vote) on the current group; True: the ranks' models already agree
    rewrap: Callable[[bool], None] = lambda in_sync: None
    parallelism: Parallelism = field(default_factory=SingleProcess)
    after_done: int = 0  # the last step whose evaluation / checkpoint work is done
    _best_pending: bool = False

    @property
    def recovery(self) -> RecoveryService:
        """This process's recovery (the tail's)."""
        return self.tail.recovery

    @property
    def state(self) -> TrainState:
        return self.session.state

    @property
    def stop(self) -> StopPolicy:
        return self.session.stop

    @property
    def sampler(self) -> ElasticSampler:
        return self.loader.elastic_sampler

    @property
    def checkpoints(self) -> CheckpointManager:
        return self.session.checkpoints

    def group_formed(self, joining: list[int]) -> None:
        """A replacement's model is wrapped with the group's in ``rewrap``: nothing here."""

    def attach(self, tail: RecoveryTail) -> None:
        """Recover through the process's ``tail`` (in place, or not at all); a preemption of
        some nodes then lets them leave while the others go on."""
        self.tail = tail
        recovery = tail.recovery
        self.session.leave = lambda: recovery.leave(self)
        recovery.bind(self)

    def close(self) -> None:
        """Commit the in-flight checkpoint and stop the reporting threads (idempotent); a
        sharded model's process groups are left to ``destroy_process_group`` to free
        (:func:`~elastic_runner.dist.release_groups_of`)."""
        self.session.close()
        release_groups_of(self.model)

    def resume(self) -> bool:
        """Load the newest valid checkpoint (chosen by rank 0, loaded by every rank)."""
        return self.session.resume()

    # ------------------------------------------------------------ the loop

    def fit(self, joined: bool = False) -> dict[str, Any]:
        """Train until a stop; ``joined``: this process replaced a failed worker
        (``recovery/rejoin.py`` has opened the reporting at the group's step)."""
        if self.stop.reason is StopReason.FAILED:
            raise TrainingFailed(self.stop.message)
        if self.stop.stopped:
            log.info("training already finished at step %d (%s); nothing to do",
                     self.state.step, self.stop.message)
            return self.results
        if not joined:
            self.session.start()
            self.after_done = self.state.step
        try:
            while not self.stop.stopped:
                try:
                    self._run_epoch()
                except RollbackRequested:
                    self.session.rollback()
                except StepRedo:  # a membership boundary that changed nothing
                    self.session.abandon_step()
                except RuntimeError as e:  # a collective failed: did a peer die?
                    self._recover(e)
        finally:
            self.session.close()  # the last checkpoint is committed before we go on
        report_results(self)
        return self.results

    def _recover(self, error: RuntimeError) -> None:
        """In-place recovery (``recovery/inplace.py``), or re-raise ``error`` when it is the
        run's own failure, no peer died or recovery is off (torchrun then restarts every
        worker)."""
        epoch = self.sampler.epoch
        self.tail.recover(error, self, self._discard)
        self._ended_by_peer(epoch)

    def _discard(self) -> None:
        """The step in flight is applied by no rank: its partial gradients go too."""
        self.session.abandon_step()
        self.optimizer.zero_grad(set_to_none=True)

    def _ended_by_peer(self, epoch: int) -> None:
        """The state a peer sent has this rank past the end of ``epoch``, which it had not
        reached itself (that peer finished the epoch's evaluation, whose collective failed
        here): record the epoch's end as :meth:`_end_epoch` would have (its dropped tail, by
        the geometry the epoch ended with)."""
        s = self.sampler
        if s.epoch <= epoch or s.cursor != 0:
            return
        end = s.previous_epoch_end()
        self.session.callbacks.on_epoch_end(
            epoch, self.state.step, lambda: s.permutation(epoch)[end:].tolist())

    def _run_epoch(self) -> None:
        session = self.session
        # a recovery interrupted the last step's evaluation or checkpoint: redo it
        if self.after_done < self.state.step and self._after_step(
                end_of_epoch=self.sampler.steps_left_in_epoch() == 0):
            return
        for micro_batches in self._steps():  # the cursor moves only on finished steps
            loss = self.engine.step(micro_batches, session)  # no host sync but the vote
            session.end_step(loss)  # counters, reporting, guards, preemption
            if self.tail.pending:  # the first step after a recovery: report it
                self.tail.committed(self.state.step, self.info.rank, session.callbacks)
            if self._after_step(end_of_epoch=self.sampler.steps_left_in_epoch() == 0):
                return
            self.recovery.regroup_due(self)  # shrunk: back to full size once it can
        self._end_epoch()

    def _steps(self) -> Any:
        """The epoch's remaining steps, each a list of micro-batches, fetched after
        ``begin_step`` so the data time is part of the step."""
        batches = iter(self.loader)
        while self.sampler.steps_left_in_epoch() > 0:
            self.session.begin_step()
            micro_batches = [next(batches) for _ in range(self.sampler.grad_accum_steps)]
            self.session.data_ready()
            yield micro_batches

    def _after_step(self, end_of_epoch: bool) -> bool:
        """Evaluation, early stopping, max_steps and checkpoint cadence after one step; returns
        True when training is over (its final checkpoint is then written)."""
        every_eval = self.cfg.eval.every_steps
        eval_due = bool(every_eval and self.state.step % every_eval == 0) or (not every_eval
                                                                              and end_of_epoch)
        if eval_due or end_of_epoch or self._boundary():
            self.session.settle()  # the lagged vote's pending verdict, on every rank alike
        if eval_due:
            self._evaluate_and_decide()
        if self.session.check_limits():
            self.save()
            self.after_done = self.state.step
            return True
        epoch_save = end_of_epoch and self.cfg.checkpoint.at_epoch_end  # _end_epoch saves
        due = (not epoch_save and not self.state.bad_in_row
               and self.checkpoints.due(self.state.step)
               and not self.session.consensus.vetoed_pending())  # rank 0's clock: look only
        if due or (self._best_pending and not epoch_save):
            self.save(step_checkpoint=due)
        # sharded: this step's state in a peer's memory too (not at an epoch's last step: the
        # epoch's end, with its trace record, would run twice after a roll-back to it)
        if not (self.state.bad_in_row or end_of_epoch):
            self.recovery.keep_copy(self)
        self.after_done = self.state.step
        return False

    def _boundary(self) -> bool:
        """Whether every rank has after-step work at this step (besides evaluation and the
        epoch's end): a pending best checkpoint, a checkpoint by steps, a step or epoch limit."""
        step = self.state.step
        return (self._best_pending or self.checkpoints.due_by_steps(step)
                or (self.recovery.copy_due(step) and self.sampler.steps_left_in_epoch() > 0)
                or self.stop.limit_reached(step, self.sampler.epoch) is not None)

    def _end_epoch(self) -> None:
        epoch, cursor, sampler = self.sampler.epoch, self.sampler.cursor, self.sampler
        self.session.callbacks.on_epoch_end(
            epoch, self.state.step, lambda: sampler.permutation(epoch)[cursor:].tolist())
        self.sampler.set_epoch(epoch + 1)
        if self.session.check_limits() or (self.cfg.checkpoint.at_epoch_end
                                           and not self.state.bad_in_row):
            self.save()

    def save(self, step_checkpoint: bool = True) -> None:
        """Checkpoint the current step (all ranks; rank 0 writes): ``step-N`` when
        ``step_checkpoint``, ``best-step-N`` when the last evaluation improved."""
        best, self._best_pending = self._best_pending, False
        self.session.callbacks.on_phase("checkpointing", "checkpoint", True)
        self.checkpoints.save(self.state.step, best=best, step_checkpoint=step_checkpoint)

    # ------------------------------------------------------------ evaluation

    def evaluate(self, split: str, max_batches: int | None = None) -> dict[str, float]:
        """Sharded evaluation; sums and counts are all-reduced, so the result equals a
        single-process evaluation of the whole split (up to float64 summation order)."""
        dataset = getattr(self.bundle, split)
        shard = Subset(dataset, shard_indices(len(dataset), self.info.rank, self.info.world_size))
        loader = DataLoader(shard, batch_size=self.cfg.batch.micro_batch_size,
                            collate_fn=self.bundle.collate_fn)
        pad_to = None
        if is_sharded(self.model):  # every rank must join every forward's all-gathers
            pad_to = self._batches_everywhere(len(shard), max_batches)
        sums = metric_sums(self.model, loader, self.bundle.metrics_fn, self.info.device,
                           precision_dtype(self.cfg.training.precision), max_batches,
                           self.bundle.loss_fn, pad_to,
                           lambda: self.bundle.collate_fn([dataset[0]]) if self.bundle.collate_fn
                           else torch.utils.data.default_collate([dataset[0]]))
        total = all_reduce_sums(sums, self.info.device)
        prefix = "val" if split == "val" else split
        return {f"{prefix}_{k}": s / c if c else float("nan") for k, (s, c) in total.items()}

    def _batches_everywhere(self, shard_size: int, max_batches: int | None) -> int:
        """The most evaluation batches any rank has (capped at ``max_batches``)."""
        mb = self.cfg.batch.micro_batch_size
        n = -(-shard_size // mb)
        n = min(n, max_batches) if max_batches is not None else n
        return max_over_ranks(n, self.info.device)

    def _evaluate_and_decide(self) -> None:
        """Validate, let rank 0 decide early stopping; marks a pending best checkpoint."""
        self.session.callbacks.on_phase("evaluating", "evaluation", True)
        metrics = self.evaluate("val", self.cfg.eval.max_batches)
        self.results.update(metrics, eval_step=self.state.step)
        es, early = self.cfg.early_stopping, self.stop.early_stopping
        planted = planted_metric(self.cfg.faults, self.state.evals)
        self.state.evals += 1
        value = planted if planted is not None else metrics.get(es.metric)
        if value is None:
            raise ConfigError(f"early_stopping.metric: {es.metric!r} is not reported by the "
                              f"task; available: {', '.join(sorted(metrics))}")
        decision, message = self.stop.after_eval(value, self.state.step, self.info.rank)
        best = "none yet" if early.best is None else f"{early.best:.6g} at step {early.best_step}"
        log.info("eval at step %d: %s | %s %s%s: best %s%s", self.state.step,
                 fmt_figures(metrics), "early stopping on" if es.enabled else "tracking", es.metric,
                 f" (planted {value:.6g})" if planted is not None else "", best,
                 f", patience left {early.patience_left}" if es.enabled else "")
        self.session.callbacks.on_eval(self.state.step, metrics)
        self.session.callbacks.on_early_stopping(es.metric, early.best, early.patience_left)
        self._best_pending = decision.improved
        if decision.stop:
            self.session.finish(StopReason.EARLY_STOPPING, message)
