"""The parallelism interface the trainer, the step engine, the own-loop API and the checkpoint
manager use, and its null object for a single process.

A strategy wraps the model for a process group, says how a micro-batch skips the gradient
reduction (accumulation), measures the total gradient norm over every rank's gradients (the same
value on every rank: the clip and the step vote depend on it), and says whether the state is
sharded (checkpoints then go through DCP; in-place recovery then needs peer copies), and gives
the module to wrap again on a re-formed group. The two
implementations are ``parallel/ddp.py`` and ``parallel/fsdp.py``; :func:`make_parallelism` picks one
from the config.
"""

from __future__ import annotations

import contextlib
from typing import Any, Protocol

import torch
from torch import nn


class Parallelism(Protocol):
    """One way of spreading a model over the ranks of the current process group."""

    name: str
    sharded: bool  # each rank holds a part of the parameters and optimizer state

    def wrap(self, model: nn.Module, init_sync: bool = True) -> nn.Module:
        """What the forward runs through (DDP's wrapper; the sharded module itself for FSDP).
        ``init_sync=False``: every rank's ``model`` already holds the same values (a rejoin
        installed them), so DDP's construction broadcast from rank 0 is skipped (collective
        either way: every rank passes the same value)."""
        ...

    def module_for_new_group(self, model: nn.Module) -> nn.Module:
        """After the process group was re-formed: the module to :meth:`wrap` on the new one.
        ``model`` itself for a replica (DDP re-wraps it); for sharded state a new module of
        the same structure whose parameters hold no values yet (the caller loads them)."""
        ...

    def gradient_sync(self, net: nn.Module, sync: bool) -> contextlib.AbstractContextManager[Any]:
        """The context of one micro-batch's forward and backward: gradients are reduced across
        ranks only when ``sync`` (the last micro-batch of gradient accumulation)."""
        ...

    def grad_norm(self, params: list[torch.Tensor], max_norm: float | None) -> torch.Tensor:
        """The total 2-norm of the reduced gradients of ``params`` over all ranks, a plain scalar tensor equal on
        every rank; the gradients are scaled to at most ``max_norm`` first when it is given
        (torch's ``clip_grad_norm_`` semantics: coefficient max_norm / (norm + 1e-6))."""
        ...


def total_norm(params: list[torch.Tensor], max_norm: float | None) -> torch.Tensor:
    """The total 2-norm of the gradients of ``params`` as a plain tensor, the gradients clipped
    to ``max_norm`` first when given (``clip_grad_norm_``'s two halves), also when they are
    DTensors (FSDP2): the norm of the local shards is made whole with ``full_tensor()`` before
    the clip coefficient is taken, as torchtitan's ``dist_utils.clip_grad_norm_`` does."""
    norm = nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    full = getattr(norm, "full_tensor", None)
    if full is not None:  # a DTensor with a Partial placement: all-reduce it
        norm = full()
    if max_norm:
        nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


class SingleProcess:
    """No process group: the model as it is (null object for :class:`Parallelism`)."""

    name = "single"
    sharded = False

    def wrap(self, model: nn.Module, init_sync: bool = True) -> nn.Module:
        return model

    def module_for_new_group(self, model: nn.Module) -> nn.Module:
        return model

    def gradient_sync(self, net: nn.Module, sync: bool) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def grad_norm(self, params: list[torch.Tensor], max_norm: float | None) -> torch.Tensor:
        return total_norm(params, max_norm)
