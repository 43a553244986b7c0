"""Reporting as callbacks on step, evaluation, checkpoint and phase events.

A :class:`Callback` overrides the events it cares about; :class:`Callbacks` dispatches to a list
of them. A disabled feature is simply not in the list (the empty list is the null object), so no
call site checks for ``None``. The built-in ones: Prometheus metrics (:class:`MetricsReporter`),
the step log line (:class:`StepLog`), TensorBoard, a tqdm progress bar, the sample audit trace,
the hang watchdog's heartbeat and fault injection (``observe/reporting.py``).

Event order per optimizer step: ``on_step_begin`` (before its data is fetched), then
``on_step_end`` with a :class:`StepEnd`; a skipped update also gets ``on_skipped_step``; a
logging step's :class:`LogEvent` (mean loss over ranks) comes with the next step's end.
Long operations announce themselves with ``on_phase`` (checkpointing, evaluating, loading).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..checkpoint.events import CheckpointEvent
from ..checkpoint.storage import CheckpointInfo
from .stop import StopReason

# the phases of a rank, also the values of the metrics' ``phase`` label
PHASES = ("starting", "loading", "training", "evaluating", "checkpointing", "recovering",
          "finished")
# the operation of a replacement's "recovering" phase: it joined a running group and agrees with
# it on the state to go on from
JOINING = "joining the running group"


@dataclass(frozen=True)
class StepEnd:
    """One finished optimizer step, as every rank saw it.

    Attributes:
        step: the global step just completed (1-based count of optimizer steps).
        epoch: its epoch.
        seconds: wall time of the step (data loading included).
        data_seconds: time it waited for its micro-batches.
        samples: samples of this rank in the step (micro-batch x accumulation).
        global_samples: samples of the step over all ranks (the global batch).
        loss: this rank's loss of the step (scalar tensor on the device; reading it syncs).
        mean_loss: the loss averaged over ranks when a callback asked for it every step
            (``needs_mean_loss``); this rank's own loss when that average failed because a
            peer died (the step is committed, the recovery follows); None otherwise (logging
            steps get :class:`LogEvent`).
        lr: the learning rate after the step.
        committed: the update was applied (False: skipped for a non-finite loss/gradient).
        log_due: a logging step (``log_every_steps``).
        indices: this rank's dataset indices of the step, over its micro-batches in order
            (a list of ints, computed when called): those the data loader fetched and handed
            to the loop when ``indices_fetched``, else the sampler's plan for the step (a
            session without the loader's record).
        indices_fetched: ``indices`` are the loader's record of the fetch.
    """

    step: int
    epoch: int
    seconds: float
    data_seconds: float
    samples: int
    global_samples: int
    loss: torch.Tensor
    mean_loss: float | None
    lr: float
    committed: bool
    log_due: bool
    indices: Callable[[], list[int]]
    indices_fetched: bool = False


@dataclass(frozen=True)
class LogEvent:
    """A logging step (``log_every_steps``), reported at the end of the step after it: its
    mean loss over ranks travels in an asynchronous collective the loop does not wait for.

    Attributes:
        step, epoch: the logging step and its epoch.
        mean_loss: that step's loss averaged over ranks.
        straggler_ratio: this rank's local step time over the median of the ranks, over the
            steps since the previous logging step (None: straggler detection off).
        lr: the learning rate after that step.
        samples_per_second: the global batch over that step's wall time.
    """

    step: int
    epoch: int
    mean_loss: float
    straggler_ratio: float | None
    lr: float
    samples_per_second: float


class Callback:
    """No-op base: override what you need. ``needs_mean_loss`` asks the loop to average the
    loss over ranks every step (one small collective), not only at logging steps."""

    needs_mean_loss = False

    def on_phase(self, phase: str, what: str, long: bool) -> None:
        """Entering ``phase`` (see :data:`PHASES`) for operation ``what``; ``long``: it may
        take the long-operation budget (first step, checkpoint I/O, evaluation)."""

    def on_step_begin(self, step: int, steps_this_attempt: int) -> None:
        """Step ``step`` (1-based, global) is about to run; the attempt's ``steps_this_attempt``-th."""

    def on_step_end(self, event: StepEnd) -> None:
        """Step ``event.step`` ended on this rank, committed (applied on every rank) or
        skipped (``event.committed``); :class:`StepEnd` has its loss, samples and seconds."""

    def on_log(self, event: LogEvent) -> None:
        """A logging step's figures (every ``training.log_every_steps``), once its loss
        averaged over ranks has arrived: reported at the next step's end, on every rank."""

    def on_skipped_step(self, step: int, in_row: int, limit: int) -> None:
        """Step ``step``'s update was skipped on every rank (a non-finite loss or gradient on
        some rank); ``in_row`` skipped in a row so far, ``limit``: after this many the run
        rolls back to the last checkpoint (``training.max_bad_steps``)."""

    def on_rollback(self, step: int) -> None:
        """The run rolled back to the checkpoint of ``step`` (after a non-finite streak)."""

    def on_epoch_end(self, epoch: int, step: int, dropped: Callable[[], list[int]]) -> None:
        """Epoch ``epoch`` ended after ``step``; ``dropped`` gives its tail indices."""

    def on_eval(self, step: int, metrics: dict[str, float]) -> None:
        """An evaluation after ``step``: ``metrics`` by name (``val_loss``, the task's own),
        averaged over ranks; the same on every rank."""

    def on_early_stopping(self, metric: str, best: float | None, patience_left: int) -> None:
        """After an evaluation: the early-stopping ``metric``, its ``best`` value so far (None:
        none yet) and the evaluations without improvement still allowed."""

    def on_resumed(self, step: int) -> None:
        """Training (re)starts after ``step`` (0: from scratch); before the first step."""

    def on_finish(self, reason: StopReason | None, message: str) -> None:
        """The run stops after the current step for ``reason`` (the step or epoch limit,
        early stopping, a preemption: before its checkpoint), ``message`` saying why; on every
        rank, at the same step."""

    def on_recovered(self, step: int, joining: bool,
                     last_step: Callable[[int], tuple[int, int, list[int]]]) -> None:
        """An in-place recovery re-formed the group at ``step`` (``joining``: this process is
        the replacement); training goes on from there. ``last_step(rank)``: (epoch, world
        size, sample indices of ``rank``) of step ``step``, in the group that committed it."""

    def on_recovery_report(self, report: Any) -> None:
        """The first step after an in-place recovery is committed; ``report``:
        :class:`~elastic_runner.recovery.rejoin.RecoveryReport` with every phase's seconds."""

    def on_membership_change(self, reason: str) -> None:
        """The group changed its nodes in place (``reason``: ``preempted`` or ``lost``, see
        :mod:`elastic_runner.recovery.membership`); a new group at the new world size follows."""

    # CheckpointListener
    def checkpoint_stall(self, seconds: float) -> None:
        """A save blocked training for ``seconds`` (the synchronous write, or the copy into
        staging buffers when asynchronous)."""

    def checkpoint_committed(self, event: CheckpointEvent) -> None:
        """A checkpoint was committed (on rank 0): its paths, step, write seconds and bytes."""

    def checkpoint_loaded(self, info: CheckpointInfo) -> None:
        """A checkpoint was loaded to resume or roll back; ``info`` names it and its step."""

    def close(self) -> None:
        """The run is over on this rank: release what the callback holds (files, writers)."""


