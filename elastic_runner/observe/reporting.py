"""The built-in callbacks: metrics, step log, TensorBoard, progress bar, sample trace, hang
watchdog heartbeat and fault injection. Each is added only when its feature is on."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

from ..checkpoint.events import CheckpointEvent
from ..checkpoint.storage import CheckpointInfo
from ..data import audit
from ..dist import barrier
from ..train.callbacks import JOINING, Callback, LogEvent, StepEnd
from ..train.faults import FaultInjector
from ..train.stop import StopReason
from .metrics import RankMetrics
from .watchdog import HangWatchdog

# the step line keeps the trainer's logger name: operators and bench/ read it
step_log = logging.getLogger("elastic_runner.train.loop")


class Budgets:
    """Seconds a step or a long operation may take (watchdog) and heartbeat silence allowed
    (metrics); ``step`` None: no step limit."""

    def __init__(self, step: float | None, long: float, heartbeat: float | None = None) -> None:
        self.step, self.long = step, long
        self.heartbeat = heartbeat or step or 300.0

    def health(self, phase: str, long: bool) -> float | None:
        """Heartbeat silence allowed in ``phase``: none while loading a checkpoint."""
        if phase in ("loading", "finished", "starting"):
            return None
        return self.long if long else self.heartbeat


class MetricsReporter(Callback):
    """Feeds :class:`RankMetrics` (the rank's Prometheus series)."""

    def __init__(self, metrics: RankMetrics, budgets: Budgets, is_main: bool) -> None:
        self.metrics, self.budgets, self.is_main = metrics, budgets, is_main
        self._eval: dict[str, float] = {}

    def on_phase(self, phase: str, what: str, long: bool) -> None:
        self.metrics.phase(phase, self.budgets.health(phase, long))

    def on_step_begin(self, step: int, steps_this_attempt: int) -> None:
        self.metrics.phase("training", self.budgets.health("training", steps_this_attempt == 1))

    def on_step_end(self, e: StepEnd) -> None:
        self.metrics.step_done(e.step, e.epoch, e.seconds, e.data_seconds, e.samples, None,
                               e.lr)

    def on_log(self, e: LogEvent) -> None:
        self.metrics.window(e.straggler_ratio, e.mean_loss)

    def on_skipped_step(self, step: int, in_row: int, limit: int) -> None:
        self.metrics.skipped_step()

    def on_rollback(self, step: int) -> None:
        self.metrics.rolled_back()

    def on_recovery_report(self, report: Any) -> None:
        self.metrics.recovered(report.phases, report.redone)

    def on_membership_change(self, reason: str) -> None:
        self.metrics.membership_changed(reason)

    def on_eval(self, step: int, metrics: dict[str, float]) -> None:
        self._eval = metrics

    def on_early_stopping(self, metric: str, best: float | None, patience_left: int) -> None:
        if self.is_main:
            self.metrics.evaluated(self._eval, metric, best, patience_left)

    def on_finish(self, reason: StopReason | None, message: str) -> None:
        if reason is not None:
            self.metrics.finished(reason)
        self.metrics.phase("finished", None)

    def checkpoint_stall(self, seconds: float) -> None:
        self.metrics.checkpoint_stall(seconds)

    def checkpoint_committed(self, event: CheckpointEvent) -> None:
        self.metrics.checkpoint_committed(event.seconds, event.size_bytes)

    def checkpoint_loaded(self, info: CheckpointInfo) -> None:
        self.metrics.checkpoint_loaded(info.time, info.size_bytes)


class StepLog(Callback):
    """``epoch E step N/T loss L lr X S samples/s`` at each logging step (``step N`` when the
    total ``T`` is unknown, 0)."""

    def __init__(self, total_steps: int) -> None:
        self.total = f"/{total_steps}" if total_steps else ""

    def on_log(self, e: LogEvent) -> None:
        step_log.info("epoch %d step %d%s loss %.4f lr %.3e %.0f samples/s", e.epoch, e.step,
                      self.total, e.mean_loss, e.lr, e.samples_per_second)


class TensorBoardScalars(Callback):
    """Rank 0's scalars (``train/loss``, ``train/lr`` at logging steps, every evaluation)."""

    def __init__(self, log_dir: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir)

    def on_log(self, e: LogEvent) -> None:
        self.writer.add_scalar("train/loss", e.mean_loss, e.step)
        self.writer.add_scalar("train/lr", e.lr, e.step)

    def on_eval(self, step: int, metrics: dict[str, float]) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, step)

    def close(self) -> None:
        self.writer.close()  # flushed here: the worker may leave without interpreter teardown


