"""Where in-place recovery's store lives, and how agents and workers reach it.

In-place recovery (:mod:`elastic_runner.recovery.inplace`, :mod:`elastic_runner.agent.inplace_agent`) keeps
its generation/assignment protocol and the process groups of every generation in one
``torch.distributed.Store`` that all agents and workers of the job reach:

* **one node**: a ``TCPStore`` the node's agent hosts on ``127.0.0.1`` (``tcp``);
* **several nodes, c10d rendezvous**: the rendezvous' own ``TCPStore``, hosted by the agent of
  the rendezvous host (the ``--rdzv-endpoint`` node, ``is_host``); agents and workers on every
  node connect to it as clients (``c10d``). When that node is lost the store is gone with it,
  and so is the rendezvous: the job takes torch's restart path;
* **several nodes, etcd rendezvous** (``etcd-v2`` or ``etcd``): a ``TCPStore`` in an agent
  (``node0``). Every agent hosts one; the attempt starts on node rank 0's, at the address its
  workers' ``MASTER_ADDR`` names, and no node is special: when the node whose store is in use
  leaves, the store moves to the lowest remaining node id's agent
  (:meth:`~elastic_runner.recovery.membership.View.successor`). A preempted host is alive while its
  workers leave: the departure's announcer seeds the successor's store and names it in the
  announcement (:func:`~elastic_runner.recovery.membership.announce_departure`), and the host's agent
  waits until every other agent followed. A host that died without a word: each surviving
  agent finds the store unreachable, claims the successor through the rendezvous round's
  store in etcd (:func:`claim_successor`: every agent moves to the same one, and a node cut
  off from etcd too does not move at all), seeds it from the view it last read, and tells
  its workers through :data:`STORE_FILE` in its node-local heartbeat directory; the lost
  host's departure is then announced like any lost node's. Not etcd itself: the process
  groups of every generation live in the recovery store, and a process group touches its
  store while it trains, so groups in etcd stopped training when etcd did (seen: "No more
  machines in the cluster" in a step during an etcd outage, where the restart path trains
  on).

Every attempt (a rendezvous round that started workers) gets its own key prefix,
``elastic_runner/<run id>/<attempt>``: the agent of node rank 0 draws it and publishes it, with
the store's endpoint, through the round's rendezvous store (:func:`agree_attempt`), so a
re-formed group never reads an earlier attempt's keys. A round that only lets nodes join a
running attempt keeps that attempt's prefix and store.
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from ..compat.rendezvous import ETCD_BACKENDS
from ..protocol.counting import counted
from ..protocol.keys import RoundKeys, attempt_prefix

C10D_DEFAULT_PORT = 29400  # torchrun's default c10d rendezvous port
STORE_FILE = "recovery-store.json"  # in the agent's heartbeat directory: the store it moved to


@dataclass(frozen=True)
class StoreLocation:
    """How to reach the recovery store, passed from the agent to its workers as JSON.

    Attributes:
        kind: ``tcp`` (a TCPStore that this node's agent hosts), ``c10d`` (the c10d
            rendezvous' TCPStore) or ``node0`` (etcd: a TCPStore in an agent, node rank 0's at
            the attempt's start; it moves when its node leaves).
        endpoint: ``host:port`` of the store (``node0``: known once the round is).
        prefix: this attempt's keys (set by the agent once the rendezvous round is known).
        run_id: the rendezvous id (``--rdzv-id``).
    """

    kind: str
    endpoint: str
    prefix: str = ""
    run_id: str = ""

    @classmethod
    def for_rendezvous(cls, backend: str, endpoint: str, run_id: str) -> StoreLocation:
        """The store of a multi-node job's rendezvous (``--rdzv-backend``/``-endpoint``/
        ``-id``).

        Raises:
            ValueError: a backend other than ``c10d``, ``etcd-v2`` or ``etcd``.
        """
        if backend in ETCD_BACKENDS:
            return cls("node0", "", run_id=run_id)
        if backend == "c10d":
            host, port = parse_rendezvous_endpoint(endpoint, default_port=C10D_DEFAULT_PORT)
            return cls("c10d", f"{host}:{port}", run_id=run_id)
        raise ValueError(f"in-place recovery across nodes needs a c10d or etcd rendezvous, "
                         f"not {backend!r}")

    def at(self, endpoint: str, prefix: str) -> StoreLocation:
        """This location with the round's ``endpoint`` and ``prefix``."""
        return StoreLocation(self.kind, endpoint, prefix, self.run_id)

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> StoreLocation:
        return cls(**json.loads(text))

    def describe(self) -> str:
        """For log lines: which store, where."""
        return {"tcp": f"this node's agent ({self.endpoint})",
                "c10d": f"the c10d rendezvous store at {self.endpoint}",
                "node0": (f"the store in an agent at {self.endpoint}" if self.endpoint else
                          "a store in an agent, node rank 0's at each rendezvous, moving to "
                          "another node's when its node leaves"),
                }[self.kind]


