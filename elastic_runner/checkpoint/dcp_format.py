"""The sharded part of a checkpoint: model and optimizer state through
``torch.distributed.checkpoint`` (DCP), read without running a checkpoint's code.

Every rank writes its own shards (``__<rank>_<n>.distcp``; DCP's ``FileSystemWriter`` names a
rank's files by its plan's index) into the checkpoint's staging directory, DCP's coordinator
writes ``.metadata``; the runner's commit protocol (``checkpoint/storage.py``) then hashes, fences
and publishes them. State dicts come from ``torch.distributed.checkpoint.state_dict``
(``get_state_dict`` / ``set_state_dict``): keys are parameter FQNs, so one checkpoint loads into
DDP, FSDP2 or a plain module at any world size (DCP reshards on load).

What DCP itself would unpickle is restricted: ``.metadata`` is read with an unpickler that
admits only DCP's metadata classes (DCP's ``FileSystemReader`` uses plain ``pickle.load``), and
non-tensor values (optimizer hyper-parameters) are loaded with ``torch.load(weights_only=True)``
(DCP's default planner uses ``weights_only=False``). Tensors DCP already loads with
``weights_only=True``.

The torch internals this relies on (the offline whole-state load, where ``load_bytes`` puts a
value) come from :func:`elastic_runner.compat.dcp.dcp_internals` (fix 11 there, checked at
start-up).
"""

from __future__ import annotations

import io
import pickle
from functools import cache
from pathlib import Path
from typing import Any

import fsspec
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from .. import nested
from ..compat.dcp import dcp_fsspec, dcp_internals
from .dcp_names import METADATA, SHARD_FILE, SHARDED_KEYS  # noqa: F401  (re-exported)

# what ``.metadata`` may name (as torch 2.13's DCP writes it): DCP's metadata dataclasses and
# enums, torch's Size, dtypes and layouts, the checkpoint's path. Anything else is refused.
_SAFE_MODULES = ("torch.distributed.checkpoint.metadata",)
_SAFE_GLOBALS = {("torch", "Size"), ("torch.serialization", "_get_layout"),
                 ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
                 ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
                 ("collections", "OrderedDict")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        safe = (module in _SAFE_MODULES and not name.startswith("__")) \
            or (module, name) in _SAFE_GLOBALS \
            or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))
        if not safe:
            raise pickle.UnpicklingError(f"{METADATA} names {module}.{name}, which a DCP "
                                         "checkpoint's metadata never holds (refused)")
        return super().find_class(module, name)


def problem(error: BaseException) -> str:
    """One line saying why a DCP save or load failed: DCP's ``CheckpointException`` (a
    ``BaseException``) wraps each rank's error with its traceback; keep the first rank's last
    line."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, inner = next(iter(sorted(failures.items())))
        if isinstance(inner, tuple):  # (exception, traceback) in some releases
            inner = inner[0]
        return f"rank {rank}: {problem(inner) if isinstance(inner, BaseException) else inner}"
    lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()]
    text = lines[-1] if lines else type(error).__name__
    return text.split("; rank local metadata read failed")[0][:300]


def read_metadata(path: str | Path) -> Metadata:
    """The DCP metadata of the checkpoint directory ``path``, unpickled with only DCP's own
    classes allowed.

    Raises:
        pickle.UnpicklingError: it names any other global; OSError: unreadable.
    """
    with fsspec.open(f"{str(path).rstrip('/')}/{METADATA}", "rb") as f:  # a path or a URL
        metadata = _MetadataUnpickler(f).load()
    if not isinstance(metadata, Metadata):
        raise pickle.UnpicklingError(f"{METADATA} holds a {type(metadata).__name__}, not DCP "
                                     "Metadata")
    return metadata


class _SafeMetadata:
    """``read_metadata`` with :func:`read_metadata`'s restricted unpickler (before a DCP reader
    class: the checkpoint's path or URL as given, which fsspec's reader strips)."""

    def __init__(self, path: str | Path) -> None:
        super().__init__(path)  # type: ignore[call-arg]
        self.where = str(path)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata(self.where)  # type: ignore[attr-defined]
        metadata.storage_meta = metadata.storage_meta or dcp.metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # type: ignore[attr-defined]
        return metadata


class SafeReader(_SafeMetadata, dcp.FileSystemReader):
    """DCP's filesystem reader with :func:`read_metadata`'s restricted unpickler."""


@cache
def _safe_fsspec_reader() -> type:
    """DCP's fsspec reader (compat fix 12) with the restricted unpickler."""
    return type("SafeFsspecReader", (_SafeMetadata, _fsspec(0)), {})