class ProgressBar(Callback):
    """A tqdm bar on rank 0 when stderr is a terminal."""

    def __init__(self, total_steps: int) -> None:
        self.total_steps = total_steps
        self.bar: Any = None

    @staticmethod
    def wanted(is_main: bool, enabled: bool) -> bool:
        return is_main and enabled and sys.stderr.isatty()

    def on_resumed(self, step: int) -> None:
        from tqdm import tqdm

        self.close()
        self.bar = tqdm(total=self.total_steps, initial=step, unit="step", dynamic_ncols=True)

    def on_recovered(self, step: int, joining: bool, last_step: Any) -> None:
        if joining or self.bar is None:  # a replacement, or a trainer rebuilt in place
            self.on_resumed(step)

    def on_step_end(self, e: StepEnd) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def on_log(self, e: LogEvent) -> None:
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{e.mean_loss:.4f}", lr=f"{e.lr:.2e}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


LastStep = Callable[[int], tuple[int, int, list[int]]]  # rank -> (epoch, world size, indices)


def _no_step(rank: int) -> tuple[int, int, list[int]]:
    """No step known (epoch 0, world size 0, no indices): the trace repair does nothing."""
    return 0, 0, []


class SampleTraceRecorder(Callback):
    """The sample audit trace (``data/audit.py``): every step's indices on every rank (those its
    data loader fetched, :attr:`StepEnd.indices`), rewound to the resumed step on each
    (re)start, rollback and in-place recovery.

    ``last_step(rank)``: (epoch, world size, indices of ``rank``) of the step the sampler's
    cursor reached, as the group that committed it split it (``ElasticSampler.last_step``);
    rank 0 uses it to write the entries of that step that ranks which died after committing it
    never wrote, marked ``repaired`` (the default knows of no step: nothing is repaired)."""

    needs_mean_loss = True

    def __init__(self, directory: str, rank: int, world_size: int, num_samples: int,
                 last_step: LastStep = _no_step) -> None:
        self.directory, self.rank, self.world_size = directory, rank, world_size
        self.num_samples, self.last_step = num_samples, last_step
        self.trace: audit.SampleTrace | None = None

    def on_resumed(self, step: int) -> None:
        """Rank 0 rewinds the trace to ``step`` before any rank appends, then repairs it."""
        self._reopen(step, self.last_step)

    on_rollback = on_resumed

    def on_recovered(self, step: int, joining: bool,
                     last_step: LastStep) -> None:
        """In-place recovery at ``step``: as :meth:`on_resumed`, with the recovered trainer's
        sampler."""
        self._reopen(step, last_step)

    def _reopen(self, step: int, last_step: LastStep
                ) -> None:
        self.close()
        if self.rank == 0:
            dropped = audit.rewind(self.directory, step)
            if dropped:
                step_log.info("sample trace: dropped %d entries of steps after %d (lost work)",
                              dropped, step)
        barrier()
        self.trace = audit.SampleTrace(self.directory, self.rank)
        if self.rank == 0 and step > 0:
            self._repair(step, last_step)

    def _repair(self, step: int, last_step: LastStep
                ) -> None:
        """Write every entry of ``step`` missing for a rank of the group that committed it (that
        rank died after the step's gradient all-reduce, or in its loss collective). Every rank
        of the new attempt or group is past the barrier, and the old processes that could still
        write an entry of ``step`` are gone or stopped past it. The entry holds the sampler's
        plan of that rank's share, not a record of its fetch: it is marked ``repaired``."""
        have = audit.ranks_recorded(self.directory, step)
        for rank in range(last_step(0)[1]):
            if rank not in have:
                epoch, world_size, indices = last_step(rank)
                self.trace.record_step(epoch, step, world_size, None, indices, rank=rank,
                                       repaired=True)
                step_log.info("sample trace: wrote the entry of step %d for rank %d", step,
                              rank)

    def on_step_end(self, e: StepEnd) -> None:
        self.trace.record_step(e.epoch, e.step, self.world_size, e.mean_loss, e.indices(),
                               skipped=not e.committed, planned=not e.indices_fetched)

    def on_epoch_end(self, epoch: int, step: int, dropped: Callable[[], list[int]]) -> None:
        if self.rank == 0:
            self.trace.record_epoch_end(epoch, step, self.num_samples, dropped())

    def close(self) -> None:
        if self.trace is not None:
            self.trace.close()
            self.trace = None