def connect(location: StoreLocation, timeout_s: float) -> dist.Store:
    """A client of the store at ``location`` (``timeout_s``: its operations' limit, seconds),
    its operations counted (:mod:`elastic_runner.protocol.counting`).

    Raises:
        torch.distributed.DistStoreError: a store that does not answer within ``timeout_s``.
    """
    host, port = location.endpoint.rsplit(":", 1)
    return counted(dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                                 timeout=timedelta(seconds=timeout_s)))


@dataclass(frozen=True)
class Attempt:
    """What the agents of a rendezvous round agreed on (:func:`agree_attempt`).

    Attributes:
        prefix: the attempt's keys in the recovery store.
        endpoint: the recovery store's ``host:port``.
        running: the attempt was already running: this round only lets nodes join it.
    """

    prefix: str
    endpoint: str
    running: bool


def agree_attempt(round_store: dist.Store, node_rank: int, nnodes: int, run_id: str,
                  endpoint: str, running: tuple[str, str] | None = None) -> Attempt:
    """This attempt's key prefix and the recovery store's endpoint, the same on every node.
    Every agent of the round says whether its workers still run an attempt (``running``: its
    prefix and endpoint; a round that only lets nodes join, see ``agent/joins.py``); node rank
    0's agent reads all ``nnodes`` answers and sets the running attempt, or a new prefix with
    its own ``endpoint`` offer, in ``round_store`` (the round's store, new every round); every
    agent reads that (blocking until it is there, within the store's timeout)."""
    keys = RoundKeys(round_store)
    keys.say_running(node_rank, running)
    if node_rank == 0:
        answers = [keys.running(n) for n in range(nnodes)]
        going = next((a for a in answers if a), None)
        fresh = [attempt_prefix(run_id, uuid.uuid4().hex[:12]), endpoint]
        keys.set_attempt([*(going or fresh), going is not None])
    prefix, agreed, was_running = keys.attempt()
    return Attempt(prefix, agreed, was_running)


def claim_successor(round_store: dist.Store, prefix: str, dead: str, proposed: str,
                    timeout_s: float) -> str:
    """The store every agent moves to once the recovery store at ``dead`` (``host:port``) is
    unreachable: the first agent to claim it (an atomic ``add`` in ``round_store``, the
    rendezvous round's store in etcd) sets its ``proposed`` endpoint; the others read that
    one (waiting up to ``timeout_s`` seconds for it). Agents that proposed from the same view
    propose the same node; the claim keeps two that read different views together.

    Raises:
        RuntimeError, LookupError: etcd unreachable, or no endpoint set within ``timeout_s``
            (the first claimer died between its claim and the set).
    """
    keys = RoundKeys(round_store)
    key = keys.successor(prefix, dead)
    if keys.claim_successor(prefix, dead):
        round_store.set(key, proposed)
    round_store.wait([key], timedelta(seconds=timeout_s))
    return round_store.get(key).decode()


def tell_workers(directory: Path, location: StoreLocation) -> None:
    """Name the recovery store's new ``location`` to this node's workers: a file in the
    agent's node-local ``directory`` (written whole, then renamed into place)."""
    tmp = directory / f".{STORE_FILE}.{os.getpid()}"
    tmp.write_text(location.to_json())
    tmp.replace(directory / STORE_FILE)


def told(directory: Path) -> StoreLocation | None:
    """The location the agent last named in ``directory`` (:func:`tell_workers`), or None."""
    try:
        return StoreLocation.from_json((directory / STORE_FILE).read_text())
    except (FileNotFoundError, ValueError, TypeError):
        return None
