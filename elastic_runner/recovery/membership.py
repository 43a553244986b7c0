"""Which nodes are in a multi-node job's group, and a node that leaves without a restart.

torchrun's elasticity is restart-all: a node that leaves stops every worker on every node.
Under ``elastic-runner run`` with in-place recovery across nodes (``recovery/store.py``) a
node that leaves is instead one more *generation* of the process group
(:mod:`elastic_runner.recovery.inplace`): the survivors re-form it without the node, renumbered, at the
smaller world size (``batch.global_batch_size`` keeps the global batch), from their own state;
no process starts and no checkpoint is read. Two ways a node leaves:

* **preempted** (SIGTERM to its agent: a pod eviction, a spot notice): its workers leave at the
  next step boundary (the step vote carries the stop; :meth:`InPlaceRecovery.leave
  <elastic_runner.recovery.inplace.InPlaceRecovery.leave>` tells the ranks that stay from those that go)
  and exit 143;
* **lost** (killed, or cut off by a partition): its agent's heartbeat in the recovery store
  stops; after ``recovery.node_timeout_seconds`` another node's agent announces the generation
  without it (:class:`NodeWatch`). A lost node that comes back (a healed partition) finds itself
  departed: its workers exit 3 (fenced out) and commit nothing.

A node that **joins** (a replacement pod, a new node within ``--nnodes`` MAX) is a generation
too: torch's rendezvous lets it in (the running agents take the new round without stopping their
workers: :mod:`elastic_runner.agent.joins`), its workers build the task and wait, its agent
posts a join request (:func:`request_join`); the running ranks stop at their next step boundary
(the step vote again), rank 0 announces the generation with the node's ranks appended
(:func:`announce_join`), and the group re-forms at the larger world size, the joiners getting
the state from a live peer.

Keys, under the attempt's prefix in the recovery store (built and read only by
:class:`~elastic_runner.protocol.keys.MembershipKeys`, which the functions here take):

``node/<n>/ranks``
    node rank ``n``'s workers' global ranks at the attempt's start, by local rank (its agent
    sets it before starting them).
``node/<n>/store``
    etcd rendezvous only: the ``host:port`` of the store node ``n``'s agent hosts, where the
    recovery store moves when the node hosting it leaves (:meth:`View.successor`).
``node/<n>/beat``
    a counter node ``n``'s agent adds to every :attr:`NodeBeat.interval_s` (from a thread).
``node/<n>/leaving``
    set by node ``n``'s agent when it got SIGTERM: the others do not count it lost meanwhile.
``view``
    the current :class:`View` (JSON), written on every change by the process that claimed
    it (the ``departed/<n>`` claim, or rank 0 for a join).
``departed/<n>``
    the claim of whoever announces node ``n``'s departure (so it is announced once).
``moved/<n>``
    set in the store being left by node ``n``'s agent once it follows the recovery store to
    its new host (the departing host's agent waits for these before it ends).
``node/<n>/claim``
    a joining node's claim of node id ``n`` (:func:`claim_node_id`).
``joins``, ``join/<i>``
    the number of join requests, and request ``i``: ``{"node", "nproc"}`` (:func:`request_join`).
``admitted/<n>``
    the generation that took joining node ``n`` in, its ranks and the new world size
    (:func:`announce_join`).
``joins_admitted``
    the last join request answered (taken in, or refused: ``join/<i>/refused`` says why).

The generation announcement itself (``gen/<g>``) is an
:class:`~elastic_runner.protocol.announcement.Announcement`, with ``departed`` or ``joined``, ``members`` (the old global ranks that stay, in their new order: new
rank = index; a joined node's ranks follow them) and ``world_size`` added, and ``store`` (the
new host's ``host:port``) when the recovery store moved with it.

**The node that hosts the store leaves** (etcd rendezvous; with c10d the store is the
rendezvous' own and leaves with its host, the restart path): the announcer picks the
successor, the lowest remaining node id (:meth:`View.successor`), seeds that node's store with
the new view, the departure claims and the generation counter (:func:`seed`), and only then
publishes the departure in the old store, naming the new one; every process follows from
there (:mod:`elastic_runner.agent.store_failover`).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import torch.distributed as dist

from ..config_base import ConfigError
from ..protocol.announcement import Announcement
from ..protocol.keys import AttemptKeys, MembershipKeys
from ..protocol.keys import raise_counter as raise_counter  # its home before
from ..train.config import BatchConfig

log = logging.getLogger(__name__)

# the operation timeout of a watcher thread's own store client (seconds): a call blocked on an
# unreachable store returns within it, so closing the thread can wait for it to end (a daemon
# thread still inside a store call when the interpreter exits aborts the process)
THREAD_STORE_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class View:
    """The group's membership after generation :attr:`generation`.

    Attributes:
        generation: the generation that made this view (0: the attempt's start).
        nodes: node rank -> the global ranks of its workers, indexed by local rank.
        departed: node ranks that left during this attempt.
        store_node: the node whose agent hosts the recovery store (-1: none known).
        stores: node -> the ``host:port`` of the store its agent hosts (etcd rendezvous: every
            agent hosts one, and the recovery store can move to it); empty with c10d, whose
            store leaves with its host.
    """

    generation: int
    nodes: dict[int, list[int]]
    departed: tuple[int, ...] = ()
    store_node: int = -1
    stores: dict[int, str] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return sum(len(ranks) for ranks in self.nodes.values())

    def successor(self, leaving: Iterable[int] = ()) -> int | None:
        """The node the recovery store moves to when its host leaves (with the nodes
        ``leaving``): the lowest remaining node id whose agent hosts a store; None when none
        does (c10d)."""
        gone = {self.store_node, *leaving}
        return min((n for n in self.nodes if n not in gone and n in self.stores), default=None)

    def moved_to(self, node: int) -> View:
        """This view with the recovery store at node ``node``'s agent."""
        return replace(self, store_node=node)

    def node_of(self, rank: int) -> int:
        """The node of global rank ``rank``.

        Raises:
            KeyError: no node has it.
        """
        node = next((n for n, ranks in self.nodes.items() if rank in ranks), None)
        if node is None:
            raise KeyError(f"no node of view {self.generation} has rank {rank}")
        return node

    def without(self, leaving: Iterable[int], generation: int) -> tuple[View, list[int]]:
        """The view once the nodes ``leaving`` left in ``generation``, and the members: the old
        global ranks that stay, sorted (a member's new rank is its index; the ranks of a node
        stay contiguous, as torchrun numbers them)."""
        gone = set(leaving)
        members = sorted(r for n, ranks in self.nodes.items() if n not in gone for r in ranks)
        renumber = {old: new for new, old in enumerate(members)}
        nodes = {n: [renumber[r] for r in ranks] for n, ranks in self.nodes.items()
                 if n not in gone}
        return View(generation, nodes, tuple(sorted({*self.departed, *gone})),
                    self.store_node, self.stores), members

    def with_nodes(self, joining: dict[int, int], generation: int,
                   stores: dict[int, str] | None = None) -> View:
        """The view once the nodes ``joining`` (node id -> its number of workers) joined in
        ``generation``: their ranks follow the existing ones, in node id order; ``stores``:
        the stores their agents host (etcd)."""
        nodes = {n: list(r) for n, r in self.nodes.items()}
        rank = self.world_size
        for node, nproc in sorted(joining.items()):
            nodes[node] = list(range(rank, rank + nproc))
            rank += nproc
        return View(generation, nodes, self.departed, self.store_node,
                    {**self.stores, **(stores or {})})

    def ids(self) -> set[int]:
        """Every node id this attempt used (members and departed)."""
        return {*self.nodes, *self.departed}

    def to_json(self) -> str:
        return json.dumps({"generation": self.generation, "departed": list(self.departed),
                           "store_node": self.store_node,
                           "nodes": {str(n): r for n, r in sorted(self.nodes.items())},
                           "stores": {str(n): e for n, e in sorted(self.stores.items())}},
                          separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> View:
        data = json.loads(text)
        return cls(data["generation"], {int(n): r for n, r in data["nodes"].items()},
                   tuple(data["departed"]), data["store_node"],
                   {int(n): e for n, e in data.get("stores", {}).items()})


def register(keys: MembershipKeys, node: int, ranks: list[int], hosts_store: bool,
             nnodes: int | None, own_store: str = "") -> None:
    """Node ``node``'s agent: its workers' global ``ranks`` (by local rank), before it starts
    them; ``hosts_store``: its process hosts the recovery store; ``nnodes``: the attempt's
    number of nodes at its start (None: a node that joined later); ``own_store``: the
    ``host:port`` of the store its agent hosts (etcd; empty: none)."""
    keys.register_node(node, ranks, nnodes, hosts_store, own_store)


def read_view(keys: MembershipKeys) -> View:
    """The current view; before the first membership change, assembled from the registrations
    of the attempt's nodes (blocking until every one registered, within the store's
    timeout)."""
    text = keys.view_text()
    if text is not None:
        return View.from_json(text)
    nodes = {n: keys.node_ranks(n) for n in range(keys.nnodes())}
    host = keys.store_node()
    stores = {n: e for n in nodes if (e := keys.node_store(n)) is not None}
    return View(0, nodes, store_node=host, stores=stores)


def record_global_batch(keys: MembershipKeys, samples: int | None) -> None:
    """Rank 0: the group's global batch (None: it follows the world size; nothing kept)."""
    keys.record_global_batch(samples)


def read_global_batch(keys: MembershipKeys) -> int | None:
    """The global batch the group's rank 0 recorded, or None (not recorded, or not kept)."""
    return keys.global_batch()


def announce_departure(keys: AttemptKeys, view: View, leaving: list[int],
                       reason: str, connect: Callable[[str], dist.Store] | None = None
                       ) -> tuple[int, View, list[int]] | None:
    """Announce the generation without the nodes ``leaving`` (``reason``: ``preempted`` or
    ``lost``): claim each node's departure, draw the generation from the job's counter, publish
    the view, then the announcement the survivors wait for. When the store's host leaves, the
    store moves first: its successor's store (reached through ``connect``: ``host:port`` ->
    a client) gets the new view, the claims and the counter (:func:`seed`), and the
    announcement names it (``store``).

    Returns:
        ``(generation, new view, members)``, or None when another process claimed one of these
        departures first (it announces them).

    Raises:
        ValueError: the store's host leaves and no remaining node hosts a store (the caller's
            :class:`Policy` refuses that first).
    """
    me = f"{reason}:{time.time_ns()}"
    for node in leaving:
        if not keys.claim_departure(node, me):
            return None
    generation = keys.draw_generations()
    new, members = view.without(leaving, generation)
    moved_to: str | None = None
    if view.store_node in leaving:
        successor = view.successor(leaving)
        if successor is None or connect is None:
            raise ValueError(f"node {view.store_node} hosts the recovery store and no "
                             "remaining node hosts one")
        new = new.moved_to(successor)
        moved_to = new.stores[successor]
        seed(AttemptKeys(connect(moved_to), keys.key), new, generation,
             {n: me for n in leaving})
    keys.set_view(new.to_json())
    failed = sorted(r for n in leaving for r in view.nodes.get(n, []))
    keys.announce(generation, Announcement(
        departed=tuple(leaving), failed=tuple(failed), members=tuple(members),
        world_size=len(members), reason=reason, store=moved_to))
    return generation, new, members


def seed(keys: AttemptKeys, view: View, generation: int,
         departed: dict[int, str] | None = None) -> None:
    """Make ``keys``' store the attempt's recovery store from here on: the current ``view``
    (unless one is there: the first process to seed wins), the generation counter at least
    ``generation``, and the departure claims ``departed`` (node -> claim). Idempotent: every
    process that moves seeds, whoever comes first."""
    keys.raise_generations(generation)
    keys.seed_view(view.to_json())
    for node, claim in (departed or {}).items():
        keys.claim_departure(node, claim)


def claim_node_id(keys: MembershipKeys, view: View) -> int:
    """A node that joins a running attempt: the lowest node id nobody used or claimed (ids are
    stable across rendezvous rounds, where torch may renumber the nodes)."""
    me, node = f"{time.time_ns()}", max(view.ids(), default=-1) + 1
    while not keys.claim_node(node, me):
        node += 1
    return node


def request_join(keys: MembershipKeys, node: int, nproc: int, own_store: str = "") -> int:
    """A joining node's agent, once its ``nproc`` workers have built the task: ask the running
    group to take it in at its next step boundary (``own_store``: the ``host:port`` of the
    store its agent hosts, etcd). Returns the request's number (1, 2, ...)."""
    return keys.post_join({"node": node, "nproc": nproc, "store": own_store})


def pending_joins(keys: MembershipKeys, admitted: int) -> dict[int, dict[str, Any]]:
    """The join requests after number ``admitted``: number -> ``{"node", "nproc", "store"}``.
    """
    posted = keys.joins_posted()
    return {n: keys.join_request(n) for n in range(admitted + 1, posted + 1)}


def joins_waiting(keys: MembershipKeys) -> bool:
    """Whether a join request is posted and not yet answered (two reads; polled by every
    worker's :class:`~elastic_runner.recovery.generation_watch.GenerationWatch`)."""
    posted = keys.joins_posted()
    return bool(posted) and posted > answered_joins(keys)


def answered_joins(keys: MembershipKeys) -> int:
    """The number of the last join request answered (0: none)."""
    return keys.joins_answered()


def refuse_joins(keys: MembershipKeys, requests: Iterable[int], why: str) -> None:
    """Answer the join requests ``requests`` with a refusal (``why``); their agents end."""
    numbers = sorted(requests)
    for number in numbers:
        keys.refuse_join(number, why)
    if numbers:
        keys.answer_joins(numbers[-1])


def announce_join(keys: AttemptKeys, view: View, joining: dict[int, int],
                  admitted: int, stores: dict[int, str] | None = None) -> tuple[int, View]:
    """Announce the generation with the nodes ``joining`` (node id -> workers) added after the
    members, every member keeping its rank; ``admitted``: the last join request it answers;
    ``stores``: the stores the joining nodes' agents host (etcd). Each joining node's agent
    finds its generation, ranks and the world size in ``admitted/<node>``.

    Returns:
        ``(generation, new view)``.
    """
    generation = keys.draw_generations()
    new = view.with_nodes(joining, generation, stores)
    keys.set_view(new.to_json())
    keys.answer_joins(admitted)
    keys.announce(generation, Announcement(
        joined=tuple(sorted(joining)), failed=(), members=tuple(range(view.world_size)),
        world_size=new.world_size, admitted=admitted, reason="joined"))
    for node in joining:
        keys.admit(node, {"generation": generation, "ranks": new.nodes[node],
                          "world_size": new.world_size})
    return generation, new


@dataclass(frozen=True)
class Policy:
    """Which groups a node's departure may leave: at least ``min_nodes`` nodes (``--nnodes``
    MIN) and a world size the global batch fits (``batch``; None: a script's own loop, whose
    batch the runner does not know: any world size). Below that the job takes torch's restart
    path, where torchrun waits for enough nodes (its ``join_timeout``)."""

    min_nodes: int = 1
    batch: BatchConfig | None = None

    @classmethod
    def for_batch(cls, min_nodes: int, batch: BatchConfig | None) -> Policy:
        """``--nnodes`` MIN and the config's ``batch`` section (None: any world size)."""
        return cls(min_nodes, batch)

    def keeping(self, job_global_batch: int | None) -> Policy:
        """This policy for a job that keeps the global batch ``job_global_batch`` (samples:
        what its rank 0 recorded, ``global_batch``; None: not known yet)."""
        if self.batch is None or job_global_batch is None:
            return self
        return replace(self, batch=self.batch.kept(0, job_global_batch))

    def fits(self, world_size: int) -> bool:
        """Whether the global batch gives every micro-batch of ``world_size`` ranks a sample (an
        uneven split where it does not divide them: ``data/sampler.py``)."""
        if self.batch is None:
            return True
        try:
            self.batch.accumulation_for(world_size)
        except ConfigError:
            return False
        return True

    def refuses(self, view: View, leaving: Iterable[int]) -> str | None:
        """Why the group of ``view`` may not go on without the nodes ``leaving`` (None: it
        may)."""
        gone = set(leaving)
        if view.store_node in gone and view.successor(gone) is None:
            return (f"node {view.store_node} hosts the recovery store (the c10d rendezvous "
                    "host), and no remaining node can take it over: the store leaves with it")
        nodes = len([n for n in view.nodes if n not in gone])
        world_size = sum(len(r) for n, r in view.nodes.items() if n not in gone)
        if nodes < self.min_nodes:
            return f"{nodes} node(s) left, fewer than --nnodes MIN {self.min_nodes}"
        if world_size < 1:
            return "no rank left"
        if not self.fits(world_size):
            return f"batch.global_batch_size cannot be split at world size {world_size}"
        return None


class NodeBeat:
    """This node's heartbeat in the recovery store: a daemon thread adds to ``node/<n>/beat``
    every ``interval_s`` through its own store client. A thread rather than the agent's monitor
    loop: that loop also waits on torch's rendezvous backend (``num_nodes_waiting``), which
    blocks for as long as etcd is stopped, and a node whose loop waited would look lost (seen:
    7 s of silence during an etcd outage in the soak). A killed agent stops beating with its
    process; so does one cut off from the store.

    Args:
        keys: the attempt's keys through a client of the recovery store for this thread alone.
        node: this node's rank.
        interval_s: seconds between beats.
    """

    def __init__(self, keys: MembershipKeys, node: int, interval_s: float = 0.25) -> None:
        self.keys, self.node, self.interval_s = keys, node, interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def beat(self) -> None:
        self.keys.beat(self.node)

    def start(self) -> NodeBeat:
        """Beat once now, then from the thread; returns self."""
        self.beat()
        self._thread = threading.Thread(target=self._run, name="node-beat", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.beat()
            except (RuntimeError, dist.DistError):  # the store unreachable: silence
                continue

    def close(self) -> None:
        """Stop beating; waits for the thread (at most its store's timeout)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=THREAD_STORE_TIMEOUT_S + 1)


class NoBeat:
    """No heartbeat (one node, or ``recovery.node_timeout_seconds: null``)."""

    def close(self) -> None:
        pass


@dataclass
class NodeWatch:
    """An agent's view of the other nodes' heartbeats (:class:`NodeBeat`): :meth:`lost` names
    the nodes whose counter has not moved for ``timeout_s`` by this process's monotonic clock
    (clocks of different machines are never compared). A node's silence counts from when this
    watch first read its counter, so a node still starting gets the whole timeout; and when
    this watch itself did not look for more than half the timeout (its agent's loop was
    blocked), every node's silence counts afresh: it cannot tell a silent node from its own
    absence.

    Args:
        keys: the attempt's keys in the recovery store; ``node``: this node.
        timeout_s: ``recovery.node_timeout_seconds``.
        interval_s: :meth:`due` says a look is due this often (seconds).
    """

    keys: MembershipKeys
    node: int
    timeout_s: float
    interval_s: float = 0.25
    _looked: float = float("-inf")
    _seen: dict[int, tuple[int, float]] = field(default_factory=dict)  # node -> (count, when)

    def due(self) -> bool:
        """Whether :attr:`interval_s` passed since the last :meth:`lost`."""
        return time.monotonic() - self._looked >= self.interval_s

    def lost(self, nodes: Iterable[int]) -> dict[int, float]:
        """Of ``nodes`` (not this one), those silent longer than the timeout: node -> seconds
        of silence. (A node whose agent got SIGTERM beats until its workers left.)"""
        now = time.monotonic()
        if now - self._looked > self.timeout_s / 2:
            self._seen.clear()
        self._looked = now
        out: dict[int, float] = {}
        for node in nodes:
            if node == self.node:
                continue
            count = self.keys.beat(node, 0)
            seen = self._seen.get(node)
            if seen is None or seen[0] != count:
                self._seen[node] = (count, now)
            elif now - seen[1] > self.timeout_s:
                out[node] = now - seen[1]
        return out


def departure_of(keys: MembershipKeys, node: int) -> str | None:
    """Why node ``node`` left the group in place (``preempted``, ``lost``), None while it is a
    member."""
    claim = keys.departure(node)
    return None if claim is None else claim.split(":")[0]


def refusal(keys: MembershipKeys, request: int) -> str | None:
    """Why join request ``request`` was refused (:func:`refuse_joins`), None while it was not."""
    return keys.refusal(request)


def admission(keys: MembershipKeys, node: int) -> dict[str, Any] | None:
    """Node ``node``'s admission (``generation``, ``world_size``, ``ranks``:
    :func:`announce_join`), None while it is not admitted."""
    return keys.admission(node)
