"""The keys agents and workers read and write in the job's stores, behind typed operations (as
nvidia-resiliency-ext's store mixin keeps its keys as constants behind methods): nothing
outside :mod:`elastic_runner.protocol` builds a key string.

**The attempt's recovery store** (:class:`AttemptKeys`; every key under the attempt's prefix,
``<prefix>/...``, added by the key function it is given):

=====================================  =========================================================
key                                    written by -> read by
=====================================  =========================================================
``restart``                            a worker or agent that takes torch's restart path ->
                                       every worker (no recovery in place) and agent
``built``                              rank 0, once the workers built their loop -> the agents
                                       (a spare may start; a script's loop recovers in place)
``finished``                           rank 0 at the end of training -> a replacement still
                                       waiting to join (it leaves with exit code 0)
``recovered/<g>``                      the lowest rank that kept its process, at generation
                                       ``g``'s first committed step -> the agent whose spare
                                       was taken (the next one may start)
``joins_in_place``                     rank 0 of a loop that can regroup -> the agents (nodes
                                       join in place)
``generations``                        a counter every announcer draws from
``gen/<g>``                            the announcer -> the workers: generation ``g``, an
                                       :class:`~elastic_runner.protocol.announcement.Announcement`
``pg/<g>/present/<r>``, ``pg/<g>/...`` each member of generation ``g``'s group; its store
``spare/<name>/ready``                 a spare -> its agent
``spare/<name>/assign``                the agent -> its spare: the environment of the rank it
                                       takes
``moved/<node>``                       an agent following the store to another node -> the
                                       leaving host
``rank0_state``                        rank 0 of a script's loop, at a step boundary where the
                                       loop's work after a step changed its ``state=`` -> the
                                       group's source after rank 0 was replaced
                                       (``own_loop/script_state.py``)
=====================================  =========================================================

The membership's keys (:class:`MembershipKeys`; what they mean:
:mod:`elastic_runner.recovery.membership`): ``node/<n>/ranks``, ``node/<n>/store``,
``node/<n>/beat``, ``node/<n>/claim``, ``nnodes``, ``store_node``, ``view``,
``departed/<n>``, ``joins``, ``join/<i>``, ``join/<i>/refused``, ``joins_admitted``,
``admitted/<n>``, ``global_batch``.

**A rendezvous round's store** (:class:`RoundKeys`, ``recovery/store.py``: the agents agree on
the attempt's prefix and a moved store's successor there): ``elastic_runner/running/<node
rank>``, ``elastic_runner/recovery_prefix``, ``elastic_runner/successor/<prefix>/<endpoint>``
(and ``.../claims``).

**torch's agent store** (:class:`HandshakeKeys`, ``dist.py``: the process-group handshake under
plain torchrun): ``elastic_runner/attempt/clock``, ``.../hello/<r>``, ``.../ack/<r>/<t>``, and
a group's store ``elastic_runner/pg/<namespace>/``.

Store errors propagate from every operation (``RuntimeError``/``DistError``: the store is
unreachable).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch.distributed as dist

from .announcement import RESTART, Announcement
from .counting import uncounted

Key = Callable[..., str]
"""An attempt's key function: ``key("gen", 3)`` -> ``<prefix>/gen/3``."""

NAMES = frozenset({
    "restart", "built", "finished", "recovered", "joins_in_place", "generations", "gen", "pg",
    "spare", "moved", "rank0_state", "node", "nnodes", "store_node", "view", "departed",
    "joins", "join", "joins_admitted", "admitted", "global_batch", "elastic_runner"})
"""The first part of every key this module builds (the boundary test looks for them)."""

_POLL_S = 0.01
_NS = "elastic_runner"


def join_key(prefix: str, *parts: object) -> str:
    """The key ``<prefix>/<parts...>`` (the key function of an attempt's store clients)."""
    return "/".join([prefix, *map(str, parts)])


def attempt_prefix(run_id: str, token: str) -> str:
    """A multi-node attempt's prefix: ``elastic_runner/<run id>/<token>``."""
    return join_key(_NS, run_id, token)


