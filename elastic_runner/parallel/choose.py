"""The strategy ``distributed.strategy`` names, for this process's group."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..config_base import ConfigError
from .base import Parallelism, SingleProcess
from .config import DDPConfig, FSDPConfig
from .ddp import DDPParallelism
from .fsdp import FSDPParallelism


def make_parallelism(strategy: str, ddp: DDPConfig, fsdp: FSDPConfig, distributed: bool,
                     world_size: int,
                     device: torch.device, param_dtype: torch.dtype | None = None,
                     shard_units: Callable[[nn.Module], list[nn.Module]] | None = None
                     ) -> Parallelism:
    """DDP or FSDP2 over the current process group; without one, :class:`SingleProcess` for
    DDP (the model as it is).

    Args:
        strategy: ``distributed.strategy`` (``ddp`` or ``fsdp``).
        ddp, fsdp: the ``distributed.ddp`` and ``distributed.fsdp`` options.
        distributed: whether a process group exists.
        param_dtype, shard_units: see :class:`~elastic_runner.parallel.fsdp.FSDPParallelism`.

    Raises:
        ConfigError: ``fsdp`` without a process group.
    """
    if strategy == "fsdp":
        if not distributed:
            raise ConfigError("distributed.strategy: 'fsdp' needs a process group (FSDP2 shards "
                              "over a DeviceMesh): start with 'elastic-runner run' or torchrun, "
                              "or use 'ddp' in a single process")
        return FSDPParallelism(fsdp, world_size, device, param_dtype, shard_units)
    if not distributed:
        return SingleProcess()
    return DDPParallelism(ddp, device)
