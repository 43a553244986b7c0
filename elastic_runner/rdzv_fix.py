"""Fixes, applied in the agent that ``elastic-runner run`` hosts, for torch 2.13's dynamic
rendezvous (c10d, etcd-v2). Plain torchrun does not get them (see the README for what to set).

1. **Stale bootstrap store when a node's rank changes.** ``next_rendezvous`` caches the workers'
   bootstrap store (MASTER_ADDR / MASTER_PORT) of the first round and rebuilds it only when the
   node *becomes* rank 0. A node that was rank 0 and is rank 1 in a later round (another node
   joined, or the old rank-0 node left and came back) keeps pointing its workers at its own
   store while the new rank 0's workers use another one: the restarted group never forms. Seen
   here with etcd-v2 and a node joining a running job. We forget the cached info before every
   round, so each round publishes a fresh store address through that round's rendezvous store
   (rank 0 also gets a fresh TCPStore, which leaves no keys of earlier attempts behind). Under
   plain torchrun set ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (torch's own switch).
2. **Rendezvous backend outages.** The agent polls the backend every ``--monitor-interval`` for
   waiting nodes and fails the whole job when that poll cannot reach etcd; training does not
   need the backend between restarts, so the poll now reports "no waiting nodes" while the
   backend is unreachable (nodes cannot join until it is back). A rendezvous that cannot reach
   the backend is retried every second until its join timeout instead of failing at once.
"""

from __future__ import annotations

import functools
import logging
import time

from torch.distributed.elastic.rendezvous import RendezvousConnectionError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

log = logging.getLogger(__name__)

_RETRY_S = 1.0
_MARK = "_elastic_runner_fix"


def apply() -> bool:
    """Patch ``DynamicRendezvousHandler`` in this process (idempotent). Returns False, with a
    warning, when torch's internals no longer look as expected."""
    if getattr(DynamicRendezvousHandler.next_rendezvous, _MARK, False):
        return True
    names = DynamicRendezvousHandler.__init__.__code__.co_names
    if "_bootstrap_store_info" not in names or "_shared_tcp_store_server" not in names:
        log.warning("torch's DynamicRendezvousHandler changed; rendezvous fixes not applied")
        return False
    DynamicRendezvousHandler.next_rendezvous = _fresh_store(  # type: ignore[method-assign]
        _retry_until_join_timeout(DynamicRendezvousHandler.next_rendezvous))
    DynamicRendezvousHandler.num_nodes_waiting = _tolerate_outage(  # type: ignore[method-assign]
        DynamicRendezvousHandler.num_nodes_waiting)
    return True


def _fresh_store(next_rendezvous):  # type: ignore[no-untyped-def]
    @functools.wraps(next_rendezvous)
    def wrapper(self: DynamicRendezvousHandler):  # type: ignore[no-untyped-def]
        self._bootstrap_store_info = None
        self._shared_tcp_store_server = None
        return next_rendezvous(self)

    setattr(wrapper, _MARK, True)
    return wrapper


def _retry_until_join_timeout(next_rendezvous):  # type: ignore[no-untyped-def]
    @functools.wraps(next_rendezvous)
    def wrapper(self: DynamicRendezvousHandler):  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + self._settings.timeout.join.total_seconds()
        while True:
            try:
                return next_rendezvous(self)
            except RendezvousConnectionError as e:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise
                log.warning("rendezvous backend unreachable (%s); retrying for up to %.0f s "
                            "(join_timeout)", _first_line(e), left)
                time.sleep(_RETRY_S)

    return wrapper


def _tolerate_outage(num_nodes_waiting):  # type: ignore[no-untyped-def]
    last_warning = [0.0]

    @functools.wraps(num_nodes_waiting)
    def wrapper(self: DynamicRendezvousHandler) -> int:
        try:
            return num_nodes_waiting(self)
        except RendezvousConnectionError as e:
            if time.monotonic() - last_warning[0] > 30:
                last_warning[0] = time.monotonic()
                log.warning("rendezvous backend unreachable (%s): training continues; nodes "
                            "cannot join until it is back", _first_line(e))
            return 0

    return wrapper


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
