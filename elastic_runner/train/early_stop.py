"""Early stopping: rank 0 applies the patience rule, every rank follows its broadcast decision."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..dist import broadcast_object
from .config import EarlyStoppingConfig


@dataclass
class Decision:
    improved: bool  # this evaluation is the best so far (keep a `best` checkpoint)
    stop: bool  # leave the training loop after this step


class EarlyStopping:
    """Patience rule: stop after ``patience`` consecutive evaluations that did not improve the
    best value by more than ``min_delta`` (in the direction of ``mode``), as in Keras'
    ``EarlyStopping`` callback. A non-finite value never counts as an improvement."""

    def __init__(self, cfg: EarlyStoppingConfig) -> None:
        self.cfg = cfg
        self.best: float | None = None
        self.best_step: int | None = None
        self.bad_evals = 0
        self.stopped = False

    @property
    def patience_left(self) -> int:
        return self.cfg.patience - self.bad_evals

    def _is_improvement(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if self.best is None:
            return True
        if self.cfg.mode == "min":
            return value < self.best - self.cfg.min_delta
        return value > self.best + self.cfg.min_delta

    def update(self, value: float, step: int) -> Decision:
        """Apply one evaluation's value locally (call on rank 0 only, via :meth:`decide`)."""
        improved = self._is_improvement(value)
        if improved:
            self.best, self.best_step, self.bad_evals = value, step, 0
        else:
            self.bad_evals += 1
        self.stopped = self.cfg.enabled and self.bad_evals >= self.cfg.patience
        return Decision(improved=improved, stop=self.stopped)

    def decide(self, value: float, step: int, rank: int) -> Decision:
        """Rank 0 updates and broadcasts; all ranks adopt rank 0's state and decision."""
        payload = None
        if rank == 0:
            decision = self.update(value, step)
            payload = (decision, self.state_dict())
        decision, state = broadcast_object(payload, src=0)
        self.load_state_dict(state)
        return decision

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "best_step": self.best_step, "bad_evals": self.bad_evals,
                "stopped": self.stopped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.best_step = state["best"], state["best_step"]
        self.bad_evals, self.stopped = state["bad_evals"], state["stopped"]
