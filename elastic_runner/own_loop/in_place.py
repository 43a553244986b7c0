"""A script loop's side of in-place recovery (``recovery/inplace.py``): the loop's collectives
run guarded, a peer's death in one re-forms the group without leaving the process, nodes leaving
or joining move this rank's place, and the script's model object goes on in the new group. The
step in flight is discarded on every rank; its micro-batches come again from the loader."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from ..compat.ddp import ddp_construction_collectives, ddp_reattach, ddp_reattach_supported
from ..nested import each_tensor
from ..recovery.fsdp_reattach import fsdp_reattach, fsdp_reattach_refusal
from ..recovery.inplace import Regroup, StepRedo
from ..recovery.recoverable import Recoverable
from ..recovery.rejoin import RecoveryReport
from ..recovery.runtime import RecoveryService, RecoveryTail, renew_exchanges
from ..recovery.script import NoScriptRecovery, ScriptProcess, ScriptRecovery
from ..recovery.script import current as current_process
from .parts import LoopParts
from .script_collectives import Guards, NoScriptCollectives

log = logging.getLogger("elastic_runner.own_loop")


class LoopRecovery:
    """The in-place recovery of one :class:`~elastic_runner.own_loop.loop.FaultTolerantLoop`.

    Args:
        loop: the loop, as the recovery sees it.
        parts: what the loop holds besides its session (``parts.info`` moves on a regroup).
        params: the script's trainable parameters (a discarded step's gradients are dropped).
        discarded: called once a recovery discarded the step in flight on every rank (the loop
            then redoes it from its first micro-batch).
    """

    def __init__(self, loop: Recoverable, parts: LoopParts, params: list[nn.Parameter],
                 discarded: Callable[[], None]) -> None:
        self._loop, self._parts, self._params = loop, parts, params
        self._discarded = discarded
        self._tail = RecoveryTail(parts.process.recovery)  # the runtime both loops share
        # a replacement's first pass through the loop: discarded, so that it runs the loop's
        # window of the group's step as the survivors do (FaultTolerantLoop.rewrap)
        self.phantom = False
        # the loop's own collectives (own_loop/script_collectives.py): the loop sets them
        self.script_calls: Guards = NoScriptCollectives()

    @property
    def _recovery(self) -> RecoveryService:
        return self._tail.recovery

    def collective(self, call: Callable[..., Any], *args: Any) -> bool:
        """``call(*args)``; when one of its collectives fails because a peer died (in-place
        recovery on): the group is re-formed without leaving this process and False is
        returned: the step in flight is discarded on every rank, and its micro-batches come
        again from the loader.

        Raises:
            RuntimeError: the error, when no peer died or recovery is off (torch's restart
                path).
        """
        try:
            try:
                call(*args)
            except RuntimeError as e:
                self._tail.recover(e, self._loop, self._forget_step)
                self._redo()
                return False
        except Regroup as r:  # nodes left or joined: this rank goes on in another group
            self._regroup(r)
            return False
        except StepRedo:  # a membership boundary that changed nothing: the step is redone
            self._forget_step()
            self._parts.loader.restart()
            self._parts.script_state.restore()  # the window before it runs again
            return False
        return True

    def recover_in_window(self, error: RuntimeError) -> None:
        """A collective of the loop's own work after a step failed: re-form the group in place;
        the loop's code goes on where it was (``own_loop/script_collectives.py`` calls the
        window's collectives again in the new group). The first committed step completes the
        report.

        Raises:
            RuntimeError: ``error``, when no peer died or recovery is off; a new one when nodes
                left or joined meanwhile, or the model is sharded (FSDP2 re-forms its modules
                at a step only): every worker then restarts from the newest checkpoint.
        """
        try:  # the loop's code goes on where it was: nothing to discard
            self._tail.recover(error, self._loop, lambda: None)
        except (Regroup, StepRedo):
            self._recovery.ask_restart()
            raise RuntimeError("a peer died inside the loop's own work after a step, and the "
                               "group cannot go on there at another world size or with a "
                               "sharded model: every worker restarts from the newest "
                               "checkpoint") from error

    def discarded_pass_done(self) -> None:
        """A discarded pass reached ``step_done()``: a replacement's first one (:attr:`phantom`)
        hands its micro-batches back to the loader and drops its gradients."""
        if self.phantom:
            self.phantom = False
            self._forget_step()
            self._parts.loader.restart()

    def committed(self, step: int) -> None:
        """Step ``step`` is committed: the first one after an in-place recovery completes its
        report."""
        self._tail.committed(step, self._parts.info.rank, self._loop.session.callbacks)

    # ------------------------------------------------------------ the script's model

    def guard(self, model: nn.Module) -> None:
        """The script's model recovers where its own collectives fail: a DDP's forward, an
        FSDP2 root module's call (a plain module has none)."""
        if isinstance(model, DDP):
            self._guard_forward(model)
        elif self._loop.session.checkpoints.sharded:
            self._guard_call(model)

    def _guard_forward(self, ddp: DDP) -> None:
        """The script's DDP forward carries collectives of its own (the buffers' broadcast,
        the buckets' rebuild after a new reducer): when one fails because a peer died, the
        group is re-formed there (:meth:`collective`) and the forward returns the local
        module's output without autograd, for a step that is discarded anyway (the loop's
        ``backward`` does nothing, its ``should_commit`` answers False). In the loop's work
        after a step (an evaluation) it is one of that work's collectives
        (``own_loop/script_collectives.py``); in a replacement's discarded first pass it is
        the local module's, with no collective. The local module runs on copies of its
        buffers (a BatchNorm's statistics stay the group's)."""
        forward = ddp.forward

        def guarded(*args: Any, **kwargs: Any) -> Any:
            out: list[Any] = []
            if self.phantom:  # a replacement's discarded first pass: no collective
                return _local_forward(ddp.module, args, kwargs)
            if self.script_calls.in_window:  # an evaluation's: called again after a recovery
                if not (torch.is_grad_enabled() or ddp.will_sync_module_buffers()):
                    return forward(*args, **kwargs)  # no collective in it: nothing to record
                return self.script_calls.call("forward", forward, args, kwargs, _nothing)
            if self.collective(lambda: out.append(forward(*args, **kwargs))):
                return out[0]
            with torch.no_grad():
                return _local_forward(ddp.module, args, kwargs)

        ddp.forward = guarded  # type: ignore[method-assign]

    def _guard_call(self, module: nn.Module) -> None:
        """The script's FSDP2 root module gathers its shards in forward hooks: when a
        collective of its call fails because a peer died, the group is re-formed there
        (:meth:`collective`) and the call returns zeros shaped as this process's last output,
        for a step that is discarded anyway. Its class becomes a subclass with that
        ``__call__``, as ``fully_shard`` itself swaps the class."""
        cls, recovery = type(module), self
        last: list[Any] = []

        def guarded(mod: nn.Module, *args: Any, **kwargs: Any) -> Any:
            out: list[Any] = []
            if recovery.collective(lambda: out.append(cls.__call__(mod, *args, **kwargs))):
                last[:] = [each_tensor(_meta, out[0])]
                return out[0]
            if not last:  # recovered before any output: nothing to stand in for it
                recovery._recovery.ask_restart()
                raise RuntimeError("a peer died in this process's first forward: every "
                                   "worker restarts from the newest checkpoint")
            return each_tensor(_zeros, last[0], (_Meta,))

        module.__class__ = type(cls.__name__, (cls,), {"__call__": guarded,
                                                      "__module__": cls.__module__})

    # ------------------------------------------------------------ the new group

    def group_formed(self, joining: list[int]) -> None:
        """The new group exists; a replacement constructs its DDP now (the script's line
        after ``init_distributed``): run the collectives of that construction with it. Under
        FSDP2 it makes its checkpoint group: so does this rank."""
        model, info = self._parts.model, self._parts.info
        checkpoints = self._loop.session.checkpoints
        if joining and isinstance(model, DDP) and info.rank not in joining:
            ddp_construction_collectives(model, src_is_peer=0 in joining)
        if checkpoints.sharded:  # as a replacement's CheckpointManager makes it
            with self._recovery.sockets.forming(subgroups=True):
                checkpoints.renew_group()

    def rewrap(self) -> None:
        """On the new group: the script's DDP object reduces over it (its reducer rebuilt in
        place, so the ``model`` the loop holds stays the one to call), or its FSDP2 modules
        gather and scatter over it; and the vote and the straggler exchange that go with it."""
        parts, session = self._parts, self._loop.session
        if isinstance(parts.model, DDP):
            ddp_reattach(parts.model)
        elif session.checkpoints.sharded:
            fsdp_reattach(parts.model)
        renew_exchanges(session, parts.vote(), parts.info)

    # ------------------------------------------------------------ recovering

    def _forget_step(self) -> None:
        self._loop.session.abandon_step()
        for p in self._params:  # the step's partial gradients
            p.grad = None

    def _redo(self) -> None:
        """The group agreed on the state: the step in flight is discarded on every rank and
        its micro-batches come again (the first committed step completes the report)."""
        self._discarded()
        self._parts.loader.restart()

    def _regroup(self, r: Regroup) -> None:
        """Go on as rank ``r.rank`` of ``r.world_size`` (nodes left, or joined at a step
        boundary), in this process: the group re-formed, this rank's place (sampler split,
        reporting, checkpoint writer) moved to it, the script's DDP reduces over it, and the
        members agree on the state (a joining node's ranks receive it): the runtime's
        :meth:`~elastic_runner.recovery.runtime.RecoveryTail.regroup`. The sampler's global
        cursor keeps every sample once; the micro-batch stays, so the global batch follows the
        world size."""
        self._forget_step()
        loop, info = self._loop, self._parts.info
        report = r.report or RecoveryReport(r.generation, [], loop.session.state.step)
        if r.world_size == info.world_size:  # FSDP2's replacements (recover())
            joining = list(report.failed_ranks)
        else:  # a join's ranks follow the members'
            joining = list(range(info.world_size, r.world_size))
        if loop.session.checkpoints.sharded and r.world_size != info.world_size:
            self._recovery.ask_restart()
            raise RuntimeError(f"an FSDP2 loop cannot go on at world size {r.world_size} in "
                               "its process: every worker restarts from the newest checkpoint")

        def moved() -> Recoverable:
            self._place(r.rank, r.world_size)
            self._recovery.bind(loop)
            self.group_formed(joining)
            return loop

        self._tail.regroup(r, report, info.rank, moved, self._parts.own_logging)
        self._redo()

    def _place(self, rank: int, world_size: int) -> None:
        """This process is ``rank`` of ``world_size`` now: one move of its place, which
        :class:`~elastic_runner.dist.DistInfo`, the sampler's split, the session and the
        checkpoints refer to (the writer renumbers itself on it), then the world-size gauge
        and the rank-bound reporting made anew."""
        parts, session = self._parts, self._loop.session
        parts.info.place.move(rank, world_size)
        parts.metrics.world(world_size)
        old, parts.reporting = parts.reporting, parts.runner(rank, world_size)
        session.callbacks.swap(old, parts.reporting)


