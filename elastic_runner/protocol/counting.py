"""The recovery store's operations counted at the client (issue 56: the protocol's traffic).

Every client of the attempt's recovery store that the agents and workers make is a
:class:`CountingStore` around torch's store (``recovery/store.py``'s ``connect``, the store an
agent hosts, :class:`~elastic_runner.protocol.client.AttemptClient`'s subclasses), so no call
site counts: each operation adds one to this process's :data:`COUNTS`, by operation (``set``,
``get``, ``check``, ...) and by the first part of its key after the attempt's prefix
(``gen``, ``restart``, ``node``, ``spare``, ... :data:`~elastic_runner.protocol.keys.NAMES`;
which polling loop made it). An operation of several keys counts once. The process groups'
own traffic (a generation's group store, ``AttemptKeys.group_store``) goes to torch's store
directly and is not counted, nor is torch's rendezvous.

Read in-process with :meth:`OpCounts.snapshot`; exported as ``store_operations_total`` by a
rank (``observe/metrics.py``) and ``agent_store_operations_total`` by the agent
(``observe/node_metrics.py``). With :data:`~elastic_runner.protocol.env.STORE_OPS_DIR_ENV`
set, each process also writes its counts to ``<dir>/<pid>.json`` every
:data:`DUMP_INTERVAL_S` seconds (a benchmark's reading across processes,
``bench/store_traffic.py``).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from . import env

OPS = ("set", "get", "add", "compare_set", "check", "wait", "delete_key", "num_keys",
       "multi_get", "multi_set", "append", "list_keys", "queue_push", "queue_pop",
       "queue_len")
"""The operations counted (one label value each); torch's ``Store`` methods."""

PROTOCOL_OPS = ("set", "get", "add", "compare_set", "check", "wait")
"""The operations the protocol's keys use (:mod:`~elastic_runner.protocol.keys`): their
series exist from the start, at 0."""
ROLES = ("agent", "worker")
DUMP_INTERVAL_S = 0.1
_NS = "elastic_runner"


def key_family(key: str) -> str:
    """The first part of ``key`` after the attempt's prefix (``elastic_runner/<run>/<token>/``
    across nodes, ``attempt-<token>/`` on one node): ``gen`` for ``.../gen/3``; ``other``
    for a key of no attempt."""
    parts = key.split("/", 4)
    if parts[0] == _NS and len(parts) > 3:
        return parts[3]
    if parts[0].startswith("attempt-") and len(parts) > 1:
        return parts[1]
    return "other"


class OpCounts:
    """One process's store operations, by ``(operation, key family)``; threads count through
    one lock (held for a dict update: the store's round trip is a thousand times longer).

    Attributes:
        role: ``agent`` once this process's agent made its store (:class:`AgentStore
            <elastic_runner.agent.store.AgentStore>`), else ``worker`` (a worker or a spare).
    """

    def __init__(self) -> None:
        self.role = "worker"
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, str], int] = {}
        self._dumping = 0  # the pid whose dump thread runs (0: none)

    def forked(self) -> None:
        """In a forked child (the agent's fork server's workers): a worker, nothing counted
        yet, a lock no thread of the parent may hold, no dump thread."""
        self.role = "worker"
        self._lock = threading.Lock()
        self._counts = {}
        self._dumping = 0

    def count(self, op: str, key: str | None = None) -> None:
        family = "" if key is None else key_family(key)
        with self._lock:
            k = (op, family)
            self._counts[k] = self._counts.get(k, 0) + 1

    def snapshot(self) -> dict[tuple[str, str], int]:
        """``(operation, key family) -> count`` so far (the family empty: an operation of no
        key, ``num_keys``)."""
        with self._lock:
            return dict(self._counts)

    def by_op(self) -> dict[str, int]:
        """``operation -> count`` so far."""
        out: dict[str, int] = {}
        for (op, _), n in self.snapshot().items():
            out[op] = out.get(op, 0) + n
        return out

    def reset(self) -> None:
        with self._lock:
            self._counts.clear()

    def as_json(self) -> dict[str, Any]:
        """This process's counts as :data:`~elastic_runner.protocol.env.STORE_OPS_DIR_ENV`'s
        files hold them."""
        return {"pid": os.getpid(), "role": self.role, "time": time.time(),
                "counts": {f"{op}/{family}": n for (op, family), n in self.snapshot().items()}}

    def dump_if_asked(self) -> None:
        """Start this process's dump thread once, where the environment asks for one."""
        directory = env.store_ops_dir()
        if self._dumping == os.getpid() or not directory:
            return
        self._dumping = os.getpid()
        threading.Thread(target=self._dump, args=(Path(directory),), name="store-ops-dump",
                         daemon=True).start()

    def _dump(self, directory: Path) -> None:
        path = directory / f"{os.getpid()}.json"
        tmp = directory / f".{os.getpid()}.json.tmp"
        while True:
            try:
                tmp.write_text(json.dumps(self.as_json()))
                tmp.replace(path)
            except OSError:
                pass
            time.sleep(DUMP_INTERVAL_S)