class Callbacks(Callback):
    """Dispatches every event to each callback in order; itself a :class:`Callback`."""

    def __init__(self, callbacks: Iterable[Callback] = ()) -> None:
        self.items = list(callbacks)
        self.needs_mean_loss = any(c.needs_mean_loss for c in self.items)
        # bound methods of the callbacks that override the per-step events: no call per step
        # into a no-op
        self._begin = _overriding(self.items, "on_step_begin")
        self._end = _overriding(self.items, "on_step_end")

    def append(self, callback: Callback) -> None:
        self.__init__([*self.items, callback])  # type: ignore[misc]

    def swap(self, old: Sequence[Callback], new: Sequence[Callback]) -> None:
        """Close ``old`` and dispatch to ``new`` first in their stead (a regroup renumbered
        the rank: the callbacks bound to its rank and world size are rebuilt)."""
        for c in old:
            c.close()
        self.__init__([*new, *(c for c in self.items if c not in old)])  # type: ignore[misc]

    def on_step_begin(self, step: int, steps_this_attempt: int) -> None:
        for f in self._begin:
            f(step, steps_this_attempt)

    def on_step_end(self, event: StepEnd) -> None:
        for f in self._end:
            f(event)

    def _each(self, name: str, *args: Any) -> None:
        for c in self.items:
            getattr(c, name)(*args)

    def on_phase(self, phase: str, what: str, long: bool) -> None:
        self._each("on_phase", phase, what, long)

    def on_log(self, event: LogEvent) -> None:
        self._each("on_log", event)

    def on_skipped_step(self, step: int, in_row: int, limit: int) -> None:
        self._each("on_skipped_step", step, in_row, limit)

    def on_rollback(self, step: int) -> None:
        self._each("on_rollback", step)

    def on_epoch_end(self, epoch: int, step: int, dropped: Callable[[], list[int]]) -> None:
        self._each("on_epoch_end", epoch, step, dropped)

    def on_eval(self, step: int, metrics: dict[str, float]) -> None:
        self._each("on_eval", step, metrics)

    def on_early_stopping(self, metric: str, best: float | None, patience_left: int) -> None:
        self._each("on_early_stopping", metric, best, patience_left)

    def on_resumed(self, step: int) -> None:
        self._each("on_resumed", step)

    def on_finish(self, reason: StopReason | None, message: str) -> None:
        self._each("on_finish", reason, message)

    def on_recovered(self, step: int, joining: bool,
                     last_step: Callable[[int], tuple[int, int, list[int]]]) -> None:
        self._each("on_recovered", step, joining, last_step)

    def on_recovery_report(self, report: Any) -> None:
        self._each("on_recovery_report", report)

    def on_membership_change(self, reason: str) -> None:
        self._each("on_membership_change", reason)

    def checkpoint_stall(self, seconds: float) -> None:
        self._each("checkpoint_stall", seconds)

    def checkpoint_committed(self, event: CheckpointEvent) -> None:
        self._each("checkpoint_committed", event)

    def checkpoint_loaded(self, info: CheckpointInfo) -> None:
        self._each("checkpoint_loaded", info)

    def close(self) -> None:
        for c in self.items:
            c.close()


def _overriding(items: list[Callback], name: str) -> list[Callable[..., None]]:
    return [getattr(c, name) for c in items if getattr(type(c), name) is not getattr(Callback,
                                                                                     name)]
