"""Distributed checkpoints (DCP): what elastic-runner relies on in torch's
``torch/distributed/checkpoint/`` (torch 2.13), for ``checkpoint/dcp_format.py``.

11. **DCP internals of sharded checkpoints** (``default_planner.py``:
   ``_EmptyStateDictLoadPlanner``; ``state_dict_loader.py``: ``_load_state_dict`` with
   ``no_dist``; ``_nested_dict.py``: ``set_element``; optional, worker). :func:`dcp_internals`
   returns them to ``checkpoint/dcp_format.py``: the whole-state load of a sharded checkpoint
   in one process (``export``, ``evaluate``, ``generate``; torch's own
   ``format_utils.dcp_to_torch_save`` does it this way) and the planner's ``load_bytes``, which
   loads non-tensor values with ``weights_only=True`` where torch's uses ``weights_only=False``.
   Without them sharded checkpoints cannot be loaded: resume, export and the rest fail naming
   the checkpoint.
12. **DCP on fsspec URLs** (``_fsspec_filesystem.py``: ``FsspecReader(path)``,
   ``FsspecWriter(path, sync_files=...)``; optional, worker). :func:`dcp_fsspec` returns them to
   ``checkpoint/dcp_format.py`` for sharded checkpoints on object stores (``s3://``...); torch
   2.13 exports only the local ``FileSystemReader``/``FileSystemWriter``. Without them a sharded
   checkpoint on a URL cannot be written or read: the save or load fails naming it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from ..logs import first_line
from .fix import Fix, applies, problem

# --- 11. DCP internals of sharded checkpoints ---

def dcp_internals() -> tuple[type, Callable[..., Any], Callable[..., Any]]:
    """Fix 11: torch's ``(_EmptyStateDictLoadPlanner, _load_state_dict, set_element)``.

    Raises:
        ImportError, AttributeError: this torch has moved or removed one of them.
    """
    found = _dcp_internals()  # a name that is gone raises here, as torch's import does
    if not applies(FIX_DCP_LOAD):
        raise ImportError(f"{FIX_DCP_LOAD.name} is off: {problem(FIX_DCP_LOAD)}")
    return found


def _dcp_internals() -> tuple[type, Callable[..., Any], Callable[..., Any]]:
    from torch.distributed.checkpoint import _nested_dict, default_planner, state_dict_loader

    return (default_planner._EmptyStateDictLoadPlanner, state_dict_loader._load_state_dict,
            _nested_dict.set_element)


def _check_dcp_internals() -> str | None:
    try:
        _, load, set_element = _dcp_internals()
    except (ImportError, AttributeError) as e:
        return first_line(e)
    wanted = ("state_dict", "storage_reader", "planner", "no_dist")
    missing = [p for p in wanted if p not in inspect.signature(load).parameters]
    if missing:
        return f"state_dict_loader._load_state_dict takes no {', '.join(missing)}"
    if len(inspect.signature(set_element).parameters) != 3:
        return "_nested_dict.set_element no longer takes (root, path, value)"
    return None


FIX_DCP_LOAD = Fix(
    "the sharded checkpoints' loading (DCP internals)", ("worker",), False,
    _check_dcp_internals,
    "sharded (DCP) checkpoints cannot be loaded: resume and export fail naming the checkpoint",
    ("torch.distributed.checkpoint.default_planner:_EmptyStateDictLoadPlanner",
     "torch.distributed.checkpoint.state_dict_loader:_load_state_dict",
     "torch.distributed.checkpoint._nested_dict"))


# --- 12. DCP on fsspec URLs ---

def dcp_fsspec() -> tuple[type, type]:
    """Fix 12: torch's ``(FsspecReader, FsspecWriter)``, DCP on any fsspec URL (object stores),
    from the private ``torch.distributed.checkpoint._fsspec_filesystem`` in torch 2.13.

    Raises:
        ImportError, AttributeError: this torch has moved or removed them.
    """
    found = _dcp_fsspec()  # a name that is gone raises here, as torch's import does
    if not applies(FIX_DCP_FSSPEC):
        raise ImportError(f"{FIX_DCP_FSSPEC.name} is off: {problem(FIX_DCP_FSSPEC)}")
    return found


def _dcp_fsspec() -> tuple[type, type]:
    from torch.distributed.checkpoint import _fsspec_filesystem

    return _fsspec_filesystem.FsspecReader, _fsspec_filesystem.FsspecWriter


def _check_dcp_fsspec() -> str | None:
    try:
        reader, writer = _dcp_fsspec()
    except (ImportError, AttributeError) as e:
        return first_line(e)
    if "path" not in inspect.signature(reader.__init__).parameters:
        return "FsspecReader no longer takes a path"
    if "sync_files" not in inspect.signature(writer.__init__).parameters:
        return "FsspecWriter no longer takes sync_files"
    return None


FIX_DCP_FSSPEC = Fix(
    "sharded checkpoints on object stores (DCP's fsspec reader and writer)", ("worker",),
    False, _check_dcp_fsspec,
    "a sharded (DCP) checkpoint on an s3:// (or other fsspec) URL cannot be written or read: "
    "the save or load fails naming the checkpoint",
    ("torch.distributed.checkpoint._fsspec_filesystem",))

FIXES: tuple[Fix, ...] = (FIX_DCP_LOAD, FIX_DCP_FSSPEC)
