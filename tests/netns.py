"""Several "nodes" on this machine, each a network namespace with its own address.

:class:`Nodes` makes ``n`` namespaces (iproute2: ``ip netns add``), one veth pair per node from
the node's ``eth0`` to a bridge in the root namespace, addresses ``10.231.<k>.<2+i>/24`` on the
nodes and ``.1`` on the bridge (the root namespace's address: servers that belong to no node,
such as etcd, listen there). A process runs on node ``i`` through ``ip netns exec``
(:meth:`Nodes.argv`), with :meth:`Nodes.env`: gloo binds ``eth0`` and torchrun advertises the
node's address (``PET_LOCAL_ADDR``), as a host's own name would resolve on a real cluster.
:meth:`Nodes.cut` drops every packet of a node: its veth is taken off the bridge, so what it sends
reaches no one and nothing reaches it, with no reset and no error; its own link stays up (a
switch port gone dark). ``tc qdisc ... netem loss 100%`` would be the usual way; this kernel
has no ``netem`` ("Specified qdisc kind is unknown").

Needs root and ``ip`` (Debian ``iproute2``); :func:`netns_nodes` fails the test in CI
when namespaces cannot be made and skips it elsewhere.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator

import pytest

from .needs import require_netns

_IP = "ip"
# each Nodes of this process a tag of its own: the kernel removes a deleted namespace's veth
# asynchronously, so a name used again at once can still exist (a random tag repeated when a
# test seeded the global RNG in this process: "ip link add" failed with status 2)
_MADE = itertools.count()


def _run(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: exit {done.returncode}: {done.stderr.strip()}")


class Nodes:
    """``count`` namespaces on one bridge; :meth:`close` removes them (idempotent)."""

    def __init__(self, count: int) -> None:
        self.count = count
        made = next(_MADE)
        self.tag = f"{os.getpid() % 1000:03d}{made % 1000:03d}"
        self.subnet = f"10.231.{(os.getpid() + made) % 254 + 1}"
        self.bridge = f"erb{self.tag}"
        self.names = [f"er{self.tag}n{i}" for i in range(count)]
        self._made: list[Callable[[], None]] = []
        try:
            self._make()
        except BaseException:
            self.close()
            raise

    @property
    def host_address(self) -> str:
        """The root namespace's address on the bridge (reachable from every node)."""
        return f"{self.subnet}.1"

    def address(self, i: int) -> str:
        return f"{self.subnet}.{i + 2}"

    def _make(self) -> None:
        _run(_IP, "link", "add", self.bridge, "type", "bridge")
        self._made.append(lambda: _run(_IP, "link", "del", self.bridge))
        _run(_IP, "addr", "add", f"{self.host_address}/24", "dev", self.bridge)
        _run(_IP, "link", "set", self.bridge, "up")
        for i, ns in enumerate(self.names):
            _run(_IP, "netns", "add", ns)
            self._made.append(lambda ns=ns: _run(_IP, "netns", "del", ns))
            outside = self._outside(i)
            _run(_IP, "link", "add", outside, "type", "veth", "peer", "name", "eth0",
                 "netns", ns)
            _run(_IP, "link", "set", outside, "master", self.bridge, "up")
            inside = (_IP, "netns", "exec", ns, _IP)
            _run(*inside, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            _run(*inside, "link", "set", "eth0", "up")
            _run(*inside, "link", "set", "lo", "up")

    def _outside(self, i: int) -> str:
        return f"erv{self.tag}{i}"  # node i's veth end on the bridge

    def argv(self, i: int, argv: list[str]) -> list[str]:
        """``argv`` run on node ``i`` (``ip netns exec`` execs it: the pid is the command's)."""
        return [shutil.which(_IP) or _IP, "netns", "exec", self.names[i], *argv]

    def env(self, i: int) -> dict[str, str]:
        """The variables a process on node ``i`` needs to use the node's address."""
        return {"GLOO_SOCKET_IFNAME": "eth0", "PET_LOCAL_ADDR": self.address(i),
                "NO_PROXY": "*"}

    def cut(self, i: int) -> None:
        """Drop every packet to and from node ``i`` (its peers see silence, not a reset)."""
        _run(_IP, "link", "set", self._outside(i), "nomaster")

    def heal(self, i: int) -> None:
        _run(_IP, "link", "set", self._outside(i), "master", self.bridge)

    def close(self) -> None:
        while self._made:
            with contextlib.suppress(subprocess.SubprocessError, OSError, RuntimeError):
                self._made.pop()()


@pytest.fixture
def netns_nodes() -> Iterator[Callable[[int], Nodes]]:
    """``netns_nodes(n)`` makes ``n`` nodes; all are removed at teardown."""
    require_netns()
    made: list[Nodes] = []

    def make(count: int) -> Nodes:
        nodes = Nodes(count)
        made.append(nodes)
        return nodes

    yield make
    for nodes in made:
        nodes.close()
