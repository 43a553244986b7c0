"""In-place recovery, the agent's side: replace only the failed worker, from a warm spare.

:class:`InPlaceAgent` is torch's ``LocalElasticAgent`` (subclassed through torch.distributed.
elastic's agent API, not forked) with these changes, used by ``elastic-runner run`` with
``recovery.mode: in_place``, on one node or on each node of a multi-node job:

* it names the attempt's **recovery store** to the workers in
  :data:`~elastic_runner.protocol.env.INPLACE_ENV` (one node: a ``TCPStore`` it hosts on ``127.0.0.1``;
  several nodes: the rendezvous backend's store that every node reaches, see
  :mod:`elastic_runner.recovery.store`); the workers' process groups live in it, one namespace
  per generation (:mod:`elastic_runner.recovery.inplace`), and any node's agent announces generations
  through one counter in it;
* once the workers have built the task it starts a **spare**: the worker command with
  :data:`~elastic_runner.protocol.env.SPARE_ENV` set, which imports torch, builds the task's data and
  model and waits;
* when a worker exits with a failure (not 0, not 2 = bad input, not 143 = preempted) while
  others of the node still run, :meth:`_monitor_workers` hands the dead worker's environment
  (rank, local_rank, error file, ...) to the spare, puts the spare in the dead worker's place in
  torch's process context, publishes the next generation and reports the group healthy, instead
  of torch's stop-everything-and-restart (:mod:`.replacement`). Each replacement counts against
  ``--max-restarts``;
* a worker whose heartbeat file (:mod:`elastic_runner.recovery.heartbeat`) is older than
  ``recovery.heartbeat_timeout_seconds`` (SIGSTOP, a process frozen in the kernel or holding
  the GIL) is SIGKILLed and then replaced in the same way (:mod:`.hang_watch`).

The agent composes the parts that do this, each in its own module: the attempt's shared state
(:mod:`.node_attempt`), spares (:mod:`.spares`), hung workers (:mod:`.hang_watch`),
replacements (:mod:`.replacement`), the node's membership of a multi-node job
(:mod:`.node_membership`), nodes joining it (:mod:`.joins`) and the recovery store's fail-over
(:mod:`.store_failover`); this module holds torch's agent hooks and the look at the workers
that picks between them.

Everything else (no survivor on this node, a worker that finished, bad input, preemption,
running out of restarts, a restart asked for by any worker or agent of the attempt, an
unreachable recovery store) goes to torch's own handling unchanged; the agent then sets the
attempt's ``restart`` key so that no other node's agent replaces anyone in place meanwhile.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import SignalException, SubprocessContext

from ..compat.rendezvous import leave_rendezvous_open
from ..protocol.env import SPARE_ENV
from ..protocol.keys import single_node_prefix
from ..protocol.scoped_env import environment
from ..recovery.config import RecoveryConfig
from ..recovery.membership import Policy
from ..recovery.store import StoreLocation
from .hang_watch import hang_watch
from .joins import Joins
from .node_attempt import AGENT_LOG as log
from .node_attempt import NodeAttempt
from .node_membership import NodeMembership
from .replacement import Replacement, Replacer
from .spares import spares_for
from .store import AgentStore
from .store_failover import StoreFailover


class InPlaceAgent(LocalElasticAgent):
    """See the module docstring. ``recovery``: the config's ``recovery`` section;
    ``location``: the rendezvous backend's store for a multi-node job (None: one node, this
    agent hosts the store); ``on_replacement``: called with each :class:`Replacement` (the
    node's metrics); ``policy``: whether the rest may go on without a lost node;
    ``hosts_store``: c10d, this node is the rendezvous host; ``script``: the workers run a
    user's script (``recovery/script.py``), replaced in place only once its loop announced
    that it recovers in place."""

    def __init__(self, *args: Any, recovery: RecoveryConfig,
                 location: StoreLocation | None = None,
                 on_replacement: Callable[[Replacement], None] | None = None,
                 policy: Policy | None = None, hosts_store: bool = False,
                 script: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._cfg = recovery
        # (not _store: torch's agent has one of its own)
        rs = AgentStore(location, recovery.join_timeout_seconds,
                        self._worker_group.spec.local_addr)
        heartbeats = Path(tempfile.mkdtemp(prefix="elastic-runner-heartbeats-"))
        self._attempt = NodeAttempt(rs, heartbeats, policy or Policy())
        self._spares = spares_for(self._attempt, recovery.spare, recovery.spare_delay_seconds,
                                  recovery.spares)
        self._hangs = hang_watch(heartbeats, recovery.heartbeat_timeout_seconds)
        self._membership = NodeMembership(
            self._attempt, recovery.node_timeout_seconds, hosts_store,
            StoreFailover(self._attempt, self._followed_store))
        self._joins = Joins(self._attempt, self._membership)
        # a user's script recovers in place once its loop said it can (``built``, announced by
        # a fault_tolerant loop's resume); before that, or in a script without one, a failure
        # takes the restart path
        self._replacer = Replacer(self._attempt, self._spares, recovery.continue_shrunk, script,
                                  on_replacement or (lambda r: None))
        self._healthy = False  # the last look found the group healthy
        self.left_the_job = False  # this node left in place: no restart (the restart budget's)

    # ------------------------------------------------------------ torch's agent hooks

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        rs, joining = self._attempt.rs, False
        if not rs.multi_node:
            rs.prefix = single_node_prefix(uuid.uuid4().hex[:12])
        else:  # the same prefix on every node, new every rendezvous round (unless running)
            joining = rs.agree(worker_group.store, worker_group.group_rank or 0,
                               worker_group.group_world_size or 1)
        # the previous attempt's generations, membership, shrinking and join say nothing
        # about this one
        self._attempt.begin(worker_group.group_rank or 0)
        for part in (self._replacer, self._spares, self._joins):
            part.begin()
        self._clear_heartbeats()
        # SPARE_ENV: restored too (a joining node's stand_by sets it for its workers)
        with environment({SPARE_ENV: os.environ.get(SPARE_ENV),
                          **self._attempt.worker_variables()}):
            rs.attempt.restart_asked()  # connect before the workers
            if joining:
                self._joins.stand_by(worker_group)
            else:
                self._membership.register(worker_group)
            return super()._start_workers(worker_group)

    def _exit_barrier(self) -> None:
        """torch's barrier of every node's agent at the end waits for the nodes of the
        rendezvous round; nodes that left in place never arrive (it would wait its whole
        timeout, 300 s): only the nodes still in the group count."""
        if self._attempt.rs.multi_node:
            try:
                self._worker_group.group_world_size = len(self._attempt.current_view().nodes)
            except (RuntimeError, dist.DistError) as e:
                log.warning("membership: the recovery store is unreachable at the end (%s)", e)
        super()._exit_barrier()

    def _stop_workers(self, worker_group: WorkerGroup, *args: Any, **kwargs: Any) -> None:
        self._membership.close()
        self._spares.drop()
        super()._stop_workers(worker_group, *args, **kwargs)

    def _shutdown(self, *args: Any, **kwargs: Any) -> None:
        # stopped from outside (SIGTERM: an eviction) while the workers run: they leave at
        # their next step boundary, so the node beats until they are gone; silence after that
        # is a node that is gone, whether its workers left in order or died on the way
        self._spares.drop()
        try:
            super()._shutdown(*args, **kwargs)
        finally:
            self._membership.close()
        # this node left, and the store it hosts moved on
        self._wait_for_followers()
        shutil.rmtree(self._attempt.heartbeats, ignore_errors=True)

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        result = self._look(worker_group)
        self._healthy = result.state == WorkerState.HEALTHY
        return result

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        """torch calls this for a failure, and, while the group is healthy, when a node waits
        in the rendezvous: that one joins in place instead when the workers can take it in."""
        if self._healthy and not self._replacer.shrunk and self._joins.takes_joins():
            self._joins.let_in(worker_group, self._rendezvous)
            return
        super()._restart_workers(worker_group)

    # ------------------------------------------------------------ the look at the workers

    def _look(self, worker_group: WorkerGroup) -> RunResult:
        pc = self._pcontext
        if not isinstance(pc, SubprocessContext):
            return super()._monitor_workers(worker_group)
        # one look at every worker decides; torch's own poll, which stops every worker at the
        # first failure it sees, runs only when this look leaves it nothing to recover
        self._hangs.kill_hung(pc)
        codes = {lr: h.proc.poll() for lr, h in pc.subprocess_handlers.items()}
        failed = {lr: c for lr, c in codes.items() if c not in (None, 0)}
        if failed:
            return self._on_failure(worker_group, pc, codes, failed)
        joining = self._keep_up(worker_group, pc)
        if joining is not None:
            return joining
        if any(code is None for code in codes.values()):
            # torch's optional check for workers stuck in the kernel (off unless configured)
            timeout = getattr(self, "_uninterruptible_state_timeout", 0.0)
            stuck = (self._check_uninterruptible_state_timeout(worker_group, timeout)
                     if timeout > 0 else None)
            return stuck or RunResult(state=WorkerState.HEALTHY)
        return super()._monitor_workers(worker_group)  # all succeeded

    def _on_failure(self, worker_group: WorkerGroup, pc: SubprocessContext,
                    codes: dict[int, int | None], failed: dict[int, int]) -> RunResult:
        """Some worker failed (``failed``: local rank -> exit code; ``codes``: every local
        rank's): leave, replace in place, or torch's restart path."""
        # a node that left is not a member: a worker of it that failed on the way out (any
        # code) has no rank to be replaced into
        if (reason := self._membership.departed()) is not None:
            return self._leave(worker_group, reason)
        if self._replacer.replaceable(codes, failed, self._remaining_restarts,
                                      self._joins.joining):
            left = self._remaining_restarts - 1
            self._replacer.replace(worker_group, pc, failed, left)
            self._remaining_restarts = left
            return RunResult(state=WorkerState.HEALTHY)
        if not self._joins.joining:  # (joining: not in the group yet, this node restarts)
            # torch's restart path: release survivors (on every node) waiting for an
            # announcement, and keep the other nodes' agents from replacing anyone meanwhile
            with contextlib.suppress(RuntimeError, dist.DistError):
                self._attempt.rs.attempt.ask_restart()
        return super()._monitor_workers(worker_group)

    def _keep_up(self, worker_group: WorkerGroup, pc: SubprocessContext) -> RunResult | None:
        """No failure: follow a join under way (returns how the join stands), or watch the
        other nodes, bring a shrunk group back to full size and keep a spare warm (returns
        None)."""
        try:
            if self._joins.joining:
                return self._follow_join(worker_group, pc)
            self._membership.watch_nodes(worker_group.store)
            self._replacer.announce_grow()
            self._spares.keep(pc)
        except SignalException:
            # SIGTERM/SIGINT to the agent (an eviction) raised here by torch's handler: it is
            # an Exception too, and swallowed it left the agent running (CI: a JobSet's SIGTERM
            # ignored for 120 s); torch's run() stops the workers for it
            raise
        except Exception as e:  # noqa: BLE001 - any client error of an unreachable store
            # (etcd down or restarting: python-etcd, urllib3 and torch raise their own types):
            # training goes on, the spare bookkeeping waits for the store
            log.debug("recovery store unavailable this round: %s", e)
        return None

    def _follow_join(self, worker_group: WorkerGroup, pc: SubprocessContext) -> RunResult:
        """Joining: healthy while the join goes on or once it is done; the end of this agent
        when the running job refused this node."""
        if self._joins.follow(worker_group, pc):
            return RunResult(state=WorkerState.HEALTHY)
        return self._leave(worker_group, "refused")

    # ------------------------------------------------------------ leaving

    def _leave(self, worker_group: WorkerGroup, reason: str) -> RunResult:
        """This node left the group (``reason``): end this agent without a restart and without
        closing the rendezvous (torch closes it when an agent fails; the job goes on without
        this node). Its workers' exit codes are the agent's (143 preempted, 3 fenced out)."""
        node = self._attempt.node
        if reason == "lost":
            log.error("membership: this node (%d) was declared lost while cut off; its workers "
                      "were fenced out and committed nothing; the job goes on without it", node)
        else:
            log.warning("membership: this node (%d) was %s and left the job; the others go on "
                        "without it", node, reason)
        self._remaining_restarts, self.left_the_job = 0, True
        self._wait_for_followers()
        leave_rendezvous_open(worker_group.spec.rdzv_handler)
        return super()._monitor_workers(worker_group)

    def _wait_for_followers(self) -> None:
        self._attempt.rs.wait_for_followers(self._attempt.node,
                                            self._cfg.node_timeout_seconds or 10.0)

    def _followed_store(self, store: dist.Store) -> None:
        """The recovery store moved (``store``: a client of the new one): the spare waits in
        the old store (the next one starts in the new one); the node beats in the new one."""
        self._spares.drop()
        self._membership.follow(store)

    def _clear_heartbeats(self) -> None:
        """The previous attempt's workers' heartbeat files go."""
        self._attempt.heartbeats.mkdir(parents=True, exist_ok=True)
        for beat in self._attempt.heartbeats.iterdir():
            beat.unlink(missing_ok=True)
