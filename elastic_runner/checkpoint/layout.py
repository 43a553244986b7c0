"""What a checkpoint holds of a ``dict[str, Stateful]``: the whole state (the rank-0 layout),
the rest beside the model's and optimizer's shards (the sharded layout), and whether a model is
sharded at all."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from . import dcp_format


def is_sharded(model: Any) -> bool:
    """Whether ``model`` is a module with DTensor parameters (FSDP2's shards)."""
    if not isinstance(model, torch.nn.Module):
        return False
    return any(isinstance(p, DTensor) for p in model.parameters())


def whole_state(state: Mapping[str, Stateful], extra: Mapping[str, Any]) -> dict[str, Any]:
    """Every value's ``state_dict()``, with ``extra``'s plain values beside them."""
    return {**{k: v.state_dict() for k, v in state.items()}, **extra}


def rest_state(state: Mapping[str, Stateful], extra: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`whole_state` without the sharded keys (``model``, ``optimizer``)."""
    return {**{k: v.state_dict() for k, v in state.items()
               if k not in dcp_format.SHARDED_KEYS}, **extra}
