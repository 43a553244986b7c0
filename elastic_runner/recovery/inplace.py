"""In-place recovery, the workers' side: survivors keep their process when a peer dies.

Under ``elastic-runner run`` (``recovery.mode: in_place``) every agent
(:mod:`elastic_runner.agent.inplace_agent`) names the job's **recovery store** in :data:`~elastic_runner.protocol.env.INPLACE_ENV`: a
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
   behind it over the group: a manifest (``torch.load(weights_only=True)`` on the receiver),
   then the tensors' bytes straight into the receiver's own tensors
   (:mod:`~elastic_runner.recovery.state_transfer`). No checkpoint is read.
4. Everyone wraps the model in a new DDP on the new group, the trainer re-creates its data
   iterator from the sampler cursor and trains on. The step in flight was applied by nobody (its
   gradient all-reduce failed, or its update vote never completed), its samples stay
   unconsumed, and each step reseeds its RNG streams from ``(seed, epoch, step, rank)``: the run
   goes on bitwise as if nothing happened.

Sharded state (FSDP2) differs in steps 3-4: no survivor holds a dead rank's shards, and a sharded
module cannot move to a new group. Each survivor leaves through :class:`Regroup` at its own rank,
shards a new module on the new group, and the members roll back to the peer copies (or take a
surviving HSDP replica's live state): :mod:`elastic_runner.recovery.rejoin`.

A process started without :data:`~elastic_runner.protocol.env.INPLACE_ENV` (plain torchrun, ``recovery.mode: restart``, a user's own
script) gets :class:`NoRecovery`: errors propagate and torchrun restarts everyone.
"""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist

from ..protocol import env
from ..protocol.keys import AttemptKeys
from ..protocol.torchrun_env import TorchrunEnv, node_rank_of
from .background import Stoppable
from .failure import OWN_ERROR_GRACE_S, FailureRecovery
from .generation_watch import GenerationWatch, NoWatch
from .group_formation import GroupFormation
from .group_sockets import GroupSockets, NoSockets
from .membership import Policy
from .node_changes import NodeChanges
from .outcomes import JobFinished, Regroup, StepRedo
from .peer_copies import NoCopies, PeerCopies
from .recoverable import Copies, Live, Recoverable
from .rejoin import RecoveryReport, wire_device
from .signals import AgentSignals
from .store import StoreLocation, connect
from .store_client import StoreClient

# the names callers import from here, wherever they live now
__all__ = ["OWN_ERROR_GRACE_S", "GenerationWatch", "InPlaceRecovery", "JobFinished",
           "NoRecovery", "NoWatch", "Regroup", "StepRedo"]

log = logging.getLogger(__name__)


class NoRecovery:
    """Recovery off (plain torchrun, ``recovery.mode: restart``): every error propagates; the
    null object of :class:`~elastic_runner.recovery.recoverable.RecoveryService`."""

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

    def keep_copy(self, loop: Recoverable) -> None:
        pass

    def announce_built(self, rank: int) -> None:
        pass

    def announce_finished(self, rank: int) -> None:
        pass

    def announce_recovered(self, rank: int, report: RecoveryReport) -> None:
        pass

    def keep_rank0_state(self, blob: bytes) -> None:
        pass

    def rank0_state(self) -> bytes | None:
        return None

    def recover(self, error: BaseException, loop: Recoverable) -> RecoveryReport | None:
        return None

    def regroup_due(self, loop: Recoverable) -> None:
        pass

    def leave(self, loop: Recoverable) -> None:
        pass

    def bind(self, loop: Recoverable) -> None:
        pass

    def watch(self) -> NoWatch:
        return NoWatch()

    def ask_restart(self) -> None:
        pass  # torch's restart path is the only one

    def group_store(self, rank: int | None = None, world_size: int | None = None) -> None:
        return None  # torchrun's own store

    def form_group(self, rank: int, world_size: int, generation: int) -> None:
        raise RuntimeError("no in-place recovery: no group is re-formed in this process")

    def wait_assignment(self, spare: str) -> dict[str, str]:
        raise RuntimeError("no in-place recovery: no agent assigns a spare")


