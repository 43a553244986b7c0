"""Hang detection driven by per-step heartbeats.

The training loop arms the watchdog before every step with the step budget
(``watchdog.hang_timeout_seconds``) and before long operations (first step of an attempt,
checkpoint I/O, evaluation) with the longer ``long_op_timeout_seconds``. If a budget runs out
(a collective that never returns, a deadlocked data loader), the watchdog thread

1. logs which operation of which rank exceeded which budget,
2. dumps the Python stack of every thread of this process to stderr (``faulthandler``, which
   needs no GIL-free cooperation from the stuck thread),
3. records the error in torch elastic's error file (so the launcher's summary names it),
4. waits ``dump_grace_seconds`` so the other local ranks, stuck in the same collective with
   budgets armed at the same step, dump their stacks too, and
5. exits the process with code 124 (``exit_codes.EXIT_HANG``), so torchrun's agent kills and
   restarts the group.

This is the "equivalent watchdog" alternative to ``torch.distributed.elastic.timer``: it works
under any launcher (plain torchrun, Kubeflow) without an agent-side timer server.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time

from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

from ..exit_codes import EXIT_HANG

log = logging.getLogger(__name__)


class HangDetected(RuntimeError):
    """Recorded in the error file when a budget runs out."""


class HangWatchdog:
    """A daemon thread that fires when the armed deadline passes without being re-armed."""

    def __init__(self, rank: int, grace_seconds: float = 2.0) -> None:
        self.rank, self.grace = rank, grace_seconds
        self._lock = threading.Condition()
        self._deadline: float | None = None
        self._what, self._budget = "", 0.0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="hang-watchdog", daemon=True)
        self._thread.start()

    def arm(self, seconds: float | None, what: str) -> None:
        """Require the operation ``what`` to finish within ``seconds`` (None: no limit)."""
        deadline = None if seconds is None else time.monotonic() + seconds
        with self._lock:
            earlier = deadline is not None and (self._deadline is None
                                                or deadline < self._deadline)
            self._deadline = deadline
            self._what, self._budget = what, seconds or 0.0
            # wake the thread only for an earlier deadline: it re-reads the deadline when the
            # old one passes anyway, and a wake-up per step costs the training thread the GIL
            # and a context switch on every step
            if earlier:
                self._lock.notify()

    def disarm(self) -> None:
        self.arm(None, "")

    def close(self) -> None:
        """Stop the thread (so no daemon thread is left blocked at interpreter shutdown)."""
        with self._lock:
            self._closed, self._deadline = True, None
            self._lock.notify()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        with self._lock:
            while not self._closed:
                if self._deadline is None:
                    self._lock.wait()
                    continue
                left = self._deadline - time.monotonic()
                if left > 0:
                    self._lock.wait(timeout=left)
                    continue
                self._fire()

    def _fire(self) -> None:
        msg = (f"rank {self.rank}: {self._what} exceeded its {self._budget:g} s budget "
               "(hang): stack traces follow, then this rank exits")
        log.error("%s", msg)
        for handler in logging.getLogger("elastic_runner").handlers:
            handler.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        try:
            raise HangDetected(msg)
        except HangDetected as e:
            ErrorHandler().record_exception(e)
        time.sleep(self.grace)
        os._exit(EXIT_HANG)
