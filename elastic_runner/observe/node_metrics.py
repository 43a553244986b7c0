"""The node's metrics endpoint, hosted by the launching process (``elastic-runner run``).

The agent process outlives its workers, so its endpoint keeps answering while workers die,
rendezvous and restart. It serves

* the workers' series, which they write with prometheus-client's multiprocess mode into a
  directory this module creates and hands them as ``PROMETHEUS_MULTIPROC_DIR``; before each
  collection the files of exited workers' live gauges are removed (``mark_process_dead``), so a
  dead rank's heartbeat and step disappear instead of freezing;
* the agent's own series, derived from torchelastic's metrics API
  (``torch.distributed.elastic.metrics``: the agent publishes ``<Class>._rendezvous.duration.ms``,
  ``workers.<role>.remaining_restarts``, ``workers.<role>.<state>`` ... through it; we install a
  handler for its ``torchelastic`` group; the names are torch internals, kept and checked in
  :mod:`elastic_runner.compat.agent`, fix 4):

  - ``elastic_runner_restarts_total{reason}``: worker-group restarts, ``failure`` (a worker
    failed, counts against ``--max-restarts``) or ``membership`` (a node joined or left);
  - ``elastic_runner_rendezvous_total`` and ``elastic_runner_rendezvous_duration_seconds``;
  - ``elastic_runner_agent_state{state}`` and ``elastic_runner_local_ranks``;
  - ``elastic_runner_agent_store_operations_total{op}``: the agent's operations on the recovery
    store (:mod:`elastic_runner.protocol.counting`), read at each collection.
"""

from __future__ import annotations

import glob
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

import psutil
import torch.distributed.elastic.metrics as te_metrics
from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

from ..compat import agent as torch_agent
from ..protocol.counting import COUNTS as store_counts
from ..protocol.counting import PROTOCOL_OPS
from ..protocol.env import METRICS_AGENT_ENV as AGENT_ENV
from .config import MetricsConfig
from .health import MetricsServer
from .metrics import node_label
from .rank_series import PREFIX

log = logging.getLogger(__name__)

AGENT_STATES = ("rendezvous", "starting", "running", "restarting", "succeeded", "failed",
                "stopped")
_RDZV_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class AgentMonitor(te_metrics.MetricHandler):
    """Turns the torchelastic agent's metric stream into agent state and series."""

    def __init__(self, job: str, node: str, local_ranks: int) -> None:
        self.labels = {"job": job, "node": node}
        self.local_ranks = local_ranks
        self._lock = threading.Lock()
        self.state = "rendezvous"
        self.restarts = {"failure": 0, "membership": 0, "in_place": 0}
        self.rendezvous = 0
        self._rdzv_buckets = [0] * len(_RDZV_BUCKETS)
        self._rdzv_sum = 0.0
        self._remaining_restarts: int | None = None

    def emit(self, metric_data: te_metrics.MetricData) -> None:
        name, value = metric_data.name, metric_data.value
        with self._lock:
            if name.endswith(torch_agent.RENDEZVOUS_DURATION):
                self._observe_rendezvous(value / 1000.0)
                # the restart timeline with millisecond stamps (torch's agent logs at WARNING)
                log.info("rendezvous round %d took %.3f s", self.rendezvous, value / 1000.0)
            elif name.endswith(torch_agent.RENDEZVOUS_SUCCESS):
                self.rendezvous += 1
                self.state = "starting"
            elif name.endswith(torch_agent.WORKERS_STARTED):
                self.state = "running"
                log.info("workers started")
            elif name.endswith(torch_agent.WORKERS_STOPPED) and self.state == "running":
                self.restarts["membership"] += 1  # stopped while healthy: a node joined/left
                self.state = "restarting"
                log.info("workers stopped for a membership change")
            elif name.endswith(torch_agent.REMAINING_RESTARTS):
                self._remaining_restarts = int(value)
            elif name.startswith(torch_agent.WORKER_GROUP) and value == 1:
                self._worker_group_state(name.rsplit(".", 1)[-1])

    def _worker_group_state(self, state: str) -> None:
        if state in ("failed", "unhealthy"):
            if self._remaining_restarts:
                self.restarts["failure"] += 1
                self.state = "restarting"
                log.info("worker group %s: restarting it", state)
            else:
                self.state = "failed"
        elif state == "succeeded":
            self.state = "succeeded"

    def replaced(self, replacement: Any) -> None:
        """An in-place replacement (:class:`~elastic_runner.agent.replacement.Replacement`): the
        group stays running."""
        with self._lock:
            self.restarts["in_place"] += 1
        log.info("worker(s) %s replaced in place (generation %d)", list(replacement.ranks),
                 replacement.generation)

    def _observe_rendezvous(self, seconds: float) -> None:
        self._rdzv_sum += seconds
        for i, le in enumerate(_RDZV_BUCKETS):
            if seconds <= le:
                self._rdzv_buckets[i] += 1

    def set_state(self, state: str) -> None:
        with self._lock:
            self.state = state

    def snapshot(self) -> dict[str, Any]:
        """The agent's state for ``/health``."""
        with self._lock:
            return {"state": self.state, "restarts": dict(self.restarts),
                    "rendezvous_rounds": self.rendezvous, "local_ranks": self.local_ranks}

    def collect(self) -> Iterator[Metric]:
        names, values = list(self.labels), list(self.labels.values())
        with self._lock:
            restarts = CounterMetricFamily(PREFIX + "restarts", "Worker-group restarts on this "
                                           "node: failure (all workers restarted; counts "
                                           "against max restarts), membership (a node joined "
                                           "or left) or in_place (only the failed worker "
                                           "replaced; counts against max restarts too).",
                                           labels=[*names, "reason"])
            for reason, n in self.restarts.items():
                restarts.add_metric([*values, reason], n)
            rounds = CounterMetricFamily(PREFIX + "rendezvous", "Completed rendezvous rounds.",
                                         labels=names)
            rounds.add_metric(values, self.rendezvous)
            duration = HistogramMetricFamily(PREFIX + "rendezvous_duration_seconds",
                                             "Time the agent spent in one rendezvous round.",
                                             labels=names)
            buckets = [(str(le), n) for le, n in zip(_RDZV_BUCKETS, self._rdzv_buckets,
                                                     strict=True)]
            duration.add_metric(values, [*buckets, ("+Inf", self.rendezvous)],
                                self._rdzv_sum)
            state = GaugeMetricFamily(PREFIX + "agent_state", "1 for the agent's current "
                                      "state.", labels=[*names, "state"])
            for s in AGENT_STATES:
                state.add_metric([*values, s], 1.0 if s == self.state else 0.0)
        local = GaugeMetricFamily(PREFIX + "local_ranks", "Workers this node runs.",
                                  labels=names)
        local.add_metric(values, self.local_ranks)
        store_ops = CounterMetricFamily(PREFIX + "agent_store_operations", "Operations on the "
                                        "recovery store by this node's agent, by torch Store "
                                        "operation (see protocol/counting.py).",
                                        labels=[*names, "op"])
        for op, n in {**dict.fromkeys(PROTOCOL_OPS, 0), **store_counts.by_op()}.items():
            store_ops.add_metric([*values, op], n)
        yield from (restarts, rounds, duration, state, local, store_ops)


