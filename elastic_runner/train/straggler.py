"""Straggler detection: each rank's local step time relative to the other ranks'.

With DDP every rank waits for the slowest one inside the gradient all-reduce, so the wall time
of a step is the same on all ranks and cannot name the straggler. What differs is the rank-local
part of the step: waiting for data, the forward passes and the backward passes of the
accumulation micro-batches, up to the start of the last backward (whose all-reduce
synchronises the ranks). The loop measures that per step; at the logging cadence the ranks
exchange their mean over the window together with their loss (one ``all_gather`` of two floats
per rank, which also yields the logged mean loss, so the signal costs no extra collective;
asynchronous, read one step later) and
each rank's ratio to the lower median (so that with two ranks the slow one is compared with the fast one)
becomes the ``elastic_runner_straggler_ratio`` gauge. Rank 0 names the ranks above
``metrics.straggler_threshold`` in the log.

On CUDA the host-side times miss kernels still running on the device; they catch slow data
loading and CPU contention, which are the usual causes.
"""

from __future__ import annotations

import logging
import socket
import statistics

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


class StragglerMonitor:
    """Collects one rank's local step times and compares them across ranks.

    Args:
        threshold: ratio to the median above which rank 0 logs a rank as a straggler; 0: no
            ratio and no log (:meth:`exchange` still averages the loss).
        rank, world_size: this rank and the process group's size.
        device: where the exchanged tensor lives (the process group's device).
    """

    def __init__(self, threshold: float, rank: int, world_size: int,
                 device: torch.device) -> None:
        self.threshold, self.rank, self.world_size, self.device = (threshold, rank, world_size,
                                                                   device)
        self._sum, self._n = 0.0, 0
        self._steps, self._work, self._parts = 0, None, []
        self.hosts = [socket.gethostname()] * world_size
        if threshold and dist.is_initialized() and world_size > 1:
            dist.all_gather_object(self.hosts, socket.gethostname())

    def reset(self) -> None:
        """Drop an exchange in flight (its group is gone after a peer died)."""
        self._work, self._parts = None, []

    def add(self, local_seconds: float) -> None:
        """Record the rank-local time (seconds) of one step."""
        self._sum += local_seconds
        self._n += 1

    def start(self, loss: torch.Tensor) -> None:
        """Collective (all ranks, same step), asynchronous: share ``loss`` (a scalar tensor)
        and the mean local step time of the window since the last call; :meth:`result` reads
        it. Launched at a logging step and read a step later, it costs the loop no wait."""
        mean, self._steps = (self._sum / self._n if self._n else 0.0), self._n
        self._sum, self._n = 0.0, 0
        mine = torch.stack([loss.detach().reshape(()).to(torch.float64),
                            torch.full((), mean, dtype=torch.float64, device=loss.device)])
        if not (dist.is_initialized() and self.world_size > 1):
            self._parts, self._work = [mine], None
            return
        self._parts = [torch.empty_like(mine) for _ in range(self.world_size)]
        self._work = dist.all_gather(self._parts, mine, async_op=True)

    def result(self) -> tuple[float, float | None]:
        """The mean loss over ranks, and this rank's step-time ratio to the median over the
        window (None when the threshold is 0 or no step was recorded) of the last
        :meth:`start`."""
        if self._work is not None:
            self._work.wait()
        values = torch.stack(self._parts).tolist()
        mean_loss = sum(v[0] for v in values) / len(values)
        if not self.threshold or not self._steps:
            return mean_loss, None
        times = [v[1] for v in values]
        median = statistics.median_low(times)
        ratios = [t / median if median > 0 else 1.0 for t in times]
        if self.rank == 0:
            for r, ratio in enumerate(ratios):
                if ratio > self.threshold:
                    log.warning("straggler: rank %d on %s: local step time %.4f s is %.1fx the "
                                "median %.4f s over the last %d steps", r, self.hosts[r],
                                times[r], ratio, median, self._steps)
        return mean_loss, ratios[self.rank] if len(values) > 1 else 1.0

    def exchange(self, loss: float) -> tuple[float, float | None]:
        """:meth:`start` and :meth:`result` at once (blocking)."""
        self.start(torch.tensor(loss, dtype=torch.float64, device=self.device))
        return self.result()
