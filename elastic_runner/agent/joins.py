"""Nodes joining a running in-place job at ``--nnodes MIN:MAX`` without stopping it.

Two sides, each a node's agent: a running node takes part in the rendezvous round that lets
a waiting node in without stopping its workers (:meth:`Joins.let_in`); the joining node claims
a node id, starts its workers as spares and asks the group to take them in
(:meth:`Joins.stand_by`, :meth:`Joins.follow`). The workers take the newcomers in at a step
boundary (:mod:`elastic_runner.recovery.membership`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.agent.server.api import WorkerGroup

from ..protocol.env import SPARE_ENV
from ..protocol.torchrun_env import assignment
from ..recovery.membership import admission, claim_node_id, refusal, request_join
from .node_attempt import AGENT_LOG as log
from .node_attempt import NodeAttempt
from .node_membership import NodeMembership


@dataclass
class _Join:
    """This node joins a running attempt as node id ``node``: its workers stand by as spares
    named ``<node>.join.<local rank>`` until the group takes them in; ``request``: the number
    of its join request once posted."""

    node: int
    request: int = 0

    @property
    def spares(self) -> str:
        """The workers' :data:`~elastic_runner.protocol.env.SPARE_ENV`: each appends its local
        rank."""
        return f"{self.node}.join."

    def spare(self, local_rank: int) -> str:
        return f"{self.spares}{local_rank}"


class Joins:
    """Both sides of a join for this node's agent.

    Args:
        attempt: the attempt this node runs.
        membership: this node's membership (registered again once this node joined).
    """

    def __init__(self, attempt: NodeAttempt, membership: NodeMembership) -> None:
        self._attempt, self._membership = attempt, membership
        self._joining: _Join | None = None  # this node joins a running attempt

    @property
    def joining(self) -> bool:
        """Whether this node is joining, not yet in the group."""
        return self._joining is not None

    def begin(self) -> None:
        """A new attempt starts: this node joins nothing yet."""
        self._joining = None

    def takes_joins(self) -> bool:
        """Whether a node waiting in the rendezvous may join in place: several nodes, this
        node's workers run (not joining themselves), no restart under way, and the workers
        said they can take nodes in (the built-in trainer and a script's ``fault_tolerant``
        loop, once bound: ``InPlaceRecovery.bind``)."""
        rs = self._attempt.rs
        if not rs.multi_node or self._joining is not None:
            return False
        try:
            return rs.attempt.joins_in_place() and not self._attempt.restart_asked()
        except (RuntimeError, dist.DistError):
            return False

    def let_in(self, worker_group: WorkerGroup,
               rendezvous: Callable[[WorkerGroup], None]) -> None:
        """Take part in the new rendezvous round (``rendezvous``: torch's, whose round and
        rank assignment the newcomer's agent waits for) that lets the waiting node(s) in,
        without stopping this node's workers; then hand on the attempt's prefix and store
        (:func:`agree_attempt <elastic_runner.recovery.store.agree_attempt>`)."""
        t0 = time.monotonic()
        rs, workers, node = self._attempt.rs, worker_group.workers, self._attempt.node
        master = (worker_group.master_addr, worker_group.master_port)
        rendezvous(worker_group)
        nnodes = worker_group.group_world_size
        worker_group.workers = workers  # this node's workers keep their ranks and processes
        worker_group.master_addr, worker_group.master_port = master
        rs.agree(worker_group.store, worker_group.group_rank or 0,
                 worker_group.group_world_size or 1,
                 running=(rs.prefix, rs.location.endpoint))
        worker_group.group_rank = node  # the node keeps its id across rounds
        log.warning("membership: node(s) waiting to join: rendezvous round of %d nodes taken "
                    "in %.2f s; this node's workers go on and take them in at a step boundary",
                    nnodes, time.monotonic() - t0)

    def stand_by(self, worker_group: WorkerGroup) -> None:
        """This node's agent joined a running attempt: claim a node id, and have the workers
        (started next, from ``os.environ``) start as spares that build the task and wait for
        the group to take them in."""
        attempt = self._attempt
        self._joining = _Join(claim_node_id(attempt.rs.attempt, attempt.current_view()))
        attempt.node = worker_group.group_rank = self._joining.node
        os.environ[SPARE_ENV] = self._joining.spares
        log.warning("membership: joining the running job as node %d: its %d worker(s) build "
                    "the task, then the group takes them in at a step boundary",
                    attempt.node, len(worker_group.workers))

    def follow(self, worker_group: WorkerGroup, pc: Any) -> bool:
        """Joining: post the join request once every worker stands by, then hand each worker
        its place once the group announced the generation that takes this node in. Returns
        False when the group refused this node (its workers are killed then).

        Raises:
            Exception: any client error of an unreachable recovery store.
        """
        join, rs = self._joining, self._attempt.rs
        assert join is not None
        if not join.request:
            if all(rs.attempt.is_spare_ready(join.spare(lr)) for lr in pc.subprocess_handlers):
                join.request = request_join(rs.attempt, join.node, len(pc.subprocess_handlers),
                                            rs.own)
                log.info("membership: node %d ready to join (request %d)", join.node,
                         join.request)
            return True
        refused = refusal(rs.attempt, join.request)
        if refused is not None:
            log.error("membership: the running job did not take this node in: %s", refused)
            _kill_all(pc)
            return False
        admitted = admission(rs.attempt, join.node)
        if admitted is not None:
            self._take_places(worker_group, pc, join, admitted)
        return True

    def _take_places(self, worker_group: WorkerGroup, pc: Any, join: _Join,
                     admitted: dict[str, Any]) -> None:
        """Admitted: assign each standing-by worker its rank in the announced generation."""
        generation, world_size = admitted["generation"], admitted["world_size"]
        for local_rank, rank in enumerate(admitted["ranks"]):
            env = assignment(pc.envs[local_rank], generation, rank=rank,
                             world_size=world_size, node_rank=join.node)
            worker_group.workers[local_rank].global_rank = rank
            worker_group.workers[local_rank].world_size = world_size
            self._attempt.rs.attempt.assign(join.spare(local_rank), env)
        self._joining, self._attempt.generation = None, generation
        self._membership.register(worker_group, joined=True)
        log.warning("membership: node %d joined the running job in generation %d as rank(s) "
                    "%s (world size %d)", join.node, generation, admitted["ranks"], world_size)


def _kill_all(pc: Any) -> None:
    """SIGKILL every worker of ``pc`` and wait up to 5 s for each."""
    for handler in pc.subprocess_handlers.values():
        handler.close(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            handler.proc.wait(timeout=5)
