"""Why training stops: max steps/epochs, early stopping (rank 0 decides), preemption, failure.

Every rank takes the same decision after the same step: limits are checked against counters
that are equal on all ranks, the early-stopping decision is rank 0's, broadcast
(:meth:`EarlyStopping.decide`), and preemption comes from the step consensus. The reason is a
:class:`StopReason`, never a string to parse; the human-readable message goes with it.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Any

from .early_stop import Decision, EarlyStopping

log = logging.getLogger(__name__)


class StopReason(str, enum.Enum):
    """Why a run ended; the value is the ``reason`` label of the finished metric."""

    MAX_STEPS = "max_steps"
    MAX_EPOCHS = "max_epochs"
    EARLY_STOPPING = "early_stopping"
    PREEMPTED = "preempted"
    FAILED = "failed"

    @property
    def final(self) -> bool:
        """A run that stopped for this reason stays stopped on resume (a limit that was
        raised since reopens it; see :meth:`StopPolicy.reopen`)."""
        return self not in (StopReason.PREEMPTED,)

    @classmethod
    def from_message(cls, message: str) -> StopReason | None:
        """The reason of a stop message written by releases that stored only the message."""
        for prefix, reason in (("max_steps", cls.MAX_STEPS), ("max_epochs", cls.MAX_EPOCHS),
                               ("early stopping", cls.EARLY_STOPPING), ("failed", cls.FAILED),
                               ("preempt", cls.PREEMPTED)):
            if message.startswith(prefix):
                return reason
        return None


@dataclass
class StopPolicy:
    """Limits and early stopping of one run; Stateful (the reason survives a restart).

    Args:
        max_steps: optimizer steps (None: no limit).
        max_epochs: epochs (each a pass over the training set's permutation).
        early_stopping: the patience rule; with ``enabled: false`` it only tracks the best.
    """

    max_steps: int | None
    max_epochs: int
    early_stopping: EarlyStopping
    reason: StopReason | None = None
    message: str = ""

    @property
    def stopped(self) -> bool:
        return self.reason is not None

    def stop(self, reason: StopReason, message: str, step: int) -> None:
        self.reason, self.message = reason, message
        log.info("stopping after step %d: %s", step, message)

    def limit_reached(self, step: int, epochs_done: int) -> tuple[StopReason, str] | None:
        """The limit that ``step`` (optimizer steps done) or ``epochs_done`` reached, if any."""
        if self.max_steps and step >= self.max_steps:
            return StopReason.MAX_STEPS, "max_steps reached"
        if epochs_done >= self.max_epochs:
            return StopReason.MAX_EPOCHS, "max_epochs reached"
        return None

    def after_eval(self, value: float, step: int, rank: int) -> tuple[Decision, str]:
        """Collective: rank 0 applies the patience rule to ``value``, every rank adopts its
        decision. Returns it with the stop message (used when ``decision.stop``)."""
        decision = self.early_stopping.decide(value, step, rank)
        es = self.early_stopping
        best = f"{es.best:.6g}" if es.best is not None else "none"
        return decision, (f"early stopping: no improvement of {es.cfg.metric} in "
                          f"{es.cfg.patience} evaluations; best {best} at step {es.best_step}")

    def reopen(self, step: int, epoch: int) -> bool:
        """A run that ended at a limit continues when the limits were raised since; True if
        it reopened. Early-stopped and failed runs stay stopped."""
        if self.reason not in (StopReason.MAX_STEPS, StopReason.MAX_EPOCHS):
            return False
        if (self.max_steps and step >= self.max_steps) or epoch >= self.max_epochs:
            return False
        log.info("training limits raised (max_steps %s, max_epochs %d): continuing after step "
                 "%d", self.max_steps, self.max_epochs, step)
        self.reason, self.message = None, ""
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"reason": self.reason.value if self.reason else None, "message": self.message,
                "early_stopping": self.early_stopping.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.reason = StopReason(state["reason"]) if state.get("reason") else None
        self.message = state.get("message", "")
        self.early_stopping.load_state_dict(state["early_stopping"])
