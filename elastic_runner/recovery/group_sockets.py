"""Cut a process group's TCP connections, so that every peer's blocked collective fails now.

Gloo cannot abort a collective: ``ProcessGroupGloo.abort()``/``shutdown()`` and
``destroy_process_group()`` leave its connections open until the process exits (measured on
torch 2.13 with three ranks: a peer blocked in ``all_reduce`` failed only when the aborting
process exited, whichever of the three was called). A rank that learns of a failure in a
collective therefore keeps the ranks that wait on *it* blocked until the collective timeout:
with three ranks or more, those not next to the dead one in the ring stay in the old group.

:class:`GroupSockets` records the sockets a process group opened (the TCP sockets that appear
in ``/proc/self/fd`` while the group forms) and :meth:`GroupSockets.cut` shuts down their
sending side (``shutdown(2)``, ``SHUT_WR``; the descriptors stay open and owned by gloo). Each
peer then reads end-of-file, which is what it would see if this process had died: its
collective fails with "Connection closed by peer" and it follows the same recovery. Shutting
down the reading side as well (``SHUT_RD``/``SHUT_RDWR``) also fails *this* process's own
waiting collective the same way: a partitioned peer sends nothing, no reset and no error, and
this is how a rank leaves such a collective
(:class:`~elastic_runner.recovery.generation_watch.GenerationWatch`).
The group's *listening* socket is never shut down: gloo's accept loop then raises
``gloo::EnforceNotMet`` ("accept: Invalid argument") outside any handler, which aborts the
process (measured with three ranks, one of them stopped). torchft solves the same
problem by running gloo in a child process it can kill (``ProcessGroupBabyGloo``), which costs a
copy through shared memory per collective; shutting the sockets down costs nothing per step.

Linux only (``/proc``); elsewhere nothing is recorded and :meth:`cut` does nothing.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Iterator
from typing import Protocol

_FD_DIR = "/proc/self/fd"


def _sockets() -> dict[int, str]:
    """This process's socket descriptors: fd -> ``socket:[inode]``."""
    found: dict[int, str] = {}
    with contextlib.suppress(OSError):
        for name in os.listdir(_FD_DIR):
            with contextlib.suppress(OSError, ValueError):
                target = os.readlink(f"{_FD_DIR}/{name}")
                if target.startswith("socket:"):
                    found[int(name)] = target
    return found


class GroupSockets:
    """The sockets of the process groups formed inside :meth:`forming` since the last
    :meth:`cut`."""

    def __init__(self) -> None:
        self._owned: dict[int, str] = {}
        self._exempt: dict[int, str] = {}  # opened by another thread meanwhile (:meth:`outside`)
        self._lock = threading.Lock()
        self.epoch = 0  # which group's sockets are recorded (one more per forming)

    @contextlib.contextmanager
    def forming(self, subgroups: bool = False) -> Iterator[None]:
        """Record the sockets opened inside the ``with`` block (a process group forming);
        ``subgroups``: groups made inside the current one (an HSDP mesh's, the checkpoint
        group: a peer may wait on this rank in them too), recorded with it, not as a newer
        group."""
        if not subgroups:
            with self._lock:
                self.epoch += 1
        before = _sockets()
        try:
            yield
        finally:
            after = _sockets()
            with self._lock:
                self._owned.update({fd: t for fd, t in after.items()
                                    if before.get(fd) != t and self._exempt.get(fd) != t})

    @contextlib.contextmanager
    def outside(self) -> Iterator[None]:
        """Sockets another thread opens inside the ``with`` block are never the group's, even
        when a group forms meanwhile (seen: a
        :class:`~elastic_runner.recovery.generation_watch.GenerationWatch` that reconnected to a moved store while the main thread formed the next group had its
        client recorded, and the next :meth:`cut` broke it for good)."""
        before = _sockets()
        try:
            yield
        finally:
            after = _sockets()
            new = {fd: t for fd, t in after.items() if before.get(fd) != t}
            with self._lock:
                self._exempt.update(new)
                for fd, t in new.items():
                    if self._owned.get(fd) == t:
                        del self._owned[fd]

    def cut(self, epoch: int | None = None, how: int = socket.SHUT_WR) -> int:
        """Shut down (``how``) every recorded socket that is still the one recorded (a closed
        fd may have been reused); with ``epoch``, only if no group formed since that epoch
        (another thread's view of which group to cut). Returns how many were shut down."""
        with self._lock:
            if epoch is not None and epoch != self.epoch:
                return 0
            owned, self._owned = self._owned, {}
        current = _sockets()
        count = 0
        for fd, target in owned.items():
            if current.get(fd) != target:
                continue
            with contextlib.suppress(OSError):
                sock = socket.socket(fileno=fd)
                try:
                    if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                        continue  # the listener: see the module docstring
                    sock.shutdown(how)
                    count += 1
                finally:
                    sock.detach()  # the descriptor stays gloo's
        return count


class Sockets(Protocol):
    """What the recovery uses of the current group's connections: :class:`GroupSockets`, or
    its null object :class:`NoSockets`."""

    epoch: int

    def forming(self, subgroups: bool = False) -> contextlib.AbstractContextManager[None]: ...

    def outside(self) -> contextlib.AbstractContextManager[None]: ...

    def cut(self, epoch: int | None = None, how: int = socket.SHUT_WR) -> int: ...


class NoSockets:
    """Nothing to cut (no in-place recovery: torchrun restarts every worker); a
    :class:`Sockets`."""

    epoch = 0

    def forming(self, subgroups: bool = False) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def outside(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def cut(self, epoch: int | None = None, how: int = socket.SHUT_WR) -> int:
        return 0


NO_SOCKETS = NoSockets()  # stateless: one instance serves every user
