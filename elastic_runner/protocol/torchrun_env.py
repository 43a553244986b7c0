"""The one reader of torchrun's environment: what torchrun's agent (or ours, which is torch's
``LocalElasticAgent``) gives each worker (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ...:
torch's ``torch.distributed.elastic.agent.server.local_elastic_agent`` sets them), what the
Kubeflow operators give the agent (``PET_*``, read by torchrun's argument parser and by
``agent/launch.py``), and the one writer of a worker's rank when in-place recovery renumbers
it or a spare takes a dead worker's place.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from .env import GENERATION_ENV, INPLACE_ENV
from .env import PREFIX as RUNNER_PREFIX

RANK, LOCAL_RANK, WORLD_SIZE = "RANK", "LOCAL_RANK", "WORLD_SIZE"
LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE = "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE"
ROLE_RANK, ROLE_WORLD_SIZE = "ROLE_RANK", "ROLE_WORLD_SIZE"
MASTER_ADDR, MASTER_PORT = "MASTER_ADDR", "MASTER_PORT"
RESTART_COUNT, RUN_ID = "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID"
TORCHELASTIC_PREFIX = "TORCHELASTIC_"
"""What the per-worker variables of torch's agent start with (``agent/fork_server.py``)."""
PET_PREFIX = "PET_"
"""torchrun reads ``PET_<OPTION>`` as the default of ``--<option>`` (Kubeflow operators)."""
ERROR_FILE = "TORCHELASTIC_ERROR_FILE"
USE_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"  # torchrun's agent: MASTER_* is its store
NAMES = (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE,
         ROLE_RANK, ROLE_WORLD_SIZE, MASTER_ADDR, MASTER_PORT)
"""torchrun's per-worker names besides the ``TORCHELASTIC_*`` ones."""
PER_WORKER_NAMES = (*NAMES, "ROLE_NAME")
"""What torch's agent (``LocalElasticAgent._start_workers``) sets per worker, besides the
names with one of :data:`PER_WORKER_PREFIXES` (``agent/fork_server.py``)."""
PER_WORKER_PREFIXES = (TORCHELASTIC_PREFIX, RUNNER_PREFIX)
"""torch's per-worker ``TORCHELASTIC_*`` and the runner's ``ELASTIC_RUNNER_*``."""
PLACE_NAMES = (RANK, LOCAL_RANK, GROUP_RANK, ROLE_RANK, ERROR_FILE)
"""A dead worker's place, not a spare's: the agent hands these over at the replacement
(``agent/spares.py``)."""


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    text = env.get(name)
    return default if text is None else int(text)


def _maybe_int(env: Mapping[str, str], name: str) -> int | None:
    text = env.get(name)
    return None if text is None else int(text)


@dataclass(frozen=True)
class TorchrunEnv:
    """Where this process sits in the job, as torchrun's environment says (the defaults:
    a process started without torchrun, world size 1).

    Attributes:
        launched: ``WORLD_SIZE`` is set: the process runs under torchrun (or a launcher that
            sets its variables).
        rank, local_rank, world_size, local_world_size: ``RANK``, ``LOCAL_RANK``,
            ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``.
        node_rank, nnodes: ``GROUP_RANK``, ``GROUP_WORLD_SIZE`` (the agent's in the rendezvous
            round).
        role_rank: ``ROLE_RANK`` (None: unset).
        master_addr, master_port: ``MASTER_ADDR``, ``MASTER_PORT`` (None: unset).
        restart_count: ``TORCHELASTIC_RESTART_COUNT``; ``restart_count_text``: as written
            (None: unset).
        run_id: ``TORCHELASTIC_RUN_ID`` (the rendezvous id; None: unset).
        agent_store: ``TORCHELASTIC_USE_AGENT_STORE`` is ``True``: MASTER_ADDR:MASTER_PORT is
            the agent's own, long-lived store (read as torch's
            ``_torchelastic_use_agent_store`` reads it).
    """

    launched: bool = False
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    nnodes: int = 1
    role_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    restart_count: int = 0
    restart_count_text: str | None = None
    run_id: str | None = None
    agent_store: bool = False

    @classmethod
    def read(cls, env: Mapping[str, str] | None = None) -> TorchrunEnv:
        """From ``env`` (default: this process's environment, read now).

        Raises:
            ValueError: a number that is not an integer.
        """
        env = os.environ if env is None else env
        return cls(launched=WORLD_SIZE in env, rank=_int(env, RANK, 0),
                   local_rank=_int(env, LOCAL_RANK, 0), world_size=_int(env, WORLD_SIZE, 1),
                   local_world_size=_int(env, LOCAL_WORLD_SIZE, 1),
                   node_rank=_int(env, GROUP_RANK, 0), nnodes=_int(env, GROUP_WORLD_SIZE, 1),
                   role_rank=_maybe_int(env, ROLE_RANK), master_addr=env.get(MASTER_ADDR),
                   master_port=_maybe_int(env, MASTER_PORT),
                   restart_count=_int(env, RESTART_COUNT, 0),
                   restart_count_text=env.get(RESTART_COUNT), run_id=env.get(RUN_ID),
                   agent_store=env.get(USE_AGENT_STORE) == str(True))


