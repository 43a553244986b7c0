"""One walk over the nested values a script's loop hands the runner (a model's outputs, a
collective's arguments, a ``state_dict``): tensors in tuples, namedtuples, lists and dicts."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def each_tensor(fn: Callable[[Any], Any], x: Any, leaves: tuple[type, ...] = (torch.Tensor,)
                ) -> Any:
    """``x`` rebuilt with ``fn`` applied to each of its ``leaves`` (tensors by default); the
    containers keep their types (a dict's, a ``ModelOutput``'s too), anything else is kept."""
    if isinstance(x, leaves):
        return fn(x)
    if isinstance(x, dict):
        return type(x)({k: each_tensor(fn, v, leaves) for k, v in x.items()})
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # a namedtuple
        return type(x)(*(each_tensor(fn, v, leaves) for v in x))
    if isinstance(x, (list, tuple)):
        return type(x)(each_tensor(fn, v, leaves) for v in x)
    return x


def tensor_bytes(x: Any) -> int:
    """The bytes of the tensors in ``x`` (0: none)."""
    sizes: list[int] = []
    each_tensor(lambda t: sizes.append(t.numel() * t.element_size()), x)
    return sum(sizes)


def holds_tensor(x: Any) -> bool:
    """Whether ``x`` holds a tensor anywhere."""
    found: list[bool] = []
    each_tensor(found.append, x)
    return bool(found)