def _fsspec(which: int) -> type:
    """``dcp_fsspec()[which]``.

    Raises:
        OSError: this torch moved it (compat fix 12): named, with what is affected."""
    try:
        return dcp_fsspec()[which]
    except (ImportError, AttributeError) as e:
        raise OSError(f"DCP's fsspec {('reader', 'writer')[which]} is not in this torch "
                      f"({type(e).__name__}: {e}); sharded checkpoints on URLs need it "
                      "(compat fix 12)") from e


def is_url(path: str | Path) -> bool:
    """Whether ``path`` is a URL (``s3://...``) rather than a local path."""
    return "://" in str(path) and not str(path).startswith("file://")


def reader(path: str | Path) -> dcp.StorageReader:
    """A reader of the checkpoint at ``path`` (local or fsspec URL) that unpickles only DCP's
    metadata classes."""
    return SafeReader(path) if not is_url(path) else _safe_fsspec_reader()(str(path))


def writer(path: str | Path) -> dcp.StorageWriter:
    """DCP's writer of ``path`` (local: ``FileSystemWriter``; a URL: ``FsspecWriter``, compat fix
    12), files synced before the commit."""
    if not is_url(path):
        return dcp.FileSystemWriter(str(path), sync_files=True)
    return _fsspec(1)(str(path), sync_files=True)


class _SafeBytes:
    """``load_bytes`` with ``torch.load(weights_only=True)`` (DCP's: ``weights_only=False``)."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:  # type: ignore[attr-defined]
            set_element = dcp_internals()[2]
            set_element(self.original_state_dict,  # type: ignore[attr-defined]
                        self.mappings[read_item.dest_index.fqn],  # type: ignore[attr-defined]
                        loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded  # type: ignore[attr-defined]


class SafeLoadPlanner(_SafeBytes, DefaultLoadPlanner):
    """DCP's default load planner, non-tensor values loaded with ``weights_only=True``."""


def sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``{"model": ..., "optimizer": ...}`` keyed by parameter FQN (DTensor shards under FSDP2,
    whole tensors otherwise), as DCP saves and loads them."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optimizer": optim_sd}


def save_shards(directory: str | Path, state: dict[str, Any],
                group: dist.ProcessGroup | None = None) -> Metadata:
    """Write this rank's part of ``state`` (:func:`sharded_state`, or a staged copy of it) into
    ``directory`` (collective over ``group``, default: the default group: every rank calls it
    with the same directory; files are fsynced). DCP's planner writes each sharded tensor's
    local shard on its rank and spreads replicated tensors over the ranks."""
    return dcp.save(state, storage_writer=writer(directory), process_group=group)


def load_shards(directory: str | Path, model: nn.Module,
                optimizer: torch.optim.Optimizer | None) -> None:
    """Load the checkpoint in ``directory`` into ``model`` (and ``optimizer``), resharding to the
    current group (collective)."""
    state = sharded_state(model, optimizer) if optimizer is not None else {
        "model": get_state_dict(model, [])[0]}
    dcp.load(state, storage_reader=reader(directory), planner=SafeLoadPlanner())
    if optimizer is None:
        set_state_dict(model, [], model_state_dict=state["model"], optim_state_dict={})
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])


def local_shards(state: Any, to_cpu: bool = True) -> Any:
    """``state`` (:func:`sharded_state`: dicts, lists, tuples) with each DTensor replaced by
    this rank's local shard, on the CPU (plain tensors too; ``to_cpu=False``: where they are,
    for a caller that copies them itself), as plain dicts, lists and tuples: what an in-memory
    copy of this rank's part holds, picklable with ``torch.save`` and loadable with
    ``weights_only=True``. A tensor already on the CPU is not copied (it is the parameter's own
    storage): copy it before the model changes."""
    def local(_: nested.Path, t: Any) -> Any:
        if isinstance(t, DTensor):
            t = t.to_local()
        if isinstance(t, torch.Tensor):
            return t.detach().cpu() if to_cpu else t.detach()
        return t

    return nested.map_leaves(local, state, rebuild=nested.Rebuild.PLAIN)


def from_local_shards(template: Any, saved: Any, where: str = "state") -> Any:
    """The inverse of :func:`local_shards` on the same mesh shape and rank: ``template``'s
    structure (:func:`sharded_state` of the model to load into; its dicts, as plain dicts) with
    every DTensor rebuilt over ``saved``'s local shard (``DTensor.from_local`` with the
    template's mesh, placements and global shape), every tensor as ``saved``'s on the
    template's device, and every other value (lists and tuples whole) taken from ``saved``.

    Raises:
        ValueError: ``saved`` does not match ``template`` (another model, or another mesh
            shape): names the key path.
    """
    def check(path: nested.Path, node: dict[Any, Any]) -> None:
        got = _at(saved, path)  # its parents were checked first
        missing = sorted(map(str, set(node) - set(got))) if isinstance(got, dict) else []
        if not isinstance(got, dict) or missing:
            raise ValueError(f"{nested.dotted(path, where)}: missing "
                             f"{', '.join(missing) or 'a dict'}")

    def fill(path: nested.Path, mine: Any) -> Any:
        return _from_local(mine, _at(saved, path), nested.dotted(path, where))

    return nested.map_leaves(fill, template, into=(dict,), rebuild=nested.Rebuild.PLAIN,
                             enter=check)


