"""One step's report: its :class:`~.callbacks.StepEnd` event (loss, times, samples, the data
indices it trained on) and the logging step that awaits its collective (the mean loss and the
straggler times travel in one asynchronous collective, read at the next step's end)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from ..data.sampler import ElasticSampler
from ..dist import all_reduce_sums
from .callbacks import Callbacks, LogEvent, StepEnd
from .straggler import StragglerMonitor


def global_mean(loss: torch.Tensor, device: torch.device) -> float:
    """``loss`` averaged over ranks (a collective; reads the device)."""
    total, count = all_reduce_sums({"loss": (loss.item(), 1.0)}, device)["loss"]
    return total / count


class StepReport:
    """The report of one rank's steps; :meth:`flush` delivers the pending logging step."""

    def __init__(self) -> None:
        # (step, epoch, lr, samples per second) of a logging step awaiting its collective
        self.pending: tuple[int, int, float, float] | None = None

    def event(self, *, loss: torch.Tensor, step: int, epoch: int, cursor: int,
              committed: bool, fetched: list[list[int]] | None, t0: float, t_data: float,
              sampler: ElasticSampler, callbacks: Callbacks, straggler: StragglerMonitor,
              world_size: int, log_every_steps: int, lr: Callable[[], float],
              device: torch.device) -> StepEnd:
        """The step's event; its indices are ``fetched`` (the loader's record of the step's
        micro-batches) or, without one, the sampler's plan of the step at ``cursor``. ``t0``,
        ``t_data``: ``time.perf_counter()`` at the step's begin and once its data was ready.

        Raises:
            RuntimeError: the mean loss's collective failed (its event went out first, with
                this rank's own loss)."""
        log_due = step % log_every_steps == 0
        seconds = time.perf_counter() - t0
        gbs, rate = sampler.global_batch_size, lr()

        def event(mean_loss: float | None, log: bool) -> StepEnd:
            return StepEnd(
                step=step, epoch=epoch, seconds=seconds, data_seconds=t_data - t0,
                samples=gbs // world_size, global_samples=gbs, loss=loss,
                mean_loss=mean_loss, lr=rate, committed=committed, log_due=log,
                indices=lambda: [i for mb in (sampler.step_indices(cursor, epoch)
                                              if fetched is None else fetched) for i in mb],
                indices_fetched=fetched is not None)

        try:
            mean_loss = global_mean(loss, device) if callbacks.needs_mean_loss else None
        except RuntimeError:
            # the step is committed (applied and counted) when its loss collective fails (a
            # peer died after the gradient all-reduce): its entry goes out with this rank's
            # own loss before the recovery, which then repairs only the dead ranks' entries
            callbacks.on_step_end(event(float(loss.item()), False))
            raise
        if log_due:  # one asynchronous collective carries the loss and the straggler times
            straggler.start(loss)
            self.pending = (step, epoch, rate, gbs / max(seconds, 1e-9))
        return event(mean_loss, log_due)

    def flush(self, callbacks: Callbacks, straggler: StragglerMonitor) -> None:
        """Report the pending logging step (a collective's completion: all ranks call it at
        the same point)."""
        if self.pending is None:
            return
        (step, epoch, lr, rate), self.pending = self.pending, None
        mean_loss, ratio = straggler.result()
        callbacks.on_log(LogEvent(step, epoch, mean_loss, ratio, lr, rate))
