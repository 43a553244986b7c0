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

With ``metrics.enabled: false`` nothing is recorded; every method returns at once.
"""

from __future__ import annotations

import socket
import time
from typing import Any

import psutil
import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ..protocol.env import METRICS_AGENT_ENV
from ..protocol.torchrun_env import TorchrunEnv
from .config import MetricsConfig

PREFIX = "elastic_runner_"
RANK_LABELS = ("job", "node", "rank", "local_rank")
PHASES = ("starting", "loading", "training", "evaluating", "checkpointing", "recovering",
          "finished")
FINISH_REASONS = ("max_steps", "max_epochs", "early_stopping", "failed", "preempted")
RECOVERY_PHASES = ("detection", "teardown", "group", "state", "first step")
MEMBERSHIP_REASONS = ("preempted", "lost", "joined")  # recovery/membership.py: why the nodes changed
GOODPUT_CAUSES = ("productive", "startup", "recovery", "redone", "checkpoint", "evaluation",
                  "other")
# set by elastic-runner run for its workers: the agent serves the node's endpoint
AGENT_ENV = METRICS_AGENT_ENV

_STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_WAIT_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 60)
_CKPT_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


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
        labels = {"job": job_label(cfg), "node": node_label(cfg), "rank": str(rank),
                  "local_rank": str(local_rank)}
        r = self.registry

        def gauge(name: str, doc: str, mode: str = "livemostrecent", extra: tuple = ()) -> Any:
            g = Gauge(PREFIX + name, doc, (*RANK_LABELS, *extra), registry=r,
                      multiprocess_mode=mode)
            return g if extra else g.labels(**labels)

        def counter(name: str, doc: str) -> Any:
            c = Counter(PREFIX + name, doc, RANK_LABELS, registry=r).labels(**labels)
            c.inc(0)
            return c

        def histogram(name: str, doc: str, buckets: tuple) -> Any:
            return Histogram(PREFIX + name, doc, RANK_LABELS, registry=r,
                             buckets=buckets).labels(**labels)

        self._labels = labels
        self._gauge, self._counter = gauge, counter
        self.step = gauge("step", "Optimizer steps completed (the global step).")
        self.epoch = gauge("epoch", "Current epoch (0-based).")
        self.world_size = gauge("world_size", "Ranks in the current process group.")
        self.steps_total = counter("steps_total", "Optimizer steps this rank completed, over "
                                   "all restarts (use rate() for steps per second).")
        self.step_seconds = histogram("step_duration_seconds", "Wall time of one optimizer "
                                      "step on this rank, data loading included.", _STEP_BUCKETS)
        self.data_wait = histogram("data_wait_seconds", "Time one step waited for its "
                                   "micro-batches from the data loader.", _WAIT_BUCKETS)
        self.samples_total = counter("samples_total", "Training samples this rank consumed.")
        self.samples_rate = gauge("samples_per_second", "Training samples per second on this "
                                  "rank over the last logging window.")
        self.loss = gauge("loss", "Training loss, the mean over ranks, at the last logging step.")
        self.lr = gauge("learning_rate", "Learning rate of the last step.")
        self.heartbeat = gauge("heartbeat_timestamp_seconds", "Unix time of this rank's last "
                               "heartbeat (each step and each phase change).")
        self.heartbeat_timeout = gauge(
            "heartbeat_timeout_seconds", "Heartbeat silence allowed in the current phase before "
            "the rank counts as unhealthy; 0 while no limit applies (start, checkpoint load).")
        phase = gauge("phase", "1 for the phase this rank is in.", extra=("phase",))
        self._phases = {p: phase.labels(**labels, phase=p) for p in PHASES}
        self.straggler = gauge("straggler_ratio", "This rank's local step time (data, forward, "
                               "backward up to the gradient all-reduce) over the median of all "
                               "ranks, last logging window; 1.0 is typical.")
        self.straggler.set(1.0)
        self.skipped = counter("skipped_steps_total", "Steps whose update was skipped because a "
                               "loss or gradient was not finite on some rank.")
        self.rollbacks = counter("rollbacks_total", "Rollbacks to the last checkpoint after "
                                 "repeated non-finite steps.")
        self.rss = gauge("process_resident_memory_bytes", "Resident memory of this worker "
                         "process.")
        if cuda:
            self.cuda_allocated = gauge("cuda_memory_allocated_bytes", "CUDA memory held by "
                                        "tensors (torch.cuda.memory_allocated).")
            self.cuda_reserved = gauge("cuda_memory_reserved_bytes", "CUDA memory reserved by "
                                       "the caching allocator (torch.cuda.memory_reserved).")
        self.eval_metric = Gauge(PREFIX + "eval_metric", "Latest validation metrics (rank 0).",
                                 (*RANK_LABELS, "metric"), registry=r,
                                 multiprocess_mode="mostrecent")
        self.es_best = Gauge(PREFIX + "early_stopping_best", "Best value of the early-stopping "
                             "metric so far (rank 0).", (*RANK_LABELS, "metric"), registry=r,
                             multiprocess_mode="mostrecent")
        self.es_patience = gauge("early_stopping_patience_left", "Evaluations without "
                                 "improvement left before early stopping (rank 0).", "mostrecent")
        finished = gauge("finished", "1 once training ended for this reason.", "mostrecent",
                         extra=("reason",))
        self._finished = {f: finished.labels(**labels, reason=f) for f in FINISH_REASONS}
        for g in self._finished.values():
            g.set(0)  # a new attempt clears the previous attempt's ending (mostrecent wins)
        self.ckpt_seconds = histogram("checkpoint_save_duration_seconds", "Time to write and "
                                      "commit one checkpoint (in the background when async).",
                                      _CKPT_BUCKETS)
        self.ckpt_stall = histogram("checkpoint_stall_seconds", "Time the training loop was "
                                    "blocked by one checkpoint save.", _CKPT_BUCKETS)
        self.recoveries = counter("in_place_recoveries_total", "In-place recoveries this "
                                  "rank took part in (a peer died; this process went on).")
        self.redone = counter("in_place_steps_redone_total", "Committed steps that in-place "
                              "recoveries rolled back and redid (sharded state: back to the "
                              "peer copies' step; see recovery/peer_copies.py).")
        changes = Counter(PREFIX + "membership_changes_total", "Changes of the group's nodes "
                          "in place that this rank went through, by reason (preempted: a node "
                          "got SIGTERM and left; lost: a node's heartbeat stopped; see "
                          "recovery/membership.py).", (*RANK_LABELS, "reason"), registry=r)
        self._membership = {why: changes.labels(**labels, reason=why)
                            for why in MEMBERSHIP_REASONS}
        for c in self._membership.values():
            c.inc(0)
        recovery = gauge("last_recovery_seconds", "Phases of the last in-place recovery: "
                         "detection, teardown, group, state, first step (see recovery/inplace.py).",
                         "mostrecent", extra=("phase",))
        self._recovery = {p: recovery.labels(**labels, phase=p) for p in RECOVERY_PHASES}
        goodput = gauge("goodput_seconds", "The job's wall time by cause: productive (committed "
                        "steps) or badput (startup, recovery, redone, checkpoint, evaluation, "
                        "other), as this rank accounts it (see observe/goodput.py).", "mostrecent",
                        extra=("cause",))
        self._goodput = {c: goodput.labels(**labels, cause=c) for c in GOODPUT_CAUSES}
        self.ettr = gauge("ettr", "Effective training time ratio: productive seconds over the "
                          "job's wall seconds.", "mostrecent")
        self.ckpt_size = gauge("checkpoint_size_bytes", "Size of the last committed "
                               "checkpoint.", "mostrecent")
        self.ckpt_bytes = counter("checkpoint_written_bytes_total", "Checkpoint bytes written.")
        self.ckpt_time = gauge("checkpoint_last_success_timestamp_seconds", "Unix time the "
                               "newest checkpoint was committed (also the one resumed from).",
                               "mostrecent")

    def count_tokens(self, tokens_per_sample: int | None) -> None:
        """Language-model tasks: also export ``tokens_total`` and ``tokens_per_second``
        (``tokens_per_sample`` tokens in each training sample)."""
        if not (self.enabled and tokens_per_sample) or self.tokens_per_sample:
            return
        self.tokens_per_sample = tokens_per_sample
        self.tokens_total = self._counter("tokens_total", "Training tokens this rank consumed "
                                          "(language-model tasks).")
        self.tokens_rate = self._gauge("tokens_per_second", "Training tokens per second on "
                                       "this rank over the last logging window.")

    # ------------------------------------------------------------ phases and heartbeat

    def phase(self, name: str, timeout_seconds: float | None) -> None:
        """Enter phase ``name`` (one of :data:`PHASES`) and beat; ``timeout_seconds`` is the
        heartbeat silence allowed from now on (None or 0: no limit)."""
        if not self.enabled:
            return
        if name != self._phase:
            self.publish()  # the step series are current when the phase changes
            for p, g in self._phases.items():
                g.set(1 if p == name else 0)
            self._phase = name
        timeout = timeout_seconds or 0.0
        changed = timeout != self._timeout
        if changed:
            self.heartbeat_timeout.set(timeout)
            self._timeout = timeout
        now = time.monotonic()
        # a beat per step costs a multiprocess-file write; health needs seconds, not steps
        if changed or name != self._beat_phase or now - self._beat >= BEAT_SECONDS:
            self.heartbeat.set(time.time())
            self._beat, self._beat_phase = now, name

    # ------------------------------------------------------------ training

    def world(self, world_size: int) -> None:
        if self.enabled:
            self.world_size.set(world_size)

    def step_done(self, step: int, epoch: int, seconds: float, data_seconds: float,
                  samples: int, loss: float | None, lr: float) -> None:
        """One optimizer step completed: ``samples`` this rank consumed, wall ``seconds``;
        ``loss`` (the mean over ranks) only at logging steps, None otherwise: reading a device
        loss every step would synchronise the host with the device."""
        if not self.enabled:
            return
        self.step.set(step)  # per step: /health names the last step of a hung rank
        if epoch != self._epoch:
            self.epoch.set(epoch)
            self._epoch = epoch
        self.step_seconds.observe(seconds)
        self.data_wait.observe(data_seconds)
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
        """Write the step counters, the LR and the loss gathered since the last call (each
        write is a multiprocess-file update: per step they cost ~40 us with the gauges);
        called at logging steps, at least every ``PUBLISH_SECONDS``, and at phase changes."""
        p, self._pending = self._pending, _pending()
        self._published = time.monotonic()
        if not self.enabled:
            return
        if "loss" in p:
            self.loss.set(p["loss"])
        if not p["steps"]:
            return
        self.lr.set(p["lr"])
        self.steps_total.inc(p["steps"])
        self.samples_total.inc(p["samples"])
        if self.tokens_per_sample:
            self.tokens_total.inc(p["samples"] * self.tokens_per_sample)

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
            self.samples_rate.set(samples / seconds)
            if self.tokens_per_sample:
                self.tokens_rate.set(samples * self.tokens_per_sample / seconds)
        if straggler_ratio is not None:
            self.straggler.set(straggler_ratio)
        self.rss.set(self._process.memory_info().rss)
        if self.cuda:
            self.cuda_allocated.set(torch.cuda.memory_allocated())
            self.cuda_reserved.set(torch.cuda.memory_reserved())

    def skipped_step(self) -> None:
        if self.enabled:
            self.skipped.inc()

    def recovered(self, phases: dict[str, float], redone: int = 0) -> None:
        """An in-place recovery ended with its first committed step; ``phases`` in seconds;
        ``redone``: committed steps it rolled back."""
        if not self.enabled:
            return
        self.recoveries.inc()
        self.redone.inc(redone)
        for phase, gauge in self._recovery.items():
            gauge.set(phases.get(phase, 0.0))

    def membership_changed(self, reason: str) -> None:
        """The group changed its nodes in place (``reason``: one of
        :data:`MEMBERSHIP_REASONS`)."""
        if self.enabled:
            self._membership[reason].inc()

    def goodput(self, seconds: dict[str, float], ettr: float) -> None:
        """The job's seconds by cause and its ETTR (:mod:`elastic_runner.observe.goodput`)."""
        if not self.enabled:
            return
        for cause, gauge in self._goodput.items():
            gauge.set(seconds.get(cause, 0.0))
        self.ettr.set(ettr)

    def rolled_back(self) -> None:
        if self.enabled:
            self.rollbacks.inc()

    def evaluated(self, values: dict[str, float], metric: str, best: float | None,
                  patience_left: int) -> None:
        """Validation ``values`` and the early-stopping state after an evaluation."""
        if not self.enabled:
            return
        for name, value in values.items():
            self.eval_metric.labels(**self._labels, metric=name).set(value)
        if best is not None:
            self.es_best.labels(**self._labels, metric=metric).set(best)
        self.es_patience.set(patience_left)

    def finished(self, stop_reason: str) -> None:
        """The run ended; ``stop_reason`` is a :class:`~elastic_runner.train.stop.StopReason` value
        (or a free-text reason of older callers, mapped by :func:`finish_category`)."""
        if self.enabled:
            value = getattr(stop_reason, "value", stop_reason)
            category = value if value in self._finished else finish_category(value)
            self._finished[category].set(1)

    # ------------------------------------------------------------ checkpoints

    def checkpoint_stall(self, seconds: float) -> None:
        if self.enabled:
            self.ckpt_stall.observe(seconds)

    def checkpoint_committed(self, seconds: float, size_bytes: int,
                             timestamp: float | None = None) -> None:
        """A checkpoint of ``size_bytes`` was committed after ``seconds`` of writing."""
        if not self.enabled:
            return
        self.ckpt_seconds.observe(seconds)
        self.ckpt_size.set(size_bytes)
        self.ckpt_bytes.inc(size_bytes)
        self.ckpt_time.set(timestamp or time.time())

    def checkpoint_loaded(self, commit_time: float | None, size_bytes: int) -> None:
        """Resumed from a checkpoint committed at unix time ``commit_time``."""
        if self.enabled and commit_time:
            self.ckpt_time.set(commit_time)
            self.ckpt_size.set(size_bytes)
