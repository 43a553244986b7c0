"""Goodput: where the job's wall time went, and the effective training time ratio (ETTR).

ETTR = productive time / wall time since the job started (Meta's "effective training time
ratio", Llama 3 report and Meta's 2024 reliability paper; Google's ML Goodput splits the rest
into kinds of badput). Productive time is the wall time of committed optimizer steps that are
part of the current model: a step redone after a restart counts once. Badput by cause:

* ``startup``: process start to the first step (interpreter, ``import torch``, data, model,
  process group, checkpoint load), for each (re)start;
* ``recovery``: in-place recovery (detection, new group, state from a peer, a regroup);
* ``redone``: work lost to a failure: the time between the checkpoint a restart resumed from and
  the restarted process's start (the steps since that checkpoint, detection, stopping the
  workers), the step in flight of an in-place recovery, the steps undone by a rollback;
* ``checkpoint``: the training loop blocked by checkpoint saves;
* ``evaluation``: validation runs;
* ``other``: everything else (skipped non-finite steps, logging, the end of the run).

Definitions (all times in seconds, on ``time.time()``'s clock):

* the *account* is per rank: each rank keeps one (:class:`Goodput`), rank 0's is the one
  checkpoints carry, and a replacement takes over a live peer's. It is not a sum over ranks or
  over processes: at every instant one cause gets the time, so a dead process's last seconds,
  a warm spare's stand-by and a survivor's wait overlap and are counted once;
* *job start* (:attr:`Goodput.job_start`): the start of the first worker process whose account
  this one continues (the rank's first process; across restarts and replacements it is carried
  with the account);
* *wall time* = now - job start. Invariant: ``sum(seconds(now).values()) == now - job_start``
  at every instant (up to float rounding), across restarts, rollbacks, in-place joins and
  regroups, and every cause is >= 0. ETTR = productive / wall time.

A process that takes over an account (a snapshot of it taken at ``saved_at``: a checkpoint, or
a live peer's state during an in-place recovery) goes on from the snapshot's seconds; the time
between the snapshot and the moment this process's own spans start counting is added to one
cause, so that the invariant holds (:meth:`Goodput.load_state_dict`):

* a restart (a checkpoint loaded by a process that started after it was written, the first
  account it takes over): ``saved_at`` -> this process's start is ``redone``, then this
  process's own spans from its start (its start-up included);
* a rollback (a checkpoint loaded by a process that existed when it was written or already
  went on from another snapshot): ``saved_at`` -> now is ``redone`` (undone steps), and the
  process's spans before are dropped (they are in the snapshot or undone);
* a live state (a peer's, or this process's previous trainer's on a regroup; anything loaded
  outside the ``loading`` phase that ``session.resume`` announces): ``saved_at`` -> now is
  ``recovery`` (the state transfer), and the process's spans before are dropped (a spare's
  start-up and stand-by ran beside the training). Under FSDP every rank rolls back to a peer
  copy (``recovery/peer_copies.py``), whose account is a snapshot of the copy's step: the steps
  undone since then count as ``recovery`` too.

A gap that comes out negative (the writer's clock ahead of this node's: checkpoints move
between nodes) counts 0 and moves the job start back by as much, so the causes stay >= 0 and
the invariant exact.

Process starts come from :func:`process_start_time` (the kernel's start time, on
``time.time()``'s clock; psutil's ``create_time()`` is off by the boot time's truncation: 0.14 s
early on the 2-core development machine).

:class:`Goodput` is a callback that attributes each second to exactly one cause (the cause of
the phase it is in), and a :class:`~torch.distributed.checkpoint.stateful.Stateful` carried in
every checkpoint and handed to an in-place replacement, so the job's figures survive restarts.
The figures are as of when they are read: each logging step (the Prometheus series), the end
of training (the ``goodput:`` log line of rank 0 and ``results.json``'s ``goodput``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

import psutil

from ..train.callbacks import Callback, StepEnd
from .rank_series import GOODPUT_CAUSES

log = logging.getLogger(__name__)

CAUSES = GOODPUT_CAUSES
_PHASE_CAUSE = {"starting": "startup", "loading": "startup", "evaluating": "evaluation",
                "checkpointing": "checkpoint", "recovering": "recovery", "finished": "other"}


def process_start_time(pid: int | None = None) -> float:
    """Unix time (seconds, on ``time.time()``'s clock) at which process ``pid`` (default: this
    one) started, to a clock tick (10 ms).

    Linux gives a process's start in clock ticks since boot (``/proc/PID/stat``); psutil adds
    the boot time from ``/proc/stat``, which is whole seconds and drifts from the wall clock as
    NTP adjusts it, so its ``create_time()`` can be off by up to a second or more (0.14 s early
    on the 2-core development machine). Here the start is converted at the current instant
    through ``CLOCK_BOOTTIME``, the clock the kernel stamped it with. Elsewhere: psutil's."""
    try:
        with open(f"/proc/{'self' if pid is None else pid}/stat") as f:
            stat = f.read()
        ticks = int(stat[stat.rindex(")") + 2:].split()[19])  # field 22, starttime
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - age
    except (OSError, ValueError, IndexError, AttributeError):
        return psutil.Process(pid).create_time()


