"""What a process holds of a background activity that it stops on its way out: a worker's
heartbeat and generation watch, an agent's node beat and hang watch. Each has a null object
(nothing runs) that implements the same :class:`Stoppable`."""

from __future__ import annotations

from typing import Protocol


class Stoppable(Protocol):
    """A background thread (or nothing, its null object) that ``close()`` stops; idempotent,
    never raises."""

    def close(self) -> None: ...
