"""Recovery after a failed collective (steps 1 and 3-4 of the protocol in
:mod:`elastic_runner.recovery.inplace`): wait for the agents to announce the next generation,
leave the failed group, and re-form it in place (or go on shrunk until the replacement is
ready, or regroup sharded state); a departure or join announced meanwhile is followed
(:mod:`elastic_runner.recovery.node_changes`)."""

from __future__ import annotations

import logging
import time
from typing import NoReturn

import torch
import torch.distributed as dist

from ..dist import is_peer_failure, release_groups_of
from ..logs import first_line
from ..protocol.announcement import Announcement
from .group_formation import GroupFormation
from .group_sockets import GroupSockets
from .node_changes import NodeChanges, commit_before_regroup
from .outcomes import Regroup
from .recoverable import Live, Recoverable
from .rejoin import RecoveryReport, rejoin
from .signals import AgentSignals

# the worker's recovery log lines keep the logger name they always had (bench and operators
# read them by it)
log = logging.getLogger("elastic_runner.recovery.inplace")

OWN_ERROR_GRACE_S = 1.0
"""Seconds a rank whose step failed with its own error (not a peer's death) waits for an
announcement that a peer died before it leaves to be replaced: a rank that raised used to wait
``recovery.detect_timeout_seconds`` (10 s) for a replacement of itself that only its exit
brings."""


class FailureRecovery:
    """This worker's recovery after a collective failed.

    Args:
        formation: this worker's generation and group; ``nodes``: departures and joins
            announced meanwhile; ``signals``: torch's restart path; ``sockets``: the failed
            group's connections (cut when it is left).
    """

    def __init__(self, formation: GroupFormation, nodes: NodeChanges, signals: AgentSignals,
                 sockets: GroupSockets) -> None:
        self.formation, self.nodes, self.signals = formation, nodes, signals
        self.sockets = sockets
        self.grow_generation: int | None = None  # shrunk: the generation with every rank back
        self.home: tuple[int, int] | None = None  # (rank, world size) at full size
        self.live: Live | None = None  # HSDP: this survivor's state as the failure left it

    def recover(self, error: BaseException, loop: Recoverable) -> RecoveryReport | None:
        """After ``error`` in a collective: re-form the group without leaving the process.

        Returns:
            The report, or None when the agent named no failed peer within
            ``detect_timeout_s`` (the caller re-raises ``error``).

        Raises:
            Regroup: this rank goes on in another group (shrunk, sharded state, or a node
                left or joined).
            Preempted, FencedOut: this rank's node left or was declared lost.
        """
        t0 = time.perf_counter()
        # this rank's own error (not a peer's death): its agent replaces it, unless a peer's
        # death that caused it is announced at once; a peer's: wait for the agents to name it
        own = not is_peer_failure(error)
        try:
            announced = self.formation.next_announcement(OWN_ERROR_GRACE_S if own else None)
        except (RuntimeError, dist.DistError):  # the store is gone, and nobody moved it
            return None
        if announced is None:
            if own:
                return None
            log.error("collective failed and no peer died within %.0f s "
                      "(recovery.detect_timeout_seconds): %s; restarting every worker",
                      self.formation.detect_timeout_s, first_line(error))
            self.signals.ask_restart()
            return None
        if announced.restart:  # an agent restarts every worker
            return None
        if announced.is_departure:  # a node left: the group goes on without it
            self.nodes.follow_departure(announced, loop, t0)
        if announced.is_join:  # a node joined (this rank's vote was cut short)
            self.nodes.follow_join(announced, loop, t0)
        return self._replace_failed(error, announced, loop, t0)

    def _replace_failed(self, error: BaseException, announced: Announcement,
                        loop: Recoverable, t0: float) -> RecoveryReport:
        """Rank(s) ``announced.failed`` died: leave the failed group and form the announced
        one (the replacements join it), or regroup.

        Raises:
            Regroup: continue shrunk, or sharded state.
        """
        report = RecoveryReport(self.formation.generation + 1, announced.failed_ranks,
                                loop.session.state.step)
        log.warning("in-place recovery: rank(s) %s died (%s); generation %d, the rest keep "
                    "their process", announced.failed_ranks, first_line(error),
                    report.generation)
        loop.session.callbacks.on_phase("recovering", "in-place recovery", True)
        t1 = time.perf_counter()
        report.phases["detection"] = t1 - t0
        self._leave_group(loop)
        t2 = time.perf_counter()
        report.phases["teardown"] = t2 - t1
        members = None if announced.members is None else list(announced.members)
        if members is not None:  # continue shrunk: no warm spare, go on without it
            self._shrink(loop, members, report)
        if loop.session.checkpoints.sharded:  # FSDP2 cannot move a module's shards
            raise Regroup(loop.info.rank, loop.info.world_size, report.generation, report)
        self.formation.form_group(loop.info.rank, loop.info.world_size, report.generation)
        report.generation = self.formation.generation  # a later one if the replacement died too
        loop.group_formed(announced.failed_ranks)
        t3 = time.perf_counter()
        report.phases["group"] = t3 - t2
        try:
            rejoin(loop, joining=False, report=report)
        except (RuntimeError, dist.DistError) as e:
            if not is_peer_failure(e):
                raise
            # a member (the replacement, another survivor) died after the group formed, while
            # it agreed on the state: nothing was installed yet, so this is one more failure
            return self.recover(e, loop)
        report.phases["state"] = time.perf_counter() - t3
        return report

    def _shrink(self, loop: Recoverable, members: list[int], report: RecoveryReport
                ) -> NoReturn:
        """No warm spare: go on among ``members`` until the replacement is ready
        (:meth:`regroup_due`).

        Raises:
            Regroup: always, as this rank's number among the members.
        """
        rank = loop.info.rank
        self.home = self.home or (rank, loop.info.world_size)
        self.grow_generation = report.generation + 1
        log.warning("continuing at world size %d until the replacement is ready", len(members))
        raise Regroup(members.index(rank), len(members), report.generation, report)

    def _leave_group(self, loop: Recoverable) -> None:
        """Destroy the failed group. Its connections are cut first, so peers that wait on this
        rank in its collective fail now, as if it had died, instead of at the collective timeout
        (gloo cannot abort: recovery/group_sockets.py). Sharded state: the save in flight
        (which failed with the peer) is abandoned, and under HSDP the live state kept."""
        self.sockets.cut()
        checkpoints = loop.session.checkpoints
        if checkpoints.sharded:
            checkpoints.abandon()
            self.live = Live.of(loop)
            release_groups_of(checkpoints.state["model"])  # freed now, not at exit
        dist.destroy_process_group()

    def regroup_due(self, loop: Recoverable) -> None:
        """At a step boundary while shrunk: when the replacement is ready (the agent announced
        the full generation; rank 0 looks, one all-reduce tells everyone), every rank leaves
        together.

        Raises:
            Regroup: to the full world size, this process's original rank.
        """
        if self.grow_generation is None:
            return
        ready = (loop.info.rank == 0
                 and self.formation.client.attempt.announced(self.grow_generation))
        flag = torch.tensor([1.0 if ready else 0.0], device=loop.info.device
                            if self.formation.backend == "nccl" else torch.device("cpu"))
        dist.all_reduce(flag)
        if flag.item() == 0:
            return
        generation, self.grow_generation = self.grow_generation, None
        commit_before_regroup(loop)
        rank, world_size = self.home or (loop.info.rank, loop.info.world_size)
        log.warning("the replacement is ready: back to world size %d after step %d",
                    world_size, loop.session.state.step)
        raise Regroup(rank, world_size, generation)
