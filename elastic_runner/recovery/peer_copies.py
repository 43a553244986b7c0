"""In-memory copies of each rank's shards on a peer: in-place recovery under FSDP.

Under FSDP2 no rank holds the whole state, so the DDP way of in-place recovery (a survivor sends
its state to the replacement, ``recovery/rejoin.py``) has nothing to send for the dead rank's shard.
As in Gemini (Wang et al., SOSP'23: checkpoints in the host memory of peers, placed so that a
lost machine's copy survives elsewhere), every ``recovery.peer_copy_every_steps`` steps each rank

1. copies its local model and optimizer shards and the rest of the state (sampler cursor,
   schedule, counters, RNG) to host memory (``CheckpointManager.local_copy``, serialised with
   ``torch.save``: the bytes are both the copy and what goes on the wire);
2. sends them to rank ``(r + 1) mod W`` and receives rank ``(r - 1) mod W``'s (one ring exchange,
   point to point over the process group);
3. keeps both, replacing the previous pair (host memory: twice this rank's shard state).

The copy is taken at the step boundary where a checkpoint would be, after the step's evaluation
and checkpoint work. After a failure (:func:`plan`) every rank rolls back to the copies' step
``s``: a survivor loads its own copy, a replacement the copy its successor holds; the steps after
``s`` are redone (at most ``peer_copy_every_steps``, plus the one in flight). When the copies cannot
cover every rank (two neighbours lost, a failure during the exchange, another world size) every
rank loads the newest checkpoint instead, still without leaving its process.
"""

from __future__ import annotations

import io
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


@dataclass
class Copy:
    """One rank's state at ``step`` as :func:`pack` bytes (a CPU ``uint8`` tensor), taken at
    world size ``world_size``."""

    step: int
    world_size: int
    payload: torch.Tensor


class NoCopies:
    """Peer copies off (``recovery.peer_copy_every_steps: 0``, DDP, no in-place recovery)."""

    enabled = False
    own: Copy | None = None
    held: Copy | None = None

    def due(self, step: int) -> bool:
        return False

    def summary(self) -> dict[str, Any]:
        return {"own": None, "held": None, "world_size": 0}


class PeerCopies:
    """This rank's own copy and its predecessor's (module docstring).

    Args:
        every_steps: refresh the pair when the step is a multiple of it (> 0).
    """

    enabled = True

    def __init__(self, every_steps: int) -> None:
        self.every_steps = every_steps
        self.own: Copy | None = None
        self.held: Copy | None = None  # rank (r - 1) mod W's
        self.seconds = 0.0  # the last refresh's stall (copy + exchange)

    def due(self, step: int) -> bool:
        return step % self.every_steps == 0

    def refresh(self, state: dict[str, Any], step: int, rank: int, world_size: int,
                wire: torch.device) -> float:
        """Pack ``state`` (``CheckpointManager.local_copy()``) and exchange it around the ring
        (collective: every rank at the same step). Returns the seconds it took."""
        t0 = time.perf_counter()
        own = Copy(step, world_size, pack(state))
        held = exchange(own, rank, world_size, wire)
        self.own, self.held = own, held  # both or neither: a failed exchange keeps the old pair
        self.seconds = time.perf_counter() - t0
        return self.seconds

    def adopt(self, copy: Copy) -> None:
        """A replacement: ``copy`` (its state, from its successor) is its own copy now."""
        self.own, self.held = copy, None

    def reshare(self, rank: int, world_size: int, wire: torch.device) -> None:
        """After a recovery: every rank sends its own copy around the ring again, so each holds
        its predecessor's (the replacement's predecessor had lost its holder). Collective."""
        assert self.own is not None
        self.held = exchange(self.own, rank, world_size, wire)

    def summary(self) -> dict[str, Any]:
        """What this rank can offer, for :func:`plan` (all-gathered)."""
        return {"own": self.own.step if self.own else None,
                "held": self.held.step if self.held else None,
                "world_size": self.own.world_size if self.own else 0}


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


def hand_over(payload: Callable[[], torch.Tensor], sources: dict[int, int], rank: int,
              wire: torch.device) -> torch.Tensor | None:
    """Each holder in ``sources`` (``{replacement: holder}``, from :func:`plan` or
    :func:`plan_replicas`) sends ``payload()`` (asked of holders only) to the replacement it
    names; returns what this rank received (None if it received nothing). Point to point
    between the members named."""
    received = None
    for receiver, holder in sorted(sources.items()):
        if rank == holder:
            send(payload(), receiver, wire)
        elif rank == receiver:
            received = recv(holder, wire)
    return received


def exchange(own: Copy, rank: int, world_size: int, wire: torch.device) -> Copy | None:
    """Send ``own`` to rank ``(rank + 1) mod world_size``, receive ``(rank - 1)``'s."""
    if world_size == 1:
        return None
    succ, pred = (rank + 1) % world_size, (rank - 1) % world_size
    size_out = torch.tensor([own.payload.numel()], dtype=torch.int64, device=wire)
    size_in = torch.zeros(1, dtype=torch.int64, device=wire)
    for req in (dist.isend(size_out, succ), dist.irecv(size_in, pred)):
        req.wait()
    buf = torch.empty(int(size_in.item()), dtype=torch.uint8, device=wire)
    for req in (dist.isend(own.payload.to(wire), succ), dist.irecv(buf, pred)):
        req.wait()
    return Copy(own.step, world_size, buf.cpu())


def send(payload: torch.Tensor, dst: int, wire: torch.device) -> None:
    """``payload`` (``uint8``) to ``dst``, its size first."""
    dist.send(torch.tensor([payload.numel()], dtype=torch.int64, device=wire), dst=dst)
    dist.send(payload.to(wire), dst=dst)


def recv(src: int, wire: torch.device) -> torch.Tensor:
    """What :func:`send` on ``src`` sent, on the CPU."""
    size = torch.zeros(1, dtype=torch.int64, device=wire)
    dist.recv(size, src=src)
    payload = torch.empty(int(size.item()), dtype=torch.uint8, device=wire)
    dist.recv(payload, src=src)
    return payload.cpu()


def pack(state: dict[str, Any]) -> torch.Tensor:
    """``state`` as ``torch.save`` bytes in a CPU ``uint8`` tensor (over the buffer's memory:
    no second copy)."""
    buf = io.BytesIO()
    torch.save(state, buf)
    return torch.frombuffer(buf.getbuffer(), dtype=torch.uint8)


def unpack(payload: torch.Tensor, device: torch.device | str = "cpu") -> dict[str, Any]:
    """:func:`pack`'s state, loaded with ``weights_only=True``."""
    data = io.BytesIO(payload.cpu().numpy().tobytes())
    return torch.load(data, weights_only=True, map_location=device)
