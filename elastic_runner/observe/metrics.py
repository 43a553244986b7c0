"""Per-rank Prometheus series, written by each worker (config section ``metrics``).

Names follow the Prometheus conventions (base units, ``_seconds``, ``_bytes``, counters end in
``_total``), all prefixed ``elastic_runner_`` and labelled ``job``, ``node``, ``rank``,
``local_rank`` (never step or epoch: a label per step would be a new series per step).

Where the series go:

* under ``elastic-runner run`` the agent sets ``PROMETHEUS_MULTIPROC_DIR`` for its workers, so
  prometheus-client's multiprocess mode writes every value to memory-mapped files that the
  agent's endpoint (``health.MetricsServer``) reads: one endpoint per node that keeps answering
  while workers die and restart. Gauges of a live process use the ``livemostrecent`` mode, so the
  series of a dead worker disappear (the agent removes their files); gauges that must outlive the
  worker (last checkpoint, why training ended) use ``mostrecent``. Counters and histograms are
  summed over a rank's processes, so they keep counting across restarts.
* under plain ``torchrun`` (no elastic-runner agent) each worker serves its own endpoint on
  ``metrics.port + local_rank``.

With ``metrics.enabled: false`` nothing is recorded; every method returns at once. The families
themselves, grouped by what they measure, are declared in :mod:`.rank_series`.
"""

from __future__ import annotations

import socket
import time
from typing import Any

import psutil
import torch
from prometheus_client import CollectorRegistry

from ..protocol.counting import COUNTS as store_counts
from ..protocol.torchrun_env import TorchrunEnv
from .config import MetricsConfig
from .rank_series import (
    CheckpointSeries,
    Declare,
    HealthSeries,
    OutcomeSeries,
    RecoverySeries,
    StepSeries,
)


def job_label(cfg: MetricsConfig) -> str:
    """``metrics.job``, else the rendezvous id torchrun gives the workers, else
    ``elastic-runner``."""
    return cfg.job or TorchrunEnv.read().run_id or "elastic-runner"


def node_label(cfg: MetricsConfig) -> str:
    """``metrics.node``, else the hostname (the pod name on Kubernetes)."""
    return cfg.node or socket.gethostname()


def finish_category(stop_reason: str) -> str:
    """The bounded ``reason`` label for a free-text stop reason of ``TrainState``."""
    for prefix, category in (("max_steps", "max_steps"), ("max_epochs", "max_epochs"),
                             ("early stopping", "early_stopping"), ("failed", "failed"),
                             ("preempt", "preempted")):
        if stop_reason.startswith(prefix):
            return category
    return "failed"


PUBLISH_SECONDS = 1.0  # step counters and gauges are written at least this often
BEAT_SECONDS = 0.5  # the heartbeat gauge is written at most this often within one phase


def _pending() -> dict[str, Any]:
    return {"steps": 0, "samples": 0}