def set_rank(rank: int, world_size: int) -> None:
    """This process is ``rank`` of ``world_size`` from now on (in-place recovery renumbered
    it): ``RANK`` and ``WORLD_SIZE`` of its environment, which later readers (and the
    processes it starts) see."""
    os.environ.update({RANK: str(rank), WORLD_SIZE: str(world_size)})


def take_place(assignment: Mapping[str, str]) -> TorchrunEnv:
    """A spare takes a worker's place: the assigned environment (the dead worker's ``RANK``,
    ``LOCAL_RANK``, ..., and the runner's generation) becomes this process's; returns it
    read."""
    os.environ.update(assignment)
    return TorchrunEnv.read()


def pet_name(flag: str) -> str:
    """The ``PET_*`` variable torchrun reads for option ``flag`` (``--nproc-per-node`` ->
    ``PET_NPROC_PER_NODE``)."""
    return PET_PREFIX + flag.lstrip("-").upper().replace("-", "_")


@dataclass(frozen=True)
class PetEnv:
    """The ``PET_*`` variables of the agent's environment (a Kubeflow operator sets them;
    torchrun reads them as its options' defaults), read once by :meth:`read`.

    Attributes:
        names: every ``PET_*`` name that is set.
        n_proc_per_node: ``PET_N_PROC_PER_NODE`` (some training-operator releases inject it;
            torchrun does not read it).
        master_addr, master_port, node_rank: ``PET_MASTER_ADDR``, ``PET_MASTER_PORT``,
            ``PET_NODE_RANK`` (Kubeflow Trainer v2's torch plugin).
        rdzv_backend, rdzv_conf: ``PET_RDZV_BACKEND``, ``PET_RDZV_CONF``.
        (Each None: unset.)
    """

    names: frozenset[str] = frozenset()
    n_proc_per_node: str | None = None
    master_addr: str | None = None
    master_port: str | None = None
    node_rank: str | None = None
    rdzv_backend: str | None = None
    rdzv_conf: str | None = None

    @classmethod
    def read(cls, env: Mapping[str, str] | None = None) -> PetEnv:
        """From ``env`` (default: this process's environment, read now)."""
        env = os.environ if env is None else env
        return cls(frozenset(n for n in env if n.startswith(PET_PREFIX)),
                   env.get("PET_N_PROC_PER_NODE"), env.get("PET_MASTER_ADDR"),
                   env.get("PET_MASTER_PORT"), env.get("PET_NODE_RANK"),
                   env.get("PET_RDZV_BACKEND"), env.get("PET_RDZV_CONF"))

    def sets(self, flag: str) -> bool:
        """Whether torchrun's option ``flag`` (``--rdzv-endpoint``) has a ``PET_*`` value."""
        return pet_name(flag) in self.names


def assignment(base: Mapping[str, str], generation: int, *, rank: int | None = None,
               world_size: int | None = None, node_rank: int | None = None,
               restart_count: int | None = None, store: str | None = None) -> dict[str, str]:
    """The environment an agent assigns a spare that takes a worker's place (written to the
    store, ``AttemptKeys.assign``; the spare makes it its own, :func:`take_place`): the
    worker's own ``base`` (torch's per-worker variables) with the generation it joins
    (:data:`~elastic_runner.protocol.env.GENERATION_ENV`) and, where given, its ``RANK``,
    ``WORLD_SIZE``, ``GROUP_RANK``, ``TORCHELASTIC_RESTART_COUNT`` and the recovery store
    (:data:`~elastic_runner.protocol.env.INPLACE_ENV`, a ``StoreLocation`` as JSON)."""
    out = {**base, GENERATION_ENV: str(generation)}
    for name, value in ((RESTART_COUNT, restart_count), (GROUP_RANK, node_rank),
                        (INPLACE_ENV, store), (RANK, rank), (WORLD_SIZE, world_size)):
        if value is not None:
            out[name] = str(value)
    return out


def node_rank_of(assignment: Mapping[str, str], default: int) -> int:
    """The ``GROUP_RANK`` a spare's ``assignment`` names (``default``: none named)."""
    return int(assignment.get(GROUP_RANK, default))
