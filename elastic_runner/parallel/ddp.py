"""DistributedDataParallel: every rank holds the whole model; gradients are all-reduced in
buckets during backward, skipped with ``no_sync()`` on all but the last micro-batch."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from .base import total_norm
from .config import DDPConfig


class DDPParallelism:
    """DDP over the current process group with ``distributed.ddp``'s options, on ``device``."""

    name = "ddp"
    sharded = False

    def __init__(self, options: DDPConfig, device: torch.device) -> None:
        self.options, self.device = options, device

    def wrap(self, model: nn.Module, init_sync: bool = True) -> nn.Module:
        d = self.options
        return DDP(model, device_ids=[self.device] if self.device.type == "cuda" else None,
                   bucket_cap_mb=d.bucket_cap_mb, static_graph=d.static_graph,
                   find_unused_parameters=d.find_unused_parameters, init_sync=init_sync)

    def module_for_new_group(self, model: nn.Module) -> nn.Module:
        return model  # every replica holds the whole module: a new DDP wraps the same one

    def gradient_sync(self, net: nn.Module, sync: bool) -> contextlib.AbstractContextManager[Any]:
        if sync or not isinstance(net, DDP):
            return contextlib.nullcontext()
        return net.no_sync()

    def grad_norm(self, params: list[torch.Tensor], max_norm: float | None) -> torch.Tensor:
        return total_norm(params, max_norm)  # replicas: the local norm is the global one
