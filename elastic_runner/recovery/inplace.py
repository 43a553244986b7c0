"""In-place recovery, the workers' side: survivors keep their process when a peer dies.

Under ``elastic-runner run`` (``recovery.mode: in_place``) every agent
(:mod:`elastic_runner.agent.inplace_agent`) names the job's **recovery store** in :data:`~elastic_runner.recovery.protocol.ENV`: a
TCPStore in the agent on one node; across nodes the c10d rendezvous store, or with etcd a
TCPStore in an agent that moves when its node leaves (:mod:`elastic_runner.recovery.store`). The process group of *generation* ``g`` lives under
``<prefix>/pg/<g>/`` of that store (a ``PrefixStore``, as
:func:`~elastic_runner.dist.attempt_namespace` namespaces restarted groups), so a re-formed group
never reads a dead member's keys, and the store outlives every worker (the workers' own rank-0
store would die with rank 0).

Protocol (sequence diagram in ``docs/design/recovery.md``):

1. A peer dies; a survivor's next collective fails (gloo: "Connection closed by peer").
   :meth:`InPlaceRecovery.recover` waits up to ``recovery.detect_timeout_seconds`` for an agent
   (the dead worker's, on whichever node) to publish generation ``g+1`` (``<prefix>/gen/<g+1>``:
   the failed ranks; generations are numbered by one counter in the store, ``<prefix>/
   generations``). When a collective failed and no worker died (a timeout, a lost node whose
   agent cannot announce), the worker sets ``<prefix>/restart`` (so no agent replaces anyone
   in place any more) and re-raises: torchrun restarts everyone; so it does once an agent took
   torch's restart path and set that key. This rank's own error (not a collective's) is
   re-raised as it is: its agent replaces this rank in place.
2. The agent hands the failed rank to its warm spare (a process that has imported torch and
   built the task's data and model, waiting for ``<prefix>/spare/<n>/assign``).
3. Survivors destroy the old group; all members create group ``g+1`` (same ranks, same world
   size). :func:`~elastic_runner.recovery.rejoin.rejoin` all-gathers each member's progress
   (committed step, whether that step's evaluation/checkpoint is done) and task fingerprint;
   the member furthest along is the source. It sends its checkpoint state (model, optimizer,
   scheduler, sampler cursor, step counters, stop policy, RNG) to the joiner and to any member
   behind it, as ``torch.save`` bytes over the group (``torch.load(weights_only=True)`` on the
   receiver). No checkpoint is read.
4. Everyone wraps the model in a new DDP on the new group, the trainer re-creates its data
   iterator from the sampler cursor and trains on. The step in flight was applied by nobody (its
   gradient all-reduce failed, or its update vote never completed), its samples stay
   unconsumed, and each step reseeds its RNG streams from ``(seed, epoch, step, rank)``: the run
   goes on bitwise as if nothing happened.

Sharded state (FSDP2) differs in steps 3-4: no survivor holds a dead rank's shards, and a sharded
module cannot move to a new group. Each survivor leaves through :class:`Regroup` at its own rank,
shards a new module on the new group, and the members roll back to the peer copies (or take a
surviving HSDP replica's live state): :mod:`elastic_runner.recovery.rejoin`.

A process started without :data:`~elastic_runner.recovery.protocol.ENV` (plain torchrun, ``recovery.mode: restart``, a user's own
script) gets :class:`NoRecovery`: errors propagate and torchrun restarts everyone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from ..checkpoint.fencing import FencedOut
from ..dist import is_peer_failure, release_groups_of
from ..logs import first_line
from ..preempt import Preempted
from .group_sockets import GroupSockets, NoSockets
from .membership import (
    THREAD_STORE_TIMEOUT_S,
    Policy,
    View,
    announce_departure,
    announce_join,
    answered_joins,
    joins_waiting,
    pending_joins,
    raise_counter,
    read_global_batch,
    read_view,
    record_global_batch,
    refuse_joins,
)
from .peer_copies import NoCopies, PeerCopies
from .protocol import ENV, GENERATION_ENV, HEARTBEAT_ENV, MIN_NODES_ENV, AttemptKeys
from .rejoin import Live, Recoverable, RecoveryReport, rejoin, wire_device
from .store import StoreLocation, connect, told

log = logging.getLogger(__name__)

OWN_ERROR_GRACE_S = 1.0
"""Seconds a rank whose step failed with its own error (not a peer's death) waits for an
announcement that a peer died before it leaves to be replaced: a rank that raised used to wait
``recovery.detect_timeout_seconds`` (10 s) for a replacement of itself that only its exit
brings."""

_POLL_S = 0.005
_SPARE_POLL_S = 0.01  # a spare's look for its assignment (seconds)


class Regroup(Exception):  # noqa: N818 - control flow: the worker rebuilds its trainer
    """Continue shrunk (``recovery.continue_shrunk``): this process goes on as ``rank`` of
    ``world_size`` in generation ``generation`` (fewer ranks after a failure, all of them again
    once the replacement is ready); the worker rebuilds its trainer for that world size in
    place (``worker.regroup``)."""

    def __init__(self, rank: int, world_size: int, generation: int,
                 report: RecoveryReport | None = None) -> None:
        super().__init__(f"regroup as rank {rank} of {world_size} (generation {generation})")
        self.rank, self.world_size, self.generation = rank, world_size, generation
        self.report = report


class JobFinished(Exception):  # noqa: N818 - the process's normal end
    """The job's training finished while this process waited to join a group (a replacement
    that was ready after the last step): nothing is left to do, the process exits 0."""


class StepRedo(Exception):  # noqa: N818 - control flow: the loop redoes the step
    """Every rank stopped at a step boundary for a membership change that did not happen (a
    join request refused, or already answered): the discarded step is redone in the same
    group."""


class NoRecovery:
    """Recovery off (plain torchrun, ``recovery.mode: restart``): every error propagates."""

    active = False
    generation = 0
    backend = ""
    sockets = NoSockets()
    copies = NoCopies()
    live: Live | None = None

    def copy_due(self, step: int) -> bool:
        return False

    def job_global_batch(self) -> int | None:
        return None

    def keep_copy(self, trainer: Recoverable) -> None:
        pass

    def announce_built(self, rank: int) -> None:
        pass

    def announce_finished(self, rank: int) -> None:
        pass

    def recover(self, error: BaseException, trainer: Recoverable) -> RecoveryReport | None:
        return None

    def regroup_due(self, trainer: Recoverable) -> None:
        pass

    def leave(self, trainer: Recoverable) -> None:
        pass

    def bind(self, trainer: Recoverable) -> None:
        pass

    def watch(self) -> NoWatch:
        return NoWatch()


class NoWatch:
    """No generation watch (one node: a dead peer's connections reset on their own)."""

    def close(self) -> None:
        pass


class InPlaceRecovery:
    """This worker's side of the protocol in the module docstring.

    Args:
        store: the job's recovery store; ``prefix``: this attempt's keys in it;
            ``location``: where it is (for log lines).
        generation: the group this process (first) joins: 0 at the attempt's start, the
            announced one for a replacement.
        detect_timeout_s: how long a failed collective waits for the agent's announcement.
        join_timeout_s: the limit for forming a new group (covers a replacement still
            starting).
        backend: the process-group backend (``gloo``/``nccl``).
        node, nnodes: this worker's node rank and the attempt's number of nodes (torchrun's
            ``GROUP_RANK``/``GROUP_WORLD_SIZE``; the node rank stays when ranks are renumbered).
        min_nodes: ``--nnodes`` MIN: a departure may not leave fewer nodes.
    """

    active = True

    def __init__(self, store: dist.Store, prefix: str, generation: int, detect_timeout_s: float,
                 join_timeout_s: float, backend: str = "gloo",
                 location: StoreLocation | None = None, node: int = 0, nnodes: int = 1,
                 min_nodes: int = 1, peer_copy_every_steps: int = 0) -> None:
        self.store, self.prefix, self.generation = store, prefix, generation
        self.location = location or StoreLocation("tcp", "?")
        self.node, self.nnodes, self.min_nodes = node, nnodes, min_nodes
        self.multi_node = self.location.kind != "tcp"
        self.detect_timeout_s, self.join_timeout_s = detect_timeout_s, join_timeout_s
        self.backend = backend
        self.sockets = GroupSockets()  # the current group's connections (cut on a failure)
        self.grow_generation: int | None = None  # shrunk: the generation with every rank back
        self.home: tuple[int, int] | None = None  # (rank, world size) at full size
        self.join_waiting = False  # a node asks to join (GenerationWatch's last look)
        # sharded state: each rank's shards also in a peer's memory (recovery/peer_copies.py)
        self.copies: PeerCopies | NoCopies = (PeerCopies(peer_copy_every_steps)
                                              if peer_copy_every_steps else NoCopies())
        self.live: Live | None = None  # HSDP: this survivor's state as the failure left it

    @classmethod
    def from_env(cls, cfg: Any) -> InPlaceRecovery | NoRecovery:
        """From the agent's :data:`~elastic_runner.recovery.protocol.ENV` (``cfg``: the ``recovery`` config section), else
        :class:`NoRecovery`. Set :attr:`backend` once the group exists."""
        address = os.environ.get(ENV)
        if not address or cfg.mode != "in_place":
            return NoRecovery()
        location = StoreLocation.from_json(address)
        store = connect(location, cfg.join_timeout_seconds)
        return cls(store, location.prefix, int(os.environ.get(GENERATION_ENV, 0)),
                   cfg.detect_timeout_seconds, cfg.join_timeout_seconds, location=location,
                   node=int(os.environ.get("GROUP_RANK", 0)),
                   nnodes=int(os.environ.get("GROUP_WORLD_SIZE", 1)),
                   min_nodes=int(os.environ.get(MIN_NODES_ENV, 1)),
                   peer_copy_every_steps=cfg.peer_copy_every_steps)

    def bind(self, trainer: Recoverable) -> None:
        """``trainer`` recovers through this: a join request stops it at the next step
        boundary (the step vote, :attr:`~elastic_runner.preempt.PreemptionFlag.membership`),
        and rank 0 tells the agents that nodes may join in place (a script's own loop does
        not bind, so its nodes join through torch's restart)."""
        self.join_waiting = False
        if not trainer.checkpoints.sharded:  # a DDP survivor holds the whole state already
            self.copies = NoCopies()
        trainer.preempt.membership = lambda: self.join_waiting
        if trainer.info.rank == 0:
            with contextlib.suppress(RuntimeError, dist.DistError):
                record_global_batch(self.store, self.key, trainer.sampler.global_batch_size)
                if self.multi_node and trainer.regroups:
                    self.attempt.allow_joins_in_place()

    def watch(self) -> GenerationWatch | NoWatch:
        """Several nodes: a :class:`GenerationWatch` on this worker (close it at the end)."""
        return GenerationWatch(self) if self.multi_node else NoWatch()

    def job_global_batch(self) -> int | None:
        """The global batch (samples) the group's rank 0 recorded: what a joiner builds for
        (None: not recorded; the joiner reads the newest checkpoint's)."""
        with contextlib.suppress(RuntimeError, dist.DistError):
            return read_global_batch(self.store, self.key)
        return None

    def policy(self, trainer: Recoverable) -> Policy:
        """The departure policy: ``--nnodes`` MIN, and a world size the global batch
        divides."""
        return Policy.for_batch(self.min_nodes, trainer.batch)

    def copy_due(self, step: int) -> bool:
        """Whether the peer copies are refreshed after ``step`` (the same on every rank)."""
        return self.copies.due(step)

    def keep_copy(self, trainer: Recoverable) -> None:
        """At a step boundary (after its evaluation and checkpoint work): refresh this rank's
        copy and its predecessor's if due (collective; ``recovery/peer_copies.py``)."""
        step = trainer.state.step
        if not self.copies.due(step):
            return
        copies = self.copies
        assert isinstance(copies, PeerCopies)
        seconds = copies.refresh(trainer.checkpoints.local_copy(), step, trainer.info.rank,
                                 trainer.info.world_size, wire_device(trainer))
        log.debug("peer copies of step %d refreshed in %.3f s (%d bytes)", step, seconds,
                  copies.own.payload.numel() if copies.own else 0)

    def key(self, *parts: object) -> str:
        return "/".join([self.prefix, *map(str, parts)])

    @property
    def attempt(self) -> AttemptKeys:
        """The attempt's keys in the store in use (``recovery/protocol.py``)."""
        return AttemptKeys(self.store, self.key)

    def group_store(self, rank: int | None = None, world_size: int | None = None
                    ) -> dist.Store:
        """The store of the process group to create: the current generation's, once all
        ``world_size`` members have shown up in it (a newer generation announced meanwhile,
        e.g. the replacement died while joining, is followed).

        Raises:
            TimeoutError: not every member showed up within ``join_timeout_s``.
            JobFinished: the job's training ended meanwhile (:meth:`announce_finished`).
        """
        if rank is None:
            rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        assert world_size is not None
        deadline = time.monotonic() + self.join_timeout_s
        while True:
            attempt = self.attempt
            attempt.show_up(self.generation, rank)
            while not attempt.all_present(self.generation, world_size):
                if attempt.announced(self.generation + 1):
                    break
                if attempt.finished():
                    raise JobFinished(f"the job's training finished while this process waited "
                                      f"to join generation {self.generation}: nothing to do")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"in-place recovery: generation {self.generation} did "
                                       f"not form within {self.join_timeout_s:.0f} s "
                                       "(recovery.join_timeout_seconds)")
                time.sleep(_POLL_S)
            else:
                return attempt.group_store(self.generation)
            log.warning("generation %d was superseded while forming (another worker died); "
                        "joining %d", self.generation, self.generation + 1)
            self.generation += 1

    def announce_built(self, rank: int) -> None:
        """Rank 0 tells the agent the workers have built the task: it may start the spare now
        without competing with the workers' start-up (and a task artifact exists)."""
        if rank == 0:
            self.attempt.announce_built()

    def announce_finished(self, rank: int) -> None:
        """Rank 0, once training is over: a replacement still waiting to join leaves with exit
        code 0 (:class:`JobFinished`) instead of waiting out ``join_timeout_s`` and failing."""
        if rank == 0:
            with contextlib.suppress(RuntimeError, dist.DistError):
                self.attempt.announce_finished()

    # ------------------------------------------------------------ recovery

    def recover(self, error: BaseException, trainer: Recoverable) -> RecoveryReport | None:
        """After ``error`` in a collective: re-form the group without leaving the process.

        Returns:
            The report, or None when the agent named no failed peer within
            ``detect_timeout_s`` (the caller re-raises ``error``).
        """
        t0 = time.perf_counter()
        # this rank's own error (not a peer's death): its agent replaces it, unless a peer's
        # death that caused it is announced at once; a peer's: wait for the agents to name it
        own = not is_peer_failure(error)
        try:
            announced = self._next_announcement(OWN_ERROR_GRACE_S if own else None)
        except (RuntimeError, dist.DistError):  # the store is gone, and nobody moved it
            return None
        if announced is None:
            if own:
                return None
            log.error("collective failed and no peer died within %.0f s "
                      "(recovery.detect_timeout_seconds): %s; restarting every worker",
                      self.detect_timeout_s, first_line(error))
            self.ask_restart()
            return None
        if announced.get("restart"):  # an agent restarts every worker
            return None
        if "departed" in announced:  # a node left: the group goes on without it
            self._follow_departure(announced, trainer, t0)
        if "joined" in announced:  # a node joined (this rank's vote was cut short)
            self._follow_join(announced, trainer, t0)
        report = RecoveryReport(self.generation + 1, announced["failed"], trainer.state.step)
        log.warning("in-place recovery: rank(s) %s died (%s); generation %d, the rest keep "
                    "their process", announced["failed"], first_line(error),
                    report.generation)
        trainer.session.callbacks.on_phase("recovering", "in-place recovery", True)
        t1 = time.perf_counter()
        report.phases["detection"] = t1 - t0
        self._leave_group(trainer)
        t2 = time.perf_counter()
        report.phases["teardown"] = t2 - t1
        members = announced.get("members")
        if members is not None:  # continue shrunk: no warm spare, go on without it
            rank = trainer.info.rank
            self.home = self.home or (rank, trainer.info.world_size)
            self.grow_generation = report.generation + 1
            log.warning("continuing at world size %d until the replacement is ready",
                        len(members))
            raise Regroup(members.index(rank), len(members), report.generation, report)
        if trainer.checkpoints.sharded:  # FSDP2 cannot move a module's shards to a new group
            raise Regroup(trainer.info.rank, trainer.info.world_size, report.generation, report)
        self.form_group(trainer.info.rank, trainer.info.world_size, report.generation)
        report.generation = self.generation  # a later one if the replacement died too
        trainer.group_formed(list(announced["failed"]))
        t3 = time.perf_counter()
        report.phases["group"] = t3 - t2
        try:
            rejoin(trainer, joining=False, report=report)
        except (RuntimeError, dist.DistError) as e:
            if not is_peer_failure(e):
                raise
            # a member (the replacement, another survivor) died after the group formed, while
            # it agreed on the state: nothing was installed yet, so this is one more failure
            return self.recover(e, trainer)
        report.phases["state"] = time.perf_counter() - t3
        return report

    def _leave_group(self, trainer: Recoverable) -> None:
        """Destroy the failed group. Its connections are cut first, so peers that wait on this
        rank in its collective fail now, as if it had died, instead of at the collective timeout
        (gloo cannot abort: recovery/group_sockets.py). Sharded state: the save in flight
        (which failed with the peer) is abandoned, and under HSDP the live state kept."""
        self.sockets.cut()
        if trainer.checkpoints.sharded:
            trainer.checkpoints.abandon()
            self.live = Live.of(trainer)
            release_groups_of(trainer.checkpoints.state["model"])  # freed now, not at exit
        dist.destroy_process_group()

    def _next_announcement(self, timeout_s: float | None = None) -> dict[str, Any] | None:
        """The next generation's announcement (or the restart path's), within ``timeout_s``
        (default ``detect_timeout_s``); None when none came. A store that does not answer is
        followed to where this node's agent moved it (:meth:`_follow_agent`).

        Raises:
            RuntimeError: the store is unreachable and no agent moved it (logged).
        """
        deadline = time.monotonic() + (self.detect_timeout_s if timeout_s is None else timeout_s)
        while True:
            try:
                return self._wait_generation(self.generation + 1, deadline - time.monotonic())
            except (RuntimeError, dist.DistError) as e:
                if not self._follow_agent(deadline):
                    log.error("in-place recovery: the recovery store (%s) is unreachable (%s): "
                              "taking the restart path", self.location.describe(),
                              first_line(e))
                    raise

    def _follow_departure(self, announced: dict[str, Any], trainer: Recoverable, t0: float
                          ) -> None:
        """Node(s) left: lost (an agent announced it: no heartbeat), or preempted (the lowest
        remaining rank announced it at a step boundary, while this rank's collective was cut
        short). This node's workers, if it is one of them, leave: as preempted, or fenced out
        when it was declared lost (a healed partition); the others go on without it.

        Raises:
            Preempted: this node was preempted and left (its other ranks left in
                :meth:`leave`; this one was still in the departure's collective when its
                generation watch saw the announcement: the membership soak's fault 83).
            FencedOut: this node was declared lost.
            Regroup: as this rank's new number in the smaller group.
        """
        generation = self.generation + 1
        if announced.get("store") and self.node not in announced["departed"]:
            self._switch(announced["store"])
        if self.node in announced["departed"] and announced["reason"] == "preempted":
            raise Preempted(f"node {self.node} preempted: it left the job after step "
                            f"{trainer.state.step}; the others go on at world size "
                            f"{announced['world_size']} (generation {generation})")
        if self.node in announced["departed"]:
            raise FencedOut(f"node {self.node} was declared lost in generation {generation} "
                            f"({announced['reason']}: no heartbeat within "
                            "recovery.node_timeout_seconds); the group went on without it and "
                            "this node commits nothing")
        report = RecoveryReport(generation, announced["failed"], trainer.state.step)
        report.phases["detection"] = time.perf_counter() - t0
        log.warning("membership: node(s) %s %s (ranks %s); generation %d goes on at world "
                    "size %d, this rank %d -> %d", announced["departed"], announced["reason"],
                    announced["failed"], generation, announced["world_size"], trainer.info.rank,
                    announced["members"].index(trainer.info.rank))
        trainer.session.callbacks.on_phase("recovering", "membership change", True)
        self._changed(trainer, announced["reason"])
        members = announced["members"]
        self._regroup(trainer, members.index(trainer.info.rank), len(members), generation,
                      report)

    def _follow_join(self, announced: dict[str, Any], trainer: Recoverable, t0: float
                     ) -> NoReturn:
        """Rank 0 announced that node(s) join while this rank's collective was cut short:
        go on as the same rank in the larger group.

        Raises:
            Regroup: always.
        """
        generation = self.generation + 1
        report = RecoveryReport(generation, [], trainer.state.step,
                                cause="the step boundary of the join")
        report.phases["detection"] = time.perf_counter() - t0
        trainer.session.callbacks.on_phase("recovering", "membership change", True)
        self._changed(trainer, "joined")
        self._regroup(trainer, trainer.info.rank, announced["world_size"], generation, report)

    def _changed(self, trainer: Recoverable, reason: str) -> None:
        trainer.session.callbacks.on_membership_change(reason)

    def leave(self, trainer: Recoverable) -> None:
        """At the step boundary where the vote said stop (SIGTERM on some rank, or a join
        request): if whole nodes were asked to stop and the rest may go on
        (:class:`~elastic_runner.recovery.membership.Policy`), those nodes' ranks leave and the others
        re-form the group without them, from their own state (the discarded step is redone at
        the new world size; nothing committed is); if no rank was asked to stop, the nodes that
        asked to join are taken in (:meth:`_take_in`). Returns when every rank stops instead
        (one node, every node preempted, or the policy refuses): the caller checkpoints and
        exits 143. Collective (the old group).

        Raises:
            Regroup: this rank stays, renumbered (or the same rank in a larger group).
            Preempted: this rank's node leaves; the others go on.
            StepRedo: a join request was refused; the group stays as it is.
        """
        if not self.multi_node:
            return
        # each rank's node from the view, the one record every process reads the same way;
        # read before the all-gather: the announcer (members[0]) writes the next view once its
        # all-gather returns, which a slower rank's could not have yet (seen: a joined rank
        # read the announced view, which no longer held its node)
        view = read_view(self.store, self.key)
        everyone: list[Any] = [None] * trainer.info.world_size
        dist.all_gather_object(everyone, trainer.preempt.requested)
        leaving = sorted({view.node_of(r) for r, asked in enumerate(everyone) if asked})
        if not leaving:  # the vote stopped for a node that asks to join
            self._take_in(trainer)
        _, members = view.without(leaving, view.generation)
        why = self.policy(trainer).refuses(view, leaving) if members else "every node"
        if why is not None:
            if trainer.info.rank == 0 and members:
                log.warning("membership: node(s) %s preempted, but the rest may not go on (%s): "
                            "every node stops", leaving, why)
            return
        generation, store = self._announce_departure(trainer, view, leaving, members[0])
        if generation == 0:  # another process announced these departures: not expected
            return
        self._checkpoint_before_regroup(trainer)
        step = trainer.state.step
        self._changed(trainer, "preempted")
        if trainer.info.rank not in members:
            dist.destroy_process_group()
            raise Preempted(f"node {self.node} preempted: it left the job after step {step}; "
                            f"the others go on at world size {len(members)} (generation "
                            f"{generation})")
        if store:  # this node's host left: the group forms in the store that took over
            self._switch(store)
        log.warning("membership: node(s) %s preempted after step %d; generation %d goes on at "
                    "world size %d, this rank %d -> %d", leaving, step, generation,
                    len(members), trainer.info.rank, members.index(trainer.info.rank))
        report = RecoveryReport(generation, [r for r in range(len(everyone))
                                             if r not in members], step,
                                cause="the step boundary of the departure")
        self._regroup(trainer, members.index(trainer.info.rank), len(members), generation,
                      report)

    def _announce_departure(self, trainer: Recoverable, view: View, leaving: list[int],
                            announcer: int) -> tuple[int, str]:
        """Rank ``announcer`` (the lowest remaining) announces the departure of the nodes
        ``leaving`` (:func:`~elastic_runner.recovery.membership.announce_departure`: with etcd, the
        successor's store is seeded first when the store's host leaves) and broadcasts the
        generation and, if the store moved, its new ``host:port`` over the old group.
        Collective. Returns ``(generation, endpoint)``; ``(0, "")``: another process had
        announced it already."""
        announced: list[Any] = [0, ""]
        if trainer.info.rank == announcer:
            done = announce_departure(self.store, self.key, view, leaving, "preempted",
                                      self._client)
            if done is not None:
                generation, new, _ = done
                moved = new.store_node != view.store_node
                announced = [generation, new.stores[new.store_node] if moved else ""]
        dist.broadcast_object_list(announced, src=announcer)
        return announced[0], announced[1]

    def _take_in(self, trainer: Recoverable) -> NoReturn:
        """At the step boundary a join request asked for: rank 0 answers the pending requests
        (the generation with the nodes' ranks after the members', or a refusal when the global
        batch does not divide the new world size) and tells the others. Collective (the old
        group).

        Raises:
            Regroup: the same rank in the larger group.
            StepRedo: nothing joins; the discarded step is redone.
        """
        decided: list[Any] = [0, trainer.info.world_size, []]
        if trainer.info.rank == 0:
            decided = self._answer_joins(trainer)
        dist.broadcast_object_list(decided, src=0)
        self.join_waiting = False
        generation, world_size, nodes = decided
        if generation == 0:
            raise StepRedo("no node joins")
        step = trainer.state.step
        self._checkpoint_before_regroup(trainer)
        self._changed(trainer, "joined")
        if trainer.info.rank == 0:
            log.warning("membership: node(s) %s join after step %d; generation %d goes on at "
                        "world size %d", nodes, step, generation, world_size)
        report = RecoveryReport(generation, [], step, cause="the step boundary of the join")
        self._regroup(trainer, trainer.info.rank, world_size, generation, report)

    def _answer_joins(self, trainer: Recoverable) -> list[Any]:
        """Rank 0: ``[generation, world size, joining nodes]`` (generation 0: none join)."""
        requests = pending_joins(self.store, self.key, answered_joins(self.store, self.key))
        joining = {r["node"]: r["nproc"] for r in requests.values()}
        view = read_view(self.store, self.key)
        world_size = view.world_size + sum(joining.values())
        if not joining:
            return [0, trainer.info.world_size, []]
        if not self.policy(trainer).fits(world_size):
            why = (f"batch.global_batch_size is not divisible at world size {world_size} "
                   f"(nodes {sorted(joining)} asked to join)")
            log.error("membership: %s: they stay out", why)
            refuse_joins(self.store, self.key, requests, why)
            return [0, trainer.info.world_size, []]
        generation, new = announce_join(self.store, self.key, view, joining, max(requests),
                                        {r["node"]: r["store"] for r in requests.values()
                                         if r.get("store")})
        return [generation, new.world_size, sorted(joining)]

    def _checkpoint_before_regroup(self, trainer: Recoverable) -> None:
        """Sharded state at a step boundary where the world size changes: no peer copy fits the
        new shards, so every rank commits the step first (collective, the old group); the new
        group loads it (DCP reshards) and redoes nothing."""
        if trainer.checkpoints.sharded:
            trainer.checkpoints.save(trainer.state.step)
            trainer.checkpoints.wait()

    def _regroup(self, trainer: Recoverable, rank: int, world_size: int, generation: int,
                 report: RecoveryReport) -> NoReturn:
        """Leave the old group (its connections cut, so no peer waits on this rank) and
        re-form it as ``rank`` of ``world_size`` in ``generation``.

        Raises:
            Regroup: always.
        """
        self.join_waiting = False
        self.sockets.cut()
        release_groups_of(trainer.checkpoints.state["model"])  # freed now, not at exit
        dist.destroy_process_group()
        raise Regroup(rank, world_size, generation, report)

    def _wait_generation(self, generation: int, timeout_s: float) -> dict[str, Any] | None:
        """Generation ``generation``'s announcement, ``{"restart": True}`` once any agent or
        worker asked for torch's restart path, or None after ``timeout_s``.

        Raises:
            RuntimeError: the store is unreachable.
        """
        deadline = time.monotonic() + timeout_s
        attempt = self.attempt
        while True:
            announced = attempt.announcement(generation)
            if announced is not None:
                return announced
            if time.monotonic() > deadline:
                return None
            time.sleep(_POLL_S)

    def ask_restart(self) -> None:
        """No agent replaces anyone in place in this attempt any more: torch's restart path."""
        with contextlib.suppress(RuntimeError, dist.DistError):
            self.attempt.ask_restart()

    def _client(self, endpoint: str) -> dist.Store:
        """A client of the store at ``endpoint`` (``host:port``)."""
        return connect(self.location.at(endpoint, self.prefix), self.join_timeout_s)

    def _switch(self, endpoint: str) -> None:
        """The recovery store moved to ``endpoint``: this process uses it from now on (its
        :class:`GenerationWatch` follows)."""
        if endpoint != self.location.endpoint:
            self.store = self._client(endpoint)
            self.location = self.location.at(endpoint, self.prefix)
            log.info("the recovery store moved to %s", endpoint)

    def _follow_agent(self, deadline: float) -> bool:
        """The recovery store does not answer: wait (until the monotonic ``deadline``) for
        this node's agent to name the store that took over (etcd: the agents move it when its
        host died; :data:`~elastic_runner.recovery.store.STORE_FILE`). Returns whether it
        did: this process then uses it, and raises the generation counter to its own
        generation so no announcement there reuses a number."""
        directory = os.environ.get(HEARTBEAT_ENV)
        if self.location.kind != "node0" or not directory:
            return False
        dead = self.location.endpoint
        while time.monotonic() < deadline:
            location = told(Path(directory))
            if location is not None and location.endpoint != dead:
                try:
                    self._switch(location.endpoint)
                    raise_counter(self.store, self.attempt.generations_counter(),
                                  self.generation)
                except (RuntimeError, dist.DistError):  # gone too (two nodes lost at once)
                    return False
                log.warning("in-place recovery: the recovery store at %s does not answer; "
                            "this node's agent moved it to %s", dead, location.endpoint)
                return True
            time.sleep(0.01)
        return False

    def form_group(self, rank: int, world_size: int, generation: int) -> None:
        """Create generation ``generation``'s group (or a newer one's, see
        :meth:`group_store`; after a :class:`Regroup`, with its numbers); a group that fails to form because a newer generation was
        announced meanwhile moves on to that one."""
        self.generation = generation
        while True:
            store = self.group_store(rank, world_size)
            try:
                with self.sockets.forming():
                    dist.init_process_group(self.backend, store=store, rank=rank,
                                            world_size=world_size,
                                            timeout=timedelta(seconds=self.join_timeout_s))
                return
            except (RuntimeError, dist.DistError) as e:
                if not self.attempt.announced(self.generation + 1):
                    raise
                log.warning("generation %d did not form (%s); joining %d", self.generation,
                            first_line(e), self.generation + 1)
                if dist.is_initialized():
                    dist.destroy_process_group()
                self.generation += 1

    def regroup_due(self, trainer: Recoverable) -> None:
        """At a step boundary while shrunk: when the replacement is ready (the agent announced
        the full generation; rank 0 looks, one all-reduce tells everyone), every rank leaves
        together.

        Raises:
            Regroup: to the full world size, this process's original rank.
        """
        if self.grow_generation is None:
            return
        ready = trainer.info.rank == 0 and self.attempt.announced(self.grow_generation)
        flag = torch.tensor([1.0 if ready else 0.0], device=trainer.info.device
                            if self.backend == "nccl" else torch.device("cpu"))
        dist.all_reduce(flag)
        if flag.item() == 0:
            return
        generation, self.grow_generation = self.grow_generation, None
        self._checkpoint_before_regroup(trainer)
        rank, world_size = self.home or (trainer.info.rank, trainer.info.world_size)
        log.warning("the replacement is ready: back to world size %d after step %d",
                    world_size, trainer.state.step)
        raise Regroup(rank, world_size, generation)

    # ------------------------------------------------------------ the spare

    def wait_assignment(self, spare: str) -> dict[str, str]:
        """A spare (after building the task) tells the agent it is ready and blocks until the
        agent hands it a failed worker's place; returns that worker's environment (RANK,
        LOCAL_RANK, ... and :data:`~elastic_runner.recovery.protocol.GENERATION_ENV`)."""
        attempt = self.attempt
        attempt.spare_ready(spare)
        # a store that is gone (its agent died, or the store moved on) raises here: leave
        env = attempt.wait_assignment(spare, _SPARE_POLL_S)
        self.generation = int(env[GENERATION_ENV])
        # the node's id now (a node that joined claimed one after its spares started)
        self.node = int(env.get("GROUP_RANK", self.node))
        return env