class InPlaceRecovery:
    """This worker's side of the protocol in the module docstring: composes the recovery store
    client (:class:`~elastic_runner.recovery.store_client.StoreClient`), the generation's group
    (:class:`~elastic_runner.recovery.group_formation.GroupFormation`), the signals to the
    agents (:class:`~elastic_runner.recovery.signals.AgentSignals`), node departures and joins
    (:class:`~elastic_runner.recovery.node_changes.NodeChanges`), the recovery after a failed
    collective (:class:`~elastic_runner.recovery.failure.FailureRecovery`) and the peer copies.

    Args:
        store: the job's recovery store; ``prefix``: this attempt's keys in it;
            ``location``: where it is (for log lines).
        generation: the group this process (first) joins: 0 at the attempt's start, the
            announced one for a replacement.
        detect_timeout_s: how long a failed collective waits for the agent's announcement
            (seconds).
        join_timeout_s: the limit for forming a new group (seconds; covers a replacement still
            starting).
        backend: the process-group backend (``gloo``/``nccl``).
        node, nnodes: this worker's node rank and the attempt's number of nodes (torchrun's
            ``GROUP_RANK``/``GROUP_WORLD_SIZE``; the node rank stays when ranks are renumbered).
        min_nodes: ``--nnodes`` MIN: a departure may not leave fewer nodes.
        peer_copy_every_steps: sharded state: refresh the peer copies every this many steps
            (0: none).
    """

    active = True

    def __init__(self, store: dist.Store, prefix: str, generation: int, detect_timeout_s: float,
                 join_timeout_s: float, backend: str = "gloo",
                 location: StoreLocation | None = None, node: int = 0, nnodes: int = 1,
                 min_nodes: int = 1, peer_copy_every_steps: int = 0) -> None:
        self.nnodes = nnodes
        self.sockets = GroupSockets()  # the current group's connections (cut on a failure)
        self.client = StoreClient(store, prefix, location or StoreLocation("tcp", "?"),
                                  join_timeout_s)
        self.formation = GroupFormation(self.client, generation, detect_timeout_s,
                                        join_timeout_s, backend, self.sockets)
        self.signals = AgentSignals(self.client)
        self.nodes = NodeChanges(self.client, self.formation, self.sockets, node, min_nodes)
        self.failures = FailureRecovery(self.formation, self.nodes, self.signals, self.sockets)
        # sharded state: each rank's shards also in a peer's memory (recovery/peer_copies.py)
        self.copies: Copies = (PeerCopies(peer_copy_every_steps, self.sockets)
                                              if peer_copy_every_steps else NoCopies())

    @classmethod
    def from_env(cls, cfg: Any) -> InPlaceRecovery | NoRecovery:
        """From the agent's :data:`~elastic_runner.protocol.env.INPLACE_ENV` (``cfg``: the
        ``recovery`` config section), else :class:`NoRecovery`. Set :attr:`backend` once the
        group exists.

        Raises:
            RuntimeError: the recovery store does not answer within
                ``recovery.join_timeout_seconds``.
        """
        address, torchrun = env.inplace_store(), TorchrunEnv.read()
        if not address or cfg.mode != "in_place":
            return NoRecovery()
        location = StoreLocation.from_json(address)
        store = connect(location, cfg.join_timeout_seconds)
        return cls(store, location.prefix, env.generation(),
                   cfg.detect_timeout_seconds, cfg.join_timeout_seconds, location=location,
                   node=torchrun.node_rank, nnodes=torchrun.nnodes, min_nodes=env.min_nodes(),
                   peer_copy_every_steps=cfg.peer_copy_every_steps)

    # ------------------------------------------------------------ state callers read

    @property
    def generation(self) -> int:
        """The generation this process is in (or joins next)."""
        return self.formation.generation

    @generation.setter
    def generation(self, generation: int) -> None:
        self.formation.generation = generation

    @property
    def backend(self) -> str:
        """The process-group backend (``gloo``/``nccl``)."""
        return self.formation.backend

    @backend.setter
    def backend(self, backend: str) -> None:
        self.formation.backend = backend

    @property
    def live(self) -> Live | None:
        """HSDP: this survivor's state as the failure left it (a rejoin takes it)."""
        return self.failures.live

    @live.setter
    def live(self, live: Live | None) -> None:
        self.failures.live = live

    @property
    def store(self) -> dist.Store:
        """The recovery store in use (it may move: etcd)."""
        return self.client.store

    @property
    def attempt(self) -> AttemptKeys:
        """The attempt's keys in the store in use (``protocol/keys.py``)."""
        return self.client.attempt

    # ------------------------------------------------------------ the training loop

    def bind(self, loop: Recoverable) -> None:
        """``loop`` recovers through this: a join request stops it at the next step
        boundary (the step vote, :attr:`~elastic_runner.preempt.PreemptionFlag.membership`),
        and rank 0 tells the agents that nodes may join in place (the built-in trainer and a
        script's ``fault_tolerant`` loop both bind)."""
        if not loop.session.checkpoints.sharded:  # a DDP survivor holds the whole state already
            self.copies = NoCopies()
        self.nodes.bind(loop)

    def watch(self) -> Stoppable:
        """Several nodes: a :class:`GenerationWatch` on this worker (close it at the end)."""
        if not self.client.multi_node:
            return NoWatch()
        return GenerationWatch(self.client, self.formation, self.nodes)

    def recover(self, error: BaseException, loop: Recoverable) -> RecoveryReport | None:
        """After ``error`` in a collective: re-form the group without leaving the process
        (:meth:`FailureRecovery.recover
        <elastic_runner.recovery.failure.FailureRecovery.recover>`).

        Returns:
            The report, or None when the agent named no failed peer within
            ``detect_timeout_s`` (the caller re-raises ``error``).

        Raises:
            Regroup: this rank goes on in another group.
            Preempted, FencedOut: this rank's node left or was declared lost.
        """
        return self.failures.recover(error, loop)

    def leave(self, loop: Recoverable) -> None:
        """At the step boundary where the vote said stop: nodes leave or join in place
        (:meth:`NodeChanges.leave <elastic_runner.recovery.node_changes.NodeChanges.leave>`);
        returns when every rank stops instead (the caller checkpoints and exits 143).
        Collective (the old group).

        Raises:
            Regroup: this rank stays, renumbered (or the same rank in a larger group).
            Preempted: this rank's node leaves; the others go on.
            StepRedo: a join request was refused; the group stays as it is.
        """
        self.nodes.leave(loop)

    def regroup_due(self, loop: Recoverable) -> None:
        """At a step boundary while shrunk: every rank leaves together once the replacement
        is ready.

        Raises:
            Regroup: to the full world size, this process's original rank.
        """
        self.failures.regroup_due(loop)

    def policy(self, loop: Recoverable) -> Policy:
        """The departure policy: ``--nnodes`` MIN, and a world size the global batch
        divides."""
        return self.nodes.policy(loop)

    def job_global_batch(self) -> int | None:
        """The global batch (samples) the group's rank 0 recorded: what a joiner builds for
        (None: not recorded; the joiner reads the newest checkpoint's)."""
        return self.nodes.job_global_batch()

    # ------------------------------------------------------------ the group

    def group_store(self, rank: int | None = None, world_size: int | None = None
                    ) -> dist.Store:
        """The store of the process group to create, once all ``world_size`` members showed
        up in the current generation (:meth:`GroupFormation.group_store
        <elastic_runner.recovery.group_formation.GroupFormation.group_store>`).

        Raises:
            TimeoutError: not every member showed up within ``join_timeout_s``.
            JobFinished: the job's training ended meanwhile (:meth:`announce_finished`).
        """
        return self.formation.group_store(rank, world_size)

    def form_group(self, rank: int, world_size: int, generation: int) -> None:
        """Create generation ``generation``'s group (or a newer one's, see
        :meth:`group_store`; after a :class:`Regroup`, with its numbers).

        Raises:
            RuntimeError: the group failed to form and no newer generation was announced.
            TimeoutError, JobFinished: as :meth:`group_store`.
        """
        self.formation.form_group(rank, world_size, generation)

    def wait_assignment(self, spare: str) -> dict[str, str]:
        """A spare (after building the task) tells the agent it is ready and blocks until the
        agent hands it a failed worker's place; returns that worker's environment (RANK,
        LOCAL_RANK, ... and :data:`~elastic_runner.protocol.env.GENERATION_ENV`).

        Raises:
            RuntimeError: the store is gone (its agent died, or the store moved on).
        """
        assigned = self.formation.wait_assignment(spare)
        # the node's id now (a node that joined claimed one after its spares started)
        self.nodes.node = node_rank_of(assigned, self.nodes.node)
        return assigned

    # ------------------------------------------------------------ the agents

    def announce_built(self, rank: int) -> None:
        """Rank 0 tells the agent the workers have built the task: it may start the spare now.

        Raises:
            RuntimeError: the store is unreachable.
        """
        self.signals.announce_built(rank)

    def announce_finished(self, rank: int) -> None:
        """Rank 0, once training is over: a replacement still waiting to join leaves with exit
        code 0 (:class:`JobFinished`). The peer copies' last exchange is waited for: the
        process group goes next."""
        self.copies.settle()
        self.signals.announce_finished(rank)

    def announce_recovered(self, rank: int, report: RecoveryReport) -> None:
        """At the first step committed after the recovery ``report`` describes, its lowest rank
        that kept its process (a replacement has no report) tells the agents: the next spare
        may start (:meth:`AgentSignals.announce_recovered`)."""
        if all(r in report.failed_ranks for r in range(rank)):
            self.signals.announce_recovered(report.generation)

    def ask_restart(self) -> None:
        """No agent replaces anyone in place in this attempt any more: torch's restart path."""
        self.signals.ask_restart()

    def keep_rank0_state(self, blob: bytes) -> None:
        """Rank 0 of a script's loop: its ``state=`` versions, where a replacement's group
        finds them once rank 0 is gone (``own_loop/script_state.py``).

        Raises:
            RuntimeError: the store is unreachable.
        """
        self.client.attempt.keep_rank0_state(blob)

    def rank0_state(self) -> bytes | None:
        """What rank 0 kept last (:meth:`keep_rank0_state`; None: nothing).

        Raises:
            RuntimeError: the store is unreachable.
        """
        return self.client.attempt.rank0_state()

    # ------------------------------------------------------------ peer copies

    def copy_due(self, step: int) -> bool:
        """Whether the peer copies are refreshed after ``step`` (the same on every rank)."""
        return self.copies.due(step)

    def keep_copy(self, loop: Recoverable) -> None:
        """At a step boundary (after its evaluation and checkpoint work): refresh this rank's
        copy and its predecessor's if due (collective; ``recovery/peer_copies.py``)."""
        step = loop.session.state.step
        if not self.copies.due(step):
            return
        copies = self.copies
        assert isinstance(copies, PeerCopies)
        state = loop.session.checkpoints.local_copy(to_cpu=False)  # copied into pinned memory
        seconds = copies.refresh(state, step, loop.info.rank, loop.info.world_size,
                                 wire_device(loop))
        log.debug("peer copies of step %d posted; the step waited %.3f s", step, seconds)
