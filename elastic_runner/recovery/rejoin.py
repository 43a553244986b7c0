"""After a process group was re-formed in place: the members agree on the state to go on from
and install it (``rejoin``; step 3-4 of the protocol in :mod:`elastic_runner.recovery.inplace`).

Replicas (DDP): the members furthest along send the state to the replacement and to any member
behind it, each a share of its tensors (:mod:`elastic_runner.recovery.state_transfer`). Sharded state (FSDP2): under HSDP a surviving replica of the dead rank's shard sends
its live state; otherwise every member rolls back to the peer copies
(:mod:`elastic_runner.recovery.peer_copies`); when neither covers every rank, every member loads
the newest checkpoint, still in its process.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..checkpoint.storage import check_compatible
from ..config_base import ConfigError
from .peer_copies import Copy, PeerCopies, hand_over, plan, plan_replicas
from .recoverable import Live, Recoverable
from .state_transfer import Manifest, flatten, recv_state, send_state

log = logging.getLogger(__name__)


@dataclass
class RecoveryReport:
    """One in-place recovery as this rank saw it. ``phases`` (seconds): ``detection`` (the
    failed collective -> the agent named the failed rank), ``teardown`` (old group destroyed),
    ``group`` (new group formed, including waiting for the replacement), ``state`` (progress
    exchanged, state sent to the joiner, DDP re-wrapped), ``first step`` (-> the next committed
    step; filled in by the loop). ``cause``: what started it, for the log line."""

    generation: int
    failed_ranks: list[int]
    step: int
    phases: dict[str, float] = field(default_factory=dict)
    cause: str = "the failure"
    source: int = 0
    received: bool = False
    redone: int = 0  # committed steps rolled back (sharded: to the peer copies' step)
    # the ``state`` phase's parts on this rank, seconds (replicas only: :class:`StateParts`)
    state_parts: dict[str, float] = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return sum(self.phases.values())

    def done(self, step: int) -> str:
        """The log line of the recovery, completed by the commit of ``step``: its phases,
        the state phase's parts and the committed steps redone."""
        return (f"in-place recovery {self.generation} done: step {step} committed "
                f"{self.seconds:.3f} s after {self.cause} ({_seconds(self.phases)})"
                + (f"; the state phase: {_seconds(self.state_parts)}" if self.state_parts
                   else "")
                + (f"; {self.redone} committed step(s) redone" if self.redone else ""))


def _seconds(parts: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.3f} s" for k, v in parts.items())


class StateParts:
    """Where a rank's state phase goes (seconds, by part): ``agree`` (flatten the state, gather
    every member's progress), ``send`` (a source: its share on the wire, until every receiver
    has it), ``manifest`` and ``tensors`` (a receiver: the manifest, then the tensors into place,
    fresh ones allocated for what it lacks), ``install`` (a receiver: loaded into the model and
    the optimizer), ``rewrap`` (the new DDP and its collectives, which wait for the slowest
    member), ``claim`` (rank 0: the fencing token). Each part is the time since the part
    before (``time.perf_counter``)."""

    def __init__(self) -> None:
        self.parts: dict[str, float] = {}
        self._since = time.perf_counter()

    def mark(self, part: str) -> None:
        now = time.perf_counter()
        self.parts[part] = self.parts.get(part, 0.0) + now - self._since
        self._since = now


def wire_device(loop: Recoverable) -> torch.device:
    """Where point-to-point payloads travel: nccl moves device tensors only; gloo host ones."""
    return loop.info.device if dist.get_backend() == "nccl" else torch.device("cpu")


def gather(loop: Recoverable, mine: dict[str, Any]) -> list[dict[str, Any]]:
    """``mine`` (with the task's fingerprint) from every member of the new group.

    Raises:
        ConfigError: the joiner built another task, or for another global batch, than the
            survivors."""
    everyone: list[Any] = [None] * loop.info.world_size
    dist.all_gather_object(everyone, {**mine, "fingerprint": loop.profile.fingerprint,
                                      "global_batch": loop.session.sampler.global_batch_size})
    if len({s["fingerprint"] for s in everyone}) > 1:
        raise ConfigError("the replacement built another task than the survivors: "
                          + "; ".join(f"rank {r}: {s['fingerprint']}"
                                      for r, s in enumerate(everyone)))
    if len({s["global_batch"] for s in everyone}) > 1:
        raise ConfigError("the members built for different global batches (samples): "
                          + "; ".join(f"rank {r}: {s['global_batch']}"
                                      for r, s in enumerate(everyone))
                          + "; set batch.global_batch_size to keep one explicitly")
    return everyone


