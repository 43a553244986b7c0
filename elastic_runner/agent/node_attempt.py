"""What the in-place agent's parts share about the attempt this node runs.

:class:`NodeAttempt` is the state that the spares (:mod:`.spares`), the node membership
(:mod:`.node_membership`), joins (:mod:`.joins`), the store fail-over (:mod:`.store_failover`)
and replacements (:mod:`.replacement`) read and move on: the recovery store as this agent holds
it, the workers' heartbeat directory, this node's id, the last generation it announced or
joined in and the membership last read.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist

from ..logs import first_line
from ..protocol.env import HEARTBEAT_ENV, INPLACE_ENV, MIN_NODES_ENV
from ..recovery.membership import Policy, View, read_view
from .store import AgentStore

# the in-place agent logs under one name whichever of its parts speaks: its lines are read by
# name (bench/recovery.py counts "rank(s) ... replaced in place by" lines; the docs show them)
AGENT_LOG = logging.getLogger("elastic_runner.agent.inplace_agent")


@dataclass
class NodeAttempt:
    """The attempt as this node's agent runs it.

    Attributes:
        rs: the recovery store as this agent holds it.
        heartbeats: the directory the workers' heartbeat files are in
            (:mod:`elastic_runner.recovery.heartbeat`).
        policy: whether the rest may go on without a lost node; its ``min_nodes``: ``--nnodes``
            MIN.
        node: this node's id (node rank at the start; a node that joined claimed its own).
        generation: the last generation this node announced or joined in.
        view: the membership as last read (etcd: where the store moves when its host dies).
    """

    rs: AgentStore
    heartbeats: Path
    policy: Policy = field(default_factory=Policy)
    node: int = 0
    generation: int = 0
    view: View | None = None

    def begin(self, node: int) -> None:
        """A new attempt starts with this node as ``node``: nothing of the previous one
        holds (its generations, its membership)."""
        self.node, self.generation, self.view = node, 0, None

    def current_view(self) -> View:
        """The membership as the store says now (also kept as :attr:`view`).

        Raises:
            RuntimeError, torch.distributed.DistError: the store does not answer.
        """
        self.view = read_view(self.rs.attempt)
        return self.view

    def restart_asked(self) -> bool:
        """Whether a worker or agent of this attempt asked for torch's restart path, or the
        recovery store cannot be reached (c10d: the rendezvous host is gone)."""
        try:
            return self.rs.attempt.restart_asked()
        except (RuntimeError, dist.DistError) as e:
            AGENT_LOG.error("the recovery store (%s) is unreachable (%s): torch's restart path",
                            self.rs.location.describe(), first_line(e))
            return True

    def worker_variables(self) -> dict[str, str]:
        """What every worker and spare of this agent reads: the recovery store, the heartbeat
        directory and ``--nnodes`` MIN (a spare without it took a worker's SIGTERM for a
        departure the job allows: the 2:2 soak, a replaced rank preempted)."""
        return {INPLACE_ENV: self.rs.for_workers().to_json(), HEARTBEAT_ENV: str(self.heartbeats),
                MIN_NODES_ENV: str(self.policy.min_nodes)}
