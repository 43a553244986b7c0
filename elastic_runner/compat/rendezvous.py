"""The rendezvous: what elastic-runner relies on in torch's ``DynamicRendezvousHandler`` and
its etcd backends (files under ``torch/distributed/elastic/rendezvous/`` of torch 2.13).

1. **Rendezvous store switch** (``dynamic_rendezvous.py``, required, agent).
   ``DynamicRendezvousHandler.next_rendezvous`` caches the workers' bootstrap store
   (``_bootstrap_store_info``, ``_shared_tcp_store_server``) of the first round and rebuilds it
   only when the node *becomes* rank 0, so a node whose rank changes from 0 to 1 (a node joined,
   or the old rank 0 left and came back) keeps pointing its workers at a store the new rank 0's
   workers do not use: the restarted group never forms. Torch's own switch
   ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` makes ``next_rendezvous`` return early with a fresh
   ``RendezvousStoreInfo.build(...)`` (``api.py``: rank 0 publishes a free port through that
   round's rendezvous store) every round, and ``use_agent_store`` False, so the workers' rank 0
   hosts a new store per attempt. ``elastic-runner run`` sets it in the agent's environment
   (:data:`RDZV_SWITCHES`); it replaced a patch that reset the two cached attributes. It is the
   only required fix: losing it breaks elastic membership changes silently (a hang until the
   rendezvous times out).
2. **Rendezvous outage tolerance** (``dynamic_rendezvous.py``, optional, agent). The policy
   (retry until the join timeout, report no waiting nodes while the backend is unreachable, a
   grace after an outage before any heartbeat expires) and its patch of torch's classes live
   with the agent, in :mod:`elastic_runner.agent.rendezvous_outage`, which says why. Here:
   :data:`FIX_OUTAGE`, whose check verifies what the patch wraps and reads
   (``DynamicRendezvousHandler.next_rendezvous``/``num_nodes_waiting`` taking only ``self``,
   ``self._settings``, ``self._state_holder``, ``self._this_node``, ``RendezvousTimeout.join``,
   and ``_BackendRendezvousStateHolder.sync``/``_sanitize`` expiring
   ``self._state.last_heartbeats`` into ``self._dead_nodes``), and :func:`state_holder_class`.
6. **etcd rendezvous options** (``etcd_rendezvous_backend.py`` and ``etcd_rendezvous.py``:
   ``_create_etcd_client``, ``create_rdzv_handler``; ``utils.py``: ``parse_rendezvous_endpoint``;
   tests only). The two etcd backends spell TLS files and the join timeout differently
   (:data:`ETCD_OPTION_SPELLINGS`) and default the join timeout to
   :data:`DEFAULT_JOIN_TIMEOUT_S`.

Beside them, two uses of the handler's private names that no fix gates:
:func:`names_this_machine` and :func:`leave_rendezvous_open` (their names are listed by fix 9,
in-place recovery, which needs both).
"""

from __future__ import annotations

import inspect
from typing import Any

from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousTimeout,
)

from .fix import Fix, mentions, mentions_name

_DR = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"

# --- 1. rendezvous store switch ---

SHARE_STORE_SWITCH = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
RDZV_SWITCHES: dict[str, str] = {SHARE_STORE_SWITCH: "1"}
"""Environment the agent runs with (``elastic-runner run`` sets each unless the user did)."""


def _check_share_store_switch() -> str | None:
    prop = inspect.getattr_static(DynamicRendezvousHandler, "use_agent_store", None)
    if not isinstance(prop, property) or prop.fget is None:
        return "DynamicRendezvousHandler.use_agent_store is gone"
    if not mentions(prop.fget, SHARE_STORE_SWITCH):
        return f"DynamicRendezvousHandler.use_agent_store no longer reads {SHARE_STORE_SWITCH}"
    if not mentions(DynamicRendezvousHandler.next_rendezvous, SHARE_STORE_SWITCH):
        return f"DynamicRendezvousHandler.next_rendezvous no longer reads {SHARE_STORE_SWITCH}"
    return None


FIX_STORE_SWITCH = Fix(
    "the rendezvous store switch (node join/leave)", ("agent",), True, _check_share_store_switch,
    "a node whose rank changes between rounds may hang the restarted group")


# --- 2. rendezvous outage tolerance (the policy and its patch: agent/rendezvous_outage.py) ---