def fits_model(loop: Recoverable, manifest: Manifest, peer: int) -> None:
    """Refuse a peer's state whose model tensors (names, shapes) do not fit this rank's model,
    before any tensor is received.

    Raises:
        CheckpointError: naming every missing, unexpected and mis-shaped key."""
    model = loop.session.checkpoints.state.get("model")
    if not isinstance(model, torch.nn.Module):
        return
    declared = {m.path[1]: torch.empty(m.shape, device="meta") for m in manifest.metas
                if len(m.path) == 2 and m.path[0] == "model"}
    check_compatible(model.state_dict(), declared, f"rank {peer}'s state")


def from_checkpoint(loop: Recoverable, joining: bool) -> None:
    """Every member loads the newest checkpoint (collective); without one, torch's restart
    path (a rebuilt sharded model holds no trained weights).

    Raises:
        RuntimeError: there is no checkpoint and the state is not held by any member."""
    loaded = loop.session.resume()  # rank 0's choice: the same on every rank
    if not loaded and loop.session.checkpoints.sharded:
        loop.recovery.ask_restart()
        raise RuntimeError("in-place recovery: no peer copy and no checkpoint holds the "
                           "sharded state; restarting every worker")
    loop.after_done = loop.session.state.step
    loop.rewrap(in_sync=loaded)  # nothing loaded: the replicas take rank 0's values
    loop.session.callbacks.on_recovered(loop.session.state.step, joining,
                                           loop.session.sampler.last_step)


def _rejoin_sharded(loop: Recoverable, joining: bool, report: RecoveryReport | None) -> None:
    """:func:`rejoin` under FSDP: every member rolls back to the peer copies' step, a
    replacement with the copy its successor held (``recovery/peer_copies.py``); when the copies
    do not cover every rank, to the newest checkpoint. Collective."""
    rank, world_size = loop.info.rank, loop.info.world_size
    copies, recovery = loop.recovery.copies, loop.recovery
    live, recovery.live = recovery.live, None
    everyone = gather(loop, {**copies.summary(), "joining": joining,
                                 "live": None if live is None else
                                 [live.step, live.after, live.world_size]})
    replicas = plan_replicas(everyone, loop.profile.hsdp_replicas)
    if replicas is not None:
        _from_replicas(loop, live, *replicas, joining, report)
        return
    chosen = plan(everyone)
    if isinstance(chosen, str):
        log.warning("in-place recovery under FSDP: %s; every rank loads the newest checkpoint",
                    chosen)
        from_checkpoint(loop, joining)
        if report is not None:
            report.redone = max(report.step - loop.session.state.step, 0)
        return
    step, sources = chosen
    wire = wire_device(loop)
    received = hand_over(lambda: copies.held,  # type: ignore[union-attr,return-value]
                         sources, rank, wire)
    if received is not None:  # plan() saw copies on every rank
        copies.adopt(received)  # type: ignore[union-attr]
    own = copies.own
    assert own is not None
    holder = sources.get(rank, rank)
    # the goodput account too: the undone steps must not stay productive (observe/goodput.py)
    loop.session.checkpoints.load_local_copy(
        own.state(), f"rank {holder}'s copy of rank {rank}'s state (step {step})")
    copies.reshare(rank, world_size, wire)  # type: ignore[union-attr]
    loop.after_done = step
    if report is not None:
        report.source, report.received = holder, received is not None
        report.redone = max(report.step - step, 0)
    loop.rewrap(in_sync=True)
    loop.session.callbacks.on_recovered(step, joining, loop.session.sampler.last_step)
    log.info("rank %d %s step %d (peer copies; replacements %s)", rank,
             "received the state of" if received is not None else "rolled back to", step,
             sorted(sources) or "none")


