"""One agent's hold on in-place recovery's store: the store it hosts, the one in use, moving.

Where the store lives and how it moves between nodes is :mod:`elastic_runner.recovery.store`;
:class:`AgentStore` is the agent's state in that scheme, kept apart from the agent's worker
handling (:mod:`elastic_runner.agent.inplace_agent` and its parts): the ``TCPStore`` this agent hosts, the location
and a client of the store in use, the attempt's key prefix, and the wait of a leaving host for
the agents that follow its store to another node.
"""

from __future__ import annotations

import logging
import socket
import time
from datetime import timedelta

import torch.distributed as dist

from ..protocol.client import AttemptClient
from ..protocol.counting import COUNTS, counted
from ..recovery.membership import read_view
from ..recovery.store import StoreLocation, agree_attempt, connect

log = logging.getLogger(__name__)


class AgentStore(AttemptClient):
    """The attempt's recovery store as one agent holds it.

    Args:
        location: where a multi-node job's store is (:meth:`StoreLocation.for_rendezvous
            <elastic_runner.recovery.store.StoreLocation.for_rendezvous>`); None: one node,
            this agent hosts the store on ``127.0.0.1``.
        timeout_s: the clients' limit for one store operation (``recovery.join_timeout_seconds``),
            seconds.
        host: the address torch advertises for this node (``--local-addr``; None: its fully
            qualified host name, as torch's agent uses): where the other nodes reach the
            store this agent hosts.

    Attributes:
        location: the store in use (its ``prefix`` empty: that is :attr:`prefix`).
        prefix: this attempt's keys; empty until the rendezvous round is known.
        hosted: the ``TCPStore`` server this agent hosts (one node; every agent of an etcd job,
            used while its node is the store's host), else None; its operations counted, as
            every client's of this agent (:mod:`elastic_runner.protocol.counting`: this
            process counts as ``agent``).
        own: ``host:port`` of :attr:`hosted` as other nodes reach it (etcd only; else empty).
    """

    def __init__(self, location: StoreLocation | None, timeout_s: float,
                 host: str | None) -> None:
        self.timeout_s, self.prefix = timeout_s, ""
        COUNTS.role = "agent"
        self.hosted: dist.Store | None = None
        if location is None or location.kind == "node0":
            self.hosted = counted(dist.TCPStore("127.0.0.1", 0, is_master=True,
                                                wait_for_workers=False,
                                                timeout=timedelta(seconds=timeout_s)))
        self._client: dist.Store | None = None
        if location is None:  # one node: the store lives in this process
            self._client = self.hosted
            location = StoreLocation("tcp", f"127.0.0.1:{self.hosted.port}")  # type: ignore
        self.location = location
        self.own = ""
        if self.hosted is not None and location.kind == "node0":
            self.own = (f"{host or socket.getfqdn(socket.gethostname())}:"
                        f"{self.hosted.port}")  # type: ignore[attr-defined]

    @property
    def multi_node(self) -> bool:
        return self.location.kind != "tcp"

    @property
    def store(self) -> dist.Store:
        """A client of the store in use, connected at first use (after the rendezvous: the
        store exists then).

        Raises:
            torch.distributed.DistStoreError: the store does not answer within
                :attr:`timeout_s`.
        """
        if self._client is None:
            self._client = connect(self.location, self.timeout_s)
        return self._client

    def for_workers(self) -> StoreLocation:
        """The location the workers and spares get (:data:`~elastic_runner.protocol.env.INPLACE_ENV`)."""
        return self.location.at(self.location.endpoint, self.prefix)

    def client(self, endpoint: str) -> dist.Store:
        """A client of the store at ``endpoint`` (``host:port``; this agent's own: the server
        itself)."""
        if endpoint == self.own and self.hosted is not None:
            return self.hosted
        return connect(self.location.at(endpoint, ""), self.timeout_s)

    def use(self, endpoint: str, store: dist.Store | None = None) -> None:
        """The store in use is at ``endpoint`` from now on (``store``: a client of it
        already made; None: connect at first use)."""
        self.location, self._client = self.location.at(endpoint, ""), store

    def agree(self, round_store: dist.Store, node_rank: int, nnodes: int,
              running: tuple[str, str] | None = None) -> bool:
        """Several nodes: this round's prefix and store, as node rank 0's agent says
        (:func:`~elastic_runner.recovery.store.agree_attempt`; its offer: the store it hosts,
        or the rendezvous backend's), or the attempt that some node's workers still run
        (``running``: this node's prefix and endpoint). Returns whether the attempt was
        running (the round lets nodes join it)."""
        attempt = agree_attempt(round_store, node_rank, nnodes, self.location.run_id,
                                self.own or self.location.endpoint, running)
        self.prefix = attempt.prefix
        if attempt.endpoint != self.location.endpoint:  # node rank 0 changed: another store
            self.use(attempt.endpoint)
        return attempt.running

    def wait_for_followers(self, node: int, timeout_s: float) -> None:
        """This agent's node (``node``) leaves and the store it hosts moved to another node:
        stay until every remaining node's agent acknowledged the move (``moved/<n>``, written
        by the agents as they follow), at most ``timeout_s`` seconds. Returns at once when
        this agent's store is not the one in use or did not move."""
        if self.hosted is None or self.location.endpoint != self.own:
            return
        try:
            view = read_view(self.keys_in(self.hosted))
        except (RuntimeError, dist.DistError):
            return
        if view.store_node == node:
            return
        hosted, nodes = self.keys_in(self.hosted), list(view.nodes)
        deadline = time.monotonic() + timeout_s
        while not hosted.moves_acknowledged(nodes) and time.monotonic() < deadline:
            time.sleep(0.05)
        log.info("membership: the recovery store moved to node %d; %s", view.store_node,
                 "every agent followed" if hosted.moves_acknowledged(nodes) else
                 "not every agent followed in time")