class LiveWorkersCollector:
    """prometheus-client's MultiProcessCollector after removing the live-gauge files of worker
    processes that have exited (a zombie not yet reaped by the agent counts as exited).

    Collections are serialised: concurrent scrapes and probes would otherwise remove files
    that another one is reading. A file that a starting worker has created but not yet sized
    (0 bytes) is skipped; prometheus-client's reader fails on it (``struct.error``), which
    turned a probe during a restart into an HTTP 500."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()

    def collect(self) -> list[Metric]:
        with self._lock:
            for f in glob.glob(os.path.join(self.path, "gauge_live*_*.db")):
                pid = int(f.rsplit("_", 1)[1].removesuffix(".db"))
                if not _alive(pid):
                    mark_process_dead(pid, self.path)
            files = [f for f in glob.glob(os.path.join(self.path, "*.db")) if _sized(f)]
            return list(MultiProcessCollector.merge(files, accumulate=True))


def _sized(path: str) -> bool:
    try:
        return os.path.getsize(path) > 0
    except FileNotFoundError:
        return False


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class NodeEndpoint:
    """The node's endpoint for one ``run``: worker files directory, agent monitor, server.

    Raises:
        OSError: the port cannot be bound (see :class:`~.health.MetricsServer`).
    """

    def __init__(self, cfg: MetricsConfig, rdzv_id: str, local_ranks: int) -> None:
        assert cfg.port is not None
        self.cfg = cfg
        self.dir = tempfile.mkdtemp(prefix="elastic-runner-metrics-")
        # workers inherit the environment when the agent starts them
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = self.dir
        os.environ[AGENT_ENV] = "1"
        # the workers' job label: metrics.job, else TORCHELASTIC_RUN_ID, which is the rdzv id
        self.monitor = AgentMonitor(cfg.job or rdzv_id, node_label(cfg), local_ranks)
        registry = CollectorRegistry()
        registry.register(LiveWorkersCollector(self.dir))
        registry.register(self.monitor)
        try:
            self.server = MetricsServer(registry, cfg.address, cfg.port, local_ranks,
                                        self.monitor.snapshot)
        except OSError:
            self._cleanup()
            raise
        te_metrics.configure(self.monitor, group=torch_agent.METRICS_GROUP)

    def close(self, final_state: str | None = None) -> None:
        """Record the job's end, keep serving ``metrics.linger_seconds`` (unless stopped by a
        signal: a pod being deleted should exit at once), then stop."""
        if final_state:
            self.monitor.set_state(final_state)
        if self.cfg.linger_seconds and final_state != "stopped":
            log.info("serving metrics for %.0f s more (metrics.linger_seconds)",
                     self.cfg.linger_seconds)
            threading.Event().wait(self.cfg.linger_seconds)
        te_metrics.configure(te_metrics.NullMetricHandler(), group=torch_agent.METRICS_GROUP)
        self.server.close()
        self._cleanup()

    def _cleanup(self) -> None:
        for key in ("PROMETHEUS_MULTIPROC_DIR", AGENT_ENV):
            os.environ.pop(key, None)
        shutil.rmtree(self.dir, ignore_errors=True)

