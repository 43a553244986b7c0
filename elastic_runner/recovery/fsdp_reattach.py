"""A user's FSDP2 model moved to a new process group in place (fix 15 of
:mod:`elastic_runner.compat`; its torch internals are listed, checked and read in
:mod:`elastic_runner.compat.fsdp`).

A sharded model's ``FSDPMeshInfo`` caches ``shard_process_group`` at construction, and each
``FSDPParamGroup`` reads it for its all-gathers and reduce-scatters, so a survivor's model keeps
gathering over the group a failure destroyed. :func:`fsdp_reattach` resolves those cached
groups again once an in-place recovery re-formed the default group at the same world size: a
re-formed default group gets the default group's name again, which a 1-D mesh over the world
holds, and a ``DeviceMesh`` resolves its group by name. :func:`fsdp_reattach_refusal` says why a
model cannot move so. Without fix 15 a script's FSDP2 loop takes the restart path.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from ..compat.fix import problem
from ..compat.fsdp import FIX_FSDP_REATTACH, derived_accumulated_grad, param_groups, unsharded_param

log = logging.getLogger(__name__)


def fsdp_reattach(model: torch.nn.Module) -> None:
    """Fix 15: make the FSDP2 modules of ``model`` (the user's object, sharded with
    ``fully_shard`` on a 1-D mesh over the default group: :func:`fsdp_reattach_refusal`) all-gather
    and reduce-scatter over the current default group, in place: each mesh info's cached
    groups are resolved again from its device mesh, which names its group (a re-formed default
    group has the same name). Shards keep their shapes: the same world size only.
    Collective-free."""
    for info in mesh_infos(model):
        info.shard_process_group = info.mesh.get_group(info.shard_mesh_dim)
        info.reduce_scatter_process_group = None  # a dedicated one went with the old group
    _reset_iteration(model)


def _reset_iteration(model: torch.nn.Module) -> None:
    """The failed iteration's FSDP2 state dropped (torch's public ``reset_iter_state`` on the
    root module, torch >= 2.13: shards registered again, in-flight reductions discarded);
    where that is missing or fails, each module reshards (public ``reshard``): the failed
    group's work raising again while it is waited on, or torch 2.13's reset on a root that never
    ran a forward (a replacement's: its comm context has no ``all_gather_state`` yet,
    AttributeError)."""
    from torch.distributed.fsdp import FSDPModule

    _drop_unreduced_grads(model)
    reset = getattr(model, "reset_iter_state", None)
    if isinstance(model, FSDPModule) and callable(reset):
        try:
            reset()
            return
        except (RuntimeError, dist.DistError, AttributeError) as e:
            log.debug("FSDP2 reset_iter_state after the recovery: %s", e)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _drop_unreduced_grads(model: torch.nn.Module) -> None:
    """The failed iteration's gradients that were never reduced, dropped: an unsharded
    parameter's ``.grad`` (autograd accumulated it; its group's post-backward, which
    reduce-scatters and clears it, never ran: the root's, which runs at backward's end, when a
    peer died in a unit's reduce-scatter) and a group's accumulated gradient (``no_sync``
    under mixed precision; torch 2.15 derives it from ``.grad``). torch 2.13's
    ``reset_iter_state`` keeps both, and the redone step's backward would add to them (the
    root's gradients of that step doubled)."""
    for group in param_groups(model):
        for param in group.fsdp_params:
            unsharded = unsharded_param(param)
            if unsharded is not None:
                unsharded.grad = None
            if not derived_accumulated_grad():  # torch <= 2.14 keeps it apart from .grad
                param.unsharded_accumulated_grad = None


def fsdp_reattach_refusal(model: torch.nn.Module) -> str | None:
    """Why ``model``'s FSDP2 modules cannot move to a re-formed default group in place (None:
    they can): fix 15 does not apply on this torch, or a mesh is not 1-D over the default group
    (HSDP, a 2-D mesh, a subgroup), whose groups a re-formed default group does not bring
    back."""
    why = problem(FIX_FSDP_REATTACH)
    if why is not None:
        return f"torch {torch.__version__}: {why} (compat fix 15)"
    world = dist.group.WORLD.group_name if dist.is_initialized() else None
    for info in mesh_infos(model):
        if info.mesh.ndim != 1 or hasattr(info, "replicate_process_group"):
            return "an FSDP2 mesh of more than one dimension (HSDP or a 2-D mesh)"
        if info.mesh.get_group().group_name != world:
            return "an FSDP2 mesh over a group other than the default one"
    return None


def mesh_infos(model: torch.nn.Module) -> list[Any]:
    """The distinct FSDP mesh infos of ``model``'s FSDP2 modules (their param groups' and
    parameters', for the forward and after it); empty without FSDP2 modules."""
    infos: dict[int, Any] = {}
    for group in param_groups(model):
        for info in (group.mesh_info, group.post_forward_mesh_info,
                     *(i for p in group.fsdp_params
                       for i in (p.mesh_info, p.post_forward_mesh_info))):
            if info is not None:
                infos[id(info)] = info
    return list(infos.values())