def single_node_prefix(token: str) -> str:
    """A one-node attempt's prefix: ``attempt-<token>``."""
    return f"attempt-{token}"


def raise_counter(store: dist.Store, name: str, value: int) -> int:
    """Set the counter ``name`` (a key ``Store.add`` counts in) to at least ``value``, by
    compare-and-set, so two processes raising it at once never add up. Returns its value."""
    while True:
        current = store.add(name, 0)
        if current >= value:
            return current
        if store.compare_set(name, str(current), str(value)).decode() == str(value):
            return value


class StoreKeys:
    """Keys through a client ``store`` and the attempt's key function ``key``."""

    def __init__(self, store: dist.Store, key: Key) -> None:
        self.store, self.key = store, key

    def _has(self, *parts: object) -> bool:
        return self.store.check([self.key(*parts)])

    def _json(self, *parts: object) -> Any:
        return json.loads(self.store.get(self.key(*parts)))

    def _text(self, *parts: object) -> str | None:
        """The key's value decoded, None where it is not set."""
        return self.store.get(self.key(*parts)).decode() if self._has(*parts) else None

    def _set(self, value: str | bytes, *parts: object) -> None:
        self.store.set(self.key(*parts), value)

    def _claim(self, value: str, *parts: object) -> str:
        """Set the key to ``value`` unless set; what it holds then."""
        return self.store.compare_set(self.key(*parts), "", value).decode()


class MembershipKeys(StoreKeys):
    """The membership's keys (:mod:`elastic_runner.recovery.membership` says who writes and
    reads each)."""

    # ------------------------------------------------------------ registrations
    def register_node(self, node: int, ranks: list[int], nnodes: int | None,
                      hosts_store: bool, own_store: str) -> None:
        """``node/<n>/store`` (``own_store`` non-empty), ``node/<n>/ranks``, ``nnodes``
        (``nnodes`` not None) and ``store_node`` (``hosts_store``), in that order."""
        if own_store:
            self._set(own_store, "node", node, "store")
        self._set(json.dumps(ranks), "node", node, "ranks")
        if nnodes is not None:
            self._set(str(nnodes), "nnodes")
        if hosts_store:
            self._set(str(node), "store_node")

    def nnodes(self) -> int:
        """The attempt's number of nodes at its start (blocks until registered)."""
        return int(self.store.get(self.key("nnodes")))

    def node_ranks(self, node: int) -> list[int]:
        """Node ``node``'s registered ranks (blocks until registered)."""
        return self._json("node", node, "ranks")

    def store_node(self) -> int:
        """The node whose agent hosts the store (-1: none registered)."""
        text = self._text("store_node")
        return -1 if text is None else int(text)

    def node_store(self, node: int) -> str | None:
        """The ``host:port`` of the store node ``node``'s agent hosts (None: none)."""
        return self._text("node", node, "store")

    def claim_node(self, node: int, claim: str) -> bool:
        """Claim node id ``node`` (``node/<n>/claim``); whether this claim won."""
        return self._claim(claim, "node", node, "claim") == claim

    def beat(self, node: int, count: int = 1) -> int:
        """Add ``count`` to node ``node``'s heartbeat counter; its value."""
        return self.store.add(self.key("node", node, "beat"), count)

    # ------------------------------------------------------------ the view
    def view_text(self) -> str | None:
        """The current view's JSON (None: no membership change yet)."""
        return self._text("view")

    def set_view(self, text: str) -> None:
        self._set(text, "view")

    def seed_view(self, text: str) -> None:
        """The view ``text`` unless one is there."""
        self._claim(text, "view")

    def record_global_batch(self, samples: int | None) -> None:
        self._set(str(samples or 0), "global_batch")

    def global_batch(self) -> int | None:
        """The recorded global batch (None: not recorded, or 0: not kept)."""
        text = self._text("global_batch")
        return None if text is None else int(text) or None

    # ------------------------------------------------------------ departures
    def claim_departure(self, node: int, claim: str) -> bool:
        """Claim the announcement of node ``node``'s departure; whether this claim won."""
        return self._claim(claim, "departed", node) == claim

    def departure(self, node: int) -> str | None:
        """Node ``node``'s departure claim (None: a member)."""
        return self._text("departed", node)

    # ------------------------------------------------------------ joins
    def post_join(self, request: dict[str, Any]) -> int:
        """Post a join request; its number (1, 2, ...)."""
        number = self.store.add(self.key("joins"), 1)
        self._set(json.dumps(request), "join", number)
        return number

    def joins_posted(self) -> int:
        return self.store.add(self.key("joins"), 0)

    def join_request(self, number: int) -> dict[str, Any]:
        return self._json("join", number)

    def refuse_join(self, number: int, why: str) -> None:
        self._set(why, "join", number, "refused")

    def refusal(self, number: int) -> str | None:
        """Why join request ``number`` was refused (None: it was not)."""
        return self._text("join", number, "refused")

    def joins_answered(self) -> int:
        """The last join request answered (0: none)."""
        text = self._text("joins_admitted")
        return 0 if text is None else int(text)

    def answer_joins(self, number: int) -> None:
        self._set(str(number), "joins_admitted")

    def admit(self, node: int, admission: dict[str, Any]) -> None:
        self._set(json.dumps(admission), "admitted", node)

    def admission(self, node: int) -> dict[str, Any] | None:
        return self._json("admitted", node) if self._has("admitted", node) else None