def _check_outage_patch() -> str | None:
    for name in ("next_rendezvous", "num_nodes_waiting"):
        fn = getattr(DynamicRendezvousHandler, name, None)
        if fn is None or list(inspect.signature(fn).parameters) != ["self"]:
            return f"DynamicRendezvousHandler.{name}(self) is gone or takes other arguments"
    if not mentions_name(inspect.unwrap(DynamicRendezvousHandler.__init__), "_settings"):
        return "DynamicRendezvousHandler no longer keeps its settings in self._settings"
    if not isinstance(inspect.getattr_static(RendezvousTimeout, "join", None), property):
        return "RendezvousTimeout.join is gone"
    init = inspect.unwrap(DynamicRendezvousHandler.__init__)
    for name in ("_state_holder", "_this_node"):
        if not mentions_name(init, name):
            return f"DynamicRendezvousHandler no longer keeps self.{name}"
    holder = state_holder_class()
    for name in ("sync", "_sanitize"):
        fn = getattr(holder, name, None)
        if fn is None or list(inspect.signature(fn).parameters) != ["self"]:
            return f"_BackendRendezvousStateHolder.{name}(self) is gone or takes other arguments"
    if not all(mentions_name(inspect.unwrap(holder._sanitize), n)
               for n in ("_state", "last_heartbeats", "_dead_nodes")):
        return "_BackendRendezvousStateHolder._sanitize no longer expires self._state.last_heartbeats"
    return None


def state_holder_class() -> type:
    """torch's ``_BackendRendezvousStateHolder`` (private: imported here, where fix 2 needs it).

    Raises:
        ImportError: this torch has no such class."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        _BackendRendezvousStateHolder,
    )

    return _BackendRendezvousStateHolder


FIX_OUTAGE = Fix(
    "the rendezvous outage tolerance", ("agent",), False, _check_outage_patch,
    "an unreachable rendezvous backend fails the job, as under plain torchrun",
    (f"{_DR}:DynamicRendezvousHandler._settings", f"{_DR}:DynamicRendezvousHandler._state_holder",
     f"{_DR}:DynamicRendezvousHandler._this_node", f"{_DR}:_BackendRendezvousStateHolder",
     f"{_DR}:_BackendRendezvousStateHolder._sanitize",
     f"{_DR}:_BackendRendezvousStateHolder._state",
     f"{_DR}:_BackendRendezvousStateHolder._dead_nodes"))


# --- 6. etcd rendezvous options ---

ETCD_BACKENDS = ("etcd-v2", "etcd")  # torchrun's --rdzv-backend names of its two etcd backends
# (etcd-v2 spelling, legacy etcd spelling) of the same rendezvous option
ETCD_OPTION_SPELLINGS = (("ca_cert", "cacert"), ("ssl_cert", "cert"), ("ssl_cert_key", "key"),
                         ("join_timeout", "timeout"))
DEFAULT_JOIN_TIMEOUT_S = 600  # both backends' default join timeout, seconds


# --- the handler's private names that in-place recovery (fix 9) uses ---

def names_this_machine(host: str) -> bool:
    """Whether ``host`` (a name or address) is this machine, by torch's own rule for whether an
    agent hosts the c10d rendezvous store (``_matches_machine_hostname`` in
    ``torch.distributed.elastic.rendezvous.utils``, private; kept here with the other uses of
    torch internals). Without it (a torch that renamed it): whether ``host`` is this machine's
    host name, fully qualified name or a loopback address."""
    try:
        from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname
    except ImportError:
        import socket

        return host in ("localhost", "127.0.0.1", "::1", socket.gethostname(),
                        socket.getfqdn())
    return _matches_machine_hostname(host)


def leave_rendezvous_open(handler: Any) -> None:
    """Make ``handler.shutdown()`` (torch's agent calls it when it ends) stop this node's
    keep-alive heartbeats without closing the rendezvous: a node that left a running job in
    place ends, the others go on in it. The heartbeats must stop: their timer thread (a daemon)
    would otherwise still be inside a store call when the interpreter exits, and a daemon
    thread that finalization stops in C++ code aborts the process ("terminate called without an
    active exception", exit -6; seen after a partition healed). ``_stop_heartbeats`` is private
    to torch's ``DynamicRendezvousHandler`` (etcd-v2 and c10d); other handlers keep theirs."""
    stop = getattr(handler, "_stop_heartbeats", lambda: None)

    def shutdown() -> bool:
        stop()
        return False

    handler.shutdown = shutdown


FIXES: tuple[Fix, ...] = (FIX_STORE_SWITCH, FIX_OUTAGE)
