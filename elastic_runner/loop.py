"""The worker's training loop: DDP, gradient accumulation, evaluation, checkpoints, early stop.

One optimizer step consumes one global batch (world_size x micro_batch_size x grad_accum_steps
samples) from the :class:`~elastic_runner.sampler.ElasticSampler`. Gradients are all-reduced only
on the last micro-batch (``no_sync()`` on the others). Every cross-rank decision is taken at a
step boundary by all ranks together, so all ranks leave the loop after the same step.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import fsspec
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset

from . import audit
from . import checkpoint as ckpt
from .async_save import AsyncCheckpointer
from .config import Config, ConfigError, fingerprint, task_builder
from .dist import (
    DistInfo,
    all_reduce_sums,
    assert_same_across_ranks,
    barrier,
    broadcast_object,
)
from .early_stop import EarlyStopping
from .faults import FaultInjector, perturb_replica, planted_metric
from .metrics import RankMetrics
from .preempt import Preempted, PreemptionFlag
from .sampler import ElasticSampler, shard_indices
from .state import RNGState, TrainState, seed_everything, seed_step, step_seed
from .straggler import StragglerMonitor
from .tasks.base import TaskBundle, metric_sums
from .vote import GradientVote
from .watchdog import HangWatchdog

log = logging.getLogger(__name__)


def build_optimizer(cfg: Config, model: nn.Module) -> torch.optim.Optimizer:
    o = cfg.optimizer
    if o.name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=o.lr, momentum=o.momentum,
                               weight_decay=o.weight_decay)
    return torch.optim.AdamW(model.parameters(), lr=o.lr, betas=o.betas,
                             weight_decay=o.weight_decay)


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


class TrainingFailed(RuntimeError):
    """Training cannot continue (e.g. non-finite steps recurred after a rollback)."""


class _Rollback(Exception):  # noqa: N818 - control flow inside the loop
    pass


@dataclass(frozen=True)
class StepVote:
    bad: bool  # some rank saw a non-finite loss or gradient: the update was skipped
    preempt: bool  # some rank received SIGTERM/SIGINT: checkpoint and stop after this step


def precision_dtype(precision: str) -> torch.dtype | None:
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)


@dataclass
class Trainer:
    """Everything one rank needs to train; built by :func:`build_trainer`."""

    cfg: Config
    info: DistInfo
    bundle: TaskBundle
    model: nn.Module  # unwrapped module (what checkpoints hold)
    net: nn.Module  # what the step calls: DDP(model) in a process group, else model
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    sampler: ElasticSampler
    total_steps: int
    state: TrainState = field(default_factory=TrainState)
    early: EarlyStopping | None = None
    writer: Any = None  # tensorboard SummaryWriter on rank 0
    trace: audit.SampleTrace | None = None
    checkpointer: AsyncCheckpointer | None = None
    watchdog: HangWatchdog | None = None
    faults: FaultInjector | None = None
    preempt: PreemptionFlag = field(default_factory=PreemptionFlag)
    metrics: RankMetrics | None = None
    straggler: StragglerMonitor | None = None
    vote: GradientVote | None = None  # under DDP: the step's flags reduced with the gradients
    resumed_from: str | None = None
    _t_sync: float = 0.0  # perf_counter() when the step's last backward (the all-reduce) began
    _best_pending: bool = False
    _last_save_time: float = field(default_factory=time.monotonic)
    steps_this_attempt: int = 0
    results: dict[str, Any] = field(default_factory=dict)

    # ------------------------------------------------------------ state

    def stateful(self) -> dict[str, Any]:
        return {"model": self.model, "optimizer": self.optimizer, "scheduler": self.scheduler,
                "scaler": self.scaler, "train_state": self.state, "sampler": self.sampler,
                "early_stopping": self.early, "rng": RNGState()}

    def state_dict(self) -> dict[str, Any]:
        out = {k: v.state_dict() for k, v in self.stateful().items()}
        out["config"] = self.cfg.to_dict()
        return out

    def save(self, step_checkpoint: bool = True) -> None:
        """Checkpoint the current step (all ranks call this; rank 0 writes). Commits
        ``step-N`` when ``step_checkpoint`` and ``best-step-N`` when the last evaluation
        improved; asynchronously when ``checkpoint.async_save``."""
        self._arm("checkpoint", "checkpointing", long=True)
        names = [f"step-{self.state.step:08d}"] if step_checkpoint else []
        if self._best_pending and self.cfg.checkpoint.keep_best:
            names.append(f"best-step-{self.state.step:08d}")
        self._best_pending = False
        if not names or not self.info.is_main:
            return
        self._last_save_time = time.monotonic()
        meta = {"step": self.state.step, "epoch": self.sampler.epoch,
                "cursor": self.sampler.cursor, "world_size": self.info.world_size,
                "config_hash": self.cfg.fingerprint(), "finished": self.state.finished}
        directory, step = self.cfg.checkpoint.dir, self.state.step

        def write(state: dict[str, Any]) -> None:
            t0 = time.perf_counter()
            paths = ckpt.write_checkpoint(directory, names, state, meta)
            seconds = time.perf_counter() - t0
            self.metrics.checkpoint_committed(seconds, ckpt.inspect(paths[0]).size_bytes)
            ckpt.prune(directory, self.cfg.checkpoint.keep_last, protect=self.resumed_from)
            log.info("committed checkpoint %s (written in %.2f s)", ", ".join(paths), seconds)

        if self.checkpointer is not None:
            stall = self.checkpointer.save(self.state_dict(), write)
        else:
            t0 = time.perf_counter()
            write(self.state_dict())
            stall = time.perf_counter() - t0
        self.metrics.checkpoint_stall(stall)
        log.info("checkpoint of step %d: training stalled %.3f s (%s)", step, stall,
                 "async" if self.checkpointer is not None else "sync")

    def _reopen_if_limits_raised(self) -> None:
        """A run that ended at max_steps / max_epochs continues when the config now allows more;
        an early-stopped run stays stopped."""
        t = self.cfg.training
        if not (self.state.finished and self.state.stop_reason.startswith("max_")):
            return
        if (not t.max_steps or self.state.step < t.max_steps) and self.sampler.epoch < t.max_epochs:
            log.info("training limits raised (max_steps %s, max_epochs %d): continuing after "
                     "step %d", t.max_steps, t.max_epochs, self.state.step)
            self.state.finished, self.state.stop_reason = False, ""

    def wait_for_checkpoint(self) -> None:
        if self.checkpointer is not None:
            self.checkpointer.wait()

    def _checkpoint_due(self, end_of_epoch: bool) -> bool:
        c = self.cfg.checkpoint
        if end_of_epoch or self.state.bad_in_row:
            # the epoch-end checkpoint of this step follows; during a non-finite streak no
            # checkpoint is taken, so a rollback returns to a state without skipped updates
            return False
        by_steps = bool(c.every_steps) and self.state.step % c.every_steps == 0
        by_time = (c.every_seconds is not None and self.info.is_main
                   and time.monotonic() - self._last_save_time >= c.every_seconds)
        return by_steps or by_time

    def resume(self) -> bool:
        """Load the newest valid checkpoint (chosen by rank 0, loaded by every rank)."""
        self.metrics.phase("loading", None)
        choice = None
        if self.info.is_main:
            found = ckpt.latest_valid(self.cfg.checkpoint.dir)
            choice = found.path if found else None
            if found:
                self.metrics.checkpoint_loaded(found.time, found.size_bytes)
        choice = broadcast_object(choice)
        if choice is None:
            log.info("no checkpoint in %s: starting from scratch", self.cfg.checkpoint.dir)
            return False
        self.resumed_from = choice
        state = ckpt.load_state(choice, map_location=self.info.device)
        ckpt.check_compatible(self.model.state_dict(), state["model"], choice)
        if fingerprint(state["config"]) != self.cfg.fingerprint():
            log.warning("checkpoint %s was written with a different config; resuming anyway",
                        choice)
        old_batch = state["sampler"].get("global_batch_size", self.sampler.global_batch_size)
        for key, obj in self.stateful().items():
            obj.load_state_dict(state[key])
        perturb_replica(self.cfg.faults, self.info.rank, self.model)
        # replicas must be identical after loading, or DDP would silently average diverged models
        assert_same_across_ranks(ckpt.tensors_digest(self.model.state_dict()),
                                 f"model parameters loaded from {choice}")
        if old_batch != self.sampler.global_batch_size:
            log.warning("global batch changed from %d to %d samples (world size now %d); the "
                        "learning rate is not rescaled. Set batch.global_batch_size to keep the "
                        "global batch constant.", old_batch, self.sampler.global_batch_size,
                        self.info.world_size)
        log.info("resumed from %s: step %d, epoch %d, %d samples into the epoch", choice,
                 self.state.step, self.sampler.epoch, self.sampler.cursor)
        self._reopen_if_limits_raised()
        return True

    def _arm(self, what: str, phase: str, long: bool = False) -> None:
        """A heartbeat: arm the hang watchdog for ``what`` and enter ``phase`` in the metrics.
        Steps get the step budget; long operations (first step, checkpoint I/O, evaluation)
        the long one; a checkpoint load never counts as unhealthy."""
        w = self.cfg.watchdog
        self.watchdog.arm(w.long_op_timeout_seconds if long else w.hang_timeout_seconds, what)
        if phase == "loading":
            health = None
        elif long:
            health = w.long_op_timeout_seconds
        else:
            health = (self.cfg.metrics.heartbeat_timeout_seconds or w.hang_timeout_seconds
                      or 300.0)
        self.metrics.phase(phase, health)

    # ------------------------------------------------------------ steps

    def train_step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
                   poison: bool = False) -> tuple[torch.Tensor, StepVote]:
        """One optimizer step over this rank's micro-batches.

        Returns the mean loss (detached) and the step's vote: whether any rank saw a non-finite
        loss or gradient (then the update is skipped on all ranks) and whether any rank was
        asked to stop (SIGTERM). ``poison`` makes the loss NaN (fault injection).
        """
        seed_step(step_seed(self.cfg.seed, self.sampler.epoch, self.state.step, self.info.rank),
                  self.info.device)
        dtype = precision_dtype(self.cfg.training.precision)
        n = len(micro_batches)
        total = torch.zeros((), device=self.info.device)
        for i, (x, y) in enumerate(micro_batches):
            x, y = x.to(self.info.device, non_blocking=True), y.to(self.info.device,
                                                                  non_blocking=True)
            sync = i == n - 1 or not isinstance(self.net, DDP)
            with (contextlib.nullcontext() if sync else self.net.no_sync()), \
                 torch.autocast(self.info.device.type, dtype=dtype, enabled=dtype is not None):
                loss = self.bundle.loss_fn(self.net(x), y) / n
                if poison:
                    loss = loss * float("nan")
            total += loss.detach()
            if i == n - 1:
                self._t_sync = time.perf_counter()
                if self.vote is not None:  # the flags ride on this backward's all-reduce
                    self.vote.arm(torch.stack([(~torch.isfinite(total)).float(),
                                               total.new_tensor(float(self.preempt.requested))]))
            self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.optimizer)  # no-op without fp16
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.cfg.training.grad_clip_norm:
            norm = nn.utils.clip_grad_norm_(params, self.cfg.training.grad_clip_norm)
        else:
            norm = nn.utils.get_total_norm([p.grad for p in params])
        vote = self._vote(total, norm)
        if not vote.bad:
            self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return total, vote

    def _vote(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> StepVote:
        """The step's decision, the same on every rank: the loss flags come reduced with the
        gradients (see ``vote.py``); the norm of the all-reduced gradients is the same on all
        ranks. With fp16 the GradScaler owns gradient overflow; the guard then looks at the
        loss only."""
        if self.vote is not None:
            loss_bad, preempt = (v > 0 for v in self.vote.result().tolist())
        else:
            loss_bad, preempt = not bool(torch.isfinite(loss)), self.preempt.requested
        grads_bad = not self.scaler.is_enabled() and not bool(torch.isfinite(grad_norm))
        return StepVote(bad=loss_bad or grads_bad, preempt=preempt)

    def evaluate(self, split: str, max_batches: int | None = None) -> dict[str, float]:
        """Sharded evaluation; sums and counts are all-reduced, so the result equals a
        single-process evaluation of the whole split (up to float64 summation order)."""
        dataset = getattr(self.bundle, split)
        shard = Subset(dataset, shard_indices(len(dataset), self.info.rank, self.info.world_size))
        loader = DataLoader(shard, batch_size=self.cfg.batch.micro_batch_size)
        sums = metric_sums(self.model, loader, self.bundle.metrics_fn, self.info.device,
                           precision_dtype(self.cfg.training.precision), max_batches)
        total = all_reduce_sums(sums, self.info.device)
        prefix = "val" if split == "val" else split
        return {f"{prefix}_{k}": s / c if c else float("nan") for k, (s, c) in total.items()}

    # ------------------------------------------------------------ loop

    def fit(self) -> dict[str, Any]:
        if self.state.stop_reason.startswith("failed:"):
            raise TrainingFailed(self.state.stop_reason)
        if self.state.finished:
            log.info("training already finished at step %d (%s); nothing to do",
                     self.state.step, self.state.stop_reason)
            return self.results
        self._open_trace()
        bar = self._progress_bar()
        try:
            while not self.state.finished:
                try:
                    self._run_epoch(bar)
                except _Rollback:
                    self._rollback()
        finally:
            self.watchdog.disarm()
            self.metrics.phase("finished", None)
            if bar is not None:
                bar.close()
            if self.trace is not None:
                self.trace.close()
            if self.checkpointer is not None:
                self.checkpointer.close()  # the last checkpoint is committed before we exit
        if self.results.get("eval_step") != self.state.step:  # report the final model
            self.results.update(self.evaluate("val", self.cfg.eval.max_batches),
                                eval_step=self.state.step)
        self.results.update(self.evaluate("test"))
        self.results.update(step=self.state.step, epoch=self.sampler.epoch,
                            stop_reason=self.state.stop_reason)
        log.info("finished: %s", _fmt(self.results))
        if self.info.is_main:
            self._write_json("results.json", self.results)
        self._write_rank_summary()
        return self.results

    def _write_rank_summary(self) -> None:
        """Each rank records where it left the loop (``<checkpoint.dir>/ranks/rank-<r>.json``), so
        operators and tests can check that all ranks stopped after the same step."""
        self._write_json(f"ranks/rank-{self.info.rank}.json", {
            "rank": self.info.rank, "world_size": self.info.world_size, "step": self.state.step,
            "epoch": self.sampler.epoch, "stop_reason": self.state.stop_reason,
            "restart_count": self.info.restart_count})

    def _write_json(self, relative: str, value: dict[str, Any]) -> None:
        """Write a small JSON report next to the checkpoints (local path or fsspec URL)."""
        with fsspec.open(f"{self.cfg.checkpoint.dir.rstrip('/')}/{relative}", "w",
                         auto_mkdir=True) as f:
            f.write(json.dumps(value, indent=1))

    def _run_epoch(self, bar: Any) -> None:
        epoch = self.sampler.epoch
        loader = DataLoader(
            self.bundle.train, batch_sampler=self.sampler, num_workers=self.cfg.data.num_workers,
            pin_memory=self.cfg.data.pin_memory,
            worker_init_fn=PreemptionFlag.ignore_in_child if self.cfg.data.num_workers else None,
            generator=torch.Generator().manual_seed(
                step_seed(self.cfg.seed, epoch, self.sampler.cursor, self.info.rank)))
        batches = iter(loader)
        accum = self.sampler.grad_accum_steps
        while self.sampler.steps_left_in_epoch() > 0:
            t0 = time.perf_counter()
            cursor, step = self.sampler.cursor, self.state.step + 1
            first = self.steps_this_attempt == 0
            self._arm(f"{'first ' if first else ''}step {step}", "training", long=first)
            self.faults.hang_now(step, self.steps_this_attempt + 1)
            self.faults.slow_now(step, self.steps_this_attempt + 1)
            poison = self.faults.poison_loss(step, self.steps_this_attempt + 1)
            t_data = time.perf_counter()
            micro_batches = [next(batches) for _ in range(accum)]
            data_seconds = time.perf_counter() - t_data
            loss, vote = self.train_step(micro_batches, poison)
            self.straggler.add(self._t_sync - t0)
            self.sampler.advance()
            self.state.step += 1
            self.state.samples += self.sampler.global_batch_size
            self.steps_this_attempt += 1
            log_due = self.state.step % self.cfg.training.log_every_steps == 0
            seconds = time.perf_counter() - t0
            self.metrics.step_done(self.state.step, epoch, seconds, data_seconds,
                                   self.sampler.global_batch_size // self.info.world_size,
                                   float(loss), self.scheduler.get_last_lr()[0])
            # the mean loss over ranks costs a collective: only when logged or traced; at log
            # steps it carries the straggler exchange too
            mean_loss = None
            if log_due:
                mean_loss, ratio = self.straggler.exchange(float(loss))
                self.metrics.window(ratio)
            elif self.trace is not None:
                mean_loss = self._global_mean(loss)
            if self.trace is not None:
                indices = [i for mb in self.sampler.step_indices(cursor) for i in mb]
                self.trace.record_step(epoch, self.state.step, self.info.world_size,
                                       mean_loss, indices, skipped=vote.bad)
            self._count_bad_step(vote.bad)
            self.faults.after_step(self.state.step, self.steps_this_attempt)
            if vote.preempt:
                self._stop_for_preemption()
            self._log_step(mean_loss if log_due else None, seconds, bar)
            if self._after_step(end_of_epoch=self.sampler.steps_left_in_epoch() == 0):
                return
        if self.trace is not None and self.info.is_main:
            self.trace.record_epoch_end(epoch, self.state.step, self.sampler.num_samples,
                                        self.sampler.permutation(epoch)[self.sampler.cursor:]
                                        .tolist())
        self.sampler.set_epoch(epoch + 1)
        if epoch + 1 >= self.cfg.training.max_epochs:
            self._finish("max_epochs reached")
        if self.state.finished or not self.state.bad_in_row:
            self.save()

    def _count_bad_step(self, bad: bool) -> None:
        """NaN/Inf guard: skipped updates in a row trigger one rollback, then a failure."""
        if not bad:
            self.state.bad_in_row = 0
            return
        self.state.bad_in_row += 1
        self.state.bad_steps += 1
        self.metrics.skipped_step()
        limit = self.cfg.training.max_bad_steps
        log.warning("step %d: non-finite loss or gradient on at least one rank: update skipped "
                    "on all ranks (%d in a row, limit %d)", self.state.step,
                    self.state.bad_in_row, limit)
        if self.state.bad_in_row < limit:
            return
        if self.state.rollbacks >= 1:
            self._finish(f"failed: {limit} non-finite steps in a row at step {self.state.step}, "
                         "again after rolling back to the last checkpoint")
            self.save()
            self.wait_for_checkpoint()
            raise TrainingFailed(self.state.stop_reason)
        raise _Rollback

    def _rollback(self) -> None:
        """Reload the newest valid checkpoint on all ranks (once per run)."""
        self.wait_for_checkpoint()
        rollbacks = self.state.rollbacks + 1
        log.warning("rolling back to the last valid checkpoint after %d non-finite steps",
                    self.cfg.training.max_bad_steps)
        self.metrics.rolled_back()
        self._arm("rollback", "loading", long=True)
        if not self.resume():
            raise TrainingFailed("non-finite steps and no checkpoint to roll back to")
        self.state.rollbacks, self.state.bad_in_row = rollbacks, 0
        if self.trace is not None:  # drop the trace of the discarded steps
            self.trace.close()
            self._open_trace()

    def _stop_for_preemption(self) -> None:
        """All ranks: commit a checkpoint of exactly this step, then leave with 143."""
        log.warning("preemption: checkpointing step %d, then stopping (SIGTERM on at least one "
                    "rank)", self.state.step)
        self._arm("preemption checkpoint", "checkpointing", long=True)
        self.metrics.finished("preempted")
        self.save()
        self.wait_for_checkpoint()
        barrier()  # rank 0 has committed before any rank exits
        raise Preempted(f"preempted by signal after step {self.state.step}; checkpoint "
                        f"step-{self.state.step:08d} committed")

    def _after_step(self, end_of_epoch: bool) -> bool:
        """Evaluation, early stopping, max_steps and checkpoint cadence after one step; returns
        True when training is over (its final checkpoint is then written)."""
        step, every_eval = self.state.step, self.cfg.eval.every_steps
        eval_due = (every_eval and step % every_eval == 0) or (not every_eval and end_of_epoch)
        if eval_due:
            self._evaluate_and_decide()
        max_steps = self.cfg.training.max_steps
        if not self.state.finished and max_steps and step >= max_steps:
            self._finish("max_steps reached")
        if self.state.finished:
            self.save()
            return True
        due = self._checkpoint_due(end_of_epoch)
        if due or (self._best_pending and not end_of_epoch):
            self.save(step_checkpoint=due)
        return False

    def _evaluate_and_decide(self) -> None:
        """Validate, let rank 0 decide early stopping; marks a pending best checkpoint."""
        self._arm("evaluation", "evaluating", long=True)
        metrics = self.evaluate("val", self.cfg.eval.max_batches)
        self.results.update(metrics, eval_step=self.state.step)
        es = self.cfg.early_stopping
        planted = planted_metric(self.cfg.faults, self.state.evals)
        self.state.evals += 1
        value = planted if planted is not None else metrics.get(es.metric)
        if value is None:
            raise ConfigError(f"early_stopping.metric: {es.metric!r} is not reported by the "
                              f"task; available: {', '.join(sorted(metrics))}")
        decision = self.early.decide(value, self.state.step, self.info.rank)
        log.info("eval at step %d: %s | %s %s%s: best %.6g at step %s%s", self.state.step,
                 _fmt(metrics), "early stopping on" if es.enabled else "tracking", es.metric,
                 f" (planted {value:.6g})" if planted is not None else "", self.early.best,
                 self.early.best_step,
                 f", patience left {self.early.patience_left}" if es.enabled else "")
        self._scalars(metrics)
        if self.info.is_main:
            self.metrics.evaluated(metrics, es.metric, self.early.best, self.early.patience_left)
        self._best_pending = decision.improved
        if decision.stop:
            self._finish(f"early stopping: no improvement of {es.metric} in "
                         f"{es.patience} evaluations; best {self.early.best:.6g} "
                         f"at step {self.early.best_step}")

    def _finish(self, reason: str) -> None:
        self.state.finished, self.state.stop_reason = True, reason
        self.metrics.finished(reason)
        log.info("stopping after step %d: %s", self.state.step, reason)

    # ------------------------------------------------------------ reporting

    def _progress_bar(self) -> Any:
        if not (self.info.is_main and self.cfg.logging.progress_bar and sys.stderr.isatty()):
            return None
        from tqdm import tqdm

        return tqdm(total=self.total_steps, initial=self.state.step, unit="step",
                    dynamic_ncols=True)

    def _log_step(self, value: float | None, seconds: float, bar: Any) -> None:
        """Progress bar every step; a log line when ``value`` (the mean loss) is given."""
        if bar is not None:
            bar.update(1)
        if value is None:
            return
        lr = self.scheduler.get_last_lr()[0]
        if bar is not None:
            bar.set_postfix(loss=f"{value:.4f}", lr=f"{lr:.2e}")
        log.info("epoch %d step %d/%d loss %.4f lr %.3e %.0f samples/s", self.sampler.epoch,
                 self.state.step, self.total_steps, value, lr,
                 self.sampler.global_batch_size / max(seconds, 1e-9))
        self._scalars({"train/loss": value, "train/lr": lr})

    def _global_mean(self, loss: torch.Tensor) -> float:
        total, count = all_reduce_sums({"loss": (loss.item(), 1.0)}, self.info.device)["loss"]
        return total / count

    def _open_trace(self) -> None:
        """Rank 0 rewinds the sample trace to the resumed step before any rank appends."""
        directory = self.cfg.audit.trace_dir
        if not directory:
            return
        if self.info.is_main:
            dropped = audit.rewind(directory, self.state.step)
            if dropped:
                log.info("sample trace: dropped %d entries of steps after %d (lost work)",
                         dropped, self.state.step)
        barrier()
        self.trace = audit.SampleTrace(directory, self.info.rank)

    def _scalars(self, values: dict[str, float]) -> None:
        if self.writer is not None:
            for k, v in values.items():
                self.writer.add_scalar(k, v, self.state.step)


def _fmt(d: dict[str, Any]) -> str:
    return " ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in d.items())


def build_trainer(cfg: Config, info: DistInfo, metrics: RankMetrics | None = None) -> Trainer:
    """Build task, model, DDP wrapper, optimizer, schedule and sampler for this rank;
    ``metrics`` (default: recording only) receives the rank's series."""
    if cfg.training.precision == "fp16" and info.device.type != "cuda":
        raise ConfigError("training.precision: 'fp16' needs CUDA (GradScaler); use 'bf16' on CPU")
    seed_everything(cfg.seed)
    bundle: TaskBundle = task_builder(cfg.task)(cfg)
    model = bundle.model.to(info.device)
    net: nn.Module = model
    if info.distributed:
        d = cfg.distributed.ddp
        net = DDP(model, device_ids=[info.device] if info.device.type == "cuda" else None,
                  bucket_cap_mb=d.bucket_cap_mb, static_graph=d.static_graph,
                  find_unused_parameters=d.find_unused_parameters)
    accum = cfg.batch.accumulation_for(info.world_size)
    sampler = ElasticSampler(len(bundle.train), cfg.seed, cfg.batch.micro_batch_size, accum,
                             info.rank, info.world_size)
    total = sampler.steps_per_epoch() * cfg.training.max_epochs
    if cfg.training.max_steps:
        total = min(total, cfg.training.max_steps)
    optimizer = build_optimizer(cfg, model)
    s = cfg.schedule
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, s.warmup_steps, total, s.min_lr_ratio,
                                          cosine=s.name == "cosine"))
    scaler = torch.amp.GradScaler(info.device.type,
                                  enabled=cfg.training.precision == "fp16")
    writer = None
    if info.is_main and cfg.logging.tensorboard_dir:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(cfg.logging.tensorboard_dir)
    log.info("task %s: %d train / %d val / %d test samples; world size %d; global batch %d "
             "(%d x micro-batch %d x accumulation %d); %d steps per epoch; %d steps in total",
             cfg.task, len(bundle.train), len(bundle.val), len(bundle.test), info.world_size,
             sampler.global_batch_size, info.world_size, cfg.batch.micro_batch_size,
             accum, sampler.steps_per_epoch(), total)
    checkpointer = AsyncCheckpointer() if cfg.checkpoint.async_save and info.is_main else None
    if metrics is None:
        metrics = RankMetrics(cfg.metrics, info.rank, info.local_rank,
                              cuda=info.device.type == "cuda")
    metrics.count_tokens(bundle.tokens_per_sample)
    metrics.world(info.world_size)
    return Trainer(cfg=cfg, info=info, bundle=bundle, model=model, net=net, optimizer=optimizer,
                   scheduler=scheduler, scaler=scaler, sampler=sampler, total_steps=total,
                   early=EarlyStopping(cfg.early_stopping), writer=writer,
                   checkpointer=checkpointer,
                   watchdog=HangWatchdog(info.rank, cfg.watchdog.dump_grace_seconds),
                   faults=FaultInjector(cfg.faults, info.rank, info.restart_count),
                   metrics=metrics,
                   straggler=StragglerMonitor(cfg.metrics.straggler_threshold, info.rank,
                                              info.world_size, info.device),
                   vote=GradientVote(net) if isinstance(net, DDP) else None)
