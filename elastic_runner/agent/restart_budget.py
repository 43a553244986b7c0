"""Restart budget by cause: which worker failures spend torchrun's ``--max-restarts``.

torch's agent counts every failed attempt alike: a job preempted twenty times dies of a budget
meant for crashes, and a crash that repeats at the same step burns every restart before it
stops. ``elastic-runner run`` judges each failed attempt of its node by the workers' exit codes
(the ``RunResult.failures`` of torch's ``_monitor_workers``) before torch decides on a restart:

========================  ======================================================================
cause                     rule
========================  ======================================================================
bad input (exit 2)        no restart: a restart would fail the same way
fenced out (exit 3)       no restart: a newer group owns the checkpoint directory (checkpoint/fencing.py)
preempted (all exit 143)  restarted without spending ``--max-restarts``, up to
                          ``restarts.preemption`` times
peer lost (all exit 4)    a rank's collective failed because another node's rank died or hung (a
                          membership change): restarted without spending ``--max-restarts``, up
                          to ``restarts.peer_lost`` times
crash loop                the same failure (exit codes and first error lines of the ranks that
                          failed on their own) ``restarts.crash_loop`` times in a row with no
                          newer checkpoint committed in between: no restart, one line naming
                          it; ``run`` exits :data:`EXIT_CRASH_LOOP` (5), not 1, so that an
                          operator does not retry it
anything else             a crash: spends one of ``--max-restarts``, as in torch
========================  ======================================================================

torch itself already restarts without spending the budget when nodes join (a healthy group with
nodes waiting at the rendezvous). A rank that exits 4 while its local peers still run may have
lost a *local* peer that is still dying: the agent gives those :data:`PEER_SETTLE_SECONDS` to
exit on their own before torch stops them, so a local crash is judged a crash.
A refunded restart still counts in ``TORCHELASTIC_RESTART_COUNT``. What is left of a failed group
(not a preempted one) is stopped with a SIGKILL :data:`FAILED_STOP_SECONDS` after the SIGTERM,
not torch's fixed 30 s: a stopped or hung rank would otherwise hold up every restart.

:func:`apply_agent_fixes` puts the budget into torch's ``LocalElasticAgent`` (its
``_monitor_workers``); :mod:`elastic_runner.compat.agent` (fix 8) lists and checks the torch
internals that relies on.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..exit_codes import EXIT_BAD_INPUT, EXIT_FENCED, EXIT_PEER_LOST, EXIT_PREEMPTED
from .first_death import STOPPED, cause_rank, exited, log_first_death

log = logging.getLogger("elastic_runner.restarts")

PEER_SETTLE_SECONDS = 3.0  # a rank that lost a peer waits this long for its local peers
# SIGTERM -> SIGKILL gap when the agent stops what is left of a *failed* group (a crash, a lost
# peer, a hang), instead of torch's fixed 30 s: nothing of that group is checkpointed any more
# (its step consensus fails without the dead rank), a rank blocked in a collective or stopped
# never reacts to SIGTERM, and a watchdog's stack dump (watchdog.dump_grace_seconds) is done
# well before. A preempted group (all exit 143) keeps torch's gap: its rank 0 may still commit.
FAILED_STOP_SECONDS = 5.0


@dataclass(frozen=True)
class Failure:
    """One failed local rank as the agent saw it: its exit code (negative: killed by that
    signal) and the first line of its recorded error (empty when none)."""

    exitcode: int
    message: str


class RestartBudget:
    """Decides, per failed attempt, how many of torch's restarts remain (module docstring).

    Args:
        preemption: restarts after a preemption (exit 143) that do not spend the crash budget.
        peer_lost: restarts after a lost peer (exit 4) that do not spend the crash budget.
        crash_loop: identical failures in a row without checkpoint progress that stop the job
            (0: never).
        progress: the newest committed checkpoint step (-1: none); read once per failure.
    """

    def __init__(self, preemption: int = 100, peer_lost: int = 100, crash_loop: int = 3,
                 progress: Callable[[], int] = lambda: -1) -> None:
        self.left = {"preempted": preemption, "peer lost": peer_lost}
        self.crash_loop, self.progress = crash_loop, progress
        self._last: tuple[tuple[Failure, ...], int] | None = None
        self._repeats = 0
        self.looped = False  # a crash loop stopped the job (``run`` then exits EXIT_CRASH_LOOP)

    def judge(self, failures: dict[int, Failure], remaining: int) -> int:
        """The restarts that remain after this failed attempt, *before* torch spends one on
        it (torch subtracts one from the returned value when it is positive)."""
        codes = {f.exitcode for f in failures.values()}
        first = min(failures, key=lambda r: (cause_rank(failures[r].exitcode), r))
        if codes & {EXIT_BAD_INPUT, EXIT_FENCED}:
            code = EXIT_FENCED if EXIT_FENCED in codes else EXIT_BAD_INPUT
            rank = min(r for r, f in failures.items() if f.exitcode == code)
            what = ("fenced out: a newer group owns the checkpoint directory"
                    if code == EXIT_FENCED else "bad input: config, task or checkpoint")
            log.error("rank %d exited with code %d (%s): not restarting, a restart would fail "
                      "the same way", rank, code, what)
            return 0
        if self._looping(failures):
            self.looped = True
            log.error("crash loop: rank %d failed the same way %d times in a row (exit code %d: "
                      "%s) with no newer checkpoint in between: not restarting",
                      first, self._repeats, failures[first].exitcode,
                      failures[first].message or "no error recorded")
            return 0
        cause = {frozenset({EXIT_PREEMPTED}): "preempted",
                 frozenset({EXIT_PEER_LOST}): "peer lost"}.get(frozenset(codes - {STOPPED}))
        if cause is not None and self.left[cause] > 0:
            self.left[cause] -= 1
            log.warning("restart after %s (exit code %d): not counted against --max-restarts "
                        "(%d such restarts left)", cause, failures[first].exitcode,
                        self.left[cause])
            return remaining + 1  # torch takes one back
        return remaining

    def _looping(self, failures: dict[int, Failure]) -> bool:
        if self.crash_loop <= 0:
            return False
        # preemptions and lost peers come from outside: never a loop of this node's own; the
        # workers the agent stopped after the first failure say nothing about it either
        signature = tuple(failures[r] for r in sorted(failures)
                          if failures[r].exitcode not in (EXIT_PEER_LOST, STOPPED))
        if not signature or {f.exitcode for f in signature} == {EXIT_PREEMPTED}:
            self._last, self._repeats = None, 0
            return False
        now = (signature, self.progress())
        self._repeats = self._repeats + 1 if now == self._last else 1
        self._last = now
        return self._repeats >= self.crash_loop


def failures_of(result: Any) -> dict[int, Failure]:
    """The failed ranks of torch's ``RunResult`` (``failures``: rank -> ``ProcessFailure`` with
    ``exitcode`` and ``message``: the error file's dict, or a string for a signal). A rank the
    agent stopped (SIGTERM) after it had recorded an error of its own counts as exit 1: it was
    still exiting from that error."""
    out = {}
    for rank, f in (getattr(result, "failures", None) or {}).items():
        message = f.message.get("message", "") if isinstance(f.message, dict) else f.message
        lines = str(message or "").strip().splitlines()
        code = f.exitcode
        if code == STOPPED and lines:  # it recorded an error of its own, then was stopped
            code = 1
        out[rank] = Failure(code, lines[0][:300] if lines else "")
    return out


# --- the patch of torch's agent (compat/agent.py, fix 8, checks the internals it relies on) ---

_MARK = "_elastic_runner_fix"
_BUDGET = [RestartBudget()]  # the agent process's restart budget (apply_agent_fixes sets it)


def apply_agent_fixes(cls: type | None = None, budget: RestartBudget | None = None
                      ) -> bool:
    """Patch ``cls`` (torch's ``LocalElasticAgent``) in this process with fix 8: each failed
    attempt's remaining restarts are judged by ``budget`` (``agent/restart_budget.py``: no restart
    after bad input or a fenced-out writer or in a crash loop; preemptions and lost peers do
    not spend ``--max-restarts``), and the rest of a failed group is SIGKILLed
    ``FAILED_STOP_SECONDS`` after its SIGTERM. Idempotent; a later call replaces the budget.
    Returns False, without patching, when the methods no longer look as expected
    (:func:`~elastic_runner.compat.registry.check_torch` has said so)."""
    # imported here: the command line imports this module for RestartBudget, before torch's agent
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    from ..compat.agent import FIX_RESTART_BUDGET
    from ..compat.fix import applies

    cls = LocalElasticAgent if cls is None else cls
    if budget is not None:
        _BUDGET[0] = budget
    if getattr(cls.__dict__.get("_monitor_workers"), _MARK, False):
        return True
    if not applies(FIX_RESTART_BUDGET):
        return False
    cls._monitor_workers = _restart_budget_by_cause(cls._monitor_workers)  # type: ignore
    return True


def _let_peers_settle(handlers: Mapping[int, Any]) -> None:
    """When a worker exited because it lost a peer (exit 4) and the others still run, wait up
    to ``PEER_SETTLE_SECONDS`` for them to exit on their own: torch's poll stops them all at
    the first failure it sees, and the crash that caused it would be recorded as a SIGTERM."""
    codes = {lr: h.proc.poll() for lr, h in handlers.items()}
    if EXIT_PEER_LOST not in codes.values() or None not in codes.values() \
            or set(codes.values()) - {None, 0, EXIT_PEER_LOST}:
        return
    deadline = time.monotonic() + PEER_SETTLE_SECONDS
    while time.monotonic() < deadline and any(h.proc.poll() is None for h in handlers.values()):
        time.sleep(0.05)


def _stop_failed_group(handlers: Mapping[int, Any]) -> None:
    """When a worker exited for good (a crash, a lost peer, a hang, a signal: not 0, not 143)
    while others still run, stop those now: SIGTERM, then SIGKILL ``FAILED_STOP_SECONDS``
    later. torch's poll would close them with its fixed 30 s gap, which a stopped or hung rank
    (it never reacts to SIGTERM) spends in full before every restart. A preempted group keeps
    torch's gap: its rank 0 may still be committing the preemption checkpoint."""
    codes = {lr: h.proc.poll() for lr, h in handlers.items()}
    running = [h for lr, h in handlers.items() if codes[lr] is None]
    if not running or not set(codes.values()) - {None, 0, EXIT_PREEMPTED}:
        return
    log.info("stopping the rest of the failed group (SIGKILL %.0f s after SIGTERM)",
             FAILED_STOP_SECONDS)
    for h in running:
        with contextlib.suppress(ProcessLookupError):
            h.close(death_sig=signal.SIGTERM)
    deadline = time.monotonic() + FAILED_STOP_SECONDS
    for h in running:
        with contextlib.suppress(subprocess.TimeoutExpired):
            h.proc.wait(max(0.0, deadline - time.monotonic()))
    for h in running:
        if h.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                h.close(death_sig=signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):  # not in the kernel (D state)
                h.proc.wait(FAILED_STOP_SECONDS)


def _restart_budget_by_cause(monitor: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    @functools.wraps(monitor)
    def wrapper(self: Any, worker_group: Any) -> Any:
        handlers = getattr(getattr(self, "_pcontext", None), "subprocess_handlers", {})
        _let_peers_settle(handlers)
        seen = exited(handlers)  # before the rest is stopped: who died on their own
        _stop_failed_group(handlers)
        result = monitor(self, worker_group)
        failures = failures_of(result)
        # an agent whose node left the running job in place ends (inplace_agent: its workers'
        # exit 143 is a departure, not a preemption to restart after)
        if failures and not getattr(self, "left_the_job", False):
            before = self._remaining_restarts
            self._remaining_restarts = _BUDGET[0].judge(failures, before)
            # a refunded restart still counts as one in TORCHELASTIC_RESTART_COUNT
            # (max_restarts - remaining): the limit grows with the refund
            worker_group.spec.max_restarts += max(0, self._remaining_restarts - before)
            log_first_death(result.failures, seen, self._remaining_restarts > 0)
        return result

    setattr(wrapper, _MARK, True)
    return wrapper
