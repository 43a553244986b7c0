"""The step consensus: commit this step's update on every rank, or on none.

Like torchft's ``Manager.should_commit``, every rank asks the same question after its backward:
did any rank see a non-finite loss, are the reduced gradients finite, did any rank receive a
stop signal (SIGTERM, preemption)? All ranks get the same answer for the same step, so they skip
the same updates and stop after the same step.

Three implementations, one interface (:class:`StepConsensus`):

* :class:`CommHookConsensus` (DDP): the flags ride on DDP's gradient all-reduce through a
  communication hook (``DistributedDataParallel.register_comm_hook``). Without a user hook they
  are appended to the first gradient bucket (no extra collective; the other buckets use torch's
  ``allreduce_hook``, so gradients are reduced exactly as without the hook). With a user hook
  (compression, PowerSGD, ...) the user's hook reduces every bucket unchanged and the flags go
  in one asynchronous all-reduce launched beside bucket 0's, overlapping it.
* :class:`AllReduceConsensus`: one all-reduce of the flags in :meth:`decide` (any process
  group, FSDP, a model without DDP).
* :class:`LocalConsensus`: world size 1, no collective.

Non-finite *gradients* need no vote: after the all-reduce every rank holds the same averaged
gradients, a NaN/Inf on any rank propagates into them, and their norm is non-finite on every rank
alike. The flags and the norm are combined on the device into one small tensor, read once per
step in :meth:`decide` (the step's only host read).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from . import compat

log = logging.getLogger(__name__)

N_FLAGS = 2  # (non-finite loss, stop requested)
CommHook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]


@dataclass(frozen=True)
class StepDecision:
    """The same on every rank for the same step.

    Attributes:
        commit: apply the update (no rank saw a non-finite loss, the gradients are finite).
        stop: some rank was asked to stop (SIGTERM/SIGINT): checkpoint this step and leave.
    """

    commit: bool
    stop: bool


class StepConsensus(ABC):
    """Per step: :meth:`propose` this rank's flags before the synchronising backward (the last
    micro-batch's), :meth:`decide` after it.

    Args:
        stop_requested: returns True once this rank was asked to stop (e.g.
            :attr:`~elastic_runner.preempt.PreemptionFlag.requested`).
    """

    def __init__(self, stop_requested: Callable[[], bool] = lambda: False) -> None:
        self._stop_requested = stop_requested
        self._loss_flags: torch.Tensor | None = None

    def propose(self, loss: torch.Tensor) -> None:
        """This rank's flags for the step: ``loss`` (a scalar tensor, any device and float
        dtype) is non-finite, a stop was requested. Call before the last backward."""
        loss = loss.detach()
        flags = torch.empty(N_FLAGS, dtype=torch.float32, device=loss.device)
        flags[0] = ~torch.isfinite(loss)
        flags[1] = float(self._stop_requested())
        self._loss_flags = flags

    def decide(self, grad_norm: torch.Tensor | None = None) -> StepDecision:
        """The step's decision (all ranks call it after the backward; same result on all).

        Args:
            grad_norm: total norm of the reduced gradients (``clip_grad_norm_``'s result);
                None: the gradients are not checked (e.g. fp16, where the GradScaler skips).

        Raises:
            RuntimeError: :meth:`propose` was not called for this step.
        """
        if self._loss_flags is None:
            raise RuntimeError("step consensus: decide() without propose() for this step")
        reduced = self._reduced()
        self._loss_flags = None
        bad = reduced[0] > 0
        if grad_norm is not None:
            bad = bad | ~torch.isfinite(grad_norm.to(reduced.device))
        loss_bad, stop = torch.stack([bad, reduced[1] > 0]).tolist()
        return StepDecision(commit=not loss_bad, stop=stop)

    @abstractmethod
    def _reduced(self) -> torch.Tensor:
        """The flags of this step, reduced over ranks (> 0: some rank raised it)."""


class LocalConsensus(StepConsensus):
    """World size 1: the rank's own flags are the decision."""

    def _reduced(self) -> torch.Tensor:
        return self._loss_flags


class AllReduceConsensus(StepConsensus):
    """One all-reduce (SUM) of the flags per step, in :meth:`decide`."""

    def __init__(self, stop_requested: Callable[[], bool] = lambda: False,
                 group: dist.ProcessGroup | None = None) -> None:
        super().__init__(stop_requested)
        self._group = group

    def _reduced(self) -> torch.Tensor:
        flags = self._loss_flags.clone()
        dist.all_reduce(flags, group=self._group)
        return flags


class CommHookConsensus(StepConsensus):
    """The flags ride on DDP's gradient reduction (see the module docstring).

    Args:
        ddp: the DDP module; no comm hook may be registered on it yet (DDP allows one).
        comm_hook, hook_state: the user's own hook and its state, as for
            ``register_comm_hook(state, hook)``; None: DDP's default all-reduce.

    Raises:
        RuntimeError: a comm hook is already registered on ``ddp`` (pass it here instead, or
            use :class:`AllReduceConsensus`).
    """

    def __init__(self, ddp: DDP, stop_requested: Callable[[], bool] = lambda: False,
                 comm_hook: CommHook | None = None, hook_state: Any = None) -> None:
        super().__init__(stop_requested)
        if compat.registered_comm_hook(ddp) is not None:
            raise RuntimeError("step consensus: a comm hook is already registered on this DDP "
                               "module; pass it as comm_hook= instead, so the vote can wrap it")
        self._hook, self._state = comm_hook, hook_state
        self._armed: torch.Tensor | None = None
        self._result: torch.Tensor | None = None
        ddp.register_comm_hook(None, self._wrapped)

    def propose(self, loss: torch.Tensor) -> None:
        super().propose(loss)
        self._armed, self._result = self._loss_flags, None

    def _reduced(self) -> torch.Tensor:
        if self._result is None:
            raise RuntimeError("step consensus: DDP reduced no gradient bucket since propose() "
                               "(was backward called under no_sync()?)")
        return self._result

    # no annotations: DDP's register_comm_hook checks them against the real classes, and this
    # module's postponed (string) annotations would fail that check
    def _wrapped(self, _, bucket):  # noqa: ANN001, ANN202
        flags = self._armed
        if bucket.index() != 0 or flags is None:
            return self._user_hook(bucket)
        self._armed = None
        if self._hook is None:
            return self._packed(bucket, flags)
        fut_flags = dist.all_reduce(flags.clone(), async_op=True).get_future()
        fut_grads = self._user_hook(bucket)

        def both(f: torch.futures.Future[Any]) -> torch.Tensor:
            grads, reduced = (x.value() for x in f.value())
            self._result = reduced[0]
            return grads[0] if isinstance(grads, list) else grads

        return torch.futures.collect_all([fut_grads, fut_flags]).then(both)

    def _user_hook(self, bucket):  # noqa: ANN001, ANN202
        if self._hook is None:
            return allreduce_hook(None, bucket)
        return self._hook(self._state, bucket)

    def _packed(self, bucket, flags):  # noqa: ANN001, ANN202
        grads = bucket.buffer()
        # the same averaging as allreduce_hook: divide by the world size, then SUM
        packed = torch.cat([grads, flags.to(grads.dtype)]).div_(dist.get_world_size())
        future = dist.all_reduce(packed, async_op=True).get_future()

        def unpack(f: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
            reduced = f.value()[0]
            self._result = reduced[-N_FLAGS:]
            return reduced[:-N_FLAGS]

        return future.then(unpack)


def make_consensus(net: torch.nn.Module, stop_requested: Callable[[], bool] = lambda: False,
                   comm_hook: CommHook | None = None, hook_state: Any = None) -> StepConsensus:
    """The cheapest consensus for ``net``: on the DDP comm hook when ``net`` is DDP and no hook
    is registered on it yet (or the user's hook is passed here), a plain all-reduce in a process
    group otherwise, local without one."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return LocalConsensus(stop_requested)
    if isinstance(net, DDP) and compat.registered_comm_hook(net) is None:
        return CommHookConsensus(net, stop_requested, comm_hook, hook_state)
    if isinstance(net, DDP):
        log.info("step consensus: DDP already has a comm hook; the vote uses its own all-reduce")
    return AllReduceConsensus(stop_requested)