class RankMetrics:
    """The series of one rank (one worker process).

    Args:
        cfg: the ``metrics`` config section.
        rank, local_rank: this worker's global and node-local rank.
        cuda: export CUDA allocator gauges (bytes, ``torch.cuda.memory_allocated/reserved``).
        registry: where the metrics register (a fresh one by default; the values go to the
            multiprocess files whenever ``PROMETHEUS_MULTIPROC_DIR`` was set at import).
    """

    def __init__(self, cfg: MetricsConfig, rank: int, local_rank: int, cuda: bool = False,
                 registry: CollectorRegistry | None = None) -> None:
        self.enabled = cfg.enabled
        self.registry = registry or CollectorRegistry(auto_describe=True)
        self.tokens_per_sample: int | None = None
        self.cuda = cuda
        self._phase: str | None = None
        self._timeout: float | None = None
        self._window_start = time.perf_counter()
        self._window_samples = 0
        self._pending = _pending()
        self._published = time.monotonic()
        self._beat, self._beat_phase = 0.0, ""
        self._epoch: int | None = None
        self._process = psutil.Process()
        if not self.enabled:
            return
        self._labels = {"job": job_label(cfg), "node": node_label(cfg), "rank": str(rank),
                        "local_rank": str(local_rank)}
        d = Declare(self.registry, self._labels)
        self.steps, self.health = StepSeries(d), HealthSeries(d, cuda)
        self.outcome, self.checkpoints = OutcomeSeries(d), CheckpointSeries(d)
        self.recovery = RecoverySeries(d)

    def count_tokens(self, tokens_per_sample: int | None) -> None:
        """Language-model tasks: also export ``tokens_total`` and ``tokens_per_second``
        (``tokens_per_sample`` tokens in each training sample)."""
        if not (self.enabled and tokens_per_sample) or self.tokens_per_sample:
            return
        self.tokens_per_sample = tokens_per_sample
        self.steps.count_tokens()

    # ------------------------------------------------------------ phases and heartbeat

    def phase(self, name: str, timeout_seconds: float | None) -> None:
        """Enter phase ``name`` (one of :data:`~.rank_series.PHASES`) and beat;
        ``timeout_seconds`` is the heartbeat silence allowed from now on (None or 0: no
        limit)."""
        if not self.enabled:
            return
        if name != self._phase:
            self.publish()  # the step series are current when the phase changes
            for p, g in self.health.phases.items():
                g.set(1 if p == name else 0)
            self._phase = name
        timeout = timeout_seconds or 0.0
        changed = timeout != self._timeout
        if changed:
            self.health.heartbeat_timeout.set(timeout)
            self._timeout = timeout
        now = time.monotonic()
        # a beat per step costs a multiprocess-file write; health needs seconds, not steps
        if changed or name != self._beat_phase or now - self._beat >= BEAT_SECONDS:
            self.health.heartbeat.set(time.time())
            self._beat, self._beat_phase = now, name

    # ------------------------------------------------------------ training

    def world(self, world_size: int) -> None:
        if self.enabled:
            self.steps.world_size.set(world_size)

    def step_done(self, step: int, epoch: int, seconds: float, data_seconds: float,
                  samples: int, loss: float | None, lr: float) -> None:
        """One optimizer step completed: ``samples`` this rank consumed, wall ``seconds``;
        ``loss`` (the mean over ranks) only at logging steps, None otherwise: reading a device
        loss every step would synchronise the host with the device."""
        if not self.enabled:
            return
        self.steps.step.set(step)  # per step: /health names the last step of a hung rank
        if epoch != self._epoch:
            self.steps.epoch.set(epoch)
            self._epoch = epoch
        self.steps.step_seconds.observe(seconds)
        self.steps.data_wait.observe(data_seconds)
        self._window_samples += samples
        p = self._pending
        p["steps"] += 1
        p["samples"] += samples
        p["lr"] = lr
        if loss is not None:
            p["loss"] = loss
        if loss is not None or time.monotonic() - self._published >= PUBLISH_SECONDS:
            self.publish()

    def publish(self) -> None:
        """Write the step counters, the LR, the loss gathered since the last call and the
        recovery store's operations counted since (``protocol/counting.py``; each
        write is a multiprocess-file update: per step they cost ~40 us with the gauges);
        called at logging steps, at least every ``PUBLISH_SECONDS``, and at phase changes."""
        p, self._pending = self._pending, _pending()
        self._published = time.monotonic()
        if not self.enabled:
            return
        self.recovery.count_store_ops(store_counts.by_op())
        if "loss" in p:
            self.steps.loss.set(p["loss"])
        if not p["steps"]:
            return
        self.steps.lr.set(p["lr"])
        self.steps.steps_total.inc(p["steps"])
        self.steps.samples_total.inc(p["samples"])
        if self.tokens_per_sample:
            self.steps.tokens_total.inc(p["samples"] * self.tokens_per_sample)

    def window(self, straggler_ratio: float | None, loss: float | None = None) -> None:
        """End of a logging window: throughput, straggler ratio, memory, and the logged
        ``loss`` (the mean over ranks)."""
        if loss is not None:
            self._pending["loss"] = loss
        self.publish()
        now = time.perf_counter()
        seconds, samples = now - self._window_start, self._window_samples
        self._window_start, self._window_samples = now, 0
        if not self.enabled:
            return
        if seconds > 0:
            self.steps.samples_rate.set(samples / seconds)
            if self.tokens_per_sample:
                self.steps.tokens_rate.set(samples * self.tokens_per_sample / seconds)
        if straggler_ratio is not None:
            self.health.straggler.set(straggler_ratio)
        self.health.rss.set(self._process.memory_info().rss)
        if self.cuda:
            self.health.cuda_allocated.set(torch.cuda.memory_allocated())
            self.health.cuda_reserved.set(torch.cuda.memory_reserved())

    def skipped_step(self) -> None:
        if self.enabled:
            self.health.skipped.inc()

    def recovered(self, phases: dict[str, float], redone: int = 0) -> None:
        """An in-place recovery ended with its first committed step; ``phases`` in seconds;
        ``redone``: committed steps it rolled back."""
        if not self.enabled:
            return
        self.recovery.recoveries.inc()
        self.recovery.redone.inc(redone)
        for phase, gauge in self.recovery.phases.items():
            gauge.set(phases.get(phase, 0.0))

    def membership_changed(self, reason: str) -> None:
        """The group changed its nodes in place (``reason``: one of
        :data:`~.rank_series.MEMBERSHIP_REASONS`)."""
        if self.enabled:
            self.recovery.membership[reason].inc()

    def goodput(self, seconds: dict[str, float], ettr: float) -> None:
        """The job's seconds by cause and its ETTR (:mod:`elastic_runner.observe.goodput`)."""
        if not self.enabled:
            return
        for cause, gauge in self.recovery.goodput.items():
            gauge.set(seconds.get(cause, 0.0))
        self.recovery.ettr.set(ettr)

    def rolled_back(self) -> None:
        if self.enabled:
            self.health.rollbacks.inc()

    def evaluated(self, values: dict[str, float], metric: str, best: float | None,
                  patience_left: int) -> None:
        """Validation ``values`` and the early-stopping state after an evaluation."""
        if not self.enabled:
            return
        for name, value in values.items():
            self.outcome.eval_metric.labels(**self._labels, metric=name).set(value)
        if best is not None:
            self.outcome.es_best.labels(**self._labels, metric=metric).set(best)
        self.outcome.es_patience.set(patience_left)

    def finished(self, stop_reason: str) -> None:
        """The run ended; ``stop_reason`` is a :class:`~elastic_runner.train.stop.StopReason` value
        (or a free-text reason of older callers, mapped by :func:`finish_category`)."""
        if self.enabled:
            value = getattr(stop_reason, "value", stop_reason)
            category = value if value in self.outcome.finished else finish_category(value)
            self.outcome.finished[category].set(1)

    # ------------------------------------------------------------ checkpoints

    def checkpoint_stall(self, seconds: float) -> None:
        if self.enabled:
            self.checkpoints.stall.observe(seconds)

    def checkpoint_committed(self, seconds: float, size_bytes: int,
                             timestamp: float | None = None) -> None:
        """A checkpoint of ``size_bytes`` was committed after ``seconds`` of writing."""
        if not self.enabled:
            return
        self.checkpoints.seconds.observe(seconds)
        self.checkpoints.size.set(size_bytes)
        self.checkpoints.bytes.inc(size_bytes)
        self.checkpoints.time.set(timestamp or time.time())

    def checkpoint_loaded(self, commit_time: float | None, size_bytes: int) -> None:
        """Resumed from a checkpoint committed at unix time ``commit_time``."""
        if self.enabled and commit_time:
            self.checkpoints.time.set(commit_time)
            self.checkpoints.size.set(size_bytes)
