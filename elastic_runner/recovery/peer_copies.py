"""In-memory copies of each rank's shards on a peer: in-place recovery under FSDP.

Under FSDP2 no rank holds the whole state, so the DDP way of in-place recovery (a survivor sends
its state to the replacement, ``recovery/rejoin.py``) has nothing to send for the dead rank's shard.
As in Gemini (Wang et al., SOSP'23: checkpoints in the host memory of peers, placed so that a
lost machine's copy survives elsewhere), every ``recovery.peer_copy_every_steps`` steps each rank

1. copies its local model and optimizer shards and the rest of the state (sampler cursor,
   schedule, counters, RNG) into a reusable flat host buffer (``CheckpointManager.local_copy``;
   the tensors' bytes back to back, described by a
   :class:`~elastic_runner.recovery.state_transfer.Manifest`: no pickling of tensor data);
2. sends the buffer to rank ``(r + 1) mod W`` and receives rank ``(r - 1) mod W``'s into another,
   on a gloo group of its own, **in the background**: the sends are posted and the step goes on;
   the exchange is waited for at the next refresh or when a recovery reads the copies;
3. keeps both once the exchange completed, replacing the previous pair (host memory: four times
   this rank's shard state, two buffers each for its own and its predecessor's copy, so that
   the pair a recovery may need stays whole while the next one travels).

The copy is taken at the step boundary where a checkpoint would be, after the step's evaluation
and checkpoint work. After a failure (:func:`plan`) every rank rolls back to the copies' step
``s``: a survivor loads its own copy, a replacement the copy its successor holds; the steps after
``s`` are redone (at most ``peer_copy_every_steps``, plus the one in flight). When the copies cannot
cover every rank (two neighbours lost, a failure while an exchange was in flight on some ranks,
another world size) every rank loads the newest checkpoint instead, still without leaving its
process.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .state_transfer import Manifest, TensorMeta, flatten, rebuild

log = logging.getLogger(__name__)

ALIGN = 64  # each tensor's offset in a copy's buffer: a multiple of any dtype's size


def offsets(metas: tuple[TensorMeta, ...]) -> tuple[list[int], int]:
    """Where each tensor of ``metas`` starts in a copy's flat buffer (an alias where its
    tensor does), and the buffer's size in bytes."""
    out: list[int] = []
    end = 0
    for m in metas:
        if m.alias >= 0:
            out.append(out[m.alias])
            continue
        out.append(end)
        end += -(-m.nbytes // ALIGN) * ALIGN
    return out, end


@dataclass
class Copy:
    """One rank's state at ``step`` (taken at world size ``world_size``): its ``manifest`` and
    its tensors' bytes in ``data`` (a flat CPU ``uint8`` buffer, laid out by :func:`offsets`)."""

    step: int
    world_size: int
    manifest: Manifest
    data: torch.Tensor

    @classmethod
    def of(cls, state: Any, step: int, world_size: int,
           reuse: Callable[[int], torch.Tensor | None] = lambda size: None) -> Copy:
        """``state``'s tensors copied into ``reuse(size)`` (a buffer of an earlier copy of
        that many bytes) or a new buffer."""
        manifest, tensors = flatten(state)
        starts, size = offsets(manifest.metas)
        data = reuse(size)
        if data is None:
            data = torch.empty(size, dtype=torch.uint8)
        for m, t, at in zip(manifest.metas, tensors, starts, strict=True):
            if m.alias < 0 and m.nbytes:
                data[at:at + m.nbytes].copy_(t.detach().contiguous().reshape(-1)
                                             .view(torch.uint8), non_blocking=True)
        if any(m.device_type == "cuda" for m in manifest.metas):
            torch.cuda.synchronize()  # the device-to-host copies have landed
        return cls(step, world_size, manifest, data)

    def state(self) -> Any:
        """The state, its tensors on the CPU, copied out of :attr:`data` (a loaded optimizer
        may keep them: the buffer is reused by the next copy).

        Raises:
            ValueError: :attr:`data` does not have the size the manifest declares."""
        starts, size = offsets(self.manifest.metas)
        if self.data.numel() != size:
            raise ValueError(f"the copy holds {self.data.numel()} bytes, its manifest declares "
                             f"{size}")
        out: list[torch.Tensor] = []
        for m, at in zip(self.manifest.metas, starts, strict=True):
            if m.alias >= 0:
                out.append(out[m.alias])
            elif not m.nbytes:
                out.append(torch.empty(m.shape, dtype=m.dtype))
            else:
                out.append(self.data[at:at + m.nbytes].view(m.dtype).view(m.shape).clone())
        return rebuild(self.manifest, out)


class NoCopies:
    """Peer copies off (``recovery.peer_copy_every_steps: 0``, DDP, no in-place recovery)."""

    enabled = False
    own: Copy | None = None
    held: Copy | None = None

    def due(self, step: int) -> bool:
        return False

    def summary(self) -> dict[str, Any]:
        return {"own": None, "held": None, "world_size": 0}

    def settle(self) -> None:
        pass


@dataclass
class _InFlight:
    """An exchange posted and not yet waited for: the pair it makes once it completed."""

    own: Copy
    held: Copy | None
    works: list[Any] = field(default_factory=list)


class PeerCopies:
    """This rank's own copy and its predecessor's (module docstring).

    Args:
        every_steps: refresh the pair when the step is a multiple of it (> 0).
        forming: the context a group of this process is made in (``GroupSockets.forming``:
            its connections are cut with the default group's on a failure, which fails an
            exchange in flight at once), and its ``epoch`` (a new default group formed since
            the copies' own group was made: that one is gone with it).
    """

    enabled = True

    def __init__(self, every_steps: int, sockets: Any = None) -> None:
        self.every_steps = every_steps
        self.own: Copy | None = None
        self.held: Copy | None = None  # rank (r - 1) mod W's
        self.seconds = 0.0  # the last refresh's stall: the wait for the previous exchange,
        # the copy into host memory, posting the next
        self._sockets = sockets
        self._group: Any = None
        self._epoch = -1
        self._in_flight: _InFlight | None = None
        self._spare: list[torch.Tensor] = []  # buffers of a pair replaced or dropped

    def due(self, step: int) -> bool:
        return step % self.every_steps == 0

    def refresh(self, state: dict[str, Any], step: int, rank: int, world_size: int,
                wire: torch.device) -> float:
        """Copy ``state`` (``CheckpointManager.local_copy()``) into host memory and post its
        exchange around the ring (collective: every rank at the same step; the bytes travel
        while training goes on, on the copies' own gloo group from host memory, under NCCL
        too: ``wire`` is not used). The pair becomes :attr:`own` and :attr:`held` once the
        exchange completed (:meth:`settle`). Returns the seconds the step waited.

        Raises:
            RuntimeError: a neighbour is gone (the manifests' swap is waited for).
            CheckpointError: the predecessor's manifest is unreadable or does not lay out the
                size it declares."""
        t0 = time.perf_counter()
        self.settle()
        own = Copy.of(state, step, world_size, self._spare_of)
        if world_size == 1:
            self._in_flight = _InFlight(own, None)
        else:
            group = self._side_group()
            succ, pred = (rank + 1) % world_size, (rank - 1) % world_size
            manifest, size = _swap_manifests(own, succ, pred, group, torch.device("cpu"))
            held = Copy(step, world_size, manifest, self._spare_of(size))
            self._in_flight = _InFlight(own, held, [dist.isend(own.data, succ, group=group),
                                                    dist.irecv(held.data, pred, group=group)])
        self.seconds = time.perf_counter() - t0
        return self.seconds

    def settle(self) -> None:
        """Wait for the exchange in flight: the pair it made replaces the previous one, or,
        if it failed (a peer died meanwhile), the previous pair stays."""
        flight, self._in_flight = self._in_flight, None
        if flight is None:
            return
        try:
            for work in flight.works:
                work.wait()
        except (RuntimeError, dist.DistError) as e:
            log.warning("the peer copies of step %d did not reach their peers (%s); the copies "
                        "of step %s stay", flight.own.step, str(e).splitlines()[0] if str(e)
                        else type(e).__name__, self.own.step if self.own else None)
            self._spare += [c.data for c in (flight.own, flight.held) if c is not None]
            return
        self._spare += [c.data for c in (self.own, self.held) if c is not None]
        self.own, self.held = flight.own, flight.held

    def adopt(self, copy: Copy) -> None:
        """A replacement: ``copy`` (its state, from its successor) is its own copy now."""
        self.settle()
        self.own, self.held = copy, None

    def reshare(self, rank: int, world_size: int, wire: torch.device) -> None:
        """After a recovery: every rank sends its own copy around the ring again, so each holds
        its predecessor's (the replacement's predecessor had lost its holder). Collective, on
        the default group."""
        assert self.own is not None
        self.held = exchange(self.own, rank, world_size, wire)

    def summary(self) -> dict[str, Any]:
        """What this rank can offer, for :func:`plan` (all-gathered); an exchange in flight is
        waited for first."""
        self.settle()
        return {"own": self.own.step if self.own else None,
                "held": self.held.step if self.held else None,
                "world_size": self.own.world_size if self.own else 0}

    def _spare_of(self, size: int) -> torch.Tensor:
        """A spare buffer of ``size`` bytes, else a new one."""
        for i, buf in enumerate(self._spare):
            if buf.numel() == size:
                return self._spare.pop(i)
        self._spare = self._spare[-2:]  # of another size: no longer of use
        return torch.empty(size, dtype=torch.uint8)

    def _side_group(self) -> Any:
        """The copies' own gloo group over the current default group's ranks, made once per
        default group (collective: at a refresh, every rank is here)."""
        epoch = getattr(self._sockets, "epoch", 0)
        if self._group is None or epoch != self._epoch:
            forming = self._sockets.forming(subgroups=True) if self._sockets is not None \
                else contextlib.nullcontext()
            with forming:
                self._group = dist.new_group(backend="gloo")
            self._epoch = epoch
        return self._group


def plan(everyone: list[dict[str, Any]]) -> tuple[int, dict[int, int]] | str:
    """Which copies restore a re-formed group of ``len(everyone)`` ranks.

    Args:
        everyone: per rank, :meth:`PeerCopies.summary` plus ``joining`` (a replacement).

    Returns:
        ``(step, {replacement rank: rank holding its copy})``, or why the copies do not cover
        every rank (the caller then loads the newest checkpoint).
    """
    world_size = len(everyone)
    survivors = [r for r, s in enumerate(everyone) if not s["joining"]]
    if not survivors:
        return "no survivor holds a copy"
    if all(everyone[r]["own"] is None for r in survivors):
        return "no peer copy was taken yet (recovery.peer_copy_every_steps; 0: none)"
    if any(everyone[r]["world_size"] != world_size for r in survivors):
        return f"the copies were taken at another world size than {world_size}"
    steps = {everyone[r]["own"] for r in survivors}
    if None in steps or len(steps) != 1:
        return f"the survivors' copies are of different steps ({sorted(map(str, steps))})"
    step = steps.pop()
    sources = {}
    for r, s in enumerate(everyone):
        if not s["joining"]:
            continue
        holder = (r + 1) % world_size
        if everyone[holder]["joining"] or everyone[holder]["held"] != step:
            return f"rank {r}'s copy was on rank {holder}, which lost it too"
        sources[r] = holder
    return step, sources


def plan_replicas(everyone: list[dict[str, Any]], replicas: int
                  ) -> tuple[int, int, dict[int, int]] | None:
    """HSDP (``replicas`` > 1; rank = replica x shards + shard): whether every replacement has
    a surviving replica of its shard, and every survivor kept its live state of one step.

    Args:
        everyone: per rank, ``joining`` and ``live``: ``[step, after, world size]`` or None.

    Returns:
        ``(step, after, {replacement rank: surviving replica})``, or None (the copies decide).
    """
    world_size = len(everyone)
    if replicas == 1 or world_size % replicas:
        return None
    shards = world_size // replicas
    survivors = [r for r, s in enumerate(everyone) if not s["joining"]]
    lives = {tuple(everyone[r]["live"] or ()) for r in survivors}
    if len(lives) != 1 or not next(iter(lives)) or next(iter(lives))[2] != world_size:
        return None
    step, after, _ = lives.pop()
    sources = {}
    for r, s in enumerate(everyone):
        if s["joining"]:
            same = [k for k in survivors if k % shards == r % shards]
            if not same:
                return None
            sources[r] = same[0]
    return step, after, sources


def hand_over(copy: Callable[[], Copy], sources: dict[int, int], rank: int,
              wire: torch.device) -> Copy | None:
    """Each holder in ``sources`` (``{replacement: holder}``, from :func:`plan` or
    :func:`plan_replicas`) sends ``copy()`` (asked of holders only) to the replacement it
    names; returns what this rank received (None if it received nothing). Point to point
    between the members named, on the default group.

    Raises:
        CheckpointError: a holder's manifest is unreadable."""
    received = None
    for receiver, holder in sorted(sources.items()):
        if rank == holder:
            send(copy(), receiver, wire)
        elif rank == receiver:
            received = recv(holder, wire)
    return received


def exchange(own: Copy, rank: int, world_size: int, wire: torch.device) -> Copy | None:
    """Send ``own`` to rank ``(rank + 1) mod world_size``, receive ``(rank - 1)``'s (on the
    default group, waited for)."""
    if world_size == 1:
        return None
    succ, pred = (rank + 1) % world_size, (rank - 1) % world_size
    manifest, size = _swap_manifests(own, succ, pred, None, wire)
    buf = torch.empty(size, dtype=torch.uint8, device=wire)
    for req in (dist.isend(own.data.to(wire), succ), dist.irecv(buf, pred)):
        req.wait()
    return Copy(own.step, world_size, manifest, buf.cpu())


def _swap_manifests(own: Copy, succ: int, pred: int, group: Any, wire: torch.device
                    ) -> tuple[Manifest, int]:
    """Send ``own``'s manifest and size to ``succ``, receive ``pred``'s: its manifest and the
    size of the data that follows."""
    blob = own.manifest.to_bytes()
    out = torch.tensor([len(blob), own.data.numel()], dtype=torch.int64, device=wire)
    sizes = torch.zeros(2, dtype=torch.int64, device=wire)
    for req in (dist.isend(out, succ, group=group), dist.irecv(sizes, pred, group=group)):
        req.wait()
    theirs = torch.empty(int(sizes[0].item()), dtype=torch.uint8, device=wire)
    mine = torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(wire)
    for req in (dist.isend(mine, succ, group=group), dist.irecv(theirs, pred, group=group)):
        req.wait()
    manifest = Manifest.from_bytes(theirs.cpu().numpy().tobytes(), f"rank {pred}'s peer copy")
    return manifest, _declared(manifest, int(sizes[1].item()), pred)


def _declared(manifest: Manifest, size: int, peer: int) -> int:
    """``size`` when it is what ``manifest`` lays out.

    Raises:
        CheckpointError: it is not (a peer's data would not fit its description)."""
    from ..checkpoint.storage import CheckpointError

    expected = offsets(manifest.metas)[1]
    if size != expected:
        raise CheckpointError(f"rank {peer}'s peer copy declares {size} bytes of tensors; its "
                              f"manifest lays out {expected}")
    return size


def send(copy: Copy, dst: int, wire: torch.device) -> None:
    """``copy`` to ``dst`` on the default group: the sizes, the manifest, the data."""
    blob = copy.manifest.to_bytes()
    dist.send(torch.tensor([len(blob), copy.data.numel(), copy.step, copy.world_size],
                           dtype=torch.int64, device=wire), dst=dst)
    dist.send(torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(wire), dst=dst)
    dist.send(copy.data.to(wire), dst=dst)


def recv(src: int, wire: torch.device) -> Copy:
    """What :func:`send` on ``src`` sent, its data on the CPU.

    Raises:
        CheckpointError: the manifest is unreadable or does not lay out the data's size."""
    head = torch.zeros(4, dtype=torch.int64, device=wire)
    dist.recv(head, src=src)
    blob = torch.empty(int(head[0].item()), dtype=torch.uint8, device=wire)
    dist.recv(blob, src=src)
    manifest = Manifest.from_bytes(blob.cpu().numpy().tobytes(), f"rank {src}'s peer copy")
    data = torch.empty(_declared(manifest, int(head[1].item()), src), dtype=torch.uint8,
                       device=wire)
    dist.recv(data, src=src)
    return Copy(int(head[2].item()), int(head[3].item()), manifest, data.cpu())
