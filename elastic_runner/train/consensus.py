"""The step consensus: apply this step's update on every rank, or on none.

Like torchft's ``Manager.should_commit``, every rank asks the same question after its backward:
did any rank see a non-finite loss, are the reduced gradients finite, was any rank asked to stop
(SIGTERM, preemption)? All ranks get the same answer for the same step, so they skip the same
updates and stop after the same step. A stop discards the step in flight on every rank (its
update is not applied, its samples stay unconsumed): the checkpoint that follows is of the last
applied step, and a restart redoes the discarded one.

One interface (:class:`StepConsensus`: :meth:`~StepConsensus.propose` before the step's last
backward, :meth:`~StepConsensus.decide` after it), five implementations:

* :class:`GradientConsensus` (DDP and FSDP2, the default): **no collective of its own**. A rank
  whose loss is non-finite, or that was asked to stop, backpropagates ``loss x NaN``; DDP's
  gradient all-reduce (FSDP2's reduce-scatter, then the all-reduce that makes the sharded norm
  whole) carries the NaN to every rank, so every rank sees a non-finite gradient norm at the
  same step, and only then (rarely) one all-reduce of two flags tells why. On the 2-core CI
  machine any extra per-step collective costs ~0.8 ms (gloo, measured with two processes on the
  digits model), as much as the whole step's bookkeeping budget many times over; appending the
  flags to the first gradient bucket copied that bucket twice per step (0.1-0.3 ms).
* :class:`CommHookConsensus` (DDP with your own comm hook, e.g. quantisation that may not keep
  NaN): the flags go in one asynchronous all-reduce launched from a communication hook beside
  the first bucket's; every bucket is still reduced by your hook (or torch's
  ``allreduce_hook``), unchanged.
* :class:`AllReduceConsensus`: one all-reduce of the flags in :meth:`~StepConsensus.decide`
  (any process group; models whose gradients DDP does not reduce).
* :class:`LocalConsensus`: world size 1.
* :class:`LaggedConsensus` (CUDA; ``training.lagged_vote``): the decision is taken **on the
  device** and read on the host one step later, so a step has no host synchronisation at all.
  A fused optimizer skips a vetoed update itself (its ``found_inf`` input, the path torch's
  GradScaler uses), each step's flags are all-reduced asynchronously, and the host reads the
  verdict of step N while step N+1's work is queued on the GPU. A stop carried by step N lets N
  apply and discards N+1 (see :class:`LaggedConsensus`).

The first four read one small tensor from the device per step (the gradient norm or the flags):
on CUDA that is the step's one host synchronisation.
"""

from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel as DDP

from ..compat.ddp import registered_comm_hook
from ..compat.fix import applies
from ..compat.optimizers import FIX_LAGGED_VOTE

log = logging.getLogger(__name__)

N_FLAGS = 2  # (non-finite loss, stop requested)
CommHook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]


@dataclass(frozen=True)
class StepDecision:
    """The same on every rank for the same step.

    Attributes:
        commit: apply the update (no rank saw a non-finite loss, the gradients are finite, no
            rank was asked to stop).
        stop: some rank was asked to stop (SIGTERM/SIGINT): the step is discarded on every
            rank; checkpoint the last applied step and leave.
    """

    commit: bool
    stop: bool
    final: bool = True  # False: LaggedConsensus's provisional "applied on the device"


@dataclass(frozen=True)
class Verdict:
    """One step's vote as the host reads it, a step after :class:`LaggedConsensus` took it.

    Attributes:
        step: the global step the vote was taken for (1-based, as ``TrainState.step`` after it).
        commit: its update was applied on the device (with fp16 the GradScaler may still have
            skipped an overflowing one itself, as on the eager path).
        stop: some rank was asked to stop during that step.
        nonfinite_loss: some rank's loss was not finite (else the gradients were not).
    """

    step: int
    commit: bool
    stop: bool
    nonfinite_loss: bool