class AttemptKeys(MembershipKeys):
    """The keys of one attempt in the recovery store (module docstring's table), through a
    client ``store`` and the key function ``key`` (``key("gen", 3)`` -> ``<prefix>/gen/3``)."""

    # ------------------------------------------------------------ the attempt's milestones
    def ask_restart(self) -> None:
        """No agent replaces anyone in place in this attempt any more: torch's restart path."""
        self._set(RESTART.encode(), "restart")

    def restart_asked(self) -> bool:
        return self._has("restart")

    def announce_built(self) -> None:
        self._set("1", "built")

    def built(self) -> bool:
        return self._has("built")

    def announce_finished(self) -> None:
        self._set("1", "finished")

    def finished(self) -> bool:
        return self._has("finished")

    def announce_recovered(self, generation: int) -> None:
        """Generation ``generation``'s first step is committed: its recovery is over."""
        self._set("1", "recovered", generation)

    def recovered(self, generation: int) -> bool:
        return self._has("recovered", generation)

    def keep_rank0_state(self, blob: bytes) -> None:
        """Rank 0's ``state=`` versions (``own_loop/script_state.py``; ``torch.save`` bytes)."""
        self._set(blob, "rank0_state")

    def rank0_state(self) -> bytes | None:
        """What :meth:`keep_rank0_state` wrote last (None: nothing yet)."""
        if not self._has("rank0_state"):
            return None
        return bytes(self.store.get(self.key("rank0_state")))

    def allow_joins_in_place(self) -> None:
        self._set("1", "joins_in_place")

    def joins_in_place(self) -> bool:
        return self._has("joins_in_place")

    # ------------------------------------------------------------ generations
    def draw_generations(self, count: int = 1) -> int:
        """Reserve ``count`` generation numbers (one counter for the whole job: two announcers
        never announce the same one); returns the last."""
        return self.store.add(self.key("generations"), count)

    def raise_generations(self, value: int) -> int:
        """The generation counter at least ``value`` (:func:`raise_counter`); its value."""
        return raise_counter(self.store, self.key("generations"), value)

    def announce(self, generation: int, news: Announcement) -> None:
        """Generation ``generation``: ``news``."""
        self._set(news.encode(), "gen", generation)

    def announced(self, generation: int) -> bool:
        return self._has("gen", generation)

    def announcement(self, generation: int) -> Announcement | None:
        """Generation ``generation``'s announcement, or :data:`RESTART` once the restart path
        was asked; None: neither (yet)."""
        for parts in (("gen", generation), ("restart",)):
            if self._has(*parts):
                return Announcement.decode(self.store.get(self.key(*parts)))
        return None

    # ------------------------------------------------------------ a generation's group
    def show_up(self, generation: int, rank: int) -> None:
        self._set("1", "pg", generation, "present", rank)

    def all_present(self, generation: int, world_size: int) -> bool:
        return self.store.check([self.key("pg", generation, "present", r)
                                 for r in range(world_size)])

    def group_store(self, generation: int) -> dist.Store:
        """Generation ``generation``'s process-group store (a prefix of its own), over torch's
        store itself: the group's own traffic is not counted
        (:mod:`~elastic_runner.protocol.counting`), and torch's C++ holds no Python store."""
        return dist.PrefixStore(self.key("pg", generation) + "/", uncounted(self.store))

    # ------------------------------------------------------------ spares
    def spare_ready(self, name: str) -> None:
        self._set("1", "spare", name, "ready")

    def is_spare_ready(self, name: str) -> bool:
        return self._has("spare", name, "ready")

    def assign(self, name: str, env: dict[str, str]) -> None:
        """Spare ``name`` takes the rank whose environment is ``env`` (RANK, LOCAL_RANK, ...,
        :data:`~elastic_runner.protocol.env.GENERATION_ENV`)."""
        self._set(json.dumps(env), "spare", name, "assign")

    def wait_assignment(self, name: str, poll_s: float = _POLL_S) -> dict[str, str]:
        """Block until spare ``name`` is assigned a rank; its environment. Polled, not
        ``Store.wait``: a wait that times out makes c10d print a warning (a spare may stand by
        for hours), and one that never times out would hold off a signal's handler."""
        while not self._has("spare", name, "assign"):
            time.sleep(poll_s)
        return self._json("spare", name, "assign")

    # ------------------------------------------------------------ nodes
    def acknowledge_move(self, node: int, endpoint: str) -> None:
        """Node ``node``'s agent follows the store to ``endpoint`` (the leaving host waits for
        every acknowledgement)."""
        self._set(endpoint, "moved", node)

    def moves_acknowledged(self, nodes: Iterable[int]) -> bool:
        return self.store.check([self.key("moved", n) for n in nodes])


