"""In-place recovery, the agent's side: replace only the failed worker, from a warm spare.

:class:`InPlaceAgent` is torch's ``LocalElasticAgent`` (subclassed through torch.distributed.
elastic's agent API, not forked) with three changes, used by ``elastic-runner run`` on one node
with ``recovery.mode: in_place``:

* it hosts the attempt's **recovery store** (a ``TCPStore`` on ``127.0.0.1``) and names it to
  the workers in :data:`~elastic_runner.inplace.ENV`; the workers' process groups live in it,
  one namespace per generation (:mod:`elastic_runner.inplace`);
* once the workers have built the task it starts a **spare**: the worker command with
  :data:`~elastic_runner.inplace.SPARE_ENV` set, which imports torch, builds the task's data and
  model and waits;
* when a worker exits with a failure (not 0, not 2 = bad input, not 143 = preempted) while
  others of the node still run, :meth:`_monitor_workers` hands the dead worker's environment
  (rank, local_rank, error file, ...) to the spare, puts the spare in the dead worker's place in
  torch's process context, publishes the next generation and reports the group healthy, instead
  of torch's stop-everything-and-restart. Each replacement counts against ``--max-restarts``.

Everything else (no survivor, a worker that finished, bad input, preemption, running out of
restarts) goes to torch's own handling unchanged.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import SubprocessContext

from .compat import EXIT_BAD_INPUT
from .config import RecoveryConfig
from .fencing import EXIT_FENCED
from .inplace import ENV, GENERATION_ENV, SPARE_ENV
from .preempt import EXIT_PREEMPTED
from .watchdog import EXIT_HANG

log = logging.getLogger(__name__)

_RANK_VARIABLES = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_ERROR_FILE")


class _Adopted:
    """A process the agent started itself (a spare), in the shape of torch's
    ``SubprocessHandler`` (``proc``, ``local_rank_id``, ``close``)."""

    def __init__(self, proc: subprocess.Popen[bytes], local_rank: int) -> None:
        self.proc, self.local_rank_id = proc, local_rank

    def close(self, death_sig: signal.Signals | None = None) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, death_sig or signal.SIGTERM)


@dataclass
class _Spare:
    number: int
    proc: subprocess.Popen[bytes]
    started: float
    ready: bool = False


@dataclass(frozen=True)
class Replacement:
    """One in-place replacement: ``generation`` announced, ``ranks`` that died and their exit
    codes, whether a warm spare took their place, and the agent's reaction time (seconds from
    noticing the exit to the announcement)."""

    generation: int
    ranks: tuple[int, ...]
    exitcodes: tuple[int, ...]
    warm: bool
    seconds: float


class InPlaceAgent(LocalElasticAgent):
    """See the module docstring. ``recovery``: the config's ``recovery`` section;
    ``on_replacement``: called with each :class:`Replacement` (the node's metrics)."""

    def __init__(self, *args: Any, recovery: RecoveryConfig, on_replacement: Any = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._cfg = recovery
        self._on_replacement = on_replacement or (lambda r: None)
        self._recovery_store = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False,
            timeout=timedelta(seconds=recovery.join_timeout_seconds))
        self._prefix = ""
        self._generation = 0
        self._spare: _Spare | None = None
        self._spares = 0
        self._grow: tuple[int, list[_Spare]] | None = None  # shrunk: (generation, joiners)
        self._built_since: float | None = None  # when the workers reported the task built

    def _key(self, *parts: object) -> str:
        return "/".join([self._prefix, *map(str, parts)])

    # ------------------------------------------------------------ torch's agent hooks

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        self._prefix, self._generation = f"attempt-{uuid.uuid4().hex[:12]}", 0
        self._grow, self._built_since = None, None
        os.environ[ENV] = f"127.0.0.1:{self._recovery_store.port}/{self._prefix}"
        try:
            return super()._start_workers(worker_group)
        finally:
            del os.environ[ENV]

    def _stop_workers(self, worker_group: WorkerGroup, *args: Any, **kwargs: Any) -> None:
        self._drop_spare()
        super()._stop_workers(worker_group, *args, **kwargs)

    def _shutdown(self, *args: Any, **kwargs: Any) -> None:
        self._drop_spare()
        super()._shutdown(*args, **kwargs)

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        pc = self._pcontext
        if not isinstance(pc, SubprocessContext):
            return super()._monitor_workers(worker_group)
        # one look at every worker decides; torch's own poll, which stops every worker at the
        # first failure it sees, runs only when this look leaves it nothing to recover
        codes = {lr: h.proc.poll() for lr, h in pc.subprocess_handlers.items()}
        failed = {lr: c for lr, c in codes.items() if c not in (None, 0)}
        if failed and self._replaceable(codes, failed):
            self._replace(worker_group, pc, failed)
            return RunResult(state=WorkerState.HEALTHY)
        if failed:  # torch's restart path: release survivors waiting for an announcement
            waited = self._grow[0] if self._grow else self._generation + 1
            self._recovery_store.set(self._key("gen", waited), json.dumps({"restart": True}))
            return super()._monitor_workers(worker_group)
        self._announce_grow()
        self._keep_spare(pc)
        if any(code is None for code in codes.values()):
            # torch's optional check for workers stuck in the kernel (off unless configured)
            timeout = getattr(self, "_uninterruptible_state_timeout", 0.0)
            stuck = (self._check_uninterruptible_state_timeout(worker_group, timeout)
                     if timeout > 0 else None)
            return stuck or RunResult(state=WorkerState.HEALTHY)
        return super()._monitor_workers(worker_group)  # all succeeded

    # ------------------------------------------------------------ replacement

    def _replaceable(self, codes: dict[int, int | None], failed: dict[int, int]) -> bool:
        """A failure (not bad input, not fenced out, not preemption, not a hang), some worker
        still running and none finished, and restarts left (``codes``: every local rank's exit
        code or None)."""
        # a hang: the rank whose watchdog fired may only be waiting for the hung one, which
        # has not exited; replacing the waiter would wait for the hung rank forever
        if any(code in (EXIT_BAD_INPUT, EXIT_FENCED, EXIT_PREEMPTED, EXIT_HANG)
               for code in failed.values()):
            return False
        others = [code for lr, code in codes.items() if lr not in failed]
        # a failure while shrunk takes the restart path
        return (bool(others) and all(code is None for code in others)
                and self._remaining_restarts > 0 and self._grow is None)

    def _replace(self, worker_group: WorkerGroup, pc: SubprocessContext,
                 failed: dict[int, int]) -> None:
        t0 = time.perf_counter()
        warm = (self._spare is not None and self._spare.ready
                and self._spare.proc.poll() is None)
        # continue shrunk: the survivors go on alone (generation g+1) and the replacement
        # joins them in g+2, announced once it is ready
        shrink = self._cfg.continue_shrunk and not warm
        announce = self._generation + 1
        self._generation = announce + 1 if shrink else announce
        self._remaining_restarts -= 1
        # the replacement is the rank's next attempt: restarts used so far, as torch counts them
        attempt = worker_group.spec.max_restarts - self._remaining_restarts
        ranks, pids, spares = [], [], []
        for local_rank in sorted(failed):
            spare = self._take_spare(pc)
            env = {**pc.envs[local_rank], GENERATION_ENV: str(self._generation),
                   "TORCHELASTIC_RESTART_COUNT": str(attempt)}
            self._recovery_store.set(self._key("spare", spare.number, "assign"), json.dumps(env))
            pc.subprocess_handlers[local_rank] = _Adopted(spare.proc, local_rank)  # type: ignore
            worker = worker_group.workers[local_rank]
            worker.id = spare.proc.pid
            ranks.append(worker.global_rank)
            pids.append(spare.proc.pid)
            spares.append(spare)
        news: dict[str, Any] = {"failed": ranks, "exitcodes": list(failed.values())}
        if shrink:
            members = sorted(w.global_rank for w in worker_group.workers
                             if w.global_rank not in ranks)
            news.update(members=members, world_size=len(members))
            self._grow = (self._generation, spares)
        self._recovery_store.set(self._key("gen", announce), json.dumps(news))
        replacement = Replacement(announce, tuple(ranks), tuple(failed.values()), warm,
                                  time.perf_counter() - t0)
        log.warning("rank(s) %s exited with code(s) %s: replaced in place by %s spare(s) "
                    "pid(s) %s (generation %d; %d restarts left)%s", ranks,
                    list(failed.values()), "warm" if warm else "cold", pids, announce,
                    self._remaining_restarts,
                    "; the others go on without it until it is ready" if shrink else "")
        self._on_replacement(replacement)

    def _announce_grow(self) -> None:
        """Shrunk: once every replacement is ready, announce the generation with all ranks
        (the survivors join it at their next step boundary)."""
        if self._grow is None:
            return
        generation, spares = self._grow
        if all(self._recovery_store.check([self._key("spare", s.number, "ready")])
               for s in spares):
            self._recovery_store.set(self._key("gen", generation), json.dumps({"grow": True}))
            self._grow = None
            log.info("replacement(s) ready: generation %d brings the group back to full size",
                     generation)

    def _take_spare(self, pc: SubprocessContext) -> _Spare:
        spare = self._spare
        if spare is None or spare.proc.poll() is not None:
            spare = self._start_spare(pc)
        self._spare = None
        return spare

    def _keep_spare(self, pc: SubprocessContext) -> None:
        """Start a spare ``recovery.spare_delay_seconds`` after the workers have built the task
        (so it neither competes with their start-up nor makes a task artifact before rank 0
        does, and a short job never starts one); replace one that died."""
        if not self._cfg.spare:
            return
        if self._spare is not None and self._spare.proc.poll() is not None:
            log.warning("spare %d exited with code %s; starting another", self._spare.number,
                        self._spare.proc.returncode)
            self._spare = None
        spare = self._spare
        if spare is None and self._built_since is None \
                and self._recovery_store.check([self._key("built")]):
            self._built_since = time.monotonic()
        if spare is None and self._built_since is not None \
                and time.monotonic() - self._built_since >= self._cfg.spare_delay_seconds:
            self._spare = self._start_spare(pc)
        elif (spare is not None and not spare.ready
              and self._recovery_store.check([self._key("spare", spare.number, "ready")])):
            spare.ready = True
            log.info("spare %d ready (task built) %.1f s after its start", spare.number,
                     time.monotonic() - spare.started)

    def _start_spare(self, pc: SubprocessContext) -> _Spare:
        number, self._spares = self._spares, self._spares + 1
        env = {**os.environ, **pc.envs[0]}
        for name in _RANK_VARIABLES:
            env.pop(name, None)
        env.update({ENV: f"127.0.0.1:{self._recovery_store.port}/{self._prefix}",
                    SPARE_ENV: str(number), "RANK": "-1"})
        proc = subprocess.Popen([pc.entrypoint, *map(str, pc.args[0])], env=env,
                                start_new_session=True)
        log.info("spare %d started (pid %d)", number, proc.pid)
        return _Spare(number, proc, time.monotonic())

    def _drop_spare(self) -> None:
        spare, self._spare = self._spare, None
        if spare is not None and spare.proc.poll() is None:
            os.killpg(spare.proc.pid, signal.SIGKILL)
            spare.proc.wait()
