"""The ``recovery`` section of a config file."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, StrictBool, StrictInt, model_validator

from ..config_base import Float, Section, invalid


class RecoveryConfig(Section):
    """What happens when a worker dies (see ``docs/design/recovery.md``).

    ``in_place`` (``elastic-runner run``, on one node or several): the surviving workers on
    every node keep their process, leave the step in flight, re-form the process group with a
    replacement that the failed worker's agent takes from its node's warm spare, and send it
    their state; a failure with no survivor on its node, a lost node, an unreachable recovery
    store or plain torchrun fall back to ``restart``: torchrun's agents stop every worker and
    start new ones, which resume from the newest checkpoint. Under FSDP no survivor holds a dead
    rank's shards: the group rolls back to peer copies (``peer_copy_every_steps``) or the newest
    checkpoint, still in place."""

    mode: Literal["in_place", "restart"] = "in_place"
    spare: StrictBool = True
    """Keep warm replacements per node (imported, task built): `spares` of them."""
    spares: StrictInt = Field(1, ge=1)
    """Warm spares per node with `spare` on: failures that come close together (a node losing
    several GPUs) each find one ready. They start one at a time; after a replacement the next
    starts at once at a lower CPU priority where the agent may restore it (root), else once
    that recovery's first step is committed."""
    spare_delay_seconds: Float = Field(10.0, ge=0)
    """Start it this long after the workers built the task: a short job never pays for one (a
    failure before gets a cold start). Once it replaced a worker, the next one starts when that
    recovery's first step is committed (its build would take the CPU from the recovery), or
    this long after, at least 30 s, at the latest."""
    detect_timeout_seconds: Float = Field(10.0, gt=0)
    """A rank whose collective failed waits this long for its agent to name a failed peer; then the
    error is a failure as before."""
    join_timeout_seconds: Float = Field(120.0, gt=0)
    """Re-forming the group with the replacement (covers a spare that is still starting)."""
    continue_shrunk: StrictBool = False
    """No warm spare at hand: the survivors go on at the smaller world size at once (needs
    batch.global_batch_size) and the replacement joins at a later step boundary; off: they wait
    for it (bitwise replay needs the world size) (one node only; across nodes the survivors wait
    for the replacement)."""
    peer_copy_every_steps: StrictInt = Field(10, ge=0)
    """Sharded state (``distributed.strategy: fsdp``): every this many steps each rank copies its
    shards and the rest of its state to host memory and sends it to the next rank in the
    background (recovery/peer_copies.py; host memory: four times the rank's shard state); a
    recovery in place rolls back to the copies' step and redoes the steps after it. 0: no
    copies; every rank loads the newest checkpoint in place instead."""
    heartbeat_timeout_seconds: Float | None = Field(10.0, gt=0)
    """The agent kills and replaces a worker whose heartbeat thread is silent this long (SIGSTOP, a
    frozen process); keep it below watchdog.hang_timeout_seconds, whose expiry restarts every
    worker; None: off."""
    node_timeout_seconds: Float | None = Field(5.0, gt=0)
    """Several nodes: a node whose agent's heartbeat in the recovery store is silent this long
    (killed, partitioned) is lost, and the others go on without it in place (recovery/membership.py);
    below detect_timeout_seconds, which the survivors wait for that; None: a lost node restarts
    every worker."""

    @model_validator(mode="after")
    def _lost_before_given_up(self) -> RecoveryConfig:
        if (self.node_timeout_seconds is not None
                and self.node_timeout_seconds >= self.detect_timeout_seconds):
            raise invalid(f"must be below recovery.detect_timeout_seconds "
                          f"({self.detect_timeout_seconds:g}): the survivors of a lost node "
                          "wait that long for the generation without it",
                          "node_timeout_seconds")
        return self
