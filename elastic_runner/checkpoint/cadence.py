"""When to save: every N steps and/or every N seconds of rank 0's clock."""

from __future__ import annotations

import time

from ..dist import Place, broadcast_object


class Cadence:
    """The checkpoint cadence of one rank.

    Args:
        every_steps: due when the step is a multiple of it (0: never by steps).
        every_seconds: due when this many seconds passed since the last save (rank 0's clock;
            None: never by time).
        place: this process's place (only rank 0's clock counts).
        sharded: every rank writes (the sharded layout): rank 0's time answer is broadcast.
    """

    def __init__(self, every_steps: int, every_seconds: float | None, place: Place,
                 sharded: bool) -> None:
        self.every_steps, self.every_seconds = every_steps, every_seconds
        self.place, self.sharded = place, sharded
        self.last_save = time.monotonic()

    @property
    def rank(self) -> int:
        return self.place.rank

    def saved(self) -> None:
        """A save began now: the time rule counts from here."""
        self.last_save = time.monotonic()

    def due_by_steps(self, step: int) -> bool:
        """Whether ``every_steps`` asks for a checkpoint after ``step`` (the same answer on
        every rank)."""
        return bool(self.every_steps) and step % self.every_steps == 0

    def due(self, step: int) -> bool:
        """Whether the cadence asks for a checkpoint after ``step``. The time rule is rank 0's
        clock; in the rank-0 layout only rank 0 writes, so the other ranks' answer does not
        matter for it. A sharded save needs every rank: with ``every_seconds`` rank 0's answer
        is then broadcast (collective: every rank calls this at the same step)."""
        by_time = (self.every_seconds is not None and self.rank == 0
                   and time.monotonic() - self.last_save >= self.every_seconds)
        if self.sharded and self.every_seconds is not None:
            by_time = bool(broadcast_object(by_time))
        return self.due_by_steps(step) or by_time
