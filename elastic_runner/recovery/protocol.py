"""The agent-worker protocol of in-place recovery, in one place: the environment variables an
agent gives its workers and spares, and the keys of the attempt's recovery store that both
sides read or write, behind typed operations (as nvidia-resiliency-ext's store mixin keeps its
keys as constants behind methods).

Every key lives under the attempt's prefix (``<prefix>/...``; :class:`AttemptKeys` takes the key
function that adds it).

=====================================  =========================================================
key                                    written by -> read by
=====================================  =========================================================
``restart``                            a worker or agent that takes torch's restart path ->
                                       every worker (no recovery in place) and agent
``built``                              rank 0, once the workers built their loop -> the agents
                                       (a spare may start; a script's loop recovers in place)
``finished``                           rank 0 at the end of training -> a replacement still
                                       waiting to join (it leaves with exit code 0)
``recovered/<g>``                      the lowest rank that kept its process, at generation
                                       ``g``'s first committed step -> the agent whose spare
                                       was taken (the next one may start)
``joins_in_place``                     rank 0 of a loop that can regroup -> the agents (nodes
                                       join in place)
``generations``                        a counter every announcer draws from
``gen/<g>``                            the announcer -> the workers: generation ``g`` (the failed
                                       ranks, a departure, a join, the restart path)
``pg/<g>/present/<r>``, ``pg/<g>/...`` each member of generation ``g``'s group; its store
``spare/<name>/ready``                 a spare -> its agent
``spare/<name>/assign``                the agent -> its spare: the environment of the rank it
                                       takes
``moved/<node>``                       an agent following the store to another node -> the
                                       leaving host
``rank0_state``                        rank 0 of a script's loop, at a step boundary where the
                                       loop's work after a step changed its ``state=`` -> the
                                       group's source after rank 0 was replaced
                                       (``own_loop/script_state.py``)
=====================================  =========================================================

The membership's keys (``view``, ``node/...``, ``departed/<node>``, ``join/...``,
``admitted/<node>``) are written and read through :mod:`elastic_runner.recovery.membership`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

ENV = "ELASTIC_RUNNER_INPLACE"
"""The recovery store, for a worker or spare: a ``recovery.store.StoreLocation`` as JSON."""
SPARE_ENV = "ELASTIC_RUNNER_SPARE"
"""Set on a spare only: ``<node rank>.<number>`` (a joining node's: ``<node>.`` + local rank)."""
SPARE_NICE_ENV = "ELASTIC_RUNNER_SPARE_NICE"
"""Set on a spare started at a lower CPU priority: the nice value its threads go back to once
it takes a worker's place (the agent's)."""
GENERATION_ENV = "ELASTIC_RUNNER_GENERATION"
"""Set on a replacement: the generation whose group it joins."""
HEARTBEAT_ENV = "ELASTIC_RUNNER_HEARTBEAT_DIR"
"""The directory of the node's heartbeat files (``recovery/heartbeat.py``)."""
MIN_NODES_ENV = "ELASTIC_RUNNER_MIN_NODES"
"""``--nnodes`` MIN: a departure may not leave fewer nodes."""

Key = Callable[..., str]
_RESTART = json.dumps({"restart": True})
_POLL_S = 0.01


class AttemptKeys:
    """The keys of one attempt in the recovery store, through a client ``store`` and the key
    function ``key`` (``key("gen", 3)`` -> ``<prefix>/gen/3``). Store errors propagate
    (``RuntimeError``/``DistError``: the store is unreachable)."""

    def __init__(self, store: dist.Store, key: Key) -> None:
        self.store, self.key = store, key

    def _has(self, *parts: object) -> bool:
        return self.store.check([self.key(*parts)])

    def _json(self, *parts: object) -> Any:
        return json.loads(self.store.get(self.key(*parts)))

    # ------------------------------------------------------------ the attempt's milestones

    def ask_restart(self) -> None:
        """No agent replaces anyone in place in this attempt any more: torch's restart path."""
        self.store.set(self.key("restart"), _RESTART)

    def restart_asked(self) -> bool:
        return self._has("restart")

    def announce_built(self) -> None:
        self.store.set(self.key("built"), "1")

    def built(self) -> bool:
        return self._has("built")

    def announce_finished(self) -> None:
        self.store.set(self.key("finished"), "1")

    def announce_recovered(self, generation: int) -> None:
        """Generation ``generation``'s first step is committed: its recovery is over."""
        self.store.set(self.key("recovered", generation), "1")

    def recovered(self, generation: int) -> bool:
        return self._has("recovered", generation)

    def finished(self) -> bool:
        return self._has("finished")

    def keep_rank0_state(self, blob: bytes) -> None:
        """Rank 0's ``state=`` versions (``own_loop/script_state.py``; ``torch.save`` bytes)."""
        self.store.set(self.key("rank0_state"), blob)

    def rank0_state(self) -> bytes | None:
        """What :meth:`keep_rank0_state` wrote last (None: nothing yet)."""
        if not self._has("rank0_state"):
            return None
        return bytes(self.store.get(self.key("rank0_state")))

    def allow_joins_in_place(self) -> None:
        self.store.set(self.key("joins_in_place"), "1")

    def joins_in_place(self) -> bool:
        return self._has("joins_in_place")

    # ------------------------------------------------------------ generations

    def draw_generations(self, count: int = 1) -> int:
        """Reserve ``count`` generation numbers (one counter for the whole job: two announcers
        never announce the same one); returns the last."""
        return self.store.add(self.key("generations"), count)

    def generations_counter(self) -> str:
        """The counter's key (for ``membership.raise_counter``)."""
        return self.key("generations")

    def announce(self, generation: int, news: dict[str, Any]) -> None:
        """Generation ``generation``: ``news`` (``failed``, ``exitcodes``, ``members``,
        ``grow``, a departure or join's fields)."""
        self.store.set(self.key("gen", generation), json.dumps(news))

    def announced(self, generation: int) -> bool:
        return self._has("gen", generation)

    def announcement(self, generation: int) -> dict[str, Any] | None:
        """Generation ``generation``'s announcement, or ``{"restart": True}`` once the restart
        path was asked; None: neither (yet)."""
        for parts in (("gen", generation), ("restart",)):
            if self._has(*parts):
                return self._json(*parts)
        return None

    # ------------------------------------------------------------ a generation's group

    def show_up(self, generation: int, rank: int) -> None:
        self.store.set(self.key("pg", generation, "present", rank), "1")

    def all_present(self, generation: int, world_size: int) -> bool:
        return self.store.check([self.key("pg", generation, "present", r)
                                 for r in range(world_size)])

    def group_store(self, generation: int) -> dist.Store:
        """Generation ``generation``'s process-group store (a prefix of its own)."""
        return dist.PrefixStore(self.key("pg", generation) + "/", self.store)

    # ------------------------------------------------------------ spares

    def spare_ready(self, name: str) -> None:
        self.store.set(self.key("spare", name, "ready"), "1")

    def is_spare_ready(self, name: str) -> bool:
        return self._has("spare", name, "ready")

    def assign(self, name: str, env: dict[str, str]) -> None:
        """Spare ``name`` takes the rank whose environment is ``env`` (RANK, LOCAL_RANK, ...,
        :data:`GENERATION_ENV`)."""
        self.store.set(self.key("spare", name, "assign"), json.dumps(env))

    def wait_assignment(self, name: str, poll_s: float = _POLL_S) -> dict[str, str]:
        """Block until spare ``name`` is assigned a rank; its environment. Polled, not
        ``Store.wait``: a wait that times out makes c10d print a warning (a spare may stand by
        for hours), and one that never times out would hold off a signal's handler."""
        while not self._has("spare", name, "assign"):
            time.sleep(poll_s)
        return self._json("spare", name, "assign")

    # ------------------------------------------------------------ nodes

    def acknowledge_move(self, node: int, endpoint: str) -> None:
        """Node ``node``'s agent follows the store to ``endpoint`` (the leaving host waits for
        every acknowledgement)."""
        self.store.set(self.key("moved", node), endpoint)

    def moves_acknowledged(self, nodes: list[int]) -> bool:
        return self.store.check([self.key("moved", n) for n in nodes])
