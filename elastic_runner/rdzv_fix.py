"""A fix, applied in the agent that ``elastic-runner run`` hosts, for torch 2.13's dynamic
rendezvous (c10d, etcd-v2) when a node's rank changes between rounds.

``DynamicRendezvousHandler.next_rendezvous`` caches the workers' bootstrap store (MASTER_ADDR /
MASTER_PORT) of the first round and rebuilds it only when the node *becomes* rank 0. A node that
was rank 0 and is rank 1 in a later round (another node joined, or the old rank-0 node left and
came back) keeps pointing its workers at its own store while the new rank 0's workers use
another one: the restarted group never forms (each rank waits for peers in a different store).
Seen here with etcd-v2 and a node joining a running job.

The fix forgets the cached info before every round, so each round publishes a fresh store
address through that round's rendezvous store (rank 0 also gets a fresh TCPStore, which also
leaves no keys of earlier attempts behind). Plain torchrun does not get this patch; there, set
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (torch's own switch: every round gets a new store
hosted by the rank-0 worker).
"""

from __future__ import annotations

import functools
import logging

from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

log = logging.getLogger(__name__)


def apply() -> bool:
    """Patch ``DynamicRendezvousHandler.next_rendezvous`` in this process (idempotent).
    Returns False, with a warning, when torch's internals no longer look as expected."""
    original = DynamicRendezvousHandler.next_rendezvous
    if getattr(original, "_elastic_runner_fix", False):
        return True
    probe = DynamicRendezvousHandler.__init__.__code__.co_names
    if "_bootstrap_store_info" not in probe or "_shared_tcp_store_server" not in probe:
        log.warning("torch's DynamicRendezvousHandler changed; bootstrap-store fix not applied")
        return False

    @functools.wraps(original)
    def next_rendezvous(self: DynamicRendezvousHandler):  # type: ignore[no-untyped-def]
        self._bootstrap_store_info = None
        self._shared_tcp_store_server = None
        return original(self)

    next_rendezvous._elastic_runner_fix = True  # type: ignore[attr-defined]
    DynamicRendezvousHandler.next_rendezvous = next_rendezvous  # type: ignore[method-assign]
    return True
