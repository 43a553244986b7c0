"""Replacing a failed worker in place: a spare takes its rank while the others keep running.

When a worker exits with a failure (not 0, not 2 = bad input, not 3 = fenced out, not 143 =
preempted, not a hang) while others still run, :meth:`Replacer.replace` hands the dead worker's
environment (rank, local_rank, error file, ...) to a spare, puts the spare in the dead
worker's place in torch's process context and announces the next generation: the survivors
re-form their group with it (:mod:`elastic_runner.recovery.inplace`). With
``recovery.continue_shrunk`` (one node, no warm spare) the survivors go on without the rank
until its replacement is ready (:meth:`Replacer.announce_grow`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch.distributed.elastic.agent.server.api import WorkerGroup

from ..exit_codes import EXIT_BAD_INPUT, EXIT_FENCED, EXIT_HANG, EXIT_PREEMPTED
from ..protocol.announcement import Announcement
from ..protocol.torchrun_env import assignment
from ..recovery.membership import View
from .node_attempt import AGENT_LOG as log
from .node_attempt import NodeAttempt
from .spares import Spare, Spares
from .worker_start import Worker

# exit codes never replaced in place: a replacement would fail the same way (bad input), a
# newer group owns the checkpoints (fenced out), the node goes away (preempted), or the rank
# whose watchdog fired may only be waiting for the hung one, which has not exited (a hang)
_NOT_REPLACED = (EXIT_BAD_INPUT, EXIT_FENCED, EXIT_PREEMPTED, EXIT_HANG)


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


class Replacer:
    """Replaces this node's failed workers in place.

    Args:
        attempt: the attempt this node runs.
        spares: where replacements come from.
        continue_shrunk: ``recovery.continue_shrunk``.
        script: the workers run a user's script, replaced in place only once its loop
            announced that it recovers in place (``built``).
        on_replacement: called with each :class:`Replacement` (the node's metrics).
    """

    def __init__(self, attempt: NodeAttempt, spares: Spares, continue_shrunk: bool,
                 script: bool, on_replacement: Callable[[Replacement], None]) -> None:
        self._attempt, self._spares = attempt, spares
        self._continue_shrunk, self._script = continue_shrunk, script
        self._on_replacement = on_replacement
        self._grow: tuple[int, list[Spare]] | None = None  # shrunk: (generation, joiners)

    @property
    def shrunk(self) -> bool:
        """Whether the survivors go on without replacements that are not ready yet."""
        return self._grow is not None

    def begin(self) -> None:
        """A new attempt starts at full size."""
        self._grow = None

    def replaceable(self, codes: dict[int, int | None], failed: dict[int, int],
                    restarts_left: int, joining: bool) -> bool:
        """Whether the ``failed`` local ranks (-> exit code) can be replaced in place: a
        failure of the kind replaced, some worker still running (on this node, or on another
        node of a multi-node job) and none finished (``codes``: every local rank's exit code
        or None), restarts left, not shrunk, this node not ``joining``, no restart asked for,
        and a script's loop ready for it."""
        if any(code in _NOT_REPLACED for code in failed.values()):
            return False
        others = [code for lr, code in codes.items() if lr not in failed]
        # several nodes: the survivors may all be elsewhere (if there are none, the
        # replacements find no peer to copy and resume from the checkpoint: recovery/rejoin.py)
        survivors = bool(others) or self._attempt.rs.multi_node
        # a failure while shrunk takes the restart path
        return (survivors and all(code is None for code in others)
                and restarts_left > 0 and self._grow is None
                and not joining and not self._attempt.restart_asked()
                and (not self._script or self._attempt.rs.attempt.built()))

    def replace(self, worker_group: WorkerGroup, pc: Any, failed: dict[int, int],
                restarts_left: int) -> None:
        """Put a spare in each ``failed`` local rank's place in ``pc`` (torch's
        ``SubprocessContext``) and ``worker_group``, and announce the generation that takes
        them in; ``restarts_left``: torch's remaining restarts once this one is spent.

        Raises:
            RuntimeError, torch.distributed.DistError: the recovery store does not answer.
        """
        t0 = time.perf_counter()
        attempt, rs, warm = self._attempt, self._attempt.rs, self._spares.warm
        # continue shrunk: the survivors go on alone (generation g+1) and the replacement
        # joins them in g+2, announced once it is ready
        # (one node only: a shrunk group's bookkeeping lives in this agent)
        shrink = self._continue_shrunk and not warm and not rs.multi_node
        # one counter for the whole job: two nodes' agents never announce the same generation
        attempt.generation = rs.attempt.draw_generations(2 if shrink else 1)
        announce = attempt.generation - 1 if shrink else attempt.generation
        ranks, pids, spares = [], [], []
        view = attempt.current_view() if rs.multi_node else None
        for local_rank in sorted(failed):
            spare = self._take_place(worker_group, pc, local_rank, restarts_left, view)
            ranks.append(worker_group.workers[local_rank].global_rank)
            pids.append(spare.proc.pid)
            spares.append(spare)
        members: tuple[int, ...] | None = None
        if shrink:
            members = tuple(sorted(w.global_rank for w in worker_group.workers
                                   if w.global_rank not in ranks))  # one node: every rank is here
            self._grow = (attempt.generation, spares)
        rs.attempt.announce(announce, Announcement(
            failed=tuple(ranks), exitcodes=tuple(failed.values()), members=members,
            world_size=None if members is None else len(members)))
        replacement = Replacement(announce, tuple(ranks), tuple(failed.values()), warm,
                                  time.perf_counter() - t0)
        cold = [s for s in spares if not s.ready]
        log.warning("rank(s) %s exited with code(s) %s: replaced in place by %s spare(s) "
                    "pid(s) %s (generation %d; node %d; %d restarts left)%s%s", ranks,
                    list(failed.values()), "cold" if cold else "warm", pids, announce,
                    attempt.node, restarts_left,
                    f"; cold: {self._spares.why_cold}" if cold else "",
                    "; the others go on without it until it is ready" if shrink else "")
        self._on_replacement(replacement)

    def _take_place(self, worker_group: WorkerGroup, pc: Any, local_rank: int,
                    restarts_left: int, view: View | None) -> Spare:
        """A spare takes ``local_rank``'s place: its environment assigned in the store, its
        process in ``pc``, its pid in ``worker_group`` (``view``: the membership, several
        nodes)."""
        attempt, rs = self._attempt, self._attempt.rs
        spare = self._spares.take(pc)
        # the replacement is the rank's next attempt: restarts used so far, as torch counts them
        # GROUP_RANK: this node's id, which a node that joined claimed after its start
        env = assignment(pc.envs[local_rank], attempt.generation,
                         restart_count=worker_group.spec.max_restarts - restarts_left,
                         node_rank=attempt.node, store=rs.for_workers().to_json())
        worker = worker_group.workers[local_rank]
        if view is not None:  # ranks renumbered since the start (a node left)
            rank = view.nodes[attempt.node][local_rank]
            env = assignment(env, attempt.generation, rank=rank, world_size=view.world_size)
            worker.global_rank, worker.world_size = rank, view.world_size
        # the dead worker's file goes before the spare can start beating into it
        (attempt.heartbeats / str(local_rank)).unlink(missing_ok=True)
        rs.attempt.assign(spare.name, env)
        pc.subprocess_handlers[local_rank] = Worker(spare.proc, local_rank)
        worker.id = spare.proc.pid
        return spare

    def announce_grow(self) -> None:
        """Shrunk: once every replacement is ready, announce the generation with all ranks
        (the survivors join it at their next step boundary).

        Raises:
            Exception: any client error of an unreachable recovery store.
        """
        if self._grow is None:
            return
        generation, spares = self._grow
        if all(self._attempt.rs.attempt.is_spare_ready(s.name) for s in spares):
            self._attempt.rs.attempt.announce(generation, Announcement(grow=True))
            self._grow = None
            log.info("replacement(s) ready: generation %d brings the group back to full size",
                     generation)
