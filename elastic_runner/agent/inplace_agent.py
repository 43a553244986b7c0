"""In-place recovery, the agent's side: replace only the failed worker, from a warm spare.

:class:`InPlaceAgent` is torch's ``LocalElasticAgent`` (subclassed through torch.distributed.
elastic's agent API, not forked) with these changes, used by ``elastic-runner run`` with
``recovery.mode: in_place``, on one node or on each node of a multi-node job:

* it names the attempt's **recovery store** to the workers in
  :data:`~elastic_runner.recovery.protocol.ENV` (one node: a ``TCPStore`` it hosts on ``127.0.0.1``;
  several nodes: the rendezvous backend's store that every node reaches, see
  :mod:`elastic_runner.recovery.store`); the workers' process groups live in it, one namespace
  per generation (:mod:`elastic_runner.recovery.inplace`), and any node's agent announces generations
  through one counter in it;
* once the workers have built the task it starts a **spare**: the worker command with
  :data:`~elastic_runner.recovery.protocol.SPARE_ENV` set, which imports torch, builds the task's data and
  model and waits;
* when a worker exits with a failure (not 0, not 2 = bad input, not 143 = preempted) while
  others of the node still run, :meth:`_monitor_workers` hands the dead worker's environment
  (rank, local_rank, error file, ...) to the spare, puts the spare in the dead worker's place in
  torch's process context, publishes the next generation and reports the group healthy, instead
  of torch's stop-everything-and-restart. Each replacement counts against ``--max-restarts``;
* a worker whose heartbeat file (:mod:`elastic_runner.recovery.heartbeat`) is older than
  ``recovery.heartbeat_timeout_seconds`` (SIGSTOP, a process frozen in the kernel or holding
  the GIL) is SIGKILLed and then replaced in the same way.

Everything else (no survivor on this node, a worker that finished, bad input, preemption,
running out of restarts, a restart asked for by any worker or agent of the attempt, an
unreachable recovery store) goes to torch's own handling unchanged; the agent then sets the
attempt's ``restart`` key so that no other node's agent replaces anyone in place meanwhile.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import SubprocessContext

from ..compat import leave_rendezvous_open
from ..exit_codes import EXIT_BAD_INPUT, EXIT_FENCED, EXIT_HANG, EXIT_PREEMPTED
from ..logs import first_line
from ..recovery.config import RecoveryConfig
from ..recovery.membership import (
    THREAD_STORE_TIMEOUT_S,
    NoBeat,
    NodeBeat,
    NodeWatch,
    Policy,
    View,
    admission,
    announce_departure,
    claim_node_id,
    departure_of,
    read_global_batch,
    read_view,
    refusal,
    register,
    request_join,
    seed,
)
from ..recovery.protocol import ENV, GENERATION_ENV, HEARTBEAT_ENV, MIN_NODES_ENV, SPARE_ENV
from ..recovery.store import StoreLocation, claim_successor, connect, tell_workers
from .store import AgentStore

log = logging.getLogger(__name__)

_RANK_VARIABLES = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_ERROR_FILE")


class _Adopted:
    """A process the agent started itself (a spare), in the shape of torch's
    ``SubprocessHandler`` (``proc``, ``local_rank_id``, ``close``)."""

    def __init__(self, proc: subprocess.Popen[bytes], local_rank: int) -> None:
        self.proc, self.local_rank_id = proc, local_rank

    def close(self, death_sig: signal.Signals | None = None) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, death_sig or signal.SIGTERM)


@dataclass
class _Spare:
    name: str  # "<node rank>.<number>": its keys in the recovery store
    proc: subprocess.Popen[bytes]
    started: float
    ready: bool = False


@dataclass
class _Join:
    """This node joins a running attempt as node id ``node``: its workers stand by as spares
    named ``<node>.join.<local rank>`` until the group takes them in; ``request``: the number
    of its join request once posted."""

    node: int
    request: int = 0

    @property
    def spares(self) -> str:
        """The workers' :data:`~elastic_runner.recovery.protocol.SPARE_ENV`: each appends its local
        rank."""
        return f"{self.node}.join."

    def spare(self, local_rank: int) -> str:
        return f"{self.spares}{local_rank}"


@dataclass(frozen=True)
class Replacement:
    """One in-place replacement: ``generation`` announced, ``ranks`` that died and their exit
    codes, whether a warm spare took their place, and the agent's reaction time (seconds from
    noticing the exit to the announcement)."""

    generation: int
    ranks: tuple[int, ...]
    exitcodes: tuple[int, ...]
    warm: bool
    seconds: float


class InPlaceAgent(LocalElasticAgent):
    """See the module docstring. ``recovery``: the config's ``recovery`` section;
    ``location``: the rendezvous backend's store for a multi-node job (None: one node, this
    agent hosts the store); ``on_replacement``: called with each :class:`Replacement` (the
    node's metrics); ``script``: the workers run a user's script (``recovery/script.py``),
    replaced in place only once its loop announced that it recovers in place."""

    def __init__(self, *args: Any, recovery: RecoveryConfig,
                 location: StoreLocation | None = None, on_replacement: Any = None,
                 policy: Policy | None = None, hosts_store: bool = False,
                 script: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._cfg = recovery
        # a user's script recovers in place once its loop said it can (``built``, announced by
        # a fault_tolerant loop's resume); before that, or in a script without one, a failure
        # takes the restart path
        self._script = script
        self._policy = policy or Policy()
        self._hosts_store = hosts_store  # c10d: this node is the rendezvous host
        self._watch: NodeWatch | None = None  # several nodes with node_timeout_seconds
        self._beat: NodeBeat | NoBeat = NoBeat()
        self._on_replacement = on_replacement or (lambda r: None)
        # (not _store: torch's agent has one of its own)
        self._rs = AgentStore(location, recovery.join_timeout_seconds,
                              self._worker_group.spec.local_addr)
        self._heartbeats = Path(tempfile.mkdtemp(prefix="elastic-runner-heartbeats-"))
        self._node = 0
        self._generation = 0
        self._spare: _Spare | None = None
        self._spares = 0
        self._grow: tuple[int, list[_Spare]] | None = None  # shrunk: (generation, joiners)
        self._built_since: float | None = None  # when the workers reported the task built
        self._joining: _Join | None = None  # this node joins a running attempt
        self._healthy = False  # the last look found the group healthy
        self._view: View | None = None  # the membership as last read (etcd: whom to move to)
        self.left_the_job = False  # this node left in place: no restart (compat's budget)

    # ------------------------------------------------------------ torch's agent hooks

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        self._node = worker_group.group_rank or 0
        joining = False
        if not self._rs.multi_node:
            self._rs.prefix = f"attempt-{uuid.uuid4().hex[:12]}"
        else:  # the same prefix on every node, new every rendezvous round (unless running)
            joining = self._rs.agree(worker_group.store, worker_group.group_rank or 0,
                                     worker_group.group_world_size or 1)
        self._generation, self._grow, self._built_since, self._joining = 0, None, None, None
        self._view = None  # the previous attempt's membership says nothing about this one
        self._heartbeats.mkdir(parents=True, exist_ok=True)
        for beat in self._heartbeats.iterdir():  # the previous attempt's workers
            beat.unlink(missing_ok=True)
        saved = {name: os.environ.get(name)
                 for name in (ENV, HEARTBEAT_ENV, MIN_NODES_ENV, SPARE_ENV)}
        os.environ.update(self._worker_variables())
        try:
            self._rs.attempt.restart_asked()  # connect before the workers
            if joining:
                self._stand_by_to_join(worker_group)
            else:
                self._join_membership(worker_group)
            return super()._start_workers(worker_group)
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value

    def _exit_barrier(self) -> None:
        """torch's barrier of every node's agent at the end waits for the nodes of the
        rendezvous round; nodes that left in place never arrive (it would wait its whole
        timeout, 300 s): only the nodes still in the group count."""
        if self._rs.multi_node:
            try:
                self._worker_group.group_world_size = len(self._current_view().nodes)
            except (RuntimeError, dist.DistError) as e:
                log.warning("membership: the recovery store is unreachable at the end (%s)", e)
        super()._exit_barrier()

    def _stop_workers(self, worker_group: WorkerGroup, *args: Any, **kwargs: Any) -> None:
        self._beat.close()
        self._drop_spare()
        super()._stop_workers(worker_group, *args, **kwargs)

    def _shutdown(self, *args: Any, **kwargs: Any) -> None:
        # stopped from outside (SIGTERM: an eviction) while the workers run: they leave at
        # their next step boundary, so the node beats until they are gone; silence after that
        # is a node that is gone, whether its workers left in order or died on the way
        self._drop_spare()
        try:
            super()._shutdown(*args, **kwargs)
        finally:
            self._beat.close()
        # this node left, and the store it hosts moved on
        self._rs.wait_for_followers(self._node, self._cfg.node_timeout_seconds or 10.0)
        shutil.rmtree(self._heartbeats, ignore_errors=True)

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        result = self._look(worker_group)
        self._healthy = result.state == WorkerState.HEALTHY
        return result

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        """torch calls this for a failure, and, while the group is healthy, when a node waits
        in the rendezvous: that one joins in place instead when the workers can take it in."""
        if self._healthy and self._takes_joins():
            self._let_in(worker_group)
            return
        super()._restart_workers(worker_group)

    def _look(self, worker_group: WorkerGroup) -> RunResult:
        pc = self._pcontext
        if not isinstance(pc, SubprocessContext):
            return super()._monitor_workers(worker_group)
        # one look at every worker decides; torch's own poll, which stops every worker at the
        # first failure it sees, runs only when this look leaves it nothing to recover
        self._kill_hung(pc)
        codes = {lr: h.proc.poll() for lr, h in pc.subprocess_handlers.items()}
        failed = {lr: c for lr, c in codes.items() if c not in (None, 0)}
        # a node that left is not a member: a worker of it that failed on the way out (any
        # code) has no rank to be replaced into
        if failed and (reason := self._departed()) is not None:
            return self._leave(worker_group, reason)
        if failed and self._replaceable(codes, failed):
            self._replace(worker_group, pc, failed)
            return RunResult(state=WorkerState.HEALTHY)
        if failed and self._joining is not None:  # not in the group yet: this node restarts
            return super()._monitor_workers(worker_group)
        if failed:  # torch's restart path: release survivors (on every node) waiting for an
            # announcement, and keep the other nodes' agents from replacing anyone meanwhile
            with contextlib.suppress(RuntimeError, dist.DistError):
                self._rs.attempt.ask_restart()
            return super()._monitor_workers(worker_group)
        try:
            if self._joining is not None:
                return self._follow_join(worker_group, pc)
            self._watch_nodes()
            self._announce_grow()
            self._keep_spare(pc)
        except Exception as e:  # noqa: BLE001 - any client error of an unreachable store
            # (etcd down or restarting: python-etcd, urllib3 and torch raise their own types):
            # training goes on, the spare bookkeeping waits for the store
            log.debug("recovery store unavailable this round: %s", e)
        if any(code is None for code in codes.values()):
            # torch's optional check for workers stuck in the kernel (off unless configured)
            timeout = getattr(self, "_uninterruptible_state_timeout", 0.0)
            stuck = (self._check_uninterruptible_state_timeout(worker_group, timeout)
                     if timeout > 0 else None)
            return stuck or RunResult(state=WorkerState.HEALTHY)
        return super()._monitor_workers(worker_group)  # all succeeded

    # ------------------------------------------------------------ membership

    def _join_membership(self, worker_group: WorkerGroup, joined: bool = False) -> None:
        """Several nodes: register this node's ranks, beat, and watch the others' heartbeats
        (:mod:`elastic_runner.recovery.membership`)."""
        self._watch = None
        self._beat.close()
        if not self._rs.multi_node:
            return
        # the store's host: c10d's rendezvous host; with etcd node rank 0, whose offer every
        # node took (each etcd agent hosts a store, only that one is used)
        hosts = self._node == 0 if self._rs.location.kind == "node0" else self._hosts_store
        register(self._rs.store, self._rs.key, self._node,
                 [w.global_rank for w in worker_group.workers], hosts,
                 None if joined else worker_group.group_world_size or 1, self._rs.own)
        log.info("membership: node %d registered with rank(s) %s%s", self._node,
                 [w.global_rank for w in worker_group.workers],
                 f"; it hosts the recovery store ({self._rs.location.describe()})"
                 if hosts else "")
        if self._cfg.node_timeout_seconds is not None:
            self._watch = NodeWatch(self._rs.store, self._rs.key, self._node,
                                    self._cfg.node_timeout_seconds)
            self._beat = NodeBeat(connect(self._rs.location, THREAD_STORE_TIMEOUT_S),
                                  self._rs.key, self._node).start()

    def _current_view(self) -> View:
        self._view = read_view(self._rs.store, self._rs.key)
        return self._view

    # ------------------------------------------------------------ joins

    def _takes_joins(self) -> bool:
        """Whether a node waiting in the rendezvous may join in place: several nodes, this
        node's workers run (not joining themselves, not shrunk), no restart under way, and the
        workers said they can take nodes in (the built-in trainer; a script's own loop
        cannot)."""
        if not self._rs.multi_node or self._joining is not None or self._grow is not None:
            return False
        try:
            return (self._rs.attempt.joins_in_place()
                    and not self._restart_asked())
        except (RuntimeError, dist.DistError):
            return False

    def _let_in(self, worker_group: WorkerGroup) -> None:
        """Take part in the new rendezvous round that lets the waiting node(s) in, without
        stopping this node's workers: torch's round and rank assignment (which the newcomer's
        agent waits for), then the attempt's prefix and store handed on (:func:`agree_attempt
        <elastic_runner.recovery.store.agree_attempt>`). The workers take the newcomers in at
        a step boundary once their workers are ready (:mod:`elastic_runner.recovery.membership`)."""
        t0 = time.monotonic()
        workers, node = worker_group.workers, self._node
        master = (worker_group.master_addr, worker_group.master_port)
        self._rendezvous(worker_group)
        nnodes = worker_group.group_world_size
        worker_group.workers = workers  # this node's workers keep their ranks and processes
        worker_group.master_addr, worker_group.master_port = master
        self._rs.agree(worker_group.store, worker_group.group_rank or 0,
                       worker_group.group_world_size or 1,
                       running=(self._rs.prefix, self._rs.location.endpoint))
        worker_group.group_rank = node  # the node keeps its id across rounds
        log.warning("membership: node(s) waiting to join: rendezvous round of %d nodes taken "
                    "in %.2f s; this node's workers go on and take them in at a step boundary",
                    nnodes, time.monotonic() - t0)

    def _stand_by_to_join(self, worker_group: WorkerGroup) -> None:
        """This node's agent joined a running attempt: claim a node id, and start the workers
        as spares that build the task and wait for the group to take them in."""
        self._joining = _Join(claim_node_id(self._rs.store, self._rs.key,
                                            self._current_view()))
        self._node = worker_group.group_rank = self._joining.node
        os.environ[SPARE_ENV] = self._joining.spares
        log.warning("membership: joining the running job as node %d: its %d worker(s) build "
                    "the task, then the group takes them in at a step boundary",
                    self._node, len(worker_group.workers))

    def _follow_join(self, worker_group: WorkerGroup, pc: SubprocessContext) -> RunResult:
        """Joining: post the join request once every worker stands by, then hand each worker
        its place once the group announced the generation that takes this node in."""
        join, store, attempt = self._joining, self._rs.store, self._rs.attempt
        assert join is not None
        if not join.request:
            if all(attempt.is_spare_ready(join.spare(lr)) for lr in pc.subprocess_handlers):
                join.request = request_join(store, self._rs.key, join.node,
                                            len(pc.subprocess_handlers), self._rs.own)
                log.info("membership: node %d ready to join (request %d)", join.node,
                         join.request)
            return RunResult(state=WorkerState.HEALTHY)
        refused = refusal(store, self._rs.key, join.request)
        if refused is not None:
            log.error("membership: the running job did not take this node in: %s", refused)
            for handler in pc.subprocess_handlers.values():
                handler.close(signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    handler.proc.wait(timeout=5)
            return self._leave(worker_group, "refused")
        admitted = admission(store, self._rs.key, join.node)
        if admitted is None:
            return RunResult(state=WorkerState.HEALTHY)
        generation, world_size = admitted["generation"], admitted["world_size"]
        for local_rank, rank in enumerate(admitted["ranks"]):
            env = {**pc.envs[local_rank], "RANK": str(rank), "WORLD_SIZE": str(world_size),
                   "GROUP_RANK": str(join.node), GENERATION_ENV: str(generation)}
            worker_group.workers[local_rank].global_rank = rank
            worker_group.workers[local_rank].world_size = world_size
            attempt.assign(join.spare(local_rank), env)
        self._joining, self._generation = None, generation
        self._join_membership(worker_group, joined=True)
        log.warning("membership: node %d joined the running job in generation %d as rank(s) "
                    "%s (world size %d)", join.node, generation, admitted["ranks"], world_size)
        return RunResult(state=WorkerState.HEALTHY)

    def _watch_nodes(self) -> None:
        """Announce the generation without each node whose heartbeat stopped
        (``recovery.node_timeout_seconds``), or take torch's restart path when the rest may
        not go on (:class:`~elastic_runner.recovery.membership.Policy`)."""
        if self._watch is None or not self._watch.due():
            return
        try:
            view = self._current_view()
        except (RuntimeError, dist.DistError) as e:  # the store's host is gone (etcd: move)
            self._fail_over(e)
            return
        if self._node in view.departed:  # cut off and left behind: its workers are fenced out
            return
        here = self._rs.location.endpoint
        if view.stores.get(view.store_node, here) != here:
            self._move(view.stores[view.store_node], view, "its host left")
            return
        lost = self._watch.lost(n for n in view.nodes if n not in view.departed)
        if not lost or self._restart_asked():
            return
        silent = max(lost.values())
        policy = self._policy.keeping(read_global_batch(self._rs.store, self._rs.key))
        why = policy.refuses(view, lost)
        if why is not None:
            log.error("membership: node(s) %s lost (no heartbeat for %.1f s) and the rest may "
                      "not go on without them (%s): torch's restart path", sorted(lost),
                      silent, why)
            self._rs.attempt.ask_restart()
            return
        done = announce_departure(self._rs.store, self._rs.key, view, sorted(lost), "lost",
                                  self._rs.client)
        if done is not None:
            generation, new, _ = done
            log.warning("membership: node(s) %s lost: no heartbeat for %.1f s "
                        "(recovery.node_timeout_seconds=%g); generation %d goes on without "
                        "them at world size %d", sorted(lost), silent,
                        self._cfg.node_timeout_seconds, generation, new.world_size)

    def _fail_over(self, error: BaseException) -> None:
        """The recovery store does not answer (etcd rendezvous): its host died. Move to the
        successor of the view last read, as claimed in etcd (:func:`claim_successor
        <elastic_runner.recovery.store.claim_successor>`), seeded from that view. Without a
        successor (c10d), or with etcd unreachable too (this node is cut off), nothing moves:
        the workers' failed collectives take torch's restart path."""
        view, dead = self._view, self._rs.location.endpoint
        successor = view.successor() if view is not None else None
        if view is None or successor is None:
            log.debug("recovery store unavailable: %s", error)
            return
        try:
            chosen = claim_successor(self._worker_group.store, self._rs.prefix, dead,
                                     view.stores[successor], THREAD_STORE_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - etcd's client raises its own types
            log.error("the recovery store (%s) is unreachable (%s), and so is the rendezvous "
                      "backend (%s): not moving it", self._rs.location.describe(),
                      first_line(error), first_line(e))
            return
        node = next((n for n, e in view.stores.items() if e == chosen), successor)
        self._move(chosen, view.moved_to(node), f"it does not answer ({first_line(error)})")

    def _move(self, endpoint: str, view: View, why: str) -> None:
        """Follow the recovery store to ``endpoint`` (``view``: the membership there, seeded
        unless present): acknowledge in the old store (its leaving host waits for that), seed
        the new one, tell this node's workers and spares, and beat and watch there."""
        old = self._rs.location.describe()
        with contextlib.suppress(RuntimeError, dist.DistError):
            self._rs.attempt.acknowledge_move(self._node, endpoint)
        store = self._rs.client(endpoint)
        seed(store, self._rs.key, view, max(self._generation, view.generation))
        self._rs.use(endpoint, store)
        self._view = view
        tell_workers(self._heartbeats, self._rs.for_workers())
        self._drop_spare()  # it waits in the old store; the next one starts in the new one
        self._beat.close()
        if self._watch is not None:
            self._watch = NodeWatch(store, self._rs.key, self._node, self._watch.timeout_s)
            self._beat = NodeBeat(connect(self._rs.location, THREAD_STORE_TIMEOUT_S),
                                  self._rs.key, self._node).start()
        log.warning("the recovery store moved from %s to node %d's agent (%s): %s", old,
                    view.store_node, endpoint, why)

    def _departed(self) -> str | None:
        """Why this node left the group in place (``preempted``, or ``lost``: the others
        declared it lost while it was cut off), or None while it is a member."""
        if self._watch is None:
            return None
        try:
            return departure_of(self._rs.store, self._rs.key, self._node)
        except (RuntimeError, dist.DistError):
            return None

    def _leave(self, worker_group: WorkerGroup, reason: str) -> RunResult:
        """This node left the group (``reason``): end this agent without a restart and without
        closing the rendezvous (torch closes it when an agent fails; the job goes on without
        this node). Its workers' exit codes are the agent's (143 preempted, 3 fenced out)."""
        if reason == "lost":
            log.error("membership: this node (%d) was declared lost while cut off; its workers "
                      "were fenced out and committed nothing; the job goes on without it",
                      self._node)
        else:
            log.warning("membership: this node (%d) was %s and left the job; the others go on "
                        "without it", self._node, reason)
        self._remaining_restarts, self.left_the_job = 0, True
        self._rs.wait_for_followers(self._node, self._cfg.node_timeout_seconds or 10.0)
        leave_rendezvous_open(worker_group.spec.rdzv_handler)
        return super()._monitor_workers(worker_group)

    def _running(self) -> bool:
        pc = self._pcontext
        return isinstance(pc, SubprocessContext) and any(
            h.proc.poll() is None for h in pc.subprocess_handlers.values())

    # ------------------------------------------------------------ replacement

    def _replaceable(self, codes: dict[int, int | None], failed: dict[int, int]) -> bool:
        """A failure (not bad input, not fenced out, not preemption, not a hang), some worker
        still running (on this node, or on another one of a multi-node job) and none finished,
        and restarts left (``codes``: every local rank's exit code or None)."""
        # a hang: the rank whose watchdog fired may only be waiting for the hung one, which
        # has not exited; replacing the waiter would wait for the hung rank forever
        if any(code in (EXIT_BAD_INPUT, EXIT_FENCED, EXIT_PREEMPTED, EXIT_HANG)
               for code in failed.values()):
            return False
        others = [code for lr, code in codes.items() if lr not in failed]
        # several nodes: the survivors may all be elsewhere (if there are none, the
        # replacements find no peer to copy and resume from the checkpoint: recovery/rejoin.py)
        survivors = bool(others) or self._rs.multi_node
        # a failure while shrunk takes the restart path
        return (survivors and all(code is None for code in others)
                and self._remaining_restarts > 0 and self._grow is None
                and self._joining is None and not self._restart_asked()
                and (not self._script or self._rs.attempt.built()))

    def _restart_asked(self) -> bool:
        """Whether a worker or agent of this attempt asked for torch's restart path, or the
        recovery store cannot be reached (c10d: the rendezvous host is gone)."""
        try:
            return self._rs.attempt.restart_asked()
        except (RuntimeError, dist.DistError) as e:
            log.error("the recovery store (%s) is unreachable (%s): torch's restart path",
                      self._rs.location.describe(), first_line(e))
            return True

    def _kill_hung(self, pc: SubprocessContext) -> None:
        """SIGKILL each worker whose heartbeat file is older than
        ``recovery.heartbeat_timeout_seconds`` (it is then replaced like a crashed one)."""
        limit = self._cfg.heartbeat_timeout_seconds
        if limit is None:
            return
        now = time.time()
        for local_rank, handler in pc.subprocess_handlers.items():
            beat = self._heartbeats / str(local_rank)
            try:
                age = now - beat.stat().st_mtime
            except FileNotFoundError:  # not beating yet (starting) or already replaced
                continue
            if age <= limit or handler.proc.poll() is not None:
                continue
            log.warning("local_rank %d (pid %d) sent no heartbeat for %.1f s "
                        "(recovery.heartbeat_timeout_seconds=%g): hung (stopped or frozen); "
                        "killing it", local_rank, handler.proc.pid, age, limit)
            beat.unlink(missing_ok=True)
            with contextlib.suppress(ProcessLookupError):
                os.kill(handler.proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                handler.proc.wait(timeout=5)

    def _replace(self, worker_group: WorkerGroup, pc: SubprocessContext,
                 failed: dict[int, int]) -> None:
        t0 = time.perf_counter()
        warm = (self._spare is not None and self._spare.ready
                and self._spare.proc.poll() is None)
        # continue shrunk: the survivors go on alone (generation g+1) and the replacement
        # joins them in g+2, announced once it is ready
        # (one node only: a shrunk group's bookkeeping lives in this agent)
        shrink = self._cfg.continue_shrunk and not warm and not self._rs.multi_node
        # one counter for the whole job: two nodes' agents never announce the same generation
        self._generation = self._rs.attempt.draw_generations(2 if shrink else 1)
        announce = self._generation - 1 if shrink else self._generation
        self._remaining_restarts -= 1
        # the replacement is the rank's next attempt: restarts used so far, as torch counts them
        attempt = worker_group.spec.max_restarts - self._remaining_restarts
        ranks, pids, spares = [], [], []
        view = self._current_view() if self._rs.multi_node else None
        for local_rank in sorted(failed):
            spare = self._take_spare(pc)
            # GROUP_RANK: this node's id, which a node that joined claimed after its start
            env = {**pc.envs[local_rank], GENERATION_ENV: str(self._generation),
                   "TORCHELASTIC_RESTART_COUNT": str(attempt), "GROUP_RANK": str(self._node),
                   ENV: self._rs.for_workers().to_json()}
            if view is not None:  # ranks renumbered since the start (a node left)
                rank = view.nodes[self._node][local_rank]
                env.update(RANK=str(rank), WORLD_SIZE=str(view.world_size))
                worker_group.workers[local_rank].global_rank = rank
                worker_group.workers[local_rank].world_size = view.world_size
            # the dead worker's file goes before the spare can start beating into it
            (self._heartbeats / str(local_rank)).unlink(missing_ok=True)
            self._rs.attempt.assign(spare.name, env)
            pc.subprocess_handlers[local_rank] = _Adopted(spare.proc, local_rank)  # type: ignore
            worker = worker_group.workers[local_rank]
            worker.id = spare.proc.pid
            ranks.append(worker.global_rank)
            pids.append(spare.proc.pid)
            spares.append(spare)
        news: dict[str, Any] = {"failed": ranks, "exitcodes": list(failed.values())}
        if shrink:
            members = sorted(w.global_rank for w in worker_group.workers
                             if w.global_rank not in ranks)  # one node: every rank is here
            news.update(members=members, world_size=len(members))
            self._grow = (self._generation, spares)
        self._rs.attempt.announce(announce, news)
        replacement = Replacement(announce, tuple(ranks), tuple(failed.values()), warm,
                                  time.perf_counter() - t0)
        log.warning("rank(s) %s exited with code(s) %s: replaced in place by %s spare(s) "
                    "pid(s) %s (generation %d; node %d; %d restarts left)%s", ranks,
                    list(failed.values()), "warm" if warm else "cold", pids, announce,
                    self._node, self._remaining_restarts,
                    "; the others go on without it until it is ready" if shrink else "")
        self._on_replacement(replacement)

    def _announce_grow(self) -> None:
        """Shrunk: once every replacement is ready, announce the generation with all ranks
        (the survivors join it at their next step boundary)."""
        if self._grow is None:
            return
        generation, spares = self._grow
        if all(self._rs.attempt.is_spare_ready(s.name)
               for s in spares):
            self._rs.attempt.announce(generation, {"grow": True})
            self._grow = None
            log.info("replacement(s) ready: generation %d brings the group back to full size",
                     generation)

    def _take_spare(self, pc: SubprocessContext) -> _Spare:
        spare = self._spare
        if spare is None or spare.proc.poll() is not None:
            spare = self._start_spare(pc)
        self._spare = None
        return spare

    def _keep_spare(self, pc: SubprocessContext) -> None:
        """Start a spare ``recovery.spare_delay_seconds`` after the workers have built the task
        (so it neither competes with their start-up nor makes a task artifact before rank 0
        does, and a short job never starts one); replace one that died."""
        if not self._cfg.spare:
            return
        if self._spare is not None and self._spare.proc.poll() is not None:
            log.warning("spare %s exited with code %s; starting another", self._spare.name,
                        self._spare.proc.returncode)
            self._spare = None
        spare = self._spare
        if spare is None and self._built_since is None \
                and self._rs.attempt.built():
            self._built_since = time.monotonic()
        if spare is None and self._built_since is not None \
                and time.monotonic() - self._built_since >= self._cfg.spare_delay_seconds:
            self._spare = self._start_spare(pc)
        elif (spare is not None and not spare.ready
              and self._rs.attempt.is_spare_ready(spare.name)):
            spare.ready = True
            log.info("spare %s ready (task built) %.1f s after its start", spare.name,
                     time.monotonic() - spare.started)

    def _start_spare(self, pc: SubprocessContext) -> _Spare:
        name, self._spares = f"{self._node}.{self._spares}", self._spares + 1
        env = {**os.environ, **pc.envs[0]}
        for variable in _RANK_VARIABLES:
            env.pop(variable, None)
        env.update({**self._worker_variables(), SPARE_ENV: name, "RANK": "-1"})
        proc = subprocess.Popen([pc.entrypoint, *map(str, pc.args[0])], env=env,
                                start_new_session=True)
        log.info("spare %s started (pid %d)", name, proc.pid)
        return _Spare(name, proc, time.monotonic())

    def _worker_variables(self) -> dict[str, str]:
        """What every worker and spare of this agent reads: the recovery store, the heartbeat
        directory and ``--nnodes`` MIN (a spare without it took a worker's SIGTERM for a
        departure the job allows: the 2:2 soak, a replaced rank preempted)."""
        return {ENV: self._rs.for_workers().to_json(), HEARTBEAT_ENV: str(self._heartbeats),
                MIN_NODES_ENV: str(self._policy.min_nodes)}

    def _drop_spare(self) -> None:
        spare, self._spare = self._spare, None
        if spare is not None and spare.proc.poll() is None:
            os.killpg(spare.proc.pid, signal.SIGKILL)
            spare.proc.wait()
