"""How an in-place recovery step ends for its caller: exceptions the worker and the loops catch
to go on in another group (:class:`Regroup`), to redo the step in the same group
(:class:`StepRedo`), or to exit 0 with nothing left to join (:class:`JobFinished`).
Re-exported by :mod:`elastic_runner.recovery.inplace`, where callers import them from."""

from __future__ import annotations

from .rejoin import RecoveryReport


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
