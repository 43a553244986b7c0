"""A worker's heartbeat, watched by its node's agent to find a hung process.

Under ``elastic-runner run`` with in-place recovery the agent names a directory in
:data:`HEARTBEAT_ENV`; each worker's :class:`Heartbeat` thread touches ``<dir>/<local_rank>``
(its modification time) every ``interval_s``. The thread runs whatever the training thread
does, so the file goes stale only when the whole process stops: SIGSTOP, a freeze in the kernel
(``D`` state), a C call that holds the GIL. The agent SIGKILLs a worker whose file is older than
``recovery.heartbeat_timeout_seconds`` and replaces it in place
(:meth:`elastic_runner.agent.hang_watch.HangWatch.kill_hung`). A live process stuck in a
collective keeps beating; its step watchdog (:mod:`elastic_runner.observe.watchdog`) handles it.

A file, not a key in the recovery store: the agent watches only its own node's workers, so the
heartbeat never leaves the node and costs no store traffic (etcd keeps every write).
"""

from __future__ import annotations

import threading
from pathlib import Path

from ..protocol import env
from ..protocol.env import HEARTBEAT_ENV
from ..protocol.torchrun_env import TorchrunEnv
from .background import Stoppable

__all__ = ["HEARTBEAT_ENV", "Heartbeat", "NoHeartbeat"]


class Heartbeat:
    """Touch ``path`` every ``interval_s`` seconds from a daemon thread until :meth:`close`."""

    def __init__(self, path: Path, interval_s: float) -> None:
        self.path, self.interval_s = path, interval_s
        self._closed = threading.Event()
        path.touch()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self._thread.start()

    @classmethod
    def from_env(cls, timeout_s: float | None) -> Stoppable:
        """This worker's heartbeat (four beats per ``timeout_s``, the agent's limit), or a
        :class:`NoHeartbeat` without the agent's directory or with the check off."""
        directory = env.heartbeat_dir()
        if not directory or timeout_s is None:
            return NoHeartbeat()
        return cls(Path(directory) / str(TorchrunEnv.read().local_rank), timeout_s / 4)

    def _run(self) -> None:
        while not self._closed.wait(self.interval_s):
            self.path.touch()  # creates it again if it was removed

    def close(self) -> None:
        """Stop beating and remove the file (a process on its way out is not hung)."""
        self._closed.set()
        self._thread.join(timeout=5)
        self.path.unlink(missing_ok=True)


class NoHeartbeat:
    """No agent watches this worker (plain torchrun, restart mode, the check off)."""

    def close(self) -> None:
        pass