class Goodput(Callback):
    """The job's seconds by cause (:data:`CAUSES`) as this rank accounts them (module
    docstring: definitions and the invariant).

    Args:
        process_start: unix time (seconds) this process started (:func:`process_start_time`).
        publish: called with ``(seconds by cause, ettr)`` at each logging step and at the end
            (the rank's Prometheus series).
        clock: unix time source (seconds); tests pass their own.
    """

    def __init__(self, process_start: float,
                 publish: Callable[[dict[str, float], float], None] = lambda s, e: None,
                 clock: Callable[[], float] = time.time) -> None:
        self.clock, self.publish = clock, publish
        self.process_start = process_start
        self.job_start = process_start
        self.base = dict.fromkeys(CAUSES, 0.0)  # the job's seconds before this process's own
        self.local = dict.fromkeys(CAUSES, 0.0)  # this process's own seconds, closed spans
        self._cause, self._since = "startup", process_start  # the open span
        self._phase = "starting"  # the last phase announced (a step: "training")
        self._loaded = False  # this process went on from a snapshot of the account

    # ------------------------------------------------------------ the clock

    def _switch(self, cause: str, now: float | None = None) -> None:
        """Close the current span and open one of ``cause``. A step left by anything but its
        end (a failed collective, a preemption) was lost work."""
        now = self.clock() if now is None else now
        closed = "redone" if self._cause == "step" else self._cause
        self.local[closed] += max(0.0, now - self._since)
        self._cause, self._since = cause, now

    def seconds(self, now: float | None = None) -> dict[str, float]:
        """The job's seconds by cause up to ``now`` (default: the clock); they sum to
        ``now - job_start``."""
        now = self.clock() if now is None else now
        out = {c: self.base[c] + self.local[c] for c in CAUSES}
        out["productive" if self._cause == "step" else self._cause] += max(0.0,
                                                                            now - self._since)
        return out

    def wall(self, now: float | None = None) -> float:
        """The job's wall time up to ``now`` (seconds): ``now - job_start``."""
        return (self.clock() if now is None else now) - self.job_start

    def ettr(self, now: float | None = None) -> float:
        """Productive seconds over the job's wall seconds (0 before any step)."""
        now = self.clock() if now is None else now
        wall = self.wall(now)
        return self.seconds(now)["productive"] / wall if wall > 0 else 0.0

    def figures(self, now: float | None = None) -> dict[str, Any]:
        """``{"wall_seconds", "ettr", "seconds": {cause: seconds}}``, all as of ``now``."""
        now = self.clock() if now is None else now
        return {"wall_seconds": self.wall(now), "ettr": self.ettr(now),
                "seconds": self.seconds(now)}

    def summary(self, now: float | None = None) -> str:
        """One line: ETTR, wall time, productive time and each cause of badput."""
        f = self.figures(now)
        s = f["seconds"]
        bad = ", ".join(f"{c} {s[c]:.1f} s" for c in CAUSES[1:])
        return (f"goodput: ETTR {f['ettr']:.3f} over {f['wall_seconds']:.1f} s of job "
                f"wall time (productive {s['productive']:.1f} s; badput: {bad})")

    # ------------------------------------------------------------ events

    def on_phase(self, phase: str, what: str, long: bool) -> None:
        self._phase = phase
        self._switch(_PHASE_CAUSE.get(phase, "other"))

    def on_step_begin(self, step: int, steps_this_attempt: int) -> None:
        self._phase = "training"
        self._switch("step")

    def on_step_end(self, event: StepEnd) -> None:
        now = self.clock()  # the step's span: productive if its update was applied
        self.local["productive" if event.committed else "other"] += max(0.0, now - self._since)
        self._cause, self._since = "other", now

    def on_log(self, event: Any) -> None:
        now = self.clock()
        self.publish(self.seconds(now), self.ettr(now))

    def on_recovered(self, step: int, joining: bool, last_step: Any) -> None:
        if joining:  # the state is installed: the rest until the first step is recovery
            self._switch("recovery")

    def close(self) -> None:
        self._switch("other")
        now = self.clock()
        self.publish(self.seconds(now), self.ettr(now))

    # ------------------------------------------------------------ Stateful

    def state_dict(self) -> dict[str, Any]:
        now = self.clock()
        return {"job_start": self.job_start, "seconds": self.seconds(now), "saved_at": now}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from a snapshot of the account (a checkpoint, or a live peer's state): its
        seconds, plus the time between the snapshot and this process's own spans (module
        docstring: restart, rollback, live state)."""
        now = self.clock()
        saved = dict.fromkeys(CAUSES, 0.0) | {c: float(v) for c, v in state["seconds"].items()
                                             if c in CAUSES}
        saved_at = float(state["saved_at"])
        live = self._phase != "loading"  # not session.resume: a peer's or a regroup's state
        if not live and not self._loaded and saved_at <= self.process_start:
            cause, gap = "redone", self.process_start - saved_at  # a restart
        else:
            cause, gap = ("recovery" if live else "redone"), now - saved_at
            self.local = dict.fromkeys(CAUSES, 0.0)
            self._since = now
            if live:
                self._cause = "recovery"
        saved[cause] += max(0.0, gap)
        # a negative gap is clock skew between nodes: the wall time takes it, no cause does
        self.job_start = float(state["job_start"]) + min(0.0, gap)
        self.base, self._loaded = saved, True
