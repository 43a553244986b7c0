"""The Prometheus families one rank registers (:class:`~.metrics.RankMetrics` writes them),
grouped by what they measure: the steps, the rank's health, evaluation and the run's end,
checkpoints, in-place recovery and goodput.

Every family is prefixed :data:`PREFIX` and labelled :data:`RANK_LABELS` (plus one bounded
label of its own where it has one: a phase, a reason, a cause, a metric's name). Each group's
constructor registers its families in ``registry`` in the order of the reference page
(``docs/reference/metrics.md`` is generated from the registry).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ..protocol.counting import PROTOCOL_OPS

PREFIX = "elastic_runner_"
RANK_LABELS = ("job", "node", "rank", "local_rank")
PHASES = ("starting", "loading", "training", "evaluating", "checkpointing", "recovering",
          "finished")
FINISH_REASONS = ("max_steps", "max_epochs", "early_stopping", "failed", "preempted")
RECOVERY_PHASES = ("detection", "teardown", "group", "state", "first step")
MEMBERSHIP_REASONS = ("preempted", "lost", "joined")  # recovery/membership.py: why the nodes changed
GOODPUT_CAUSES = ("productive", "startup", "recovery", "redone", "checkpoint", "evaluation",
                  "other")

_STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_WAIT_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 60)
_CKPT_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class Declare:
    """Registers families in ``registry`` with one rank's label values (``labels``: a value
    for each of :data:`RANK_LABELS`)."""

    def __init__(self, registry: CollectorRegistry, labels: dict[str, str]) -> None:
        self.registry, self.labels = registry, labels

    def gauge(self, name: str, doc: str, mode: str = "livemostrecent") -> Any:
        """This rank's child of a new gauge (``mode``: prometheus-client's multiprocess mode)."""
        return self.family(name, doc, mode).labels(**self.labels)

    def family(self, name: str, doc: str, mode: str, extra: tuple[str, ...] = ()) -> Gauge:
        """A new gauge with labels ``extra`` beyond the rank's (its children made by the
        caller)."""
        return Gauge(PREFIX + name, doc, (*RANK_LABELS, *extra), registry=self.registry,
                     multiprocess_mode=mode)

    def by(self, family: Gauge | Counter, label: str, values: tuple[str, ...]) -> dict[str, Any]:
        """This rank's child of ``family`` for each of ``values`` of its label ``label``."""
        return {v: family.labels(**self.labels, **{label: v}) for v in values}

    def counter(self, name: str, doc: str) -> Any:
        """This rank's child of a new counter, at 0 (so the series exists before its first
        event)."""
        c = Counter(PREFIX + name, doc, RANK_LABELS, registry=self.registry).labels(**self.labels)
        c.inc(0)
        return c

    def histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Any:
        """This rank's child of a new histogram (``buckets``: upper bounds in seconds)."""
        return Histogram(PREFIX + name, doc, RANK_LABELS, registry=self.registry,
                         buckets=buckets).labels(**self.labels)


class StepSeries:
    """What the steps did: the step and epoch, step and data-wait times, samples, loss and
    learning rate (and tokens, once :meth:`count_tokens` asks for them)."""

    def __init__(self, d: Declare) -> None:
        self._d = d
        self.step = d.gauge("step", "Optimizer steps completed (the global step).")
        self.epoch = d.gauge("epoch", "Current epoch (0-based).")
        self.world_size = d.gauge("world_size", "Ranks in the current process group.")
        self.steps_total = d.counter("steps_total", "Optimizer steps this rank completed, over "
                                     "all restarts (use rate() for steps per second).")
        self.step_seconds = d.histogram("step_duration_seconds", "Wall time of one optimizer "
                                        "step on this rank, data loading included.",
                                        _STEP_BUCKETS)
        self.data_wait = d.histogram("data_wait_seconds", "Time one step waited for its "
                                     "micro-batches from the data loader.", _WAIT_BUCKETS)
        self.samples_total = d.counter("samples_total", "Training samples this rank consumed.")
        self.samples_rate = d.gauge("samples_per_second", "Training samples per second on this "
                                    "rank over the last logging window.")
        self.loss = d.gauge("loss", "Training loss, the mean over ranks, at the last logging "
                            "step.")
        self.lr = d.gauge("learning_rate", "Learning rate of the last step.")

    def count_tokens(self) -> None:
        """Register ``tokens_total`` and ``tokens_per_second`` (language-model tasks)."""
        self.tokens_total = self._d.counter("tokens_total", "Training tokens this rank consumed "
                                            "(language-model tasks).")
        self.tokens_rate = self._d.gauge("tokens_per_second", "Training tokens per second on "
                                         "this rank over the last logging window.")


class HealthSeries:
    """How the rank is: its heartbeat and phase, straggling, non-finite steps and rollbacks,
    memory in bytes (``cuda``: the CUDA allocator's too)."""

    def __init__(self, d: Declare, cuda: bool) -> None:
        self.heartbeat = d.gauge("heartbeat_timestamp_seconds", "Unix time of this rank's last "
                                 "heartbeat (each step and each phase change).")
        self.heartbeat_timeout = d.gauge(
            "heartbeat_timeout_seconds", "Heartbeat silence allowed in the current phase before "
            "the rank counts as unhealthy; 0 while no limit applies (start, checkpoint load).")
        self.phases = d.by(d.family("phase", "1 for the phase this rank is in.",
                                    "livemostrecent", ("phase",)), "phase", PHASES)
        self.straggler = d.gauge("straggler_ratio", "This rank's local step time (data, "
                                 "forward, backward up to the gradient all-reduce) over the "
                                 "median of all ranks, last logging window; 1.0 is typical.")
        self.straggler.set(1.0)
        self.skipped = d.counter("skipped_steps_total", "Steps whose update was skipped because "
                                 "a loss or gradient was not finite on some rank.")
        self.rollbacks = d.counter("rollbacks_total", "Rollbacks to the last checkpoint after "
                                   "repeated non-finite steps.")
        self.rss = d.gauge("process_resident_memory_bytes", "Resident memory of this worker "
                           "process.")
        if cuda:
            self.cuda_allocated = d.gauge("cuda_memory_allocated_bytes", "CUDA memory held by "
                                          "tensors (torch.cuda.memory_allocated).")
            self.cuda_reserved = d.gauge("cuda_memory_reserved_bytes", "CUDA memory reserved by "
                                         "the caching allocator (torch.cuda.memory_reserved).")


