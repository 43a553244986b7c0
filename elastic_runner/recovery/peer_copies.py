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

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..host_buffers import HostBuffers, host_buffer
from .group_sockets import NO_SOCKETS, Sockets
from .state_transfer import Manifest, TensorMeta, flatten, rebuild, recv_manifest, send_manifest

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
           buffer: Callable[[int, bool], torch.Tensor] = host_buffer) -> Copy:
        """``state``'s tensors (on the CPU or a GPU) copied into ``buffer(size, pinned)``: a
        host buffer of that many bytes, pinned when a tensor is on a GPU (its device-to-host
        copy is then asynchronous; all are waited for together)."""
        manifest, tensors = flatten(state)
        starts, size = offsets(manifest.metas)
        on_gpu = any(m.device_type == "cuda" for m in manifest.metas)
        data = buffer(size, on_gpu)
        for m, t, at in zip(manifest.metas, tensors, starts, strict=True):
            if m.alias < 0 and m.nbytes:
                data[at:at + m.nbytes].copy_(t.detach().contiguous().reshape(-1)
                                             .view(torch.uint8), non_blocking=on_gpu)
        if on_gpu:
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
        return {"own": None, "held": None, "world_size": 0, "dropped": None}

    def settle(self) -> None:
        pass

    def drop(self, reason: str) -> None:
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
        sockets: this process's group sockets: the copies' own group is made in their
            ``forming`` context (its connections are cut with the default group's on a
            failure, which fails an exchange in flight at once), and their ``epoch`` says a
            new default group formed since it was made (it is gone with the old one).
            :class:`NoSockets` (a bench, no in-place recovery): nothing is cut.
    """

    enabled = True

    def __init__(self, every_steps: int, sockets: Sockets = NO_SOCKETS
                 ) -> None:
        self.every_steps = every_steps
        self.own: Copy | None = None
        self.held: Copy | None = None  # rank (r - 1) mod W's
        self.seconds = 0.0  # the last refresh's stall: the wait for the previous exchange,
        # the copy into host memory, posting the next
        self._sockets = sockets
        self._group: Any = None
        self._epoch = -1
        self._in_flight: _InFlight | None = None
        self._buffers = HostBuffers()  # holds the buffers of a pair replaced or dropped
        self._dropped: str | None = None  # why the pair was dropped (:meth:`drop`)

    def due(self, step: int) -> bool:
        return step % self.every_steps == 0

    def refresh(self, state: dict[str, Any], step: int, rank: int, world_size: int,
                wire: torch.device) -> float:
        """Copy ``state`` (``CheckpointManager.local_copy(to_cpu=False)``) into host memory
        (pinned when it is on a GPU: one device-to-host copy) and post its exchange around
        the ring (collective: every rank at the same step; the bytes travel
        while training goes on, on the copies' own gloo group from host memory, under NCCL
        too: ``wire`` is not used). The pair becomes :attr:`own` and :attr:`held` once the
        exchange completed (:meth:`settle`). Returns the seconds the step waited.

        Raises:
            RuntimeError: a neighbour is gone (the manifests' swap is waited for).
            CheckpointError: the predecessor's manifest is unreadable or does not lay out the
                size it declares."""
        t0 = time.perf_counter()
        self.settle()
        own = Copy.of(state, step, world_size, self._buffers.take)
        if world_size == 1:
            self._in_flight = _InFlight(own, None)
        else:
            group = self._side_group()
            succ, pred = (rank + 1) % world_size, (rank - 1) % world_size
            manifest, size = _swap_manifests(own, succ, pred, group, torch.device("cpu"))
            held = Copy(step, world_size, manifest, self._buffers.take(size, False))
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
            self._buffers.give_back(c.data for c in (flight.own, flight.held) if c is not None)
            return
        self._buffers.give_back(c.data for c in (self.own, self.held) if c is not None)
        self.own, self.held, self._dropped = flight.own, flight.held, None

    def drop(self, reason: str) -> None:
        """Forget the pair (``reason``: why, which :func:`plan` reports): a newer committed
        checkpoint supersedes it, and a group re-formed at the pair's world size would roll
        back to it instead."""
        self.settle()
        self._buffers.give_back(c.data for c in (self.own, self.held) if c is not None)
        self.own, self.held, self._dropped = None, None, reason

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
                "world_size": self.own.world_size if self.own else 0,
                "dropped": self._dropped}

    def _side_group(self) -> Any:
        """The copies' own gloo group over the current default group's ranks, made once per
        default group (collective: at a refresh, every rank is here)."""
        epoch = self._sockets.epoch
        if self._group is None or epoch != self._epoch:
            with self._sockets.forming(subgroups=True):
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
        return next((everyone[r]["dropped"] for r in survivors if everyone[r].get("dropped")),
                    "no peer copy was taken yet (recovery.peer_copy_every_steps; 0: none)")
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
    works = send_manifest(own.manifest, [succ], wire, (own.data.numel(),), group)
    manifest, (size,) = recv_manifest(pred, wire, 1, group, f"rank {pred}'s peer copy")
    for work in works:
        work.wait()
    return manifest, _declared(manifest, size, pred)


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
    """``copy`` to ``dst`` on the default group: its manifest with the data's size, step and
    world size, then the data."""
    for work in send_manifest(copy.manifest, [dst], wire,
                              (copy.data.numel(), copy.step, copy.world_size)):
        work.wait()
    dist.send(copy.data.to(wire), dst=dst)


def recv(src: int, wire: torch.device) -> Copy:
    """What :func:`send` on ``src`` sent, its data on the CPU.

    Raises:
        CheckpointError: the manifest is unreadable or does not lay out the data's size."""
    manifest, (size, step, world_size) = recv_manifest(src, wire, 3,
                                                       source=f"rank {src}'s peer copy")
    data = torch.empty(_declared(manifest, size, src), dtype=torch.uint8, device=wire)
    dist.recv(data, src=src)
    return Copy(step, world_size, manifest, data.cpu())