COUNTS = OpCounts()
"""This process's counts (every :class:`CountingStore` of it adds to them)."""
os.register_at_fork(after_in_child=COUNTS.forked)


def _first(keys: Sequence[str]) -> str | None:
    return keys[0] if keys else None


class CountingStore(dist.Store):
    """``store`` (a ``torch.distributed.Store``), each operation counted in ``counts``
    (:data:`COUNTS`). Anything else (a ``TCPStore``'s ``port``) is the store's. Not for a
    process group: give it :attr:`inner` (:func:`uncounted`), so torch's C++ holds no Python
    object."""

    def __init__(self, store: dist.Store, counts: OpCounts = COUNTS) -> None:
        super().__init__()
        self.inner, self.counts = store, counts
        counts.dump_if_asked()

    def __getattr__(self, name: str) -> Any:  # only what the class does not define
        if name == "inner":  # not set yet
            raise AttributeError(name)
        return getattr(self.inner, name)

    def set(self, key: str, value: Any) -> None:
        self.counts.count("set", key)
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        self.counts.count("get", key)
        return self.inner.get(key)

    def add(self, key: str, value: int) -> int:
        self.counts.count("add", key)
        return self.inner.add(key, value)

    def compare_set(self, key: str, expected_value: Any, desired_value: Any) -> bytes:
        self.counts.count("compare_set", key)
        return self.inner.compare_set(key, expected_value, desired_value)

    def check(self, keys: list[str]) -> bool:
        self.counts.count("check", _first(keys))
        return self.inner.check(keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self.counts.count("wait", _first(keys))
        if timeout is None:
            self.inner.wait(keys)
        else:
            self.inner.wait(keys, timeout)

    def delete_key(self, key: str) -> bool:
        self.counts.count("delete_key", key)
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        self.counts.count("num_keys")
        return self.inner.num_keys()

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self.counts.count("multi_get", _first(keys))
        return self.inner.multi_get(keys)

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        self.counts.count("multi_set", _first(keys))
        self.inner.multi_set(keys, values)

    def append(self, key: str, value: Any) -> None:
        self.counts.count("append", key)
        self.inner.append(key, value)

    def list_keys(self) -> list[str]:
        self.counts.count("list_keys")
        return self.inner.list_keys()

    def queue_push(self, key: str, value: Any) -> None:
        self.counts.count("queue_push", key)
        self.inner.queue_push(key, value)

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        self.counts.count("queue_pop", key)
        return self.inner.queue_pop(key, block)

    def queue_len(self, key: str) -> int:
        self.counts.count("queue_len", key)
        return self.inner.queue_len(key)

    @property
    def timeout(self) -> timedelta:  # type: ignore[override]
        return self.inner.timeout

    def set_timeout(self, timeout: timedelta) -> None:
        self.inner.set_timeout(timeout)

    def has_extended_api(self) -> bool:
        return self.inner.has_extended_api()


def counted(store: dist.Store, counts: OpCounts = COUNTS) -> dist.Store:
    """``store`` counted (itself when it already is)."""
    return store if isinstance(store, CountingStore) else CountingStore(store, counts)


def uncounted(store: dist.Store) -> dist.Store:
    """torch's store under ``store`` (for a process group)."""
    return store.inner if isinstance(store, CountingStore) else store
