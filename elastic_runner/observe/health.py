"""The HTTP endpoint of a node (or, under plain torchrun, of one worker): metrics and health.

Routes (all GET):

* ``/metrics``: the Prometheus exposition (prometheus-client's WSGI app: text or OpenMetrics,
  gzip when asked for);
* ``/healthz``: liveness. 200 unless a rank is *stale*: its heartbeat is older than the timeout
  of the phase it is in (``elastic_runner_heartbeat_timeout_seconds``). Starting, rendezvous,
  checkpoint loading and restarts never count as stale, so a liveness probe does not kill a pod
  that is busy recovering. 503 names the stale ranks;
* ``/readyz``: readiness. 200 when every local rank is alive, not stale and training
  (training, evaluating or checkpointing); 503 with the reason otherwise (rendezvous, loading,
  restarting, finished, stale);
* ``/health``: the same verdicts as JSON, with each local rank's phase, step, heartbeat age and
  allowed silence, and the agent's state (under ``elastic-runner run``).

The verdicts are computed from the same series that ``/metrics`` serves, so an alert rule on
those series and the probes agree.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.metrics_core import Metric

from .rank_series import PREFIX

log = logging.getLogger(__name__)

WORKING_PHASES = ("training", "evaluating", "checkpointing")
LIVENESS, READINESS, HEALTH = "/healthz", "/readyz", "/health"


@dataclass
class RankHealth:
    """One rank as seen through its series."""

    rank: int
    local_rank: int
    phase: str
    step: int
    heartbeat_age_seconds: float
    heartbeat_timeout_seconds: float  # 0: no limit in this phase
    stale: bool


@dataclass
class NodeHealth:
    """The verdicts of ``/healthz`` (``live``) and ``/readyz`` (``ready``) with their reason."""

    live: bool
    ready: bool
    reason: str
    ranks: list[RankHealth]
    agent: dict[str, Any] | None

    def to_json(self) -> dict[str, Any]:
        return {"status": "ok" if self.live else "unhealthy", "ready": self.ready,
                "reason": self.reason, "agent": self.agent,
                "ranks": [asdict(r) for r in self.ranks]}


def rank_health(families: Iterable[Metric], now: float | None = None) -> list[RankHealth]:
    """Per-rank health from collected metric families (those of :mod:`.metrics`), by rank."""
    now = time.time() if now is None else now
    by_rank: dict[tuple[str, str], dict[str, Any]] = {}

    def entry(labels: dict[str, str]) -> dict[str, Any]:
        key = (labels["rank"], labels["local_rank"])
        return by_rank.setdefault(key, {"phase": "unknown", "step": 0, "beat": None,
                                        "timeout": 0.0})

    for family in families:
        for sample in family.samples:
            name, labels, value = sample.name, sample.labels, sample.value
            if name == PREFIX + "heartbeat_timestamp_seconds":
                entry(labels)["beat"] = value
            elif name == PREFIX + "heartbeat_timeout_seconds":
                entry(labels)["timeout"] = value
            elif name == PREFIX + "step":
                entry(labels)["step"] = int(value)
            elif name == PREFIX + "phase" and value == 1:
                entry(labels)["phase"] = labels["phase"]
    out = []
    for (rank, local_rank), e in by_rank.items():
        if e["beat"] is None:  # a family seen before the rank's heartbeat series exists
            continue
        age = max(0.0, now - e["beat"])
        out.append(RankHealth(int(rank), int(local_rank), e["phase"], e["step"], round(age, 3),
                              e["timeout"], bool(e["timeout"]) and age > e["timeout"]))
    return sorted(out, key=lambda r: r.local_rank)


def node_health(ranks: list[RankHealth], expected_local_ranks: int | None,
                agent: dict[str, Any] | None) -> NodeHealth:
    """Liveness and readiness of a node (or one worker when ``expected_local_ranks`` is 1)."""
    stale = [r for r in ranks if r.stale]
    if stale:
        reason = "; ".join(f"rank {r.rank} (local_rank {r.local_rank}) silent for "
                           f"{r.heartbeat_age_seconds:.1f} s in phase {r.phase} (limit "
                           f"{r.heartbeat_timeout_seconds:g} s)" for r in stale)
        return NodeHealth(False, False, f"stale: {reason}", ranks, agent)
    state = agent.get("state") if agent else None
    if state is not None and state != "running":
        return NodeHealth(True, False, f"agent {state}", ranks, agent)
    if expected_local_ranks is not None and len(ranks) < expected_local_ranks:
        return NodeHealth(True, False, f"{len(ranks)} of {expected_local_ranks} local ranks "
                          "reporting", ranks, agent)
    waiting = [r for r in ranks if r.phase not in WORKING_PHASES]
    if waiting:
        phases = ", ".join(f"rank {r.rank} {r.phase}" for r in waiting)
        return NodeHealth(True, False, f"not training: {phases}", ranks, agent)
    return NodeHealth(True, True, "training", ranks, agent)


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass


def _bind_family(address: str, port: int) -> socket.AddressFamily:
    infos = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)
    return infos[0][0]


class MetricsServer:
    """Serves ``registry`` and the health routes on ``address:port`` from a daemon thread.

    Args:
        registry: what ``/metrics`` exposes and the health verdicts are computed from.
        expected_local_ranks: ranks this endpoint should see (None: any number).
        agent_state: returns the agent's state for ``/health`` (None: no agent, a worker's own
            endpoint).

    Raises:
        OSError: the port cannot be bound (the message names address and port).
    """

    def __init__(self, registry: CollectorRegistry, address: str, port: int,
                 expected_local_ranks: int | None = None,
                 agent_state: Callable[[], dict[str, Any]] | None = None) -> None:
        self.registry, self.expected, self.agent_state = (registry, expected_local_ranks,
                                                          agent_state)
        self._metrics_app = make_wsgi_app(registry)
        server = type("_Server", (_Server,), {"address_family": _bind_family(address, port)})
        try:
            self._httpd = make_server(address, port, self._app, server, _QuietHandler)
        except OSError as e:
            raise OSError(e.errno, f"metrics endpoint {address}:{port}: {e.strerror}; choose "
                                   "another metrics.port (or metrics.address)") from e
        self.port = self._httpd.server_port
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="metrics-http",
                                        daemon=True)
        self._thread.start()
        log.info("metrics and health on http://%s:%d/metrics (/healthz /readyz /health)",
                 address, self.port)

    def health(self) -> NodeHealth:
        ranks = rank_health(self.registry.collect())
        return node_health(ranks, self.expected,
                           self.agent_state() if self.agent_state else None)

    def _app(self, environ: dict[str, Any], start_response: Callable[..., Any]
             ) -> Iterator[bytes] | list[bytes]:
        path = environ.get("PATH_INFO", "/")
        if path not in (LIVENESS, READINESS, HEALTH):
            return self._metrics_app(environ, start_response)
        verdict = self.health()
        if path == HEALTH:
            ok, body, kind = verdict.live, json.dumps(verdict.to_json(), indent=1), "json"
        else:
            ok = verdict.live if path == LIVENESS else verdict.ready
            body, kind = ("ok" if ok else verdict.reason) + "\n", "plain"
        status = "200 OK" if ok else "503 Service Unavailable"
        start_response(status, [("Content-Type", f"application/{kind}" if kind == "json"
                                 else "text/plain; charset=utf-8")])
        return [body.encode()]

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)
