"""A state_dict moved between ranks at the wire's speed: a manifest, then the tensors.

How an in-place recovery hands a survivor's state to a replacement (``recovery/rejoin.py``).
The receiver has built the same model and optimizer already, so only the tensors' bytes need
to travel, straight into place:

1. a **manifest**: the state with every tensor taken out (the non-tensor parts: step counters,
   the optimizer's hyper-parameters, the sampler's cursor) and each tensor's key path, shape,
   dtype and device type. It is ``torch.save`` bytes read with ``weights_only=True``: nothing a
   peer sends is unpickled beyond that (the dtypes are looked up in a fixed table);
2. the tensors, as **units**: each tensor of at least :data:`DIRECT_BYTES` goes from its own
   storage (no copy on the sender; as its ``uint8`` view, since NCCL sends some dtypes, such
   as float8, not at all) into the receiver's tensor at the same key path when that
   has the declared shape and dtype (the model's parameters: no copy on the receiver either;
   loading them afterwards is a copy onto itself, which torch skips); the small ones travel
   packed in flat ``uint8`` buckets of at most :data:`BUCKET_BYTES`. Tensors the receiver does
   not have yet (AdamW's moments exist only after a first step) are allocated from the manifest
   and received into;
3. **every source sends**: the units are split among the ranks that hold the same state
   (greedy by bytes, largest first: the same split on every rank, computed from the manifest),
   and each receiver takes its share from each at once, so the time falls with the number of
   sources until the receiver's link is the limit. Several receivers are served by the same
   non-blocking sends in parallel.

torchft's ``PGTransport`` (``torchft/checkpointing/pg_transport.py``) is the model: a pickled
description, then each tensor received in place. It is not used because its description is
unpickled with ``pickle.loads`` (a peer could run code here), it sends from one rank only, one
message per tensor, and torchft brings a compiled extension and OpenTelemetry with it.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .. import nested
from ..checkpoint.storage import CheckpointError

DIRECT_BYTES = 1 << 20  # a tensor this large travels from its own storage, in a unit of its own
BUCKET_BYTES = 32 << 20  # smaller ones travel packed, at most this many bytes a bucket

Path = tuple[str | int, ...]

# the dtypes a manifest may name (torch's own: a numpy RNG state travels as uint32): a peer's
# string is looked up here, never evaluated
DTYPES = {str(d): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


@dataclass(frozen=True)
class TensorMeta:
    """One tensor of a state: its key path in the nested state (dict keys and list indices),
    shape, dtype and device type (``cpu``, ``cuda``); ``alias``: the index of an earlier tensor
    it is a view of, exactly (tied weights: sent once), or -1."""

    path: Path
    shape: tuple[int, ...]
    dtype: torch.dtype
    device_type: str
    alias: int = -1

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class Unit:
    """What one message carries: the tensors ``indices`` of the manifest (one when ``direct``:
    sent from its own storage), ``nbytes`` in all, sent by ``source`` (an index into the list
    of source ranks)."""

    indices: tuple[int, ...]
    nbytes: int
    direct: bool
    source: int = 0


@dataclass(frozen=True)
class Manifest:
    """A state's non-tensor skeleton (its tensors replaced by ``None``) and its tensors' metas,
    in the order :func:`flatten` walks them."""

    skeleton: Any
    metas: tuple[TensorMeta, ...]

    def digest(self) -> str:
        """A hash of the tensors' paths, shapes and dtypes: ranks whose states have the same
        digest send the same units (:func:`units`)."""
        text = repr([(m.path, m.shape, str(m.dtype)) for m in self.metas])
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def to_bytes(self) -> bytes:
        buf = io.BytesIO()
        torch.save({"skeleton": self.skeleton,
                    "tensors": [[list(m.path), list(m.shape), str(m.dtype), m.device_type,
                                 m.alias] for m in self.metas]}, buf)
        return buf.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes, source: str) -> Manifest:
        """Read :meth:`to_bytes` from a peer (``weights_only``; every field checked).

        Raises:
            CheckpointError: the bytes are not a manifest (named by ``source``)."""
        try:
            raw = torch.load(io.BytesIO(data), weights_only=True)
            metas = tuple(_meta(i, *t) for i, t in enumerate(raw["tensors"]))
            for m in metas:
                if m.alias >= 0 and (metas[m.alias].shape, metas[m.alias].dtype) != \
                        (m.shape, m.dtype):
                    raise ValueError(f"{_key(m.path)} aliases a tensor of another shape")
            return cls(raw["skeleton"], metas)
        except Exception as e:  # noqa: BLE001 - any malformed field is the same refusal
            raise CheckpointError(f"{source} sent a state manifest this rank cannot read: "
                                  f"{type(e).__name__}: {e}") from e


def _meta(i: int, path: list[Any], shape: list[Any], dtype: str, device_type: str,
          alias: int) -> TensorMeta:
    if not all(isinstance(k, str | int) for k in path) or \
            not all(isinstance(n, int) and n >= 0 for n in shape):
        raise ValueError(f"bad key path or shape {path!r} {shape!r}")
    if dtype not in DTYPES or device_type not in ("cpu", "cuda") or not -1 <= alias < i:
        raise ValueError(f"dtype {dtype!r}, device {device_type!r} or alias {alias!r} "
                         "not allowed")
    return TensorMeta(tuple(path), tuple(shape), DTYPES[dtype], device_type, alias)


def _key(path: Path) -> str:
    """A key path as a dotted name (``model.fc.weight``, ``optimizer.state.0.exp_avg``)."""
    return nested.dotted(path)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def flatten(state: Any) -> tuple[Manifest, list[torch.Tensor]]:
    """``state`` (nested dicts, lists, tuples; tensors at the leaves) as its manifest and its
    tensors in manifest order, in one walk; the skeleton's containers are plain dicts, lists
    and tuples (a peer reads them with ``weights_only=True``). Dict keys on a tensor's path
    must be ``str`` or ``int``."""
    found: list[tuple[Path, torch.Tensor]] = []

    def take(path: Path, leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        found.append((path, leaf))
        return None

    skeleton = nested.map_leaves(take, state, rebuild=nested.Rebuild.PLAIN)
    first: dict[tuple[Any, ...], int] = {}
    metas = []
    for i, (p, t) in enumerate(found):
        key = nested.alias_key(t)
        alias = i if key is None else first.setdefault(key, i)
        metas.append(TensorMeta(p, tuple(t.shape), t.dtype, t.device.type,
                                -1 if alias == i else alias))
    return Manifest(skeleton, tuple(metas)), [t for _, t in found]


def rebuild(manifest: Manifest, tensors: list[torch.Tensor]) -> Any:
    """The state :func:`flatten` took apart: the skeleton with ``tensors`` put back (plain
    dicts, lists and tuples)."""
    at = {m.path: t for m, t in zip(manifest.metas, tensors, strict=True)}
    return nested.map_leaves(lambda p, v: at.get(p, v), manifest.skeleton,
                             rebuild=nested.Rebuild.PLAIN)


def units(metas: tuple[TensorMeta, ...], sources: int) -> list[Unit]:
    """The messages that carry ``metas``' tensors, each assigned to one of ``sources`` ranks:
    large tensors alone, small ones in buckets (module docstring); greedy by bytes, largest
    first, ties by order, so every rank computes the same split."""
    out: list[Unit] = []
    bucket: list[int] = []
    size = 0
    for i, m in enumerate(metas):
        if m.alias >= 0:
            continue
        if m.nbytes >= DIRECT_BYTES:
            out.append(Unit((i,), m.nbytes, True))
            continue
        if bucket and size + m.nbytes > BUCKET_BYTES:
            out.append(Unit(tuple(bucket), size, False))
            bucket, size = [], 0
        bucket.append(i)
        size += m.nbytes
    if bucket:
        out.append(Unit(tuple(bucket), size, False))
    load = [0] * sources
    assigned: dict[int, int] = {}
    for k in sorted(range(len(out)), key=lambda k: (-out[k].nbytes, k)):
        s = min(range(sources), key=lambda s: (load[s], s))
        assigned[k], load[s] = s, load[s] + out[k].nbytes
    return [Unit(u.indices, u.nbytes, u.direct, assigned[k]) for k, u in enumerate(out)]


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _payload(u: Unit, tensors: list[torch.Tensor], wire: torch.device) -> torch.Tensor:
    if u.direct:  # as bytes: NCCL has no send for some dtypes (float8), bytes it has
        return _bytes_of(tensors[u.indices[0]].to(wire))
    if not u.nbytes:
        return torch.empty(0, dtype=torch.uint8, device=wire)
    return torch.cat([_bytes_of(tensors[i].to(wire)) for i in u.indices])


_TAG_SIZE, _TAG_MANIFEST, _TAG_UNITS = 1, 2, 3


def send_manifest(manifest: Manifest, receivers: list[int], wire: torch.device,
                  head: tuple[int, ...] = (), group: Any = None) -> list[Any]:
    """Post ``manifest`` to every rank in ``receivers`` (non-blocking; wait for the returned
    works): its length in bytes with ``head`` (integers of the caller's protocol), then its
    bytes. :func:`recv_manifest` reads it."""
    data = manifest.to_bytes()
    size = torch.tensor([len(data), *head], dtype=torch.int64, device=wire)
    blob = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(wire)
    return [w for r in receivers for w in (dist.isend(size, r, group=group, tag=_TAG_SIZE),
                                           dist.isend(blob, r, group=group, tag=_TAG_MANIFEST))]


def recv_manifest(src: int, wire: torch.device, head: int = 0, group: Any = None,
                  source: str = "") -> tuple[Manifest, list[int]]:
    """What :func:`send_manifest` on ``src`` sent: the manifest and the ``head`` integers.

    Raises:
        CheckpointError: the bytes are not a manifest (named by ``source``, else the rank)."""
    size = torch.zeros(1 + head, dtype=torch.int64, device=wire)
    dist.recv(size, src, group=group, tag=_TAG_SIZE)
    blob = torch.empty(int(size[0].item()), dtype=torch.uint8, device=wire)
    dist.recv(blob, src, group=group, tag=_TAG_MANIFEST)
    manifest = Manifest.from_bytes(blob.cpu().numpy().tobytes(), source or f"rank {src}")
    return manifest, [int(v) for v in size[1:].tolist()]


def send_state(flat: tuple[Manifest, list[torch.Tensor]], receivers: list[int],
               sources: list[int], rank: int, wire: torch.device) -> None:
    """Send this rank's share of a state (``flat``: its :func:`flatten`) to every rank in
    ``receivers``: ``sources[0]`` sends the manifest, each source its units (:func:`units`).
    Every rank in ``sources`` must hold the same state (the same :meth:`Manifest.digest`) and
    call this; each receiver calls :func:`recv_state`. Point to point, non-blocking sends,
    waited for together."""
    manifest, tensors = flat
    mine = sources.index(rank)
    works = send_manifest(manifest, receivers, wire) if mine == 0 else []
    for k, u in enumerate(units(manifest.metas, len(sources))):
        if u.source != mine:
            continue
        payload = _payload(u, tensors, wire)
        works += [dist.isend(payload, r, tag=_TAG_UNITS + k) for r in receivers]
    for w in works:
        w.wait()


def recv_state(template: Any, sources: list[int], wire: torch.device,
               check: Callable[[Manifest], None] | None = None,
               device: torch.device | None = None) -> Any:
    """Receive the state :func:`send_state` on ``sources`` sends, into ``template``'s tensors
    where a key path's tensor has the declared shape and dtype and is contiguous on its
    destination device (this rank's live state: the model's parameters), into new tensors
    elsewhere. Tensors declared on the CPU end there; those declared on a GPU end on ``device``
    (default: the wire's). When the wire is host memory (gloo) and ``device`` a GPU, each
    tensor's bytes are copied onto the device as soon as they have arrived, while the next
    ones are still on the wire. ``check(manifest)`` may refuse the state before any tensor is
    received.

    Returns:
        the sender's state (nested like it).

    Raises:
        CheckpointError: the manifest is unreadable, or ``check`` refused it.
    """
    manifest, _ = recv_manifest(sources[0], wire)
    if check is not None:
        check(manifest)
    live = dict(nested.tensors(template))
    out: list[torch.Tensor] = []
    for m in manifest.metas:
        out.append(out[m.alias] if m.alias >= 0 else _destination(
            m, live.get(m.path), device if device is not None and m.device_type != "cpu"
            else wire))
    pending = []
    for k, u in enumerate(units(manifest.metas, len(sources))):
        buf = _bytes_of(out[u.indices[0]]) if u.direct and out[u.indices[0]].device == wire \
            else torch.empty(u.nbytes, dtype=torch.uint8, device=wire)
        pending.append((dist.irecv(buf, sources[u.source], tag=_TAG_UNITS + k), u, buf))
    for work, u, buf in pending:  # in the order posted, which is the order they arrive
        work.wait()
        offset = 0
        for i in u.indices:
            n = manifest.metas[i].nbytes
            if n and buf.data_ptr() != _bytes_of(out[i]).data_ptr():
                _bytes_of(out[i]).copy_(buf[offset:offset + n])
            offset += n
    out = [t.cpu() if m.device_type == "cpu" else t for m, t in zip(manifest.metas, out,
                                                                     strict=True)]
    return rebuild(manifest, out)


def _destination(m: TensorMeta, mine: torch.Tensor | None, device: torch.device
                 ) -> torch.Tensor:
    if mine is not None and tuple(mine.shape) == m.shape and mine.dtype == m.dtype \
            and mine.device == device and mine.is_contiguous():
        return mine
    return torch.empty(m.shape, dtype=m.dtype, device=device)
