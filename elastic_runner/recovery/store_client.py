"""A worker's client of the job's recovery store (:mod:`elastic_runner.recovery.store`), which
follows the store when it moves: with etcd the store is a TCPStore in one agent, and the agents
move it to another node when its host leaves or dies. The attempt's keys stay behind
:class:`~elastic_runner.protocol.keys.AttemptKeys` (:class:`~elastic_runner.protocol.client.AttemptClient`)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch.distributed as dist

from ..protocol import env
from ..protocol.client import AttemptClient
from ..protocol.counting import counted
from .store import StoreLocation, connect, told

# the worker's recovery log lines keep the logger name they always had (bench and operators
# read them by it)
log = logging.getLogger("elastic_runner.recovery.inplace")

_MOVE_POLL_S = 0.01  # a look at the agent's note of where the store went (seconds)


class StoreClient(AttemptClient):
    """The recovery store in use and where it is.

    Args:
        store: a client of the job's recovery store (its operations counted from here on,
            :mod:`elastic_runner.protocol.counting`); ``prefix``: this attempt's keys in it.
        location: where the store is (for log lines, and to reconnect when it moves).
        timeout_s: a new client's limit for one store operation (seconds;
            ``recovery.join_timeout_seconds``).
    """

    def __init__(self, store: dist.Store, prefix: str, location: StoreLocation,
                 timeout_s: float) -> None:
        self.store, self.prefix, self.location = counted(store), prefix, location
        self.timeout_s = timeout_s
        # one TCPStore on one node; across nodes (c10d, etcd) a generation watch is needed
        self.multi_node = location.kind != "tcp"

    def client(self, endpoint: str) -> dist.Store:
        """A client of the store at ``endpoint`` (``host:port``).

        Raises:
            RuntimeError: the store does not answer within ``timeout_s``.
        """
        return connect(self.location.at(endpoint, self.prefix), self.timeout_s)

    def switch(self, endpoint: str) -> None:
        """The recovery store moved to ``endpoint``: this process uses it from now on (its
        :class:`~elastic_runner.recovery.generation_watch.GenerationWatch` follows).

        Raises:
            RuntimeError: the store at ``endpoint`` does not answer.
        """
        if endpoint != self.location.endpoint:
            self.store = self.client(endpoint)
            self.location = self.location.at(endpoint, self.prefix)
            log.info("the recovery store moved to %s", endpoint)

    def follow_agent(self, deadline: float, generation: int) -> bool:
        """The recovery store does not answer: wait (until the monotonic ``deadline``) for
        this node's agent to name the store that took over (etcd: the agents move it when its
        host died; :data:`~elastic_runner.recovery.store.STORE_FILE`). Returns whether it
        did: this process then uses it, and raises the generation counter to ``generation``
        (this process's) so no announcement there reuses a number."""
        directory = env.heartbeat_dir()
        if self.location.kind != "node0" or not directory:
            return False
        dead = self.location.endpoint
        while time.monotonic() < deadline:
            location = told(Path(directory))
            if location is not None and location.endpoint != dead:
                try:
                    self.switch(location.endpoint)
                    self.attempt.raise_generations(generation)
                except (RuntimeError, dist.DistError):  # gone too (two nodes lost at once)
                    return False
                log.warning("in-place recovery: the recovery store at %s does not answer; "
                            "this node's agent moved it to %s", dead, location.endpoint)
                return True
            time.sleep(_MOVE_POLL_S)
        return False
