"""Which generation this worker is in, and forming its process group: the members of generation
``g`` meet in ``<prefix>/pg/<g>/`` of the recovery store, a newer generation announced meanwhile
is followed, and after a failure the worker waits for the next generation's announcement (the
protocol in :mod:`elastic_runner.recovery.inplace`). A spare waits here for the generation it
is assigned to."""

from __future__ import annotations

import logging
import os
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ..logs import first_line
from ..protocol import env as runner_env
from ..protocol.torchrun_env import TorchrunEnv
from .group_sockets import GroupSockets
from .outcomes import JobFinished
from .store_client import StoreClient

# the worker's recovery log lines keep the logger name they always had (bench and operators
# read them by it)
log = logging.getLogger("elastic_runner.recovery.inplace")

_POLL_S = 0.005
_SPARE_POLL_S = 0.01  # a spare's look for its assignment (seconds)


class GroupFormation:
    """Generation ``generation``'s group, through ``client``'s store.

    Args:
        client: the recovery store.
        generation: the group this process (first) joins: 0 at the attempt's start, the
            announced one for a replacement.
        detect_timeout_s: how long a failed collective waits for the next generation's
            announcement (seconds).
        join_timeout_s: the limit for forming a group (seconds; covers a replacement still
            starting).
        backend: the process-group backend (``gloo``/``nccl``).
        sockets: the current group's connections (cut on a failure).
    """

    def __init__(self, client: StoreClient, generation: int, detect_timeout_s: float,
                 join_timeout_s: float, backend: str, sockets: GroupSockets) -> None:
        self.client, self.generation = client, generation
        self.detect_timeout_s, self.join_timeout_s = detect_timeout_s, join_timeout_s
        self.backend, self.sockets = backend, sockets

    def group_store(self, rank: int | None = None, world_size: int | None = None
                    ) -> dist.Store:
        """The store of the process group to create: the current generation's, once all
        ``world_size`` members have shown up in it (a newer generation announced meanwhile,
        e.g. the replacement died while joining, is followed). ``rank``/``world_size``
        default to ``RANK``/``WORLD_SIZE`` of the environment.

        Raises:
            TimeoutError: not every member showed up within ``join_timeout_s``.
            JobFinished: the job's training ended meanwhile (rank 0 announced it finished).
        """
        if rank is None:
            here = TorchrunEnv.read()
            rank, world_size = here.rank, here.world_size
        assert world_size is not None
        deadline = time.monotonic() + self.join_timeout_s
        while True:
            attempt = self.client.attempt
            attempt.show_up(self.generation, rank)
            if self._all_present(world_size, deadline):
                return attempt.group_store(self.generation)
            log.warning("generation %d was superseded while forming (another worker died); "
                        "joining %d", self.generation, self.generation + 1)
            self.generation += 1

    def _all_present(self, world_size: int, deadline: float) -> bool:
        """Whether all ``world_size`` members showed up in the current generation; False once
        the next one was announced instead.

        Raises:
            JobFinished, TimeoutError: as :meth:`group_store`.
        """
        attempt = self.client.attempt
        while not attempt.all_present(self.generation, world_size):
            if attempt.announced(self.generation + 1):
                return False
            if attempt.finished():
                raise JobFinished(f"the job's training finished while this process waited "
                                  f"to join generation {self.generation}: nothing to do")
            if time.monotonic() > deadline:
                raise TimeoutError(f"in-place recovery: generation {self.generation} did "
                                   f"not form within {self.join_timeout_s:.0f} s "
                                   "(recovery.join_timeout_seconds)")
            time.sleep(_POLL_S)
        return True

    def form_group(self, rank: int, world_size: int, generation: int) -> None:
        """Create generation ``generation``'s group (or a newer one's, see
        :meth:`group_store`; after a :class:`~elastic_runner.recovery.outcomes.Regroup`, with
        its numbers); a group that fails to form because a newer generation was announced
        meanwhile moves on to that one.

        Raises:
            RuntimeError, torch.distributed.DistError: the group failed to form and no newer
                generation was announced.
            TimeoutError, JobFinished: as :meth:`group_store`.
        """
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
                if not self.client.attempt.announced(self.generation + 1):
                    raise
                log.warning("generation %d did not form (%s); joining %d", self.generation,
                            first_line(e), self.generation + 1)
                if dist.is_initialized():
                    dist.destroy_process_group()
                self.generation += 1

    def wait_generation(self, generation: int, timeout_s: float) -> dict[str, Any] | None:
        """Generation ``generation``'s announcement, ``{"restart": True}`` once any agent or
        worker asked for torch's restart path, or None after ``timeout_s`` (seconds).

        Raises:
            RuntimeError: the store is unreachable.
        """
        deadline = time.monotonic() + timeout_s
        attempt = self.client.attempt
        while True:
            announced = attempt.announcement(generation)
            if announced is not None:
                return announced
            if time.monotonic() > deadline:
                return None
            time.sleep(_POLL_S)

    def next_announcement(self, timeout_s: float | None = None) -> dict[str, Any] | None:
        """The next generation's announcement (or the restart path's), within ``timeout_s``
        (seconds; default ``detect_timeout_s``); None when none came. A store that does not
        answer is followed to where this node's agent moved it
        (:meth:`StoreClient.follow_agent
        <elastic_runner.recovery.store_client.StoreClient.follow_agent>`).

        Raises:
            RuntimeError: the store is unreachable and no agent moved it (logged).
        """
        deadline = time.monotonic() + (self.detect_timeout_s if timeout_s is None else timeout_s)
        while True:
            try:
                return self.wait_generation(self.generation + 1, deadline - time.monotonic())
            except (RuntimeError, dist.DistError) as e:
                if not self.client.follow_agent(deadline, self.generation):
                    log.error("in-place recovery: the recovery store (%s) is unreachable (%s): "
                              "taking the restart path", self.client.location.describe(),
                              first_line(e))
                    raise

    def wait_assignment(self, spare: str) -> dict[str, str]:
        """A spare (after building the task) tells the agent it is ready and blocks until the
        agent hands it a failed worker's place; joins that worker's generation and returns its
        environment (RANK, LOCAL_RANK, ... and
        :data:`~elastic_runner.protocol.env.GENERATION_ENV`).

        Raises:
            RuntimeError: the store is gone (its agent died, or the store moved on).
        """
        attempt = self.client.attempt
        attempt.spare_ready(spare)
        # a store that is gone (its agent died, or the store moved on) raises here: leave
        env = attempt.wait_assignment(spare, _SPARE_POLL_S)
        self.generation = runner_env.generation_of(env)
        restore_priority()
        return env


def restore_priority() -> None:
    """A spare started at a lower CPU priority (:data:`~elastic_runner.protocol.env.SPARE_NICE_ENV`) that takes a worker's
    place: every thread of this process back to the agent's nice value. A thread that cannot
    be changed (no CAP_SYS_NICE: the agent then starts none lower) is logged."""
    target = runner_env.pop_spare_nice()
    if target is None:
        return
    for tid in os.listdir("/proc/self/task"):
        try:
            os.setpriority(os.PRIO_PROCESS, int(tid), int(target))
        except (PermissionError, ProcessLookupError) as e:
            log.warning("the replacement's thread %s keeps its lower priority: %s", tid, e)
