"""The agent's policy for an outage of the rendezvous backend (fix 2 of
:mod:`elastic_runner.compat`; its torch internals are listed and checked in
:mod:`elastic_runner.compat.rendezvous`), and its patch of torch's rendezvous classes.

Torch fails the whole job when the backend (etcd) is unreachable: the agent polls
``DynamicRendezvousHandler.num_nodes_waiting`` every ``--monitor-interval`` and a
``RendezvousConnectionError`` there ends the run. :func:`apply_rendezvous_fixes` wraps it to
report 0 waiting nodes while the backend is unreachable, and ``next_rendezvous`` to retry a
``RendezvousConnectionError`` every second until the join timeout
(``self._settings.timeout.join``). Torch has no switch for either. Without them a backend
outage fails the job, as under plain torchrun.

It also patches ``_BackendRendezvousStateHolder`` (``sync``, ``_sanitize``, ``_state``,
``_settings``; the handler's ``_state_holder`` and ``_this_node``) so that heartbeats nobody
could write do not make nodes dead. Torch's ``_sanitize`` drops every node whose last
keep-alive is older than ``keep_alive_interval * keep_alive_max_attempt``, on every read of the
state, its own node included; and ``_should_keep_alive`` never beats again for a node that is
no longer listed. So after an outage longer than that lapse every running node drops itself at
its first read, stops beating, and the next node to arrive finds no participants and forms a
rendezvous round of its own beside the running group (which fencing then stops). With the
patch a node never expires its own heartbeat, and a node that saw the backend unreachable
expires no heartbeat until one lapse after it is back, as etcd renews its leases after a leader
change, so the running nodes beat again before anyone judges them.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousConnectionError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

from ..compat.fix import applies
from ..compat.rendezvous import FIX_OUTAGE, state_holder_class
from ..logs import first_line

log = logging.getLogger(__name__)

_RETRY_S = 1.0
_MARK = "_elastic_runner_fix"


def apply_rendezvous_fixes(cls: type = DynamicRendezvousHandler,
                           holder: type | None = None) -> bool:
    """Patch ``cls`` (torch's ``DynamicRendezvousHandler``; a subclass in tests) and ``holder``
    (its state holder class; default torch's) in this process with the outage tolerance of
    fix 2 (idempotent). Returns False, without patching, when the methods no longer look as
    expected (:func:`~elastic_runner.compat.registry.check_torch` has said so)."""
    if getattr(cls.__dict__.get("next_rendezvous"), _MARK, False):
        return True
    if not applies(FIX_OUTAGE):
        return False
    holder = holder or state_holder_class()
    cls.next_rendezvous = _retry_until_join_timeout(cls.next_rendezvous)  # type: ignore
    cls.num_nodes_waiting = _tolerate_outage(cls.num_nodes_waiting)  # type: ignore
    if not getattr(holder.__dict__.get("sync"), _MARK, False):
        holder.sync = _grace_after_outage(holder.sync)  # type: ignore
        holder._sanitize = _spare_own_heartbeat(holder._sanitize)  # type: ignore
    return True


_GRACE_UNTIL = "_elastic_runner_grace_until"  # monotonic s; inf while the backend is unreachable
_SYNC_STARTED = "_elastic_runner_sync_started"  # monotonic s: when the running sync began
_OWN_NODE = "_elastic_runner_node"


def _lapse_s(holder: Any) -> float:
    """The keep-alive lapse after which torch expires a node (seconds)."""
    s = holder._settings
    return (s.keep_alive_interval * s.keep_alive_max_attempt).total_seconds()


def _grace_after_outage(sync: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``sync`` that starts a grace period when the backend answers again: while it lasts
    (one keep-alive lapse) ``_sanitize`` expires nobody, so the nodes that could not beat during
    the outage beat again before they are judged. An outage is a sync that failed to connect,
    or one that hung (a stopped server: the read returns once it runs again, and no error is
    raised; :func:`_spare_own_heartbeat` sees that from the sync's start time)."""
    @functools.wraps(sync)
    def wrapper(self: Any) -> Any:
        setattr(self, _SYNC_STARTED, time.monotonic())
        try:
            result = sync(self)
        except RendezvousConnectionError:
            setattr(self, _GRACE_UNTIL, float("inf"))
            raise
        if getattr(self, _GRACE_UNTIL, 0.0) == float("inf"):
            _start_grace(self)
        return result

    setattr(wrapper, _MARK, True)
    return wrapper


def _start_grace(holder: Any) -> None:
    setattr(holder, _GRACE_UNTIL, time.monotonic() + _lapse_s(holder))
    log.warning("rendezvous backend reachable again: no node's keep-alive expires for %.0f s, "
                "so the running nodes beat again first", _lapse_s(holder))


def _spare_own_heartbeat(sanitize: Callable[[Any], None]) -> Callable[[Any], None]:
    """``_sanitize`` that expires nobody during the grace after an outage and never expires
    this process's own node (which is alive: it is running this code)."""
    @functools.wraps(sanitize)
    def wrapper(self: Any) -> None:
        started = getattr(self, _SYNC_STARTED, None)
        if started is not None and time.monotonic() - started \
                > self._settings.keep_alive_interval.total_seconds():
            # this read waited on a hung backend (seen: etcd SIGSTOPped; torch then reports a
            # RendezvousTimeoutError, not a connection error): every beat is stale alike
            _start_grace(self)
        if time.monotonic() < getattr(self, _GRACE_UNTIL, 0.0):
            self._dead_nodes = []
            return
        beats = self._state.last_heartbeats
        node = getattr(self, _OWN_NODE, None)
        own = beats.pop(node, None) if node is not None else None
        try:
            sanitize(self)
        finally:
            if own is not None:
                beats[node] = own

    return wrapper


def _retry_until_join_timeout(next_rendezvous: Callable[[Any], Any]) -> Callable[[Any], Any]:
    @functools.wraps(next_rendezvous)
    def wrapper(self: DynamicRendezvousHandler) -> Any:
        setattr(self._state_holder, _OWN_NODE, self._this_node)
        deadline = time.monotonic() + self._settings.timeout.join.total_seconds()
        while True:
            try:
                return next_rendezvous(self)
            except RendezvousConnectionError as e:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise
                log.warning("rendezvous backend unreachable (%s); retrying for up to %.0f s "
                            "(join_timeout)", first_line(e), left)
                time.sleep(_RETRY_S)

    setattr(wrapper, _MARK, True)
    return wrapper


def _tolerate_outage(num_nodes_waiting: Callable[[Any], int]) -> Callable[[Any], int]:
    last_warning = [0.0]

    @functools.wraps(num_nodes_waiting)
    def wrapper(self: DynamicRendezvousHandler) -> int:
        try:
            return num_nodes_waiting(self)
        except RendezvousConnectionError as e:
            if time.monotonic() - last_warning[0] > 30:
                last_warning[0] = time.monotonic()
                log.warning("rendezvous backend unreachable (%s): training continues; nodes "
                            "cannot join until it is back", first_line(e))
            return 0

    return wrapper