class OutcomeSeries:
    """What the run achieved: validation metrics, early stopping, why training ended."""

    def __init__(self, d: Declare) -> None:
        self.eval_metric = d.family("eval_metric", "Latest validation metrics (rank 0).",
                                    "mostrecent", ("metric",))
        self.es_best = d.family("early_stopping_best", "Best value of the early-stopping "
                                "metric so far (rank 0).", "mostrecent", ("metric",))
        self.es_patience = d.gauge("early_stopping_patience_left", "Evaluations without "
                                   "improvement left before early stopping (rank 0).",
                                   "mostrecent")
        self.finished = d.by(d.family("finished", "1 once training ended for this reason.",
                                      "mostrecent", ("reason",)), "reason", FINISH_REASONS)
        for g in self.finished.values():
            g.set(0)  # a new attempt clears the previous attempt's ending (mostrecent wins)


class CheckpointSeries:
    """Checkpoints: write and stall times in seconds, the last one's size in bytes and commit
    time, the bytes written."""

    def __init__(self, d: Declare) -> None:
        self.seconds = d.histogram("checkpoint_save_duration_seconds", "Time to write and "
                                   "commit one checkpoint (in the background when async).",
                                   _CKPT_BUCKETS)
        self.stall = d.histogram("checkpoint_stall_seconds", "Time the training loop was "
                                 "blocked by one checkpoint save.", _CKPT_BUCKETS)
        self.size = d.gauge("checkpoint_size_bytes", "Size of the last committed "
                            "checkpoint.", "mostrecent")
        self.bytes = d.counter("checkpoint_written_bytes_total", "Checkpoint bytes written.")
        self.time = d.gauge("checkpoint_last_success_timestamp_seconds", "Unix time the "
                            "newest checkpoint was committed (also the one resumed from).",
                            "mostrecent")


class RecoverySeries:
    """In-place recoveries and membership changes, the last recovery's phases in seconds, and
    the job's goodput."""

    def __init__(self, d: Declare) -> None:
        self._d_labels = d.labels
        self.recoveries = d.counter("in_place_recoveries_total", "In-place recoveries this "
                                    "rank took part in (a peer died; this process went on).")
        self.redone = d.counter("in_place_steps_redone_total", "Committed steps that in-place "
                                "recoveries rolled back and redid (sharded state: back to the "
                                "peer copies' step; see recovery/peer_copies.py).")
        changes = Counter(PREFIX + "membership_changes_total", "Changes of the group's nodes "
                          "in place that this rank went through, by reason (preempted: a node "
                          "got SIGTERM and left; lost: a node's heartbeat stopped; see "
                          "recovery/membership.py).", (*RANK_LABELS, "reason"),
                          registry=d.registry)
        self.membership = d.by(changes, "reason", MEMBERSHIP_REASONS)
        for c in self.membership.values():
            c.inc(0)
        self.phases = d.by(d.family("last_recovery_seconds", "Phases of the last in-place "
                                    "recovery: detection, teardown, group, state, first step "
                                    "(see recovery/inplace.py).", "mostrecent", ("phase",)),
                           "phase", RECOVERY_PHASES)
        self.goodput = d.by(d.family("goodput_seconds", "The job's wall time by cause: "
                                     "productive (committed steps) or badput (startup, "
                                     "recovery, redone, checkpoint, evaluation, other), as this "
                                     "rank accounts it (see observe/goodput.py).", "mostrecent",
                                     ("cause",)), "cause", GOODPUT_CAUSES)
        self.ettr = d.gauge("ettr", "Effective training time ratio: productive seconds over the "
                            "job's wall seconds.", "mostrecent")
        store_ops = Counter(PREFIX + "store_operations", "Operations on the recovery store by "
                            "this rank's processes (a spare's while it stood by included), by "
                            "torch Store operation (see protocol/counting.py; a process "
                            "group's own are not counted).", (*RANK_LABELS, "op"),
                            registry=d.registry)
        self.store_ops = {op: store_ops.labels(**d.labels, op=op) for op in PROTOCOL_OPS}
        for c in self.store_ops.values():
            c.inc(0)
        self._store_ops_family = store_ops
        self._store_ops_seen: dict[str, int] = {}

    def count_store_ops(self, by_op: dict[str, int]) -> None:
        """Add what ``by_op`` (this process's operations so far, by operation) counted since
        the last call."""
        for op, n in by_op.items():
            delta = n - self._store_ops_seen.get(op, 0)
            if delta <= 0:
                continue
            if op not in self.store_ops:
                self.store_ops[op] = self._store_ops_family.labels(**self._d_labels, op=op)
            self.store_ops[op].inc(delta)
            self._store_ops_seen[op] = n
