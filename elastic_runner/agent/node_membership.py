"""This node's membership in a multi-node in-place job: registered, beating, watching the rest.

Several nodes: each agent registers its node's ranks in the recovery store, beats for it, and
watches the other nodes' beats (``recovery.node_timeout_seconds``); a node silent for longer is
announced lost and the rest go on without it, or take torch's restart path when they may not
(:mod:`elastic_runner.recovery.membership`). One node: nothing to do (the store lives in this
agent).
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.elastic.agent.server.api import WorkerGroup

from ..recovery.background import Stoppable
from ..recovery.membership import (
    THREAD_STORE_TIMEOUT_S,
    NoBeat,
    NodeBeat,
    NodeWatch,
    View,
    announce_departure,
    departure_of,
    read_global_batch,
    register,
)
from ..recovery.store import connect
from .node_attempt import AGENT_LOG as log
from .node_attempt import NodeAttempt
from .store_failover import StoreFailover


class NodeMembership:
    """This node in the membership of its attempt.

    Args:
        attempt: the attempt this node runs.
        node_timeout_s: ``recovery.node_timeout_seconds`` (None: no beats, nobody is lost).
        hosts_store: c10d: this node is the rendezvous host (whose store is the recovery
            store).
        failover: moves this node to another store when the one in use is gone.
    """

    def __init__(self, attempt: NodeAttempt, node_timeout_s: float | None, hosts_store: bool,
                 failover: StoreFailover) -> None:
        self._attempt, self._timeout_s = attempt, node_timeout_s
        self._hosts_store, self._failover = hosts_store, failover
        self._watch: NodeWatch | None = None  # several nodes with node_timeout_seconds
        self._beat: Stoppable = NoBeat()

    def register(self, worker_group: WorkerGroup, joined: bool = False) -> None:
        """Several nodes: register this node's ranks (``joined``: it joined a running
        attempt, which already counts it), beat, and watch the others' beats."""
        self._watch = None
        self._beat.close()
        rs, node = self._attempt.rs, self._attempt.node
        if not rs.multi_node:
            return
        # the store's host: c10d's rendezvous host; with etcd node rank 0, whose offer every
        # node took (each etcd agent hosts a store, only that one is used)
        hosts = node == 0 if rs.location.kind == "node0" else self._hosts_store
        ranks = [w.global_rank for w in worker_group.workers]
        register(rs.attempt, node, ranks, hosts,
                 None if joined else worker_group.group_world_size or 1, rs.own)
        log.info("membership: node %d registered with rank(s) %s%s", node, ranks,
                 f"; it hosts the recovery store ({rs.location.describe()})" if hosts else "")
        if self._timeout_s is not None:
            self._watch = NodeWatch(rs.attempt, node, self._timeout_s)
            self._beat = NodeBeat(rs.keys_in(connect(rs.location, THREAD_STORE_TIMEOUT_S)),
                                  node).start()

    def follow(self, store: dist.Store) -> None:
        """The recovery store moved (``store``: a client of the new one): beat and watch
        there."""
        rs, node = self._attempt.rs, self._attempt.node
        self._beat.close()
        if self._watch is not None:
            self._watch = NodeWatch(rs.keys_in(store), node, self._watch.timeout_s)
            self._beat = NodeBeat(rs.keys_in(connect(rs.location, THREAD_STORE_TIMEOUT_S)),
                                  node).start()

    def close(self) -> None:
        """Stop beating (silence after that reads as this node gone)."""
        self._beat.close()

    def departed(self) -> str | None:
        """Why this node left the group in place (``preempted``, or ``lost``: the others
        declared it lost while it was cut off), or None while it is a member."""
        if self._watch is None:
            return None
        try:
            return departure_of(self._attempt.rs.attempt, self._attempt.node)
        except (RuntimeError, dist.DistError):
            return None

    def watch_nodes(self, round_store: dist.Store) -> None:
        """When due, announce the generation without each node whose beat stopped, or take
        torch's restart path when the rest may not go on
        (:class:`~elastic_runner.recovery.membership.Policy`); follow the store when its host
        left or died (``round_store``: the rendezvous backend's, where etcd decides where)."""
        if self._watch is None or not self._watch.due():
            return
        attempt = self._attempt
        try:
            view = attempt.current_view()
        except (RuntimeError, dist.DistError) as e:  # the store's host is gone (etcd: move)
            self._failover.fail_over(e, round_store)
            return
        if attempt.node in view.departed:  # cut off and left behind: its workers are fenced out
            return
        here = attempt.rs.location.endpoint
        if view.stores.get(view.store_node, here) != here:
            self._failover.move(view.stores[view.store_node], view, "its host left")
            return
        lost = self._watch.lost(n for n in view.nodes if n not in view.departed)
        if not lost or attempt.restart_asked():
            return
        self._drop_lost(view, lost)

    def _drop_lost(self, view: View, lost: dict[int, float]) -> None:
        """Announce the generation without the ``lost`` nodes (node -> seconds silent), or
        ask for torch's restart path when the policy refuses."""
        rs, silent = self._attempt.rs, max(lost.values())
        policy = self._attempt.policy.keeping(read_global_batch(rs.attempt))
        why = policy.refuses(view, lost)
        if why is not None:
            log.error("membership: node(s) %s lost (no heartbeat for %.1f s) and the rest may "
                      "not go on without them (%s): torch's restart path", sorted(lost),
                      silent, why)
            rs.attempt.ask_restart()
            return
        done = announce_departure(rs.attempt, view, sorted(lost), "lost", rs.client)
        if done is not None:
            generation, new, _ = done
            log.warning("membership: node(s) %s lost: no heartbeat for %.1f s "
                        "(recovery.node_timeout_seconds=%g); generation %d goes on without "
                        "them at world size %d", sorted(lost), silent, self._timeout_s,
                        generation, new.world_size)