def _from_replicas(loop: Recoverable, live: Live | None, step: int, after: int,
                   sources: dict[int, int], joining: bool, report: RecoveryReport | None) -> None:
    """HSDP: each replacement gets the live state of a surviving replica of its shard, every
    survivor reloads its own; nothing is redone. The peer copies are refreshed at once (the
    replacement has none)."""
    rank, world_size, wire = loop.info.rank, loop.info.world_size, wire_device(loop)
    received = hand_over(lambda: Copy.of(live.state, step, world_size),  # type: ignore[union-attr]
                         sources, rank, wire)
    if received is not None:
        state = received.state()
    else:
        assert live is not None  # plan_replicas() saw every survivor's live state
        state = live.state
    holder = sources.get(rank, rank)
    # a survivor's own goodput account, as the failure left it: the time since is recovery
    loop.session.checkpoints.load_local_copy(state, f"rank {holder}'s state of step {step} (HSDP "
                                        "replica)")
    copies = loop.recovery.copies
    if isinstance(copies, PeerCopies):
        copies.refresh(loop.session.checkpoints.local_copy(to_cpu=False), step, rank,
                       world_size, wire)
    loop.after_done = after
    if report is not None:
        report.source, report.received = holder, rank in sources
    loop.rewrap(in_sync=True)
    loop.session.callbacks.on_recovered(step, joining, loop.session.sampler.last_step)
    log.info("rank %d %s step %d; replacement(s) %s received theirs from replica(s) %s", rank,
             "received the state of" if rank in sources else "goes on at", step, sorted(sources),
             [sources[r] for r in sorted(sources)])


def rejoin(loop: Recoverable, joining: bool, report: RecoveryReport | None = None) -> None:
    """All members of a new group (the survivors and the joiner) agree on the state to go on
    from and install it (module docstring, step 3-4); then the group's rank 0 claims the
    checkpoint directory's next fencing token, at once rather than at its first save, so that
    a group that a newer one replaced while it was frozen stops here. Collective.

    Raises:
        ConfigError: the joiner built another task than the survivors (fingerprints differ).
        FencedOut: (rank 0) another job claimed the checkpoint directory since this one did
            (``checkpoint/fencing.py``).
    """
    parts = StateParts()
    if loop.session.checkpoints.sharded:
        _rejoin_sharded(loop, joining, report)
        loop.session.checkpoints.claim()
        return
    sources = _rejoin_replicated(loop, joining, report, parts)
    loop.session.checkpoints.claim()
    parts.mark("claim")
    if report is not None:
        report.state_parts = parts.parts
    elif sources:  # a joiner: the survivors' report holds no part of its own
        log.warning("in-place recovery: rank %d took the state of step %d from rank(s) %s: "
                    "the state phase: %s", loop.info.rank, loop.session.state.step, sources,
                    _seconds(parts.parts))


def _rejoin_replicated(loop: Recoverable, joining: bool, report: RecoveryReport | None,
                       parts: StateParts) -> list[int]:
    """:func:`rejoin` of replicas (DDP): the members furthest along send the state. Returns
    the ranks this one received it from (none: it sent, or went on with its own)."""
    rank, checkpoints = loop.info.rank, loop.session.checkpoints
    state = checkpoints.state_dict()
    flat = flatten(state)
    everyone = gather(loop, {"step": loop.session.state.step, "after": loop.after_done,
                             "joining": joining, "layout": flat[0].digest()})
    parts.mark("agree")
    candidates = [r for r, s in enumerate(everyone) if not s["joining"]]
    if not candidates:  # every member is a replacement: the checkpoint is the fallback
        log.warning("in-place recovery: no survivor holds the state; resuming from the newest "
                    "checkpoint")
        from_checkpoint(loop, joining)
        return []
    src = max(candidates, key=lambda r: (everyone[r]["step"], everyone[r]["after"], -r))
    best = everyone[src]
    # every survivor at the newest step with the same tensors sends a share (state_transfer)
    sources = [src, *(r for r in candidates if r != src and everyone[r]["layout"] ==
                      best["layout"] and (everyone[r]["step"], everyone[r]["after"]) ==
                      (best["step"], best["after"]))]
    receivers = [r for r in range(len(everyone)) if r not in sources]
    wire = wire_device(loop)
    if rank in sources and receivers:
        send_state(flat, receivers, sources, rank, wire)
        parts.mark("send")
    elif rank in receivers:
        # a replacement receives into its own tensors; a survivor behind into new ones: a
        # transfer cut short must not leave it holding half of another step's state
        def check(manifest: Manifest) -> None:
            parts.mark("manifest")
            fits_model(loop, manifest, src)

        raw = recv_state(state if joining else None, sources, wire, check=check,
                         device=loop.info.device)
        parts.mark("tensors")
        checkpoints.load_from_peer(raw, src)
        parts.mark("install")
    loop.after_done = best["after"]
    if report is not None:
        report.source, report.received = src, rank in receivers
    loop.rewrap(in_sync=True)
    parts.mark("rewrap")
    loop.session.callbacks.on_recovered(loop.session.state.step, joining,
                                           loop.session.sampler.last_step)
    log.info("rank %d %s step %d from rank(s) %s", rank,
             "received the state of" if rank in receivers else "goes on at", best["step"],
             sources)
    return sources if rank in receivers else []
