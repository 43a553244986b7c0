"""Straggler detection: each rank's local step time relative to the other ranks'.

With DDP every rank waits for the slowest one inside the gradient all-reduce, so the wall time
of a step is the same on all ranks and cannot name the straggler. What differs is the rank-local
part of the step: waiting for data, the forward passes and the backward passes of the
accumulation micro-batches, up to the start of the last backward (whose all-reduce
synchronises the ranks). The loop measures that per step; at the logging cadence the ranks
exchange their mean over the window together with their loss (one ``all_gather`` of two floats
per rank, which also yields the logged mean loss, so the signal costs no extra collective) and
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
        self.hosts = [socket.gethostname()] * world_size
        if threshold and dist.is_initialized() and world_size > 1:
            dist.all_gather_object(self.hosts, socket.gethostname())

    def add(self, local_seconds: float) -> None:
        """Record the rank-local time (seconds) of one step."""
        self._sum += local_seconds
        self._n += 1

    def exchange(self, loss: float) -> tuple[float, float | None]:
        """Collective (all ranks, same step): the mean of ``loss`` over ranks, and this rank's
        step-time ratio to the median over the window since the last call (None when the
        threshold is 0 or no step was recorded)."""
        mean, steps = (self._sum / self._n if self._n else 0.0), self._n
        self._sum, self._n = 0.0, 0
        if not (dist.is_initialized() and self.world_size > 1):
            return loss, (1.0 if self.threshold and steps else None)
        mine = torch.tensor([loss, mean], dtype=torch.float64, device=self.device)
        parts = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(parts, mine)
        mean_loss = sum(float(p[0]) for p in parts) / self.world_size
        if not self.threshold or not steps:
            return mean_loss, None
        times = [float(p[1]) for p in parts]
        median = statistics.median_low(times)
        ratios = [t / median if median > 0 else 1.0 for t in times]
        if self.rank == 0:
            for r, ratio in enumerate(ratios):
                if ratio > self.threshold:
                    log.warning("straggler: rank %d on %s: local step time %.4f s is %.1fx the "
                                "median %.4f s over the last %d steps", r, self.hosts[r],
                                times[r], ratio, median, steps)
        return mean_loss, ratios[self.rank]
