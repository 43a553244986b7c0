"""The recovery store's fail-over: this agent follows the store to another node's agent.

Several nodes on an etcd rendezvous: every agent hosts a store and one of them is in use
(:mod:`elastic_runner.recovery.store`). When its host leaves the job (the membership names a
new store node), or dies (the store does not answer), the agents move to the successor in the
membership; etcd decides which store that is when agents disagree. c10d jobs have no
successor: the workers' failed collectives take torch's restart path instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.api import SignalException

from ..logs import first_line
from ..recovery.membership import THREAD_STORE_TIMEOUT_S, View, seed
from ..recovery.store import claim_successor, tell_workers
from .node_attempt import AGENT_LOG as log
from .node_attempt import NodeAttempt


class StoreFailover:
    """Moves this agent, its workers and its spares to another recovery store.

    Args:
        attempt: the attempt this node runs (its store, node id, generation and the
            membership last read).
        on_moved: called with a client of the new store once the workers were told: what
            waits in the old store starts again in the new one (the spare, the node's beat).
    """

    def __init__(self, attempt: NodeAttempt, on_moved: Callable[[dist.Store], None]) -> None:
        self._attempt, self._on_moved = attempt, on_moved

    def fail_over(self, error: BaseException, round_store: dist.Store) -> None:
        """The recovery store does not answer (``error``; etcd rendezvous): its host died.
        Move to the successor of the view last read, as claimed in etcd through
        ``round_store`` (the rendezvous backend's store; :func:`claim_successor
        <elastic_runner.recovery.store.claim_successor>`), seeded from that view. Without a
        successor (c10d), or with etcd unreachable too (this node is cut off), nothing moves:
        the workers' failed collectives take torch's restart path."""
        rs, view = self._attempt.rs, self._attempt.view
        successor = view.successor() if view is not None else None
        if view is None or successor is None:
            log.debug("recovery store unavailable: %s", error)
            return
        try:
            chosen = claim_successor(round_store, rs.prefix, rs.location.endpoint,
                                     view.stores[successor], THREAD_STORE_TIMEOUT_S)
        except SignalException:  # SIGTERM to the agent: torch's run() stops the workers
            raise
        except Exception as e:  # noqa: BLE001 - etcd's client raises its own types
            log.error("the recovery store (%s) is unreachable (%s), and so is the rendezvous "
                      "backend (%s): not moving it", rs.location.describe(),
                      first_line(error), first_line(e))
            return
        node = next((n for n, e in view.stores.items() if e == chosen), successor)
        self.move(chosen, view.moved_to(node), f"it does not answer ({first_line(error)})")

    def move(self, endpoint: str, view: View, why: str) -> None:
        """Follow the recovery store to ``endpoint`` (``view``: the membership there, seeded
        unless present; ``why``: for the log): acknowledge in the old store (its leaving host
        waits for that), seed the new one, tell this node's workers, then :attr:`on_moved`."""
        attempt = self._attempt
        rs, old = attempt.rs, attempt.rs.location.describe()
        with contextlib.suppress(RuntimeError, dist.DistError):
            rs.attempt.acknowledge_move(attempt.node, endpoint)
        store = rs.client(endpoint)
        seed(rs.keys_in(store), view, max(attempt.generation, view.generation))
        rs.use(endpoint, store)
        attempt.view = view
        tell_workers(attempt.heartbeats, rs.for_workers())
        self._on_moved(store)
        log.warning("the recovery store moved from %s to node %d's agent (%s): %s", old,
                    view.store_node, endpoint, why)