class WatchdogHeartbeat(Callback):
    """Arms the hang watchdog for every step (the step budget; the first step of an attempt
    gets the long one) and every long operation."""

    def __init__(self, watchdog: HangWatchdog, budgets: Budgets) -> None:
        self.watchdog, self.budgets = watchdog, budgets

    def on_phase(self, phase: str, what: str, long: bool) -> None:
        if phase == "finished":
            self.watchdog.disarm()
        else:
            self.watchdog.arm(self.budgets.long if long else self.budgets.step, what)

    def on_step_begin(self, step: int, steps_this_attempt: int) -> None:
        if steps_this_attempt == 1:
            self.watchdog.arm(self.budgets.long, f"first step {step}")
        else:
            self.watchdog.arm(self.budgets.step, f"step {step}")

    def on_finish(self, reason: StopReason | None, message: str) -> None:
        self.watchdog.disarm()

    def close(self) -> None:
        self.watchdog.close()


class FaultInjection(Callback):
    """Configured faults and the trigger file's requests (``train/faults.py``): hang and slow before
    a step, kill / raise after it; a NaN loss through :meth:`poisoned`."""

    def __init__(self, injector: FaultInjector) -> None:
        self.injector = injector
        self._attempt_steps = 0
        self._step = 0

    def on_step_begin(self, step: int, steps_this_attempt: int) -> None:
        self._attempt_steps = steps_this_attempt
        self.injector.begin_step(step, steps_this_attempt)

    def poisoned(self, step: int) -> bool:
        return self.injector.poison_loss(step, self._attempt_steps)

    def on_step_end(self, e: StepEnd) -> None:
        self._step = e.step
        self.injector.after_step(e.step, self._attempt_steps)

    def on_phase(self, phase: str, what: str, long: bool) -> None:
        if phase == "evaluating":
            self.injector.after_step(self._step, self._attempt_steps, "evaluation")
        elif phase == "recovering" and what == JOINING:
            self.injector.after_step(self._step, self._attempt_steps, "joining")

    def checkpoint_stall(self, seconds: float) -> None:
        # the snapshot is taken; an asynchronous save is now writing in the background
        self.injector.after_step(self._step, self._attempt_steps, "checkpoint")


def runner_callbacks(metrics: RankMetrics, budgets: Budgets, rank: int, world_size: int,
                     num_samples: int, total_steps: int, trace_dir: str | None,
                     dump_grace_seconds: float = 2.0,
                     last_step: LastStep = _no_step) -> list[Callback]:
    """The callbacks every loop of the runner has, in the order they see each event: the
    watchdog heartbeat, metrics (when enabled), the step log and the sample trace (when
    ``trace_dir``; ``last_step``: the sampler's, see :class:`SampleTraceRecorder`); the
    built-in trainer adds TensorBoard, the progress bar and faults."""
    out: list[Callback] = [WatchdogHeartbeat(HangWatchdog(rank, dump_grace_seconds), budgets)]
    if metrics.enabled:
        out.append(MetricsReporter(metrics, budgets, rank == 0))
    out.append(StepLog(total_steps))
    if trace_dir:
        out.append(SampleTraceRecorder(trace_dir, rank, world_size, num_samples, last_step))
    return out
