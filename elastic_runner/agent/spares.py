"""Spares: worker processes started ahead of a failure to take a dead worker's place.

A spare is the worker command with :data:`~elastic_runner.recovery.protocol.SPARE_ENV` set: it
imports torch, builds the task's data and model and waits in the recovery store until the
agent assigns it a dead worker's rank (:meth:`AttemptKeys.assign
<elastic_runner.recovery.protocol.AttemptKeys.assign>`). With ``recovery.spare`` one is kept
warm (:class:`WarmSpares`); without, one starts cold at the failure (:class:`Spares`).
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import Any

from ..recovery.protocol import SPARE_ENV
from . import worker_start
from .node_attempt import AGENT_LOG as log
from .node_attempt import NodeAttempt

# after a replacement, the next spare waits for the recovery's first committed step at most this
# long, seconds (or spare_delay_seconds, if longer): a recovery that has not committed one by
# then is stuck or was followed by another failure, whose replacement starts a spare itself
RECOVERY_WAIT_S = 30.0

# a dead worker's place, not a spare's: the agent hands these over at the replacement
_RANK_VARIABLES = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_ERROR_FILE")


@dataclass
class Spare:
    name: str  # "<node id>.<number>": its keys in the recovery store
    proc: worker_start.Process
    started: float  # time.monotonic() at its start
    ready: bool = False


class Spares:
    """Spares started cold, when a worker died (``recovery.spare`` off): the base of
    :class:`WarmSpares`, which keeps one ready beforehand."""

    def __init__(self, attempt: NodeAttempt) -> None:
        self._attempt = attempt
        self._spare: Spare | None = None  # the one kept warm
        self._started = 0  # spares started by this agent: the next one's number

    @property
    def warm(self) -> bool:
        """Whether a spare is ready (task built) and alive."""
        spare = self._spare
        return spare is not None and spare.ready and spare.proc.poll() is None

    def begin(self) -> None:
        """A new attempt starts (its workers have not built the task yet)."""

    def keep(self, pc: Any) -> None:
        """Cold spares: none is kept."""

    def take(self, pc: Any) -> Spare:
        """The spare kept (a new one, started now, if none is alive) for a dead worker's
        place; ``pc``: torch's ``SubprocessContext`` of the workers."""
        spare = self._spare
        if spare is None or spare.proc.poll() is not None:
            spare = self.start(pc)
        self._spare = None
        return spare

    def start(self, pc: Any) -> Spare:
        """Start a spare: local rank 0's command and environment, without a worker's place,
        with what every worker of this agent reads (:meth:`NodeAttempt.worker_variables`)."""
        name = f"{self._attempt.node}.{self._started}"
        self._started += 1
        env = {**os.environ, **pc.envs[0]}
        for variable in _RANK_VARIABLES:
            env.pop(variable, None)
        env.update({**self._attempt.worker_variables(), SPARE_ENV: name, "RANK": "-1"})
        proc = worker_start.popen([pc.entrypoint, *pc.args[0]], env)
        log.info("spare %s started (pid %d)", name, proc.pid)
        return Spare(name, proc, time.monotonic())

    def drop(self) -> None:
        """SIGKILL the spare kept, if any, and wait for it."""
        spare, self._spare = self._spare, None
        if spare is not None and spare.proc.poll() is None:
            worker_start.signal_session(spare.proc, signal.SIGKILL)
            spare.proc.wait()


class WarmSpares(Spares):
    """One spare kept warm (``recovery.spare``), started ``delay_s`` seconds
    (``recovery.spare_delay_seconds``) after the workers have built the task; once it took a
    failed worker's place, the next one starts when that recovery's first step is committed
    (:meth:`_due`)."""

    def __init__(self, attempt: NodeAttempt, delay_s: float) -> None:
        super().__init__(attempt)
        self._delay_s = delay_s
        self._built_since: float | None = None  # when the workers reported the task built
        self._taken: tuple[int, float] | None = None  # the last replacement's generation, when

    def begin(self) -> None:
        self._built_since, self._taken = None, None

    def take(self, pc: Any) -> Spare:
        spare = super().take(pc)
        self._taken = (self._attempt.generation, time.monotonic())
        return spare

    def keep(self, pc: Any) -> None:
        """Start the spare once due (:meth:`_due`), note it ready, replace one that died.

        Raises:
            Exception: any client error of an unreachable recovery store.
        """
        if self._spare is not None and self._spare.proc.poll() is not None:
            log.warning("spare %s exited with code %s; starting another", self._spare.name,
                        self._spare.proc.returncode)
            self._spare = None
        spare, rs = self._spare, self._attempt.rs
        if spare is None and self._due():
            self._spare = self.start(pc)
        elif spare is not None and not spare.ready and rs.attempt.is_spare_ready(spare.name):
            spare.ready = True
            log.info("spare %s ready (task built) %.1f s after its start", spare.name,
                     time.monotonic() - spare.started)

    def _due(self) -> bool:
        """Whether to start a spare now. At the start, ``delay_s`` after the workers built
        the task: it neither competes with their start-up nor makes a task artifact before
        rank 0 does, and a short job never starts one. After a replacement, once its
        recovery's first step is committed: its build (imports, the task: seconds of CPU)
        would compete with the recovery's state transfer and first step (on 2 cores it made
        them about 1 s slower at GPT-2-small width, ``bench.state_transfer``); at the latest
        :data:`RECOVERY_WAIT_S` or ``delay_s`` after the replacement."""
        attempt = self._attempt.rs.attempt
        if self._taken is not None:
            generation, since = self._taken
            return attempt.recovered(generation) or \
                time.monotonic() - since >= max(self._delay_s, RECOVERY_WAIT_S)
        if self._built_since is None and attempt.built():
            self._built_since = time.monotonic()
        return self._built_since is not None and \
            time.monotonic() - self._built_since >= self._delay_s


def spares_for(attempt: NodeAttempt, warm: bool, delay_s: float) -> Spares:
    """The spares of ``recovery.spare`` = ``warm`` (``delay_s``: its
    ``spare_delay_seconds``)."""
    return WarmSpares(attempt, delay_s) if warm else Spares(attempt)
