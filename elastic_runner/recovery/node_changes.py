"""Whole nodes leaving and joining at a step boundary, the workers' side (the store's records
are :mod:`elastic_runner.recovery.membership`'s): at the boundary where the step vote said stop,
the preempted nodes' ranks leave and the others re-form the group without them, or the nodes
that asked to join are taken in; a rank whose collective was cut short by such a change follows
its announcement. Every change ends in
:class:`~elastic_runner.recovery.outcomes.Regroup` (the worker re-forms the group at the new
size), :class:`~elastic_runner.preempt.Preempted` (this node leaves) or
:class:`~elastic_runner.recovery.outcomes.StepRedo` (nothing changed)."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, NoReturn

import torch.distributed as dist

from ..checkpoint.fencing import FencedOut
from ..dist import release_groups_of
from ..preempt import Preempted
from ..protocol.announcement import Announcement
from .group_formation import GroupFormation
from .group_sockets import GroupSockets
from .membership import (
    Policy,
    View,
    announce_departure,
    announce_join,
    answered_joins,
    pending_joins,
    read_global_batch,
    read_view,
    record_global_batch,
    refuse_joins,
)
from .outcomes import Regroup, StepRedo
from .recoverable import Recoverable
from .rejoin import RecoveryReport
from .store_client import StoreClient

# the worker's recovery log lines keep the logger name they always had (bench and operators
# read them by it)
log = logging.getLogger("elastic_runner.recovery.inplace")


def commit_before_regroup(loop: Recoverable) -> None:
    """Sharded state at a step boundary where the world size changes: no peer copy fits the
    new shards, so every rank commits the step first (collective, the old group); the new
    group loads it (DCP reshards) and redoes nothing."""
    checkpoints = loop.session.checkpoints
    if checkpoints.sharded:
        step = loop.session.state.step
        checkpoints.save(step)
        checkpoints.wait()
        # copies of an earlier step, taken at the new world size before a shrink, would fit
        # the new group and roll it back past this checkpoint
        loop.recovery.copies.drop(f"the peer copies predate step {step}, committed before "
                                  "the group changed size")


class NodeChanges:
    """Departures and joins of whole nodes, at step boundaries.

    Args:
        client: the recovery store; ``formation``: this worker's generation.
        sockets: the current group's connections (cut when this rank leaves the group).
        node: this worker's node rank (torchrun's ``GROUP_RANK``; it stays when ranks are
            renumbered).
        min_nodes: ``--nnodes`` MIN: a departure may not leave fewer nodes.
    """

    def __init__(self, client: StoreClient, formation: GroupFormation, sockets: GroupSockets,
                 node: int, min_nodes: int) -> None:
        self.client, self.formation, self.sockets = client, formation, sockets
        self.node, self.min_nodes = node, min_nodes
        self.join_waiting = False  # a node asks to join (GenerationWatch's last look)

    def bind(self, loop: Recoverable) -> None:
        """A join request stops ``loop`` at the next step boundary (the step vote,
        :attr:`~elastic_runner.preempt.PreemptionFlag.membership`), and rank 0 records the
        global batch and tells the agents that nodes may join in place (if the loop can
        regroup). A store that is gone is ignored."""
        self.join_waiting = False
        loop.preempt.membership = lambda: self.join_waiting
        if loop.info.rank == 0:
            with contextlib.suppress(RuntimeError, dist.DistError):
                record_global_batch(self.client.attempt,
                                    loop.session.sampler.global_batch_size)
                if self.client.multi_node and loop.profile.regroups:
                    self.client.attempt.allow_joins_in_place()

    def job_global_batch(self) -> int | None:
        """The global batch (samples) the group's rank 0 recorded: what a joiner builds for
        (None: not recorded, or the store is gone)."""
        with contextlib.suppress(RuntimeError, dist.DistError):
            return read_global_batch(self.client.attempt)
        return None

    def policy(self, loop: Recoverable) -> Policy:
        """The departure policy: ``--nnodes`` MIN, and a world size the global batch fits."""
        return Policy.for_batch(self.min_nodes, loop.profile.batch)

    # ------------------------------------------------------------ at the step boundary

    def leave(self, loop: Recoverable) -> None:
        """At the step boundary where the vote said stop: if whole nodes were asked to stop and
        the rest may go on (:meth:`policy`), those nodes' ranks leave and the others re-form
        the group without them, from their own state; if no rank was asked to stop, the nodes
        that asked to join are taken in (:meth:`take_in`). Returns when every rank stops
        instead (one node, every node preempted, or the policy refuses). Collective (the old
        group).

        Raises:
            Regroup: this rank stays, renumbered (or the same rank in a larger group).
            Preempted: this rank's node leaves; the others go on.
            StepRedo: a join request was refused; the group stays as it is.
        """
        if not self.client.multi_node:
            return
        # each rank's node from the view, the one record every process reads the same way;
        # read before the all-gather: the announcer (members[0]) writes the next view once its
        # all-gather returns, which a slower rank's could not have yet (seen: a joined rank
        # read the announced view, which no longer held its node)
        view = read_view(self.client.attempt)
        everyone: list[Any] = [None] * loop.info.world_size
        dist.all_gather_object(everyone, loop.preempt.requested)
        leaving = sorted({view.node_of(r) for r, asked in enumerate(everyone) if asked})
        if not leaving:  # the vote stopped for a node that asks to join
            self.take_in(loop)
        _, members = view.without(leaving, view.generation)
        why = self.policy(loop).refuses(view, leaving) if members else "every node"
        if why is not None:
            if loop.info.rank == 0 and members:
                log.warning("membership: node(s) %s preempted, but the rest may not go on (%s): "
                            "every node stops", leaving, why)
            return
        generation, store = self._announce_departure(loop, view, leaving, members[0])
        if generation == 0:  # another process announced these departures: not expected
            return
        self._depart(loop, members, len(everyone), leaving, generation, store)

    def _depart(self, loop: Recoverable, members: list[int], old_size: int,
                leaving: list[int], generation: int, store: str) -> NoReturn:
        """The departure of ``leaving`` was announced as ``generation``: this rank leaves with
        its node, or goes on renumbered among ``members`` (in the store at ``store`` if that
        moved).

        Raises:
            Preempted: this rank is not a member.
            Regroup: this rank's number among the members.
        """
        commit_before_regroup(loop)
        step = loop.session.state.step
        self._changed(loop, "preempted")
        if loop.info.rank not in members:
            dist.destroy_process_group()
            raise Preempted(f"node {self.node} preempted: it left the job after step {step}; "
                            f"the others go on at world size {len(members)} (generation "
                            f"{generation})")
        if store:  # this node's host left: the group forms in the store that took over
            self.client.switch(store)
        log.warning("membership: node(s) %s preempted after step %d; generation %d goes on at "
                    "world size %d, this rank %d -> %d", leaving, step, generation,
                    len(members), loop.info.rank, members.index(loop.info.rank))
        report = RecoveryReport(generation, [r for r in range(old_size) if r not in members],
                                step, cause="the step boundary of the departure")
        self._regroup(loop, members.index(loop.info.rank), len(members), generation,
                      report)

    def _announce_departure(self, loop: Recoverable, view: View, leaving: list[int],
                            announcer: int) -> tuple[int, str]:
        """Rank ``announcer`` (the lowest remaining) announces the departure of the nodes
        ``leaving`` (:func:`~elastic_runner.recovery.membership.announce_departure`: with etcd, the
        successor's store is seeded first when the store's host leaves) and broadcasts the
        generation and, if the store moved, its new ``host:port`` over the old group.
        Collective. Returns ``(generation, endpoint)``; ``(0, "")``: another process had
        announced it already."""
        announced: list[Any] = [0, ""]
        if loop.info.rank == announcer:
            done = announce_departure(self.client.attempt, view, leaving,
                                      "preempted", self.client.client)
            if done is not None:
                generation, new, _ = done
                moved = new.store_node != view.store_node
                announced = [generation, new.stores[new.store_node] if moved else ""]
        dist.broadcast_object_list(announced, src=announcer)
        return announced[0], announced[1]

    def take_in(self, loop: Recoverable) -> NoReturn:
        """At the step boundary a join request asked for: rank 0 answers the pending requests
        (the generation with the nodes' ranks after the members', or a refusal when the global
        batch does not divide the new world size) and tells the others. Collective (the old
        group).

        Raises:
            Regroup: the same rank in the larger group.
            StepRedo: nothing joins; the discarded step is redone.
        """
        decided: list[Any] = [0, loop.info.world_size, []]
        if loop.info.rank == 0:
            decided = self._answer_joins(loop)
        dist.broadcast_object_list(decided, src=0)
        self.join_waiting = False
        generation, world_size, nodes = decided
        if generation == 0:
            raise StepRedo("no node joins")
        step = loop.session.state.step
        commit_before_regroup(loop)
        self._changed(loop, "joined")
        if loop.info.rank == 0:
            log.warning("membership: node(s) %s join after step %d; generation %d goes on at "
                        "world size %d", nodes, step, generation, world_size)
        report = RecoveryReport(generation, [], step, cause="the step boundary of the join")
        self._regroup(loop, loop.info.rank, world_size, generation, report)

    def _answer_joins(self, loop: Recoverable) -> list[Any]:
        """Rank 0: ``[generation, world size, joining nodes]`` (generation 0: none join)."""
        keys = self.client.attempt
        requests = pending_joins(keys, answered_joins(keys))
        joining = {r["node"]: r["nproc"] for r in requests.values()}
        view = read_view(keys)
        world_size = view.world_size + sum(joining.values())
        if not joining:
            return [0, loop.info.world_size, []]
        if not self.policy(loop).fits(world_size):
            why = (f"batch.global_batch_size cannot be split at world size {world_size} "
                   f"(nodes {sorted(joining)} asked to join)")
            log.error("membership: %s: they stay out", why)
            refuse_joins(keys, requests, why)
            return [0, loop.info.world_size, []]
        generation, new = announce_join(keys, view, joining, max(requests),
                                        {r["node"]: r["store"] for r in requests.values()
                                         if r.get("store")})
        return [generation, new.world_size, sorted(joining)]

    # ------------------------------------------------------------ a collective cut short

    def follow_departure(self, announced: Announcement, loop: Recoverable, t0: float
                         ) -> NoReturn:
        """Node(s) left: lost (an agent announced it: no heartbeat), or preempted (the lowest
        remaining rank announced it at a step boundary, while this rank's collective was cut
        short). This node's workers, if it is one of them, leave: as preempted, or fenced out
        when it was declared lost (a healed partition); the others go on without it. ``t0``:
        when the failure was seen (``time.perf_counter``).

        Raises:
            Preempted: this node was preempted and left (its other ranks left in
                :meth:`leave`; this one was still in the departure's collective when its
                generation watch saw the announcement: the membership soak's fault 83).
            FencedOut: this node was declared lost.
            Regroup: as this rank's new number in the smaller group.
        """
        generation = self.formation.generation + 1
        departed, members = announced.departed or (), list(announced.members or ())
        if announced.store and self.node not in departed:
            self.client.switch(announced.store)
        if self.node in departed and announced.reason == "preempted":
            raise Preempted(f"node {self.node} preempted: it left the job after step "
                            f"{loop.session.state.step}; the others go on at world size "
                            f"{announced.world_size} (generation {generation})")
        if self.node in departed:
            raise FencedOut(f"node {self.node} was declared lost in generation {generation} "
                            f"({announced.reason}: no heartbeat within "
                            "recovery.node_timeout_seconds); the group went on without it and "
                            "this node commits nothing")
        report = RecoveryReport(generation, announced.failed_ranks, loop.session.state.step)
        report.phases["detection"] = time.perf_counter() - t0
        log.warning("membership: node(s) %s %s (ranks %s); generation %d goes on at world "
                    "size %d, this rank %d -> %d", list(departed), announced.reason,
                    announced.failed_ranks, generation, announced.world_size, loop.info.rank,
                    members.index(loop.info.rank))
        loop.session.callbacks.on_phase("recovering", "membership change", True)
        self._changed(loop, announced.reason)
        self._regroup(loop, members.index(loop.info.rank), len(members), generation,
                      report)

    def follow_join(self, announced: Announcement, loop: Recoverable, t0: float
                    ) -> NoReturn:
        """Rank 0 announced that node(s) join while this rank's collective was cut short:
        go on as the same rank in the larger group. ``t0``: when the failure was seen
        (``time.perf_counter``).

        Raises:
            Regroup: always.
        """
        generation = self.formation.generation + 1
        report = RecoveryReport(generation, [], loop.session.state.step,
                                cause="the step boundary of the join")
        report.phases["detection"] = time.perf_counter() - t0
        loop.session.callbacks.on_phase("recovering", "membership change", True)
        self._changed(loop, "joined")
        self._regroup(loop, loop.info.rank, announced.world_size, generation, report)

    def _changed(self, loop: Recoverable, reason: str) -> None:
        loop.session.callbacks.on_membership_change(reason)

    def _regroup(self, loop: Recoverable, rank: int, world_size: int, generation: int,
                 report: RecoveryReport) -> NoReturn:
        """Leave the old group (its connections cut, so no peer waits on this rank) and
        re-form it as ``rank`` of ``world_size`` in ``generation``.

        Raises:
            Regroup: always.
        """
        self.join_waiting = False
        self.sockets.cut()
        release_groups_of(loop.session.checkpoints.state["model"])  # freed now, not at exit
        dist.destroy_process_group()
        raise Regroup(rank, world_size, generation, report)
