"""One walk over nested state: a ``state_dict``, a checkpoint's state, a batch, a model's
outputs, a collective's arguments; tensors (DTensors too) at the leaves of dicts, lists,
tuples and namedtuples.

Checkpoints (``checkpoint/async_save.py``, ``checkpoint/storage.py``,
``checkpoint/dcp_format.py``), the state transfer and the peer copies (``recovery/``), batches
(``data/batches.py``) and a script's own loop (``own_loop/``) all walk it here. What differs
between them is an option of the walk, not another walk:

- ``into``: the containers descended (default :data:`CONTAINERS`: ``dict``, ``list``,
  ``tuple``, a namedtuple being a tuple; a batch descends any ``Mapping``, the inverse of
  ``local_shards`` only dicts). Anything else is a leaf: a tensor, a DTensor (a tensor: what
  its leaf function makes of it is the caller's, e.g. its local shard), a number, ``None``;
- ``rebuild``: how a container is made again (:class:`Rebuild`): with its own type
  (``TYPES``), as the plain ``dict``/``list``/``tuple`` that ``torch.load(weights_only=True)``
  reads back (``PLAIN``), or changed in place (``IN_PLACE``: a ``state_dict``'s class and
  ``_metadata`` stay);
- key paths: each leaf's keys and indices from the root, ``("optimizer", "state", 0,
  "exp_avg")``; :func:`dotted` names one ``optimizer.state.0.exp_avg``.

An own walker rather than ``torch.utils._pytree`` (private, and it flattens a namedtuple or an
``OrderedDict`` by registered node types, which a ``state_dict``'s ``_metadata`` does not
survive) or ``optree`` (a compiled dependency more, and its rules for Mappings are its own):
the rules above are the runner's, exactly, in some sixty lines.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from enum import Enum
from typing import Any

import torch

Path = tuple[Any, ...]
CONTAINERS: tuple[type, ...] = (dict, list, tuple)


class Rebuild(Enum):
    """How :func:`map_leaves` makes a container again."""

    TYPES = "types"  # its own type: type(x)(dict) (a plain dict where that raises TypeError),
    # a namedtuple from its fields, a list or tuple (subclass) from its items
    PLAIN = "plain"  # dict, list, tuple: what torch.load(weights_only=True) can read back
    IN_PLACE = "in_place"  # dicts and lists changed in place; a tuple as PLAIN


def is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(x, "_fields")


def _children(x: Any) -> Iterator[tuple[Any, Any]]:
    return iter(x.items()) if isinstance(x, Mapping) else enumerate(x)


def _rebuilt(x: Any, items: list[tuple[Any, Any]], rebuild: Rebuild) -> Any:
    if isinstance(x, Mapping):
        if rebuild is Rebuild.IN_PLACE and isinstance(x, dict):
            x.update(items)
            return x
        if rebuild is Rebuild.TYPES:
            try:
                return type(x)(dict(items))
            except TypeError:  # a mapping type not made from a dict: a dict then
                pass
        return dict(items)
    values = [v for _, v in items]
    if isinstance(x, list):
        if rebuild is Rebuild.IN_PLACE:
            x[:] = values
            return x
        return type(x)(values) if rebuild is Rebuild.TYPES else values
    if rebuild is not Rebuild.TYPES:
        return tuple(values)
    return type(x)(*values) if is_namedtuple(x) else type(x)(values)


def map_leaves(fn: Callable[[Path, Any], Any], x: Any, *,
               into: tuple[type, ...] = CONTAINERS, rebuild: Rebuild = Rebuild.TYPES,
               enter: Callable[[Path, Any], None] | None = None, path: Path = ()) -> Any:
    """``x`` with each leaf (anything not an instance of ``into``) replaced by ``fn(key path,
    leaf)``, in depth-first order, the containers made again as ``rebuild`` says.
    ``enter(key path, container)`` is called on each container before its items (a check that
    may raise). Errors are ``fn``'s, ``enter``'s, or a container type's own constructor's."""
    if not isinstance(x, into):
        return fn(path, x)
    if enter is not None:
        enter(path, x)
    items = [(k, map_leaves(fn, v, into=into, rebuild=rebuild, enter=enter, path=(*path, k)))
             for k, v in _children(x)]
    return _rebuilt(x, items, rebuild)


def leaves(x: Any, into: tuple[type, ...] = CONTAINERS, path: Path = ()
           ) -> Iterator[tuple[Path, Any]]:
    """Each leaf of ``x`` with its key path, in :func:`map_leaves`' order."""
    if not isinstance(x, into):
        yield path, x
        return
    for k, v in _children(x):
        yield from leaves(v, into, (*path, k))


def tensors(x: Any, into: tuple[type, ...] = CONTAINERS) -> Iterator[tuple[Path, torch.Tensor]]:
    """Each tensor of ``x`` (DTensors as they are) with its key path."""
    return ((p, v) for p, v in leaves(x, into) if isinstance(v, torch.Tensor))


def dotted(path: Path, root: str = "") -> str:
    """A key path as a dotted name (``model.fc.weight``), after ``root`` when given."""
    return ".".join(map(str, (root, *path) if root else path))


def alias_key(t: torch.Tensor) -> tuple[Any, ...] | None:
    """What two tensors that are exactly the same view of the same storage (tied weights)
    share; None for an empty tensor (its storage says nothing)."""
    if not t.numel():
        return None
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
            t.stride(), t.dtype)


def each_tensor(fn: Callable[[Any], Any], x: Any, leaves: tuple[type, ...] = (torch.Tensor,)
                ) -> Any:
    """``x`` rebuilt with ``fn`` applied to each of its ``leaves`` (tensors by default) in
    dicts, lists, tuples and namedtuples; the containers keep their types (a dict's, a
    ``ModelOutput``'s too), anything else is kept."""
    return map_leaves(lambda _, v: fn(v) if isinstance(v, leaves) else v, x)


def tensor_bytes(x: Any) -> int:
    """The bytes of the tensors in ``x`` (0: none)."""
    return sum(t.numel() * t.element_size() for _, t in tensors(x))


def holds_tensor(x: Any) -> bool:
    """Whether ``x`` holds a tensor anywhere."""
    return next(tensors(x), None) is not None
