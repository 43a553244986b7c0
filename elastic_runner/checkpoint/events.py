"""What the checkpoint manager reports: a committed checkpoint (:class:`CheckpointEvent`), the
listener that receives it with the stalls and loads (:class:`CheckpointListener`: the runner's
metrics and logs implement it) and its null object (:class:`QuietListener`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from .storage import CheckpointInfo


@dataclass(frozen=True)
class CheckpointEvent:
    """A committed checkpoint: its paths (a step and/or a best one), the step, the seconds the
    write took (in the background when async) and its size in bytes."""

    paths: list[str]
    step: int
    seconds: float
    size_bytes: int


class CheckpointListener(Protocol):
    """What the manager reports (the runner's metrics and logs implement it)."""

    def checkpoint_stall(self, seconds: float) -> None: ...
    def checkpoint_committed(self, event: CheckpointEvent) -> None: ...
    def checkpoint_loaded(self, info: CheckpointInfo) -> None: ...


class QuietListener:
    """The null :class:`CheckpointListener`: nobody listens."""

    def checkpoint_stall(self, seconds: float) -> None:
        pass

    def checkpoint_committed(self, event: CheckpointEvent) -> None:
        pass

    def checkpoint_loaded(self, info: CheckpointInfo) -> None:
        pass