class RoundKeys:
    """A rendezvous round's store, where the agents agree on the attempt
    (``recovery/store.py``: ``agree_attempt``, ``claim_successor``)."""

    def __init__(self, store: dist.Store) -> None:
        self.store = store

    def say_running(self, node_rank: int, running: object) -> None:
        """Node ``node_rank``'s agent: the attempt its workers still run (JSON; None: none)."""
        self.store.set(join_key(_NS, "running", node_rank), json.dumps(running))

    def running(self, node_rank: int) -> Any:
        """What :meth:`say_running` wrote for ``node_rank`` (blocks until it is there)."""
        return json.loads(self.store.get(join_key(_NS, "running", node_rank)))

    def set_attempt(self, agreed: list[Any]) -> None:
        """Node rank 0's agent: ``[prefix, endpoint, running]``."""
        self.store.set(join_key(_NS, "recovery_prefix"), json.dumps(agreed))

    def attempt(self) -> list[Any]:
        """What :meth:`set_attempt` wrote (blocks until it is there)."""
        return json.loads(self.store.get(join_key(_NS, "recovery_prefix")))

    def successor(self, prefix: str, dead: str) -> str:
        """The key of the successor of the store at ``dead`` in attempt ``prefix``."""
        return join_key(_NS, "successor", prefix, dead)

    def claim_successor(self, prefix: str, dead: str) -> bool:
        """Whether this agent is the first to claim the successor of ``dead``."""
        return self.store.add(self.successor(prefix, dead) + "/claims", 1) == 1


class HandshakeKeys:
    """torch's agent store under plain torchrun: the process-group handshake's keys
    (``dist.attempt_namespace``)."""

    CLOCK = join_key(_NS, "attempt", "clock")

    @staticmethod
    def hello(rank: int) -> str:
        return join_key(_NS, "attempt", "hello", rank)

    @staticmethod
    def ack(rank: int, t: int) -> str:
        return join_key(_NS, "attempt", "ack", rank, t)

    @staticmethod
    def group_prefix(namespace: str) -> str:
        """The prefix of the process group's keys in namespace ``namespace``."""
        return join_key(_NS, "pg", namespace) + "/"