def in_place_process(model: nn.Module) -> ScriptProcess:
    """This process's in-place recovery (``recovery/script.py``), for a DDP, FSDP2 or plain
    model; the agents are asked for torch's restart path at once where the model cannot move to
    a re-formed group: an FSDP2 mesh that is not 1-D over the default group, or a torch on
    which compat fix 14 (DDP) or 15 (FSDP2) does not apply."""
    process = current_process()
    if not isinstance(process, ScriptRecovery):
        return process
    if _sharded(model):
        why = fsdp_reattach_refusal(model)
        if why is None:
            return process
    elif not ddp_reattach_supported():
        why = f"torch {torch.__version__} cannot move a DDP to a new group (compat fix 14)"
    else:
        return process
    log.warning("%s: a failed worker restarts every worker (torch's restart path)", why)
    process.recovery.ask_restart()
    process.close()
    return NoScriptRecovery()


def _nothing() -> None:
    return None


def _local_forward(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``module(*args, **kwargs)`` with copies of its buffers, for a discarded step: a
    BatchNorm's running statistics stay as the group's state holds them."""
    buffers = {name: b.clone() for name, b in module.named_buffers()}
    return torch.func.functional_call(module, buffers, args, kwargs, strict=False)


def _sharded(model: nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in model.parameters())


def _meta(x: torch.Tensor) -> _Meta:
    """A tensor's shape, dtype and device (what :func:`_zeros` makes again)."""
    return _Meta(x.shape, x.dtype, x.device)


def _zeros(x: _Meta) -> torch.Tensor:
    return torch.zeros(x.shape, dtype=x.dtype, device=x.device)


@dataclass(frozen=True)
class _Meta:
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
