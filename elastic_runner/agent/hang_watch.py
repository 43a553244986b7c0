"""Hung workers: a worker whose heartbeat file stopped is SIGKILLed, then replaced in place.

Each worker touches ``<heartbeat directory>/<local rank>`` from a thread
(:mod:`elastic_runner.recovery.heartbeat`); a worker that stopped touching it for longer than
``recovery.heartbeat_timeout_seconds`` is stopped (SIGSTOP), frozen in the kernel or holding
the GIL. It cannot be replaced while it lives, so the agent kills it; its exit then looks like
any crash to the agent's next look at the workers.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from ..recovery.background import Stoppable
from .node_attempt import AGENT_LOG as log


class HangWatch:
    """Kills hung workers.

    Args:
        heartbeats: the workers' heartbeat directory.
        limit_s: seconds without a heartbeat after which a worker is hung.
    """

    def __init__(self, heartbeats: Path, limit_s: float) -> None:
        self.heartbeats, self.limit_s = heartbeats, limit_s

    def kill_hung(self, pc: Any) -> None:
        """SIGKILL each worker of ``pc`` (torch's ``SubprocessContext``) whose heartbeat file
        is older than :attr:`limit_s`, and wait up to 5 s for it to go."""
        now = time.time()
        for local_rank, handler in pc.subprocess_handlers.items():
            beat = self.heartbeats / str(local_rank)
            try:
                age = now - beat.stat().st_mtime
            except FileNotFoundError:  # not beating yet (starting) or already replaced
                continue
            if age <= self.limit_s or handler.proc.poll() is not None:
                continue
            log.warning("local_rank %d (pid %d) sent no heartbeat for %.1f s "
                        "(recovery.heartbeat_timeout_seconds=%g): hung (stopped or frozen); "
                        "killing it", local_rank, handler.proc.pid, age, self.limit_s)
            beat.unlink(missing_ok=True)
            with contextlib.suppress(ProcessLookupError):
                os.kill(handler.proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                handler.proc.wait(timeout=5)


class NoHangWatch:
    """``recovery.heartbeat_timeout_seconds`` unset: no worker is ever taken for hung."""

    def kill_hung(self, pc: Any) -> None:
        """Nothing to do."""


def hang_watch(heartbeats: Path, limit_s: float | None) -> Stoppable:
    """The watch for ``recovery.heartbeat_timeout_seconds`` = ``limit_s`` (None: off)."""
    return NoHangWatch() if limit_s is None else HangWatch(heartbeats, limit_s)
