"""DistributedDataParallel: what elastic-runner relies on in torch's DDP
(``torch/nn/parallel/distributed.py`` of torch 2.13).

5. **DDP comm-hook details** (optional, worker). ``register_comm_hook`` records
   ``(hook, state)`` in ``self._comm_hooks`` (:func:`registered_comm_hook`), and
   ``_check_comm_hook`` requires the hook's second parameter to be named ``bucket`` and its
   annotations, if any, to be the real classes (not strings). Without the record a hook the
   user registered goes unnoticed (DDP then refuses the step vote's own hook: "can only be
   called once").
14. **A user's DDP moved to a new group in place** (``DistributedDataParallel.__setstate__``
   building the reducer on the default group from the attributes ``__getstate__`` keeps,
   ``_build_params_for_reducer``, ``broadcast_bucket_size``, ``parameters_to_ignore``,
   ``forward_sync_buffers``; the module functions ``_verify_param_shape_across_processes`` and
   ``_sync_module_states``; optional, worker). :func:`ddp_reattach` makes a script's own DDP
   object reduce over the group an in-place recovery formed, and
   :func:`ddp_construction_collectives` runs, on a survivor, the collectives a replacement's DDP
   constructor runs meanwhile. Without them a script's loop takes the restart path. Both are
   kept here rather than in ``recovery/``: each is torch's own code path (unpickling,
   construction) called on private names, with no policy of its own.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from .fix import Fix, applies, mentions, mentions_name

_DDP = "torch.nn.parallel.distributed"

# --- 5. DDP comm-hook details ---

def _check_comm_hook_record() -> str | None:
    if not mentions_name(DistributedDataParallel.register_comm_hook, "_comm_hooks"):
        return "DistributedDataParallel.register_comm_hook no longer records self._comm_hooks"
    check = getattr(DistributedDataParallel, "_check_comm_hook", None)
    if check is None or not mentions(check, "bucket"):
        return "DistributedDataParallel no longer checks a comm hook's 'bucket' parameter"
    return None


FIX_COMM_HOOK = Fix(
    "the DDP comm-hook detection", ("worker",), False, _check_comm_hook_record,
    "a comm hook registered before the step vote's goes unnoticed",
    (f"{_DDP}:DistributedDataParallel._comm_hooks",
     f"{_DDP}:DistributedDataParallel._check_comm_hook"))


def registered_comm_hook(ddp: DistributedDataParallel
                         ) -> tuple[Callable[..., Any], object] | None:
    """``(hook, state)`` of the Python comm hook registered on ``ddp`` with
    ``register_comm_hook`` (by the user, or by torch for ``mixed_precision``), None without one.

    Built-in C++ hooks (the private ``_register_builtin_comm_hook``) are not recorded by DDP and
    not reported; DDP refuses a second hook of any kind ("can only be called once"). None, too,
    where fix 5 is off."""
    hooks = getattr(ddp, "_comm_hooks", None) if applies(FIX_COMM_HOOK) else None
    if not hooks:
        return None
    hook, state = hooks[-1]
    return hook, state


# --- 14. a user's DDP moved to a new group in place ---

_DDP_GROUP_ATTRS = ("process_group", "reducer", "logger")  # what DDP's __getstate__ drops


def ddp_reattach(ddp: DistributedDataParallel) -> None:
    """Fix 14: make ``ddp`` (the user's object) reduce over the current default process group,
    in place: a new reducer with fresh buckets and no comm hook, the same module and options.

    Torch's own unpickling path (``DistributedDataParallel.__setstate__``: "the process group
    should be the default one") builds the reducer from the DDP's attributes; its
    ``__getstate__`` refuses a DDP whose group is no longer the default one, so the state it
    would return (the attributes less :data:`_DDP_GROUP_ATTRS`) is taken here. Collective-free.
    """
    state = {k: v for k, v in ddp.__dict__.items() if k not in _DDP_GROUP_ATTRS}
    for k in _DDP_GROUP_ATTRS:
        ddp.__dict__.pop(k, None)  # the old reducer goes, and with it its autograd hooks
    ddp.__setstate__(state)


def ddp_construction_collectives(ddp: DistributedDataParallel, src_is_peer: bool) -> None:
    """Fix 14: the collectives ``DistributedDataParallel(module)`` runs on construction
    (``init_sync``: the parameter shapes all-gathered, the parameters and buffers broadcast from
    rank 0), over the current default group, for a member whose peer constructs a DDP now (a
    replacement running the user's script). ``src_is_peer``: rank 0 is that peer, whose
    parameters are not the group's: they are received into a copy and dropped. Buffers are
    broadcast when ``ddp`` syncs them in forward (``forward_sync_buffers``)."""
    from torch.nn.parallel import distributed as ddp_module

    group = dist.group.WORLD
    parameters, _ = ddp._build_params_for_reducer()
    ddp_module._verify_param_shape_across_processes(group, parameters)
    module = copy.deepcopy(ddp.module) if src_is_peer else ddp.module
    ddp_module._sync_module_states(
        module=module, process_group=group, broadcast_bucket_size=ddp.broadcast_bucket_size,
        src=0, params_and_buffers_to_ignore=ddp.parameters_to_ignore,
        broadcast_buffers=getattr(ddp, "forward_sync_buffers", True))


def _check_ddp_reattach() -> str | None:
    from torch.nn.parallel import distributed as ddp_module

    for name in ("_verify_param_shape_across_processes", "_sync_module_states"):
        if not callable(getattr(ddp_module, name, None)):
            return f"torch.nn.parallel.distributed.{name} is gone"
    if not mentions_name(DistributedDataParallel.__setstate__, "_ddp_init_helper"):
        return "DistributedDataParallel.__setstate__ no longer builds the reducer"
    for name in ("_build_params_for_reducer", "broadcast_bucket_size"):
        if not mentions_name(DistributedDataParallel.__init__, name):
            return f"DistributedDataParallel.__init__ no longer uses {name}"
    return None


FIX_DDP_REATTACH = Fix(
    "a script's DDP moved to a new group in place (DDP's unpickling path and its construction "
    "collectives)", ("worker",), False, _check_ddp_reattach,
    "a script's own loop recovers through torch's restart path: a failed worker restarts "
    "every worker",
    (f"{_DDP}:DistributedDataParallel._build_params_for_reducer",
     f"{_DDP}:DistributedDataParallel._ddp_init_helper",
     f"{_DDP}:_verify_param_shape_across_processes", f"{_DDP}:_sync_module_states"))


def ddp_reattach_supported() -> bool:
    """Whether fix 14 applies on this torch (its internals and :func:`_check_ddp_reattach`)."""
    return applies(FIX_DDP_REATTACH)


FIXES: tuple[Fix, ...] = (FIX_COMM_HOOK, FIX_DDP_REATTACH)