class StepConsensus(ABC):
    """Per step: :meth:`propose` before the synchronising backward (the last micro-batch's),
    backpropagate what it returns, then :meth:`decide`.

    Args:
        stop_requested: returns True once this rank was asked to stop (e.g.
            :attr:`~elastic_runner.preempt.PreemptionFlag.requested`).
    """

    def __init__(self, stop_requested: Callable[[], bool] = lambda: False) -> None:
        self._stop_requested = stop_requested
        self._step_loss: torch.Tensor | None = None
        self._stop = False

    def propose(self, loss: torch.Tensor, step_loss: torch.Tensor | None = None
                ) -> torch.Tensor:
        """Register this rank's step: ``step_loss`` (the step's loss over its micro-batches,
        a scalar tensor; default ``loss``) and whether a stop was requested.

        Returns:
            The tensor to call ``backward()`` on: ``loss`` itself, or ``loss x NaN`` where the
            implementation signals through the gradients.
        """
        self._step_loss = (loss if step_loss is None else step_loss).detach()
        self._stop = self._stop_requested()
        return loss

    def decide(self, grad_norm: torch.Tensor | None = None, overflow_ok: bool = False
               ) -> StepDecision:
        """The step's decision (all ranks, after the backward; the same on all).

        Args:
            grad_norm: total norm of the reduced gradients (``clip_grad_norm_``'s result);
                None: not checked (only :class:`GradientConsensus` requires it).
            overflow_ok: non-finite gradients alone do not veto the update (fp16: the
                GradScaler skips such a step itself and lowers its scale); a non-finite loss
                or a stop still does.

        Raises:
            RuntimeError: :meth:`propose` was not called for this step.
        """
        if self._step_loss is None:
            raise RuntimeError("step consensus: decide() without propose() for this step")
        try:
            return self._decide(None if overflow_ok and not self._needs_norm else grad_norm,
                                overflow_ok)
        finally:
            self._step_loss = None

    def reset(self) -> None:
        """Forget a step proposed but never decided (its collective failed)."""
        self._step_loss = None

    lagged = False  # LaggedConsensus: the decision is read a step later

    def collect(self) -> list[Verdict]:
        """Verdicts of earlier steps not yet returned, waiting for one still on the device
        (only :class:`LaggedConsensus` defers any)."""
        return []

    def vetoed_pending(self) -> bool:
        """Whether a verdict not yet collected skipped its update."""
        return False

    @staticmethod
    def _nan_if_nonfinite(loss: torch.Tensor, check: torch.Tensor) -> torch.Tensor:
        """``loss`` times 1, or times NaN when ``check`` is not finite (``x - x`` is 0 for a
        finite x, NaN otherwise): exact when nothing is signalled."""
        return loss * (1.0 + (check - check))

    def _flags(self) -> torch.Tensor:
        """This rank's (non-finite loss, stop) as a float tensor on the loss's device (a fill,
        not a copy of a host value: on CUDA such a copy would wait for the device)."""
        loss = self._step_loss
        return torch.stack([(~torch.isfinite(loss)).float().reshape(()),
                            torch.full((), float(self._stop), device=loss.device)])

    @staticmethod
    def _from_flags(reduced: torch.Tensor, grad_norm: torch.Tensor | None) -> StepDecision:
        """Decision from reduced flags (> 0: some rank raised it) and the gradient norm, with
        one host read."""
        if grad_norm is not None:
            reduced = torch.cat([reduced, grad_norm.reshape(1).to(reduced)])
        values = reduced.tolist()
        stop = values[1] > 0
        bad = values[0] > 0 or (grad_norm is not None and not math.isfinite(values[2]))
        return StepDecision(commit=not (bad or stop), stop=stop)

    _needs_norm = False  # the norm carries the signal (GradientConsensus)

    @abstractmethod
    def _decide(self, grad_norm: torch.Tensor | None, overflow_ok: bool) -> StepDecision: ...


class LocalConsensus(StepConsensus):
    """World size 1: the rank's own flags are the decision."""

    def _decide(self, grad_norm: torch.Tensor | None, overflow_ok: bool) -> StepDecision:
        return self._from_flags(self._flags(), grad_norm)


class AllReduceConsensus(StepConsensus):
    """One all-reduce (SUM) of the flags per step, in :meth:`decide`."""

    def __init__(self, stop_requested: Callable[[], bool] = lambda: False,
                 group: dist.ProcessGroup | None = None) -> None:
        super().__init__(stop_requested)
        self._group = group

    def _decide(self, grad_norm: torch.Tensor | None, overflow_ok: bool) -> StepDecision:
        flags = self._flags()
        dist.all_reduce(flags, group=self._group)
        return self._from_flags(flags, grad_norm)


class GradientConsensus(StepConsensus):
    """DDP without a collective of its own: the signal travels in the gradients (see the
    module docstring). Multiplying by 1.0 is exact, so gradients are bitwise unchanged when
    nothing is signalled; a user's comm hook must keep non-finite values (torch's hooks do)."""

    _needs_norm = True

    def propose(self, loss: torch.Tensor, step_loss: torch.Tensor | None = None
                ) -> torch.Tensor:
        super().propose(loss, step_loss)
        if self._stop:
            return loss * float("nan")
        return self._nan_if_nonfinite(loss, self._step_loss)

    def _decide(self, grad_norm: torch.Tensor | None, overflow_ok: bool) -> StepDecision:
        if grad_norm is None:
            raise ValueError("GradientConsensus.decide() needs the reduced gradients' norm")
        if math.isfinite(grad_norm.item()):
            return StepDecision(commit=True, stop=False)
        flags = self._flags()  # every rank is here at the same step: the norm is the same
        dist.all_reduce(flags)
        why = self._from_flags(flags, None)  # commit: neither a non-finite loss nor a stop
        return StepDecision(commit=overflow_ok and why.commit, stop=why.stop)


