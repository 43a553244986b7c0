"""FSDP2 and device meshes: what elastic-runner relies on in torch's
``torch/distributed/fsdp/_fully_shard/`` and ``device_mesh.py`` (torch 2.13).

13. **A device mesh's own references to its groups** (``device_mesh.py``:
   ``DeviceMesh._pg_registry``, read only while ``torch.compile`` traces; optional, worker).
   Torch's caches of DTensor layouts keep every mesh, and so its groups, alive until the
   interpreter exits, also after ``destroy_process_group``; a gloo group destroyed during the
   exit may abort the process (SIGABRT: "terminate called without an active exception", seen
   on an FSDP bench worker after its last collective). :func:`release_mesh_groups` empties the
   registry (:func:`elastic_runner.dist.release_groups_of`, called when a trainer closes or a
   sharded survivor leaves its group), so that the group is freed while the interpreter runs.
   Without it a finished FSDP process may abort on its way out, and a group left by an
   in-place recovery keeps its threads and sockets.
15. **A user's FSDP2 model moved to a new group in place** (``FSDPModule._get_fsdp_state``,
   the state's ``_fsdp_param_groups``, each group's and parameter's
   ``mesh_info``/``post_forward_mesh_info``, whose ``FSDPMeshInfo`` caches
   ``shard_process_group`` at construction and which ``FSDPParamGroup`` reads for its
   all-gathers and reduce-scatters; each parameter's ``_unsharded_param``; ``DeviceMesh``
   resolving its group by name; optional, worker). The behaviour,
   :func:`elastic_runner.recovery.fsdp_reattach.fsdp_reattach`, lives with the recovery; here
   are its check, :data:`FIX_FSDP_REATTACH`, and its reads of private names
   (:func:`param_groups`, :func:`unsharded_param`, :func:`derived_accumulated_grad`). Without
   it a script's FSDP2 loop takes the restart path.
"""

from __future__ import annotations

from typing import Any

import torch

from .fix import Fix, applies, mentions_name

_FSDP = "torch.distributed.fsdp._fully_shard"

# --- 13. a device mesh's own references to its groups ---

def release_mesh_groups(mesh: Any) -> None:
    """Fix 13: drop ``mesh``'s own references to its process groups (torch 2.13's
    ``DeviceMesh._pg_registry``, read only while ``torch.compile`` traces; otherwise a mesh
    resolves its groups by name), here and in its root mesh.

    Why: torch's caches of DTensor layouts and redistribution plans keep every mesh alive until
    the interpreter exits, and with it the groups in that registry, also after
    ``destroy_process_group``. A gloo group destroyed that late, during the interpreter's
    teardown, aborted the process ("terminate called without an active exception", SIGABRT)
    in 2 of 20 exits here (a group kept past ``destroy_process_group``; 0 of 30 without), which
    is how an FSDP worker that had finished its work could die with -6. Released, the group is
    freed by ``destroy_process_group`` while the interpreter still runs. A no-op where the
    attribute is gone (:func:`_check_mesh_registry` warns at start-up)."""
    if not applies(FIX_MESH_RELEASE):
        return
    for m in (mesh, getattr(mesh, "_root_mesh", None)):
        registry = getattr(m, "_pg_registry", None)
        if isinstance(registry, dict):
            registry.clear()


def _check_mesh_registry() -> str | None:
    from torch.distributed.device_mesh import DeviceMesh

    if "_pg_registry" not in getattr(DeviceMesh, "__annotations__", {}):
        return "DeviceMesh no longer declares _pg_registry"
    return None


FIX_MESH_RELEASE = Fix(
    "the release of a sharded model's process groups (DeviceMesh._pg_registry)", ("worker",),
    False, _check_mesh_registry,
    "under FSDP a destroyed gloo group lives until the interpreter exits, where it may abort "
    "the finished process (SIGABRT); a replaced group keeps its threads and sockets",
    ("torch.distributed.device_mesh:DeviceMesh._pg_registry",
     "torch.distributed.device_mesh:DeviceMesh._root_mesh"))


# --- 15. a user's FSDP2 model moved to a new group in place (the behaviour: recovery/) ---

def param_groups(model: torch.nn.Module) -> list[Any]:
    """The FSDP param groups of ``model``'s FSDP2 modules (torch's private ``FSDPParamGroup``;
    empty for a model without FSDP2 modules)."""
    from torch.distributed.fsdp import FSDPModule

    return [g for module in model.modules() if isinstance(module, FSDPModule)
            for g in _fsdp_param_groups(module._get_fsdp_state())]


def _fsdp_param_groups(state: Any) -> list[Any]:
    # the name is the one torch's state keeps them under, which the registry's scan reads as
    # the package's own; the older single group (_fsdp_param_group) is listed by fix 15
    own = getattr(state, "_fsdp_param_groups", None)
    if own is None:  # a torch with one param group per module
        own = [g for g in (getattr(state, "_fsdp_param_group", None),) if g is not None]
    return list(own)


def unsharded_param(param: Any) -> torch.nn.Parameter | None:
    """The unsharded parameter an ``FSDPParam`` keeps (None before its first all-gather)."""
    return getattr(param, "_unsharded_param", None)


def derived_accumulated_grad() -> bool:
    """Whether ``FSDPParam.unsharded_accumulated_grad`` is read from the unsharded parameter's
    ``.grad`` (torch 2.15: a property) rather than kept apart (an attribute, torch <= 2.14)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    return isinstance(getattr(FSDPParam, "unsharded_accumulated_grad", None), property)


def _check_fsdp_reattach() -> str | None:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard import _fsdp_common, _fsdp_param, _fsdp_param_group

    if not callable(getattr(FSDPModule, "_get_fsdp_state", None)):
        return "FSDPModule._get_fsdp_state is gone"
    param = _fsdp_param.FSDPParam
    if not mentions_name(param.init_unsharded_param, "_unsharded_param"):
        return "FSDPParam no longer keeps its unsharded parameter in _unsharded_param"
    if not (derived_accumulated_grad()
            or mentions_name(param.__init__, "unsharded_accumulated_grad")):
        return "FSDPParam no longer keeps unsharded_accumulated_grad"
    if not mentions_name(_fsdp_common.FSDPMeshInfo.__post_init__, "shard_process_group"):
        return "FSDPMeshInfo no longer caches shard_process_group"
    group = _fsdp_param_group.FSDPParamGroup
    for name in ("_all_gather_process_group", "_reduce_scatter_process_group"):
        prop = getattr(group, name, None)
        if not isinstance(prop, property) or not mentions_name(prop.fget, "shard_process_group"):
            return f"FSDPParamGroup.{name} no longer reads the mesh info's shard_process_group"
    return None


FIX_FSDP_REATTACH = Fix(
    "a script's FSDP2 model moved to a new group in place (its mesh infos' cached process "
    "groups)", ("worker",), False, _check_fsdp_reattach,
    "a script's FSDP2 loop recovers through torch's restart path: a failed worker restarts "
    "every worker",
    ("torch.distributed.fsdp:FSDPModule._get_fsdp_state",
     f"{_FSDP}._fsdp_state:FSDPState._fsdp_param_group",
     f"{_FSDP}._fsdp_param:FSDPParam._unsharded_param",
     f"{_FSDP}._fsdp_common:FSDPMeshInfo",
     f"{_FSDP}._fsdp_param_group:FSDPParamGroup._all_gather_process_group",
     f"{_FSDP}._fsdp_param_group:FSDPParamGroup._reduce_scatter_process_group"))

FIXES: tuple[Fix, ...] = (FIX_MESH_RELEASE, FIX_FSDP_REATTACH)
