"""The generation announcement (``gen/<g>`` in the attempt's recovery store): what the
announcer tells every worker about generation ``g``.

Four writers: an agent that replaces dead workers in place (``agent/replacement.py``:
``failed``, ``exitcodes``, and ``members``/``world_size`` when the group goes on shrunk), the
same agent once the spares that let the group grow back are ready (``grow``), a node's
departure (:func:`~elastic_runner.recovery.membership.announce_departure`: ``departed``,
``reason``, ``store`` when the recovery store moved) and a join
(:func:`~elastic_runner.recovery.membership.announce_join`: ``joined``, ``admitted``). The
restart path's ``{"restart": True}`` (``restart`` in the store) reads as one too. Readers: the
workers (``recovery/failure.py``, ``recovery/node_changes.py``,
``recovery/generation_watch.py``, ``recovery/group_formation.py``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class Announcement:
    """One generation's news. A field left at its default is not written (the JSON holds only
    what its writer set, as it always did).

    Attributes:
        failed: the global ranks that died or left (None: not said, a ``grow``).
        exitcodes: the dead workers' exit codes, in ``failed``'s order (replacements).
        members: the old global ranks that stay, in their new order (new rank = index; a
            joined node's ranks follow them); None: every rank stays.
        world_size: the new group's size (None: unchanged).
        grow: the spares are ready: the shrunk group grows back.
        departed: the node ranks that left (a departure); None: none left.
        reason: why the membership changed: ``preempted``, ``lost`` or ``joined``.
        store: the recovery store's new ``host:port`` when it moved with the departure.
        joined: the node ids that join (a join); None: none joined.
        admitted: the last join request the join answers.
        restart: torch's restart path was asked: no generation follows in place.
    """

    failed: tuple[int, ...] | None = None
    exitcodes: tuple[int, ...] | None = None
    members: tuple[int, ...] | None = None
    world_size: int | None = None
    grow: bool = False
    departed: tuple[int, ...] | None = None
    reason: str | None = None
    store: str | None = None
    joined: tuple[int, ...] | None = None
    admitted: int | None = None
    restart: bool = False

    @property
    def failed_ranks(self) -> list[int]:
        """:attr:`failed` as a list (empty: none said)."""
        return list(self.failed or ())

    @property
    def is_departure(self) -> bool:
        return self.departed is not None

    @property
    def is_join(self) -> bool:
        return self.joined is not None

    @property
    def cuts_collectives(self) -> bool:
        """Whether a rank's collective cannot finish on its own once this is announced: a peer
        failed or a node was lost. Not a departure at a step boundary or a join: their
        announcer writes it while every rank is in the same collective with it."""
        return self.reason not in ("preempted", "joined")

    def encode(self) -> str:
        """The JSON text the store holds (the fields set, in this class's order)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None or value is False:
                continue
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return json.dumps(out)

    @classmethod
    def decode(cls, text: str | bytes) -> Announcement:
        """What :meth:`encode` wrote (or an older writer's JSON with these keys).

        Raises:
            ValueError: not JSON; TypeError: a key this class does not know.
        """
        data = json.loads(text)
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})


RESTART = Announcement(restart=True)
"""The restart path's announcement (``restart`` in the store)."""