class CommHookConsensus(StepConsensus):
    """The flags travel with DDP's gradient reduction (see the module docstring).

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
        if registered_comm_hook(ddp) is not None:
            raise RuntimeError("step consensus: a comm hook is already registered on this DDP "
                               "module; pass it as comm_hook= instead, so the vote can wrap it")
        self._hook, self._state = comm_hook, hook_state
        self._armed: torch.Tensor | None = None
        self._result: torch.Tensor | None = None
        ddp.register_comm_hook(None, self._wrapped)

    def propose(self, loss: torch.Tensor, step_loss: torch.Tensor | None = None
                ) -> torch.Tensor:
        out = super().propose(loss, step_loss)
        self._armed, self._result = self._flags(), None
        return out

    def _decide(self, grad_norm: torch.Tensor | None, overflow_ok: bool) -> StepDecision:
        if self._result is None:
            raise RuntimeError("step consensus: DDP reduced no gradient bucket since propose() "
                               "(was backward called under no_sync()?)")
        return self._from_flags(self._result, grad_norm)

    # no annotations: DDP's register_comm_hook checks them against the real classes, and this
    # module's postponed (string) annotations would fail that check
    def _wrapped(self, _, bucket):  # noqa: ANN001, ANN202
        flags = self._armed
        if bucket.index() != 0 or flags is None:
            return self._user_hook(bucket)
        self._armed = None
        fut_flags = dist.all_reduce(flags, async_op=True).get_future()
        fut_grads = self._user_hook(bucket)

        def both(f: torch.futures.Future[Any]) -> torch.Tensor:
            grads = f.value()[0].value()
            self._result = flags
            return grads[0] if isinstance(grads, list) else grads

        return torch.futures.collect_all([fut_grads, fut_flags]).then(both)

    def _user_hook(self, bucket):  # noqa: ANN001, ANN202
        if self._hook is None:
            return allreduce_hook(None, bucket)
        return self._hook(self._state, bucket)


class LaggedConsensus(StepConsensus):
    """The step vote on the device, read on the host one step later (no host sync per step).

    Per step, after the synchronising backward and the gradient norm:

    1. :meth:`collect` returns the verdicts read since the last call: the previous step's,
       waiting on its CUDA event (that step's work is done or nearly: the current step's
       forward and backward are already queued, so the GPU does not idle while the host waits).
    2. :meth:`launch` all-reduces this step's flags (non-finite loss, stop; asynchronous on
       NCCL), copies ``(flags, norm)`` to a pinned host buffer behind an event, and returns
       ``found_inf``, a 0-dim float tensor on the device: 1.0 where the update must be skipped
       (a non-finite reduced gradient norm, or a non-finite loss on some rank). A fused torch
       optimizer (``fused=True``: Adam, AdamW, SGD) takes it as GradScaler's does and leaves
       parameters, moments and step counts untouched when it is 1.
    3. At a checkpoint, an evaluation or the end, where the host must know, :meth:`collect`
       reads the pending verdict at once.

    Semantics against the eager consensus: a non-finite loss poisons the gradients (as in
    :class:`GradientConsensus`), so every rank skips the same update on the device, and the
    host counts the skipped step one step later. A **stop is not poisoned**: the step that
    carries it applies, the host learns of it at the next step and discards *that* step (not
    applied, samples unconsumed), then checkpoints the last applied one: the same outcome as
    eager, one step later. A verdict still pending when a collective fails (in-place recovery)
    is dropped: a skipped step right before a peer's death may go uncounted in
    ``TrainState.bad_steps``.

    Args:
        device: where the loss and gradients live (pinned host buffers and events on CUDA).
        stop_requested: as for :class:`StepConsensus`.
        group: the process group of the flags' all-reduce (None: the default group; no
            all-reduce without an initialised group or at world size 1).
    """

    def __init__(self, device: torch.device, stop_requested: Callable[[], bool] = lambda: False,
                 group: dist.ProcessGroup | None = None) -> None:
        super().__init__(stop_requested)
        self._group = group
        self._reduce = (dist.is_available() and dist.is_initialized()
                        and dist.get_world_size(group) > 1)
        cuda = device.type == "cuda"
        # two buffers and events: step N's verdict is read while step N+1's is being written
        self._buffers = [torch.empty(3, dtype=torch.float32, pin_memory=cuda) for _ in range(2)]
        self._events = [torch.cuda.Event() if cuda else None for _ in range(2)]
        self._turn = 0
        self._pending: tuple[int, int, bool] | None = None  # (step, buffer index, overflow_ok)
        self._read: list[Verdict] = []

    lagged = True

    def propose(self, loss: torch.Tensor, step_loss: torch.Tensor | None = None
                ) -> torch.Tensor:
        super().propose(loss, step_loss)
        return self._nan_if_nonfinite(loss, self._step_loss)

    def _reduced_flags(self) -> torch.Tensor:
        """The flags summed over the group (NCCL: queued on its stream, no host wait)."""
        flags = self._flags()
        if self._reduce:
            dist.all_reduce(flags, group=self._group)
        return flags

    def launch(self, step: int, grad_norm: torch.Tensor, overflow_ok: bool = False
               ) -> torch.Tensor:
        """Take step ``step``'s vote on the device (see the class docstring); returns
        ``found_inf`` for a fused optimizer.

        Raises:
            RuntimeError: :meth:`propose` was not called for this step, or the previous
                verdict was not collected.
        """
        if self._step_loss is None:
            raise RuntimeError("step consensus: launch() without propose() for this step")
        if self._pending is not None:
            raise RuntimeError("step consensus: the previous step's verdict was not collected")
        flags = self._reduced_flags()
        self._step_loss = None
        norm = grad_norm.detach().reshape(1).float()
        found_inf = torch.maximum((~torch.isfinite(norm)).float(), (flags[:1] > 0).float())
        i = self._turn
        self._turn ^= 1
        self._buffers[i].copy_(torch.cat([flags, norm]), non_blocking=True)
        if self._events[i] is not None:
            self._events[i].record()
        self._pending = (step, i, overflow_ok)
        return found_inf.reshape(())

    def _read_pending(self) -> None:
        if self._pending is None:
            return
        step, i, overflow_ok = self._pending
        self._pending = None
        if self._events[i] is not None:
            self._events[i].synchronize()
        loss_bad, stop, norm = self._buffers[i].tolist()
        self._read.append(Verdict(step=step, stop=stop > 0, nonfinite_loss=loss_bad > 0,
                                  commit=loss_bad == 0 and (overflow_ok or math.isfinite(norm))))

    def collect(self) -> list[Verdict]:
        """The verdicts read since the last call, the pending one included (waits for it)."""
        self._read_pending()
        out, self._read = self._read, []
        return out

    def vetoed_pending(self) -> bool:
        """Whether a verdict not yet collected skipped its update (reads the pending one, which
        :meth:`collect` still returns). No collective: safe where only some ranks ask."""
        self._read_pending()
        return any(not v.commit for v in self._read)

    def reset(self) -> None:
        """Forget the step in flight and any verdict not yet collected (a collective failed)."""
        super().reset()
        self._pending, self._read = None, []

    def _decide(self, grad_norm: torch.Tensor | None, overflow_ok: bool) -> StepDecision:
        """The eager decision (an optimizer without ``found_inf``): one all-reduce of the flags
        and one host read, as :class:`AllReduceConsensus`."""
        return self._from_flags(self._reduced_flags(), grad_norm)


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step()`` honours a ``found_inf`` tensor (torch's fused Adam, AdamW
    and SGD: ``_step_supports_amp_scaling``), which :class:`LaggedConsensus` relies on."""
    return applies(FIX_LAGGED_VOTE) and bool(
        getattr(optimizer, "_step_supports_amp_scaling", False))


def make_consensus(net: torch.nn.Module, stop_requested: Callable[[], bool] = lambda: False,
                   comm_hook: CommHook | None = None, hook_state: Any = None,
                   lagged_on: torch.device | None = None) -> StepConsensus:
    """The cheapest consensus for ``net``: :class:`LaggedConsensus` on ``lagged_on`` when given;
    else local without a process group; on DDP and FSDP2 the gradient signal
    (:class:`GradientConsensus`, which needs the norm of all ranks' gradients in ``decide``), or the comm hook wrapping ``comm_hook`` when you pass one; a
    plain all-reduce otherwise."""
    if lagged_on is not None:
        return LaggedConsensus(lagged_on, stop_requested)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return LocalConsensus(stop_requested)
    if isinstance(net, DDP) and comm_hook is not None:
        return CommHookConsensus(net, stop_requested, comm_hook, hook_state)
    if isinstance(net, DDP | FSDPModule):  # the norm the caller passes is over all shards
        return GradientConsensus(stop_requested)
    return AllReduceConsensus(stop_requested)
