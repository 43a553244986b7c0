"""Spares: worker processes started ahead of a failure to take a dead worker's place.

A spare is the worker command with :data:`~elastic_runner.protocol.env.SPARE_ENV` set: it
imports torch, builds the task's data and model and waits in the recovery store until the
agent assigns it a dead worker's rank (:meth:`AttemptKeys.assign
<elastic_runner.protocol.keys.AttemptKeys.assign>`). With ``recovery.spare``,
``recovery.spares`` are kept warm (:class:`WarmSpares`); without, one starts cold at the
failure (:class:`Spares`). Each replacement's log line says whether it was warm, and if not,
why.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass
from typing import Any

from ..protocol.env import SPARE_ENV, SPARE_NICE_ENV
from ..protocol.torchrun_env import PLACE_NAMES, RANK
from . import worker_start
from .node_attempt import AGENT_LOG as log
from .node_attempt import NodeAttempt

# after a replacement, the next spare waits for the recovery's first committed step at most this
# long, seconds (or spare_delay_seconds, if longer): a recovery that has not committed one by
# then is stuck or was followed by another failure, whose replacement starts a spare itself
RECOVERY_WAIT_S = 30.0

# a dead worker's place, not a spare's: the agent hands these over at the replacement
_RANK_VARIABLES = PLACE_NAMES


@dataclass
class Spare:
    name: str  # "<node id>.<number>": its keys in the recovery store
    proc: worker_start.Process
    started: float  # time.monotonic() at its start
    ready: bool = False


class Spares:
    """Spares started cold, when a worker died (``recovery.spare`` off): the base of
    :class:`WarmSpares`, which keeps some ready beforehand."""

    def __init__(self, attempt: NodeAttempt) -> None:
        self._attempt = attempt
        self._kept: list[Spare] = []  # the ones kept warm, oldest first
        self._started = 0  # spares started by this agent: the next one's number
        self.why_cold = "recovery.spare is off"  # the last take's, when no spare was ready

    @property
    def warm(self) -> bool:
        """Whether a spare is ready (task built) and alive."""
        return any(s.ready and s.proc.poll() is None for s in self._kept)

    def begin(self) -> None:
        """A new attempt starts (its workers have not built the task yet)."""

    def keep(self, pc: Any) -> None:
        """Cold spares: none is kept."""

    def take(self, pc: Any) -> Spare:
        """A ready spare for a dead worker's place, else the one building the longest, else
        a new one started now; ``pc``: torch's ``SubprocessContext`` of the workers."""
        alive = [s for s in self._kept if s.proc.poll() is None]
        ready = [s for s in alive if s.ready]
        spare = (ready or alive or [None])[0]
        if spare is None:
            spare = self.start(pc)
        else:
            self._kept.remove(spare)
        if not spare.ready:
            self.why_cold = self._why_cold(spare, alive)
        return spare

    def _why_cold(self, spare: Spare, alive: list[Spare]) -> str:
        return self.why_cold

    def start(self, pc: Any, nice: int = 0) -> Spare:
        """Start a spare: local rank 0's command and environment, without a worker's place,
        with what every worker of this agent reads (:meth:`NodeAttempt.worker_variables`);
        ``nice``: this much lower a CPU priority than the agent's until it takes a place
        (``recovery/group_formation.py``: ``restore_priority``)."""
        name = f"{self._attempt.node}.{self._started}"
        self._started += 1
        env = {**os.environ, **pc.envs[0]}
        for variable in _RANK_VARIABLES:
            env.pop(variable, None)
        env.update({**self._attempt.worker_variables(), SPARE_ENV: name, RANK: "-1"})
        base = os.getpriority(os.PRIO_PROCESS, 0)
        if nice:
            env[SPARE_NICE_ENV] = str(base)
        proc = worker_start.popen([pc.entrypoint, *pc.args[0]], env)
        if nice:  # before it starts its threads, which inherit it
            with contextlib.suppress(PermissionError, ProcessLookupError):
                os.setpriority(os.PRIO_PROCESS, proc.pid, base + nice)
        log.info("spare %s started (pid %d%s)", name, proc.pid,
                 f", nice +{nice}" if nice else "")
        return Spare(name, proc, time.monotonic())

    def drop(self) -> None:
        """SIGKILL the spares kept, if any, and wait for them."""
        kept, self._kept = self._kept, []
        for spare in kept:
            if spare.proc.poll() is None:
                worker_start.signal_session(spare.proc, signal.SIGKILL)
                spare.proc.wait()


