"""A worker's watch for a newer generation while it waits in a collective, across nodes: a
partitioned node's peers get no reset and no error, their collective just never completes (gloo
has no abort, see :mod:`elastic_runner.recovery.group_sockets`). Also notes whether a node asks
to join (the step vote stops for it)."""

from __future__ import annotations

import logging
import socket
import threading

import torch.distributed as dist

from .group_formation import GroupFormation
from .membership import THREAD_STORE_TIMEOUT_S, joins_waiting
from .node_changes import NodeChanges
from .store import connect
from .store_client import StoreClient

# the worker's recovery log lines keep the logger name they always had (bench and operators
# read them by it)
log = logging.getLogger("elastic_runner.recovery.inplace")


class NoWatch:
    """No generation watch (one node: a dead peer's connections reset on their own)."""

    def close(self) -> None:
        pass


class GenerationWatch:
    """Breaks this worker's collective when a newer generation (or torch's restart path) is
    announced while it waits. A daemon thread looks every ``interval_s`` (seconds) through its
    own client of ``client``'s store and, once an announcement that a peer cannot finish the
    collective is there (a failed worker, a lost node, the restart path; not a departure at a
    step boundary or a join, see :meth:`_must_leave_collective`), shuts down the current group's
    connections (``formation.sockets``) both ways, so this rank's waiting collective (and any
    peer's that waits on this rank) fails at once and
    :meth:`InPlaceRecovery.recover <elastic_runner.recovery.inplace.InPlaceRecovery.recover>`
    follows the announcement. It also sets ``nodes.join_waiting``. Several nodes only (on one
    node a dead peer's connections reset)."""

    def __init__(self, client: StoreClient, formation: GroupFormation, nodes: NodeChanges,
                 interval_s: float = 0.1) -> None:
        self.client, self.formation, self.nodes = client, formation, nodes
        self.interval_s = interval_s
        self._store = self._connect()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="generation-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        sockets = self.formation.sockets
        endpoint, broken = self.client.location.endpoint, False
        while not self._stop.wait(self.interval_s):
            epoch = sockets.epoch  # before the generation: see GroupSockets.cut
            try:
                # the recovery store moved, or this client failed: a new client
                if broken or self.client.location.endpoint != endpoint:
                    endpoint = self.client.location.endpoint
                    self._store, broken = self._connect(), False
                announced = self._must_leave_collective(self.formation.generation + 1)
                self.nodes.join_waiting = joins_waiting(self.client.keys_in(self._store))
            except (RuntimeError, dist.DistError):  # store unreachable (partitioned): wait
                broken = True
                continue
            if announced and sockets.cut(epoch, socket.SHUT_RDWR):
                log.warning("generation %d was announced while this rank waited in a "
                            "collective: leaving it", self.formation.generation + 1)

    def _must_leave_collective(self, generation: int) -> bool:
        """Whether generation ``generation`` (or the restart path) was announced in a way this
        rank's collective cannot finish: a peer failed, or a node was lost. Not a departure at a
        step boundary or a join: their announcer writes the announcement while every rank is
        in the same collective with it, which completes on its own (cut short, a rank of the
        membership soak hung in that broadcast until its step watchdog fired).

        Raises:
            RuntimeError: the store is unreachable.
        """
        keys = self.client.keys_in(self._store)
        if keys.restart_asked():
            return True
        announced = keys.announcement(generation)
        return announced is not None and announced.cuts_collectives

    def _connect(self) -> dist.Store:
        """A client of the recovery store for this thread; its socket is never taken for a
        process group's (:meth:`GroupSockets.outside
        <elastic_runner.recovery.group_sockets.GroupSockets.outside>`)."""
        with self.formation.sockets.outside():
            return connect(self.client.location, THREAD_STORE_TIMEOUT_S)

    def close(self) -> None:
        """Stop watching; waits for the thread (at most its store's timeout): a daemon thread
        still inside a store call when the interpreter exits aborts the process."""
        self._stop.set()
        self._thread.join(timeout=THREAD_STORE_TIMEOUT_S + 1)
