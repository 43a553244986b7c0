"""Applying a step's update on every rank alike: ``optimizer.step()`` (through a GradScaler),
and the lagged consensus's update queued on the device behind its own verdict."""

from __future__ import annotations

import torch

from .consensus import StepConsensus, StepDecision, Verdict


def lagged_update(consensus: StepConsensus, verdicts: list[Verdict],
                  optimizer: torch.optim.Optimizer, grad_norm: torch.Tensor,
                  scaler: torch.amp.GradScaler | None, step: int) -> StepDecision:
    """The update of ``step`` under a lagged consensus and a fused optimizer, with no host
    synchronisation; none when ``verdicts`` (the earlier steps' read so far) carry a stop."""
    if any(v.stop for v in verdicts):  # the previous step carried a stop
        consensus.reset()
        if scaler is not None:  # unscale_ ran: end the scaler's step, its scale unchanged
            scaler.update(scaler.get_scale())
        return StepDecision(commit=False, stop=True)
    found_inf = consensus.launch(step, grad_norm, scaler is not None)
    apply_update(optimizer, scaler, found_inf)
    return StepDecision(commit=True, stop=False, final=False)


def apply_update(optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None,
                 found_inf: torch.Tensor | None = None) -> None:
    """``optimizer.step()`` (through ``scaler`` when given, which then owns the overflow
    check); ``found_inf`` (a fused optimizer without a scaler): skip the update on the device
    where it is 1, as GradScaler has a fused optimizer do."""
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    elif found_inf is None:
        optimizer.step()
    else:
        optimizer.grad_scale, optimizer.found_inf = None, found_inf  # type: ignore[attr-defined]
        try:
            optimizer.step()
        finally:
            del optimizer.grad_scale, optimizer.found_inf  # type: ignore[attr-defined]
