"""The step engine: one optimizer step over its micro-batches.

Forward and backward of each micro-batch (gradients reduced only on the last one: the
parallelism's ``gradient_sync``, DDP's ``no_sync()`` or FSDP2's ``set_requires_gradient_sync``), autocast to bf16/fp16, a GradScaler for fp16, gradient clipping,
then the optimizer and LR scheduler steps, as torchtitan's ``train_step``. The update is applied
only where the session's step consensus allows it (``TrainingSession.optimizer_step``: decided on
the host, or on the device and read a step later). Batches may be a tensor, a tuple/list or a
mapping of tensors (nested); ``data/batches.py`` says how each is passed to the model and its loss.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..data.batches import batch_loss, to_device
from ..parallel.base import Parallelism, SingleProcess
from ..train.session import TrainingSession

__all__ = ["StepEngine", "batch_loss", "precision_dtype", "to_device"]


def precision_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype of ``training.precision`` (None for fp32)."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)


class StepEngine:
    """Runs optimizer steps of ``net`` (DDP-wrapped, FSDP-sharded or plain) on its unwrapped
    ``model``.

    Args:
        parallelism: how gradients are synchronised and their norm is taken (default: one
            process).
        grad_clip_norm: clip the total gradient norm to this (None: measure it only, for the
            non-finite check).
        dtype: autocast dtype (None: fp32).
        scaler: GradScaler; enabled only for fp16 (it then owns the gradient overflow check).
    """

    def __init__(self, net: nn.Module, model: nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler, loss_fn: Callable[..., Any],
                 device: torch.device, dtype: torch.dtype | None, grad_clip_norm: float | None,
                 scaler: torch.amp.GradScaler,
                 parallelism: Parallelism | None = None) -> None:
        self.net, self.optimizer, self.scheduler = net, optimizer, scheduler
        self.loss_fn, self.device, self.dtype = loss_fn, device, dtype
        self.clip, self.scaler = grad_clip_norm, scaler
        self.fp16 = scaler.is_enabled()
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.parallelism: Parallelism = parallelism or SingleProcess()

    def rebind(self, net: nn.Module) -> None:
        """Train through ``net`` from now on (a new DDP wrapper of the same module)."""
        self.net = net

    def step(self, micro_batches: list[Any], session: TrainingSession) -> torch.Tensor:
        """One optimizer step; returns the step's loss (detached, on the device, not read)."""
        n = len(micro_batches)
        # an uneven split of the global batch: each micro-batch's share (data/sampler.py)
        weights = None if session.sampler.even else session.sampler.loss_weights()
        total = None
        for i, batch in enumerate(micro_batches):
            last = i == n - 1
            with self.parallelism.gradient_sync(self.net, last), self._autocast():
                loss = batch_loss(self.net, to_device(batch, self.device), self.loss_fn)
            if weights is not None:
                loss = loss * weights[i]
            elif n > 1:
                loss = loss / n
            total = loss.detach() if total is None else total + loss.detach()
            if last:  # this backward's all-reduce carries the step's vote
                session.backward(loss, total, self.scaler if self.fp16 else None)
            else:
                (self.scaler.scale(loss) if self.fp16 else loss).backward()
        applied = session.optimizer_step(self.optimizer, self._clip(),
                                         self.scaler if self.fp16 else None)
        self.optimizer.zero_grad(set_to_none=True)
        if applied:  # not a discarded step (a stop)
            self.scheduler.step()
        return total

    def _autocast(self) -> Any:
        if self.dtype is None:  # fp32: no autocast state to enter and leave per micro-batch
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def _clip(self) -> torch.Tensor:
        """Total norm of the reduced (unscaled) gradients, clipped when configured. With fp16
        an overflow makes it non-finite too; the GradScaler then skips the update itself."""
        if self.fp16:
            self.scaler.unscale_(self.optimizer)
        return self.parallelism.grad_norm(self.params, self.clip)
