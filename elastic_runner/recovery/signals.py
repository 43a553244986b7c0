"""What a worker tells the agents through the recovery store: the task is built (a spare may
start), a recovery is over (the next spare may start), training finished (a waiting
replacement leaves), and take torch's restart path (no agent replaces anyone in place any
more). Keys behind
:class:`~elastic_runner.protocol.keys.AttemptKeys`."""

from __future__ import annotations

import contextlib

import torch.distributed as dist

from .store_client import StoreClient


class AgentSignals:
    """The worker's signals to the agents, through ``client``'s store."""

    def __init__(self, client: StoreClient) -> None:
        self.client = client

    def announce_built(self, rank: int) -> None:
        """Rank 0 tells the agent the workers have built the task: it may start the spare now
        without competing with the workers' start-up (and a task artifact exists).

        Raises:
            RuntimeError: the store is unreachable.
        """
        if rank == 0:
            self.client.attempt.announce_built()

    def announce_finished(self, rank: int) -> None:
        """Rank 0, once training is over: a replacement still waiting to join leaves with exit
        code 0 (:class:`~elastic_runner.recovery.outcomes.JobFinished`) instead of waiting out
        its join timeout and failing. A store that is gone is ignored."""
        if rank == 0:
            with contextlib.suppress(RuntimeError, dist.DistError):
                self.client.attempt.announce_finished()

    def announce_recovered(self, generation: int) -> None:
        """Generation ``generation`` committed its first step: its recovery is over, and the
        agent whose spare took a failed worker's place starts the next one now (it would have
        competed with the recovery for the CPU). A store that is gone is ignored: the agent
        starts it later anyway (``agent/spares.py``)."""
        with contextlib.suppress(RuntimeError, dist.DistError):
            self.client.attempt.announce_recovered(generation)

    def ask_restart(self) -> None:
        """No agent replaces anyone in place in this attempt any more: torch's restart path. A
        store that is gone is ignored."""
        with contextlib.suppress(RuntimeError, dist.DistError):
            self.client.attempt.ask_restart()