def _at(saved: Any, path: nested.Path) -> Any:
    for k in path:
        saved = saved[k]
    return saved


def _from_local(template: Any, saved: Any, where: str) -> Any:
    """:func:`from_local_shards` of one leaf of the template."""
    if isinstance(template, DTensor):
        local = template.to_local()
        if not isinstance(saved, torch.Tensor) or saved.shape != local.shape:
            raise ValueError(f"{where}: local shard {tuple(getattr(saved, 'shape', ()))} does "
                             f"not fit this rank's {tuple(local.shape)}")
        return DTensor.from_local(saved.to(local.device, local.dtype), template.device_mesh,
                                  template.placements, run_check=False, shape=template.shape,
                                  stride=template.stride())
    if isinstance(template, torch.Tensor):
        if not isinstance(saved, torch.Tensor) or saved.shape != template.shape:
            raise ValueError(f"{where}: {tuple(getattr(saved, 'shape', ()))} does not fit "
                             f"{tuple(template.shape)}")
        return saved.to(template.device)
    return saved


def load_local_shards(model: nn.Module, optimizer: torch.optim.Optimizer, saved: dict[str, Any]
                      ) -> None:
    """Load ``saved`` (:func:`local_shards` of :func:`sharded_state`, taken on the same rank of
    a mesh of the same shape) into ``model`` and ``optimizer``, which may be sharded on another
    process group (a re-formed one): no collective reads another rank's data.

    Raises:
        ValueError: see :func:`from_local_shards`.
    """
    state = from_local_shards(sharded_state(model, optimizer), saved, "shards")
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])


def load_full(directory: str | Path) -> dict[str, Any]:
    """The whole model and optimizer state of the checkpoint in ``directory``, unsharded on the
    CPU, in one process without a process group (export, inspection): ``{"model": {fqn:
    tensor}, "optimizer": {"state": {fqn: {...}}, "param_groups": [...]}}``."""
    empty_planner, load_state_dict, _ = dcp_internals()
    # rebuilds the whole saved state from the metadata; non-tensor values as _SafeBytes loads them
    planner = type("SafeEmptyPlanner", (_SafeBytes, empty_planner), {})()
    state: dict[str, Any] = {}
    # dcp.load copies the keys it is given into a new dict: the empty planner's rebuilt state
    # must land in ours, as torch's dcp_to_torch_save does
    load_state_dict(state, storage_reader=reader(directory), planner=planner,
                    no_dist=True)
    return state


def model_shapes(metadata: Metadata) -> dict[str, tuple[int, ...]]:
    """The global shape of every model tensor in ``metadata``, by FQN."""
    out = {}
    for key, item in metadata.state_dict_metadata.items():
        if key.startswith("model.") and isinstance(item, TensorStorageMetadata):
            out[key[len("model."):]] = tuple(item.size)
    return out


def set_full_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                   model_state: dict[str, torch.Tensor], optim_state: dict[str, Any]) -> None:
    """Load a whole (rank-0 format) model and optimizer state into a sharded ``model``: each
    rank keeps its shard. ``optim_state`` is ``optimizer.state_dict()``'s (parameters by index,
    in the order of ``optimizer.param_groups``); it is re-keyed by FQN for
    ``set_state_dict(..., full_state_dict=True)``."""
    names = {id(p): n for n, p in model.named_parameters()}
    fqns = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    by_index = dict(enumerate(fqns))
    groups = [{**g, "params": [by_index[i] for i in g["params"]]}
              for g in optim_state["param_groups"]]
    state = {by_index[i]: s for i, s in optim_state["state"].items()}
    set_state_dict(model, optimizer, model_state_dict=model_state,
                   optim_state_dict={"state": state, "param_groups": groups},
                   options=StateDictOptions(full_state_dict=True))


def set_full_model(model: nn.Module, model_state: dict[str, torch.Tensor]) -> None:
    """Load whole tensors (a rank-0 checkpoint's model) into a sharded ``model``."""
    set_model_state_dict(model, model_state, options=StateDictOptions(full_state_dict=True))