# a refill started while a recovery runs gets this much lower a CPU priority (nice)
REFILL_NICE = 10


class WarmSpares(Spares):
    """``count`` spares kept warm (``recovery.spare``, ``recovery.spares``), one building at a
    time: the first ``delay_s`` seconds (``recovery.spare_delay_seconds``) after the workers
    built the task, each next one once the one before is ready. After a replacement the next
    one starts at once at a lower CPU priority when this agent may give it back its priority
    (:func:`may_restore_priority`), else once that recovery's first step is committed
    (:meth:`_due`)."""

    def __init__(self, attempt: NodeAttempt, delay_s: float, count: int = 1) -> None:
        super().__init__(attempt)
        self._delay_s, self._count = delay_s, count
        self._built_since: float | None = None  # when the workers reported the task built
        self._taken: tuple[int, float] | None = None  # the last replacement's generation, when
        self._nice = REFILL_NICE if may_restore_priority() else 0

    def begin(self) -> None:
        self._built_since, self._taken = None, None

    def take(self, pc: Any) -> Spare:
        spare = super().take(pc)
        self._taken = (self._attempt.generation, time.monotonic())
        return spare

    def _why_cold(self, spare: Spare, alive: list[Spare]) -> str:
        if spare in alive:
            return (f"spare {spare.name} was still building the task "
                    f"({time.monotonic() - spare.started:.1f} s after its start)")
        if self._taken is not None:
            return (f"the spares kept ({self._count}, recovery.spares) were taken by the "
                    f"failures before, {time.monotonic() - self._taken[1]:.1f} s ago")
        return ("none was started yet (recovery.spare_delay_seconds "
                f"{self._delay_s:g} after the workers built the task)")

    def keep(self, pc: Any) -> None:
        """Start the next spare once due (:meth:`_due`), note them ready, replace one that
        died.

        Raises:
            Exception: any client error of an unreachable recovery store.
        """
        for spare in [s for s in self._kept if s.proc.poll() is not None]:
            log.warning("spare %s exited with code %s; starting another", spare.name,
                        spare.proc.returncode)
            self._kept.remove(spare)
        rs = self._attempt.rs
        for spare in self._kept:
            if not spare.ready and rs.attempt.is_spare_ready(spare.name):
                spare.ready = True
                log.info("spare %s ready (task built) %.1f s after its start", spare.name,
                         time.monotonic() - spare.started)
        building = any(not s.ready for s in self._kept)
        if len(self._kept) < self._count and not building and self._due():
            self._kept.append(self.start(pc, self._nice if self._recovering() else 0))

    def _recovering(self) -> bool:
        """A replacement's recovery has not committed its first step yet."""
        if self._taken is None:
            return False
        return not self._attempt.rs.attempt.recovered(self._taken[0])

    def _due(self) -> bool:
        """Whether to start a spare now. At the start, ``delay_s`` after the workers built
        the task: it neither competes with their start-up nor makes a task artifact before
        rank 0 does, and a short job never starts one. After a replacement: at once at a lower
        CPU priority (when this agent may restore it), else once its recovery's first step is
        committed: a build at full priority (imports, the task: seconds of CPU) would compete
        with the recovery's state transfer and first step (on 2 cores it made them about 1 s
        slower at GPT-2-small width, ``bench.state_transfer``); at the latest
        :data:`RECOVERY_WAIT_S` or ``delay_s`` after the replacement."""
        attempt = self._attempt.rs.attempt
        if self._taken is not None:
            generation, since = self._taken
            return bool(self._nice) or attempt.recovered(generation) or \
                time.monotonic() - since >= max(self._delay_s, RECOVERY_WAIT_S)
        if self._built_since is None and attempt.built():
            self._built_since = time.monotonic()
        return self._built_since is not None and \
            time.monotonic() - self._built_since >= self._delay_s


def may_restore_priority() -> bool:
    """Whether this process may give a spare back the priority it lowered (CAP_SYS_NICE: an
    unprivileged process cannot lower its nice value again); root stands for it."""
    return os.geteuid() == 0


def spares_for(attempt: NodeAttempt, warm: bool, delay_s: float, count: int = 1) -> Spares:
    """The spares of ``recovery.spare`` = ``warm`` (``delay_s``: its
    ``spare_delay_seconds``; ``count``: ``recovery.spares``)."""
    return WarmSpares(attempt, delay_s, count) if warm else Spares(attempt)
