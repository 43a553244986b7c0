"""Off-by-default fault injection for tests and drills (config section ``faults``)."""

from __future__ import annotations

import logging
import os
import signal

import torch

from .config import FaultConfig

log = logging.getLogger(__name__)


def maybe_sigkill(cfg: FaultConfig, rank: int, restart_count: int, steps_this_attempt: int
                  ) -> None:
    """SIGKILL this process (a real, uncatchable signal death) when the plan says so."""
    if (cfg.sigkill_rank == rank and restart_count < cfg.sigkill_attempts
            and steps_this_attempt == cfg.sigkill_after_steps):
        log.warning("fault injection: rank %d sends itself SIGKILL after %d steps of attempt %d",
                    rank, steps_this_attempt, restart_count)
        logging.shutdown()
        os.kill(os.getpid(), signal.SIGKILL)


def planted_metric(cfg: FaultConfig, eval_index: int) -> float | None:
    """The planted value of evaluation ``eval_index`` (the last one repeats), or None."""
    if not cfg.planted_metric:
        return None
    return cfg.planted_metric[min(eval_index, len(cfg.planted_metric) - 1)]


@torch.no_grad()
def perturb_replica(cfg: FaultConfig, rank: int, model: torch.nn.Module) -> None:
    """Make this rank's replica diverge after a checkpoint load (tests the replica check)."""
    if cfg.perturb_rank == rank:
        log.warning("fault injection: rank %d perturbs its parameters after loading", rank)
        next(iter(model.parameters())).add_(1e-3)
