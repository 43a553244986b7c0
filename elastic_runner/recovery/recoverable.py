"""The one interface between a training loop and in-place recovery: :class:`Recoverable`. The
built-in :class:`~elastic_runner.trainer.loop.Trainer` and a script's
:class:`~elastic_runner.own_loop.FaultTolerantLoop` both implement it; the recovery reads the
loop's state, sampler, checkpoints and callbacks through its
:class:`~elastic_runner.train.session.TrainingSession`, so it knows neither loop."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ..dist import DistInfo
    from ..preempt import PreemptionFlag
    from ..train.config import BatchConfig
    from ..train.session import TrainingSession
    from .peer_copies import Copy


@dataclass(frozen=True)
class RecoveryProfile:
    """What a loop's recovery may do, fixed when the loop is built.

    Attributes:
        fingerprint: what the loop built (its task or model, its data); a replacement must
            have built the same.
        batch: the global batch policy a departure or a join must keep (None: the loop's
            micro-batch stays, any world size goes).
        hsdp_replicas: the FSDP replica groups (1: none, or not sharded).
        regroups: whether the loop goes on at another world size in place (nodes leaving and
            joining; else those take torch's restart path).
    """

    fingerprint: str
    batch: BatchConfig | None = None
    hsdp_replicas: int = 1
    regroups: bool = True


class Copies(Protocol):
    """The peer copies as the recovery holds them: ``peer_copies.PeerCopies`` (sharded state
    in a peer's memory too) or its null object ``peer_copies.NoCopies`` (off)."""

    enabled: bool
    own: Copy | None
    held: Copy | None

    def due(self, step: int) -> bool: ...

    def summary(self) -> dict[str, Any]: ...

    def settle(self) -> None: ...

    def drop(self, reason: str) -> None: ...


class RecoveryHooks(Protocol):
    """What a rejoin uses of the process's recovery (``inplace.InPlaceRecovery``): the peer
    copies, a survivor's live state, and torch's restart path."""

    copies: Copies
    live: Live | None

    def ask_restart(self) -> None: ...


class Recoverable(Protocol):
    """What in-place recovery uses of one rank's training loop: its place (``info``), its
    ``session`` (state, sampler, checkpoints, callbacks), its preemption flag, its
    :class:`RecoveryProfile`, ``after_done`` (the last step whose post-step work is done; a
    rejoin sets it), the process's ``recovery``, and two calls that go on in a new group:
    ``group_formed`` (the group exists, ``joining`` its replacements' ranks) and ``rewrap``
    (the model, the step vote and the straggler exchange on it; ``in_sync``: the rejoin left
    every rank's model with the same values, so nothing needs to be broadcast from rank 0;
    every rank passes the same value)."""

    info: DistInfo
    session: TrainingSession
    preempt: PreemptionFlag
    profile: RecoveryProfile
    after_done: int
    recovery: RecoveryHooks

    def group_formed(self, joining: list[int]) -> None: ...

    def rewrap(self, in_sync: bool) -> None: ...


@dataclass
class Live:
    """A survivor's sharded state as a failure left it (committed ``step``, post-step work done
    up to ``after``), on the CPU: under HSDP the replicas of a dead rank's shard hold exactly
    what it held, so the group goes on from here, nothing redone."""

    step: int
    after: int
    world_size: int
    state: dict[str, Any]

    @classmethod
    def of(cls, loop: Recoverable) -> Live | None:
        """``loop``'s state, under HSDP only (``distributed.fsdp.replicas`` > 1)."""
        if loop.profile.hsdp_replicas == 1:
            return None
        session = loop.session
        return cls(session.state.step, loop.after_done, loop.info.world_size,
                   session.checkpoints.local_copy())