class GenerationWatch:
    """Breaks this worker's collective when a newer generation (or torch's restart path) is
    announced while it waits: a partitioned node's peers get no reset and no error, their
    collective just never completes (gloo has no abort, see :mod:`elastic_runner.recovery.group_sockets`).
    A daemon thread looks every ``interval_s`` through its own store client and, once an
    announcement that a peer cannot finish the collective is there (a failed worker, a lost
    node, the restart path; not a departure at a step boundary or a join, see
    :meth:`_must_leave_collective`), shuts down the current group's connections both ways, so this
    rank's waiting collective (and any peer's that waits on this rank) fails at once and :meth:`InPlaceRecovery.recover` follows the
    announcement. Several nodes only (on one node a dead peer's connections reset)."""

    def __init__(self, recovery: InPlaceRecovery, interval_s: float = 0.1) -> None:
        self.recovery, self.interval_s = recovery, interval_s
        self._store = self._connect()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="generation-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        recovery = self.recovery
        endpoint, broken = recovery.location.endpoint, False
        while not self._stop.wait(self.interval_s):
            epoch = recovery.sockets.epoch  # before the generation: see GroupSockets.cut
            try:
                # the recovery store moved, or this client failed: a new client
                if broken or recovery.location.endpoint != endpoint:
                    endpoint = recovery.location.endpoint
                    self._store, broken = self._connect(), False
                announced = self._must_leave_collective(recovery.generation + 1)
                recovery.join_waiting = joins_waiting(self._store, recovery.key)
            except (RuntimeError, dist.DistError):  # store unreachable (partitioned): wait
                broken = True
                continue
            if announced and recovery.sockets.cut(epoch, socket.SHUT_RDWR):
                log.warning("generation %d was announced while this rank waited in a "
                            "collective: leaving it", recovery.generation + 1)

    def _must_leave_collective(self, generation: int) -> bool:
        """Whether generation ``generation`` (or the restart path) was announced in a way this
        rank's collective cannot finish: a peer failed, or a node was lost. Not a departure at a
        step boundary or a join: their announcer writes the announcement while every rank is
        in the same collective with it, which completes on its own (cut short, a rank of the
        membership soak hung in that broadcast until its step watchdog fired)."""
        keys = AttemptKeys(self._store, self.recovery.key)
        if keys.restart_asked():
            return True
        announced = keys.announcement(generation)
        return announced is not None and announced.get("reason") not in ("preempted", "joined")

    def _connect(self) -> dist.Store:
        """A client of the recovery store for this thread; its socket is never taken for a
        process group's (:meth:`GroupSockets.outside
        <elastic_runner.recovery.group_sockets.GroupSockets.outside>`)."""
        with self.recovery.sockets.outside():
            return connect(self.recovery.location, THREAD_STORE_TIMEOUT_S)

    def close(self) -> None:
        """Stop watching; waits for the thread (at most its store's timeout): a daemon thread
        still inside a store call when the interpreter exits aborts the process."""
        self._stop.set()
        self._thread.join(timeout=THREAD_STORE_TIMEOUT_S + 1)
