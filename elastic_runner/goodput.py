"""Goodput: where every second of a job went, and the effective training time ratio (ETTR).

ETTR = productive time / wall time since the job started (Meta's "effective training time
ratio", Llama 3 report and Meta's 2024 reliability paper; Google's ML Goodput splits the rest
into kinds of badput). Productive time is the wall time of committed optimizer steps that are
part of the current model: a step redone after a restart counts once. Badput by cause:

* ``startup``: process start to the first step (interpreter, ``import torch``, data, model,
  process group, checkpoint load), for each (re)start;
* ``recovery``: in-place recovery (detection, new group, state from a peer);
* ``redone``: work lost to a failure: the time between the checkpoint a restart resumed from and
  the restarted process's start (the steps since that checkpoint, detection, stopping the
  workers), the step in flight of an in-place recovery, the steps undone by a rollback;
* ``checkpoint``: the training loop blocked by checkpoint saves;
* ``evaluation``: validation runs;
* ``other``: everything else (skipped non-finite steps, logging, the end of the run).

:class:`Goodput` is a callback that attributes each second of its process to exactly one cause
(the cause of the phase it is in), and a :class:`~torch.distributed.checkpoint.stateful.Stateful`
carried in every checkpoint and handed to an in-place replacement, so the job's figures survive
restarts. Each rank keeps its own; rank 0's is the one checkpoints carry.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from .callbacks import Callback, StepEnd
from .metrics import GOODPUT_CAUSES

log = logging.getLogger(__name__)

CAUSES = GOODPUT_CAUSES
_PHASE_CAUSE = {"starting": "startup", "loading": "startup", "evaluating": "evaluation",
                "checkpointing": "checkpoint", "recovering": "recovery", "finished": "other"}


class Goodput(Callback):
    """The job's seconds by cause (:data:`CAUSES`) as this rank sees them.

    Args:
        process_start: unix time (seconds) this process started (``psutil``'s create time).
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
        self.base = dict.fromkeys(CAUSES, 0.0)  # the job's seconds before this process
        self.local = dict.fromkeys(CAUSES, 0.0)  # this process's seconds, closed spans
        self._excluded = dict.fromkeys(CAUSES, 0.0)  # local seconds the job does not count
        self._cause, self._since = "startup", process_start
        self._loaded = False

    # ------------------------------------------------------------ the clock

    def _switch(self, cause: str, now: float | None = None) -> None:
        """Close the current span and open one of ``cause``. A step left by anything but its
        end (a failed collective, a preemption) was lost work."""
        now = self.clock() if now is None else now
        closed = "redone" if self._cause == "step" else self._cause
        self.local[closed] += max(0.0, now - self._since)
        self._cause, self._since = cause, now

    def seconds(self, now: float | None = None) -> dict[str, float]:
        """The job's seconds by cause up to ``now`` (default: the clock)."""
        now = self.clock() if now is None else now
        out = {c: self.base[c] + self.local[c] - self._excluded[c] for c in CAUSES}
        out["productive" if self._cause == "step" else self._cause] += max(0.0,
                                                                            now - self._since)
        return out

    def ettr(self, now: float | None = None) -> float:
        """Productive seconds over the job's wall seconds (0 before any step)."""
        now = self.clock() if now is None else now
        wall = now - self.job_start
        return self.seconds(now)["productive"] / wall if wall > 0 else 0.0

    def summary(self, now: float | None = None) -> str:
        """One line: ETTR, wall time, productive time and each cause of badput."""
        now = self.clock() if now is None else now
        s = self.seconds(now)
        bad = ", ".join(f"{c} {s[c]:.1f} s" for c in CAUSES[1:])
        return (f"goodput: ETTR {self.ettr(now):.3f} over {now - self.job_start:.1f} s of job "
                f"wall time (productive {s['productive']:.1f} s; badput: {bad})")

    # ------------------------------------------------------------ events

    def on_phase(self, phase: str, what: str, long: bool) -> None:
        self._switch(_PHASE_CAUSE.get(phase, "other"))

    def on_step_begin(self, step: int, steps_this_attempt: int) -> None:
        self._switch("step")

    def on_step_end(self, event: StepEnd) -> None:
        now = self.clock()  # the step's span: productive if its update was applied
        self.local["productive" if event.committed else "other"] += max(0.0, now - self._since)
        self._cause, self._since = "other", now

    def on_log(self, event: Any) -> None:
        now = self.clock()
        self.publish(self.seconds(now), self.ettr(now))

    def on_recovered(self, step: int, joining: bool, last_step: Any) -> None:
        if joining:  # a spare's start-up ran beside the training: not the job's time
            self._switch("recovery")
            self._excluded = dict(self.local)

    def close(self) -> None:
        self._switch("other")
        now = self.clock()
        self.publish(self.seconds(now), self.ettr(now))

    # ------------------------------------------------------------ Stateful

    def state_dict(self) -> dict[str, Any]:
        return {"job_start": self.job_start, "seconds": self.seconds(), "saved_at": self.clock()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The job's figures as of a checkpoint (or a live peer's). The time between that
        snapshot and now that this process did not spend itself is lost work (``redone``)."""
        now = self.clock()
        saved = dict.fromkeys(CAUSES, 0.0) | {c: float(v) for c, v in state["seconds"].items()
                                             if c in CAUSES}
        saved_at = float(state["saved_at"])
        if not self._loaded:  # this process's start: what it did so far counts on top
            saved["redone"] += max(0.0, self.process_start - saved_at)
            self._excluded = dict.fromkeys(CAUSES, 0.0)
        else:  # a rollback: everything since the snapshot is undone
            saved["redone"] += max(0.0, now - saved_at)
            self._switch(self._cause, now)
            self._excluded = dict(self.local)
        self.base, self.job_start, self._loaded = saved, float(state["job_start"]), True
