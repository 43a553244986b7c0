"""FSDP2 (torch's ``fully_shard``): each rank holds 1/N of every parameter, gradient and
optimizer state, as DTensors on a DeviceMesh; each unit's parameters are all-gathered for its
forward and backward and its gradients reduce-scattered (ZeRO-3, Rajbhandari et al. 2020).

Units follow torchtitan's ``apply_fsdp``: each block of the model's block list, then the root for
what is left (embeddings, head). HSDP (``distributed.fsdp.replicas`` > 1) is a 2-D mesh
``(replicate, shard)``: replicas across nodes, shards within one. Mixed precision is FSDP's own
``MixedPrecisionPolicy``. Gradient accumulation skips the reduce-scatter with
``set_requires_gradient_sync(False)`` on all but the last micro-batch.

FSDP2 pads a parameter whose first dimension does not divide by the shard count, so no shape
constraint is checked here. A sharded module cannot be re-sharded onto another group: after an
in-place recovery, :meth:`FSDPParallelism.module_for_new_group` gives a new module of the same
structure (from a parameter-less copy taken before sharding), which is sharded on the new group
and loaded from peer copies or a checkpoint (``recovery/peer_copies.py``).
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from ..config_base import ConfigError
from .base import total_norm
from .config import FSDPConfig

log = logging.getLogger(__name__)


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks: the children of its largest ``nn.ModuleList`` (by parameter
    count) whose children are all of one type (GPT-2's ``transformer.h``, DistilBERT's
    ``transformer.layer``); ``[]`` when it has none."""
    best: list[nn.Module] = []
    best_size = 0
    for module in model.modules():
        if not isinstance(module, nn.ModuleList) or len(module) < 2:
            continue
        if len({type(m) for m in module}) != 1:
            continue
        size = sum(p.numel() for p in module.parameters())
        if size > best_size:
            best, best_size = list(module), size
    return best


def device_mesh(world_size: int, replicas: int, device: torch.device) -> DeviceMesh:
    """A 1-D mesh of every rank, or for HSDP the 2-D mesh ``(replicas, world_size/replicas)``
    named ``("replicate", "shard")``.

    Raises:
        ConfigError: ``replicas`` does not divide ``world_size``.
    """
    if world_size % replicas:
        raise ConfigError(f"distributed.fsdp.replicas: {replicas} does not divide the world size "
                          f"{world_size}; use a divisor of it (1: plain FSDP)")
    if replicas == 1:
        return init_device_mesh(device.type, (world_size,), mesh_dim_names=("shard",))
    return init_device_mesh(device.type, (replicas, world_size // replicas),
                            mesh_dim_names=("replicate", "shard"))


class FSDPParallelism:
    """FSDP2 over the current process group.

    Args:
        options: ``distributed.fsdp``.
        world_size, device: the group's size and this rank's device.
        param_dtype: the compute dtype of the gathered parameters (``torch.bfloat16`` with
            ``training.precision: bf16``), None: the parameters' own (fp32).
        shard_units: the task's ``shard_units(model)``, else :func:`find_blocks`.
    """

    name = "fsdp"
    sharded = True

    def __init__(self, options: FSDPConfig, world_size: int, device: torch.device,
                 param_dtype: torch.dtype | None = None,
                 shard_units: Callable[[nn.Module], list[nn.Module]] | None = None) -> None:
        self.options, self.world_size, self.device = options, world_size, device
        self.param_dtype, self.shard_units = param_dtype, shard_units or find_blocks
        self._skeleton: nn.Module | None = None  # the unsharded structure (wrap records it)

    def mixed_precision(self) -> MixedPrecisionPolicy:
        if self.param_dtype is None:
            return MixedPrecisionPolicy()
        reduce = torch.float32 if self.options.reduce_dtype == "fp32" else self.param_dtype
        return MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=reduce)

    def units(self, model: nn.Module) -> list[nn.Module]:
        """The modules sharded one by one before the root (``distributed.fsdp.units``).

        Raises:
            ConfigError: ``units: blocks`` and the model has no blocks.
        """
        if self.options.units == "root":
            return []
        blocks = list(self.shard_units(model))
        if not blocks and self.options.units == "blocks":
            raise ConfigError(
                f"distributed.fsdp.units: 'blocks' but {type(model).__name__} has no block list "
                "(no nn.ModuleList of repeated layers) and the task gives no shard_units(model); "
                "use 'root' (the whole model as one unit) or 'auto'")
        return blocks

    def wrap(self, model: nn.Module, init_sync: bool = True) -> nn.Module:
        """Shard ``model`` in place (its parameters become DTensors) and return it
        (``init_sync``: unused; sharding moves no values).

        Raises:
            ConfigError: see :meth:`units` and :func:`device_mesh`.
        """
        mesh = device_mesh(self.world_size, self.options.replicas, self.device)
        self._skeleton = skeleton(model)
        kwargs = {"mesh": mesh, "reshard_after_forward": self.options.reshard_after_forward,
                  "mp_policy": self.mixed_precision()}
        units = self.units(model)
        for unit in units:
            fully_shard(unit, **kwargs)
        # the root's parameters are needed again as soon as backward begins: keep them (torch's
        # default for the root; resharding it cost digits an all-gather per step, 4 ms here)
        fully_shard(model, **{**kwargs, "reshard_after_forward": False})
        log.info("FSDP2: %d unit(s) + root on mesh %s%s", len(units), tuple(mesh.shape),
                 f", parameters in {self.param_dtype}" if self.param_dtype else "")
        return model

    def module_for_new_group(self, model: nn.Module) -> nn.Module:
        """A new unsharded module of the structure :meth:`wrap` sharded: buffers as they were
        then, parameters allocated on the device but not set (tied ones stay tied).

        Raises:
            RuntimeError: :meth:`wrap` was not called."""
        if self._skeleton is None:
            raise RuntimeError("module_for_new_group before wrap: no structure recorded")
        fresh = copy.deepcopy(self._skeleton)
        made: dict[int, nn.Parameter] = {}
        for module in fresh.modules():
            for name, p in list(module.named_parameters(recurse=False, remove_duplicate=False)):
                if id(p) not in made:
                    made[id(p)] = nn.Parameter(torch.empty_like(p, device=self.device),
                                               requires_grad=p.requires_grad)
                module.register_parameter(name, made[id(p)])  # replaces this name's parameter
        return fresh

    def gradient_sync(self, net: nn.Module, sync: bool) -> contextlib.AbstractContextManager[Any]:
        if isinstance(net, FSDPModule):
            net.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()

    def grad_norm(self, params: list[torch.Tensor], max_norm: float | None) -> torch.Tensor:
        return total_norm(params, max_norm)


def skeleton(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters are on the meta device (no memory; ties kept) and
    whose buffers are copied (non-persistent ones, e.g. an attention mask, are in no state
    dict)."""
    memo: dict[int, Any] = {id(p): nn.Parameter(torch.empty_like(p, device="meta"),
                                                 requires_grad=p.requires_grad)
                            for p in model.parameters()}
    return copy.deepcopy(model, memo)
