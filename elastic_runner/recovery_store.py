"""Where in-place recovery's store lives, and how agents and workers reach it.

In-place recovery (:mod:`elastic_runner.inplace`, :mod:`elastic_runner.inplace_agent`) keeps
its generation/assignment protocol and the process groups of every generation in one
``torch.distributed.Store`` that all agents and workers of the job reach:

* **one node**: a ``TCPStore`` the node's agent hosts on ``127.0.0.1`` (``tcp``);
* **several nodes, c10d rendezvous**: the rendezvous' own ``TCPStore``, hosted by the agent of
  the rendezvous host (the ``--rdzv-endpoint`` node, ``is_host``); agents and workers on every
  node connect to it as clients (``c10d``). When that node is lost the store is gone with it,
  and so is the rendezvous: the job takes torch's restart path;
* **several nodes, etcd** (``etcd-v2`` or ``etcd``): the etcd server through torch's
  ``EtcdStore`` under ``/torch/elastic/store`` (what ``etcd-v2``'s ``create_backend`` builds),
  so no node is special (``etcd``).

Every attempt (rendezvous round) gets its own key prefix, ``elastic_runner/<run id>/<attempt>``:
the agent of node rank 0 draws it and publishes it through the round's rendezvous store
(:func:`agree_prefix`), so a re-formed group never reads an earlier attempt's keys.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import asdict, dataclass, field
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.etcd_rendezvous_backend import create_backend
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from .etcd_check import ETCD_BACKENDS, with_aliases

C10D_DEFAULT_PORT = 29400  # torchrun's default c10d rendezvous port
_PREFIX_KEY = "elastic_runner/recovery_prefix"


@dataclass(frozen=True)
class StoreLocation:
    """How to reach the recovery store, passed from the agent to its workers as JSON.

    Attributes:
        kind: ``tcp`` (a TCPStore that this node's agent hosts), ``c10d`` (the c10d
            rendezvous' TCPStore) or ``etcd`` (the etcd rendezvous server).
        endpoint: ``host:port`` of the store (etcd: of the etcd server).
        prefix: this attempt's keys (set by the agent once the rendezvous round is known).
        conf: etcd client options in ``etcd-v2``'s spelling (``protocol``, ``ca_cert``,
            ``ssl_cert``, ``ssl_cert_key``, ``read_timeout``); empty for TCP stores.
        run_id: the rendezvous id (``--rdzv-id``).
    """

    kind: str
    endpoint: str
    prefix: str = ""
    conf: dict[str, str] = field(default_factory=dict)
    run_id: str = ""

    @classmethod
    def for_rendezvous(cls, backend: str, endpoint: str, conf: dict[str, str],
                       run_id: str) -> StoreLocation:
        """The store of a multi-node job's rendezvous (``--rdzv-backend``/``-endpoint``/
        ``-conf``/``-id``).

        Raises:
            ValueError: a backend other than ``c10d``, ``etcd-v2`` or ``etcd``.
        """
        if backend in ETCD_BACKENDS:
            return cls("etcd", endpoint, conf=with_aliases(conf, "etcd-v2"), run_id=run_id)
        if backend == "c10d":
            host, port = parse_rendezvous_endpoint(endpoint, default_port=C10D_DEFAULT_PORT)
            return cls("c10d", f"{host}:{port}", run_id=run_id)
        raise ValueError(f"in-place recovery across nodes needs a c10d or etcd rendezvous, "
                         f"not {backend!r}")

    def with_prefix(self, prefix: str) -> StoreLocation:
        return StoreLocation(self.kind, self.endpoint, prefix, dict(self.conf), self.run_id)

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> StoreLocation:
        return cls(**json.loads(text))

    def describe(self) -> str:
        """For log lines: which store, where."""
        return {"tcp": f"this node's agent ({self.endpoint})",
                "c10d": f"the c10d rendezvous store at {self.endpoint}",
                "etcd": f"etcd at {self.endpoint}"}[self.kind]


def connect(location: StoreLocation, timeout_s: float) -> dist.Store:
    """A client of the store at ``location`` (``timeout_s``: its operations' limit, seconds).

    Raises:
        torch.distributed.DistStoreError: a TCP store that does not answer within
            ``timeout_s``; ``RendezvousConnectionError``: etcd's client could not be made.
    """
    if location.kind == "etcd":
        params = RendezvousParameters("etcd-v2", location.endpoint, location.run_id, 1, 1,
                                      **location.conf)
        store = create_backend(params)[1]  # torch's EtcdStore under /torch/elastic/store
        store.set_timeout(timedelta(seconds=timeout_s))
        return store
    host, port = location.endpoint.rsplit(":", 1)
    return dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout_s))


def agree_prefix(round_store: dist.Store, node_rank: int, run_id: str) -> str:
    """This attempt's key prefix, the same on every node: node rank 0's agent draws it and
    sets it in ``round_store`` (the rendezvous round's store, new every round), the others
    read it (blocking until it is there, within the store's timeout)."""
    if node_rank == 0:
        round_store.set(_PREFIX_KEY, f"elastic_runner/{run_id}/{uuid.uuid4().hex[:12]}")
    return round_store.get(_PREFIX_KEY).decode()
