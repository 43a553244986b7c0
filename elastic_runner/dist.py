"""Process-group set-up and teardown, device choice, and small collectives.

Restart hygiene (why :func:`init_distributed` does not simply call ``init_process_group()``):
since torch 2.4 the c10d/etcd-v2 rendezvous handlers share the *agent's* TCPStore with the workers
(``TORCHELASTIC_USE_AGENT_STORE=True``; MASTER_ADDR/MASTER_PORT point at it). That store lives as
long as the agent, so it still holds the keys the workers of the previous attempt wrote. In torch
2.13 ``torch.distributed.rendezvous._create_c10d_store`` returns that store without a per-attempt
prefix (earlier releases prefixed ``/worker/attempt_<TORCHELASTIC_RESTART_COUNT>``), so gloo's
``connectFullMesh`` of a restarted group can read the dead workers' addresses and fail with
"Connection refused". The restart count alone is not a safe prefix either: membership-change
restarts do not increment it, so different nodes can disagree on it.

The fix: every rank of a new attempt agrees on a fresh namespace through the shared store before
creating the process group (:func:`attempt_namespace`), and the process group's store is a
``PrefixStore`` of that namespace. Keys of earlier attempts are never read.

Which of torch's internals this relies on (the ``TORCHELASTIC_USE_AGENT_STORE`` variable and the
store it announces) lives in :mod:`elastic_runner.compat.agent` (fix 3 there).
``elastic-runner run`` turns the shared store off with torch's
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (compat fix 1), so there the workers' rank 0 hosts a
new store per attempt and the handshake is skipped; it still runs under plain torchrun.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .compat.agent import agent_store, shares_agent_store
from .compat.fsdp import release_mesh_groups
from .protocol.keys import HandshakeKeys
from .protocol.torchrun_env import TorchrunEnv

log = logging.getLogger(__name__)

_HELLO_PERIOD_S = 1.0  # a non-zero rank re-announces itself this often until rank 0 answers
_POLL_S = 0.01


class Place:
    """This process's place in the job: ``rank`` of ``world_size`` on node ``node_rank``. A
    process has one; every holder of its rank refers to it (:class:`DistInfo`, the sampler's
    split, the training session, the checkpoints' cadence and resume), so a regroup moves them
    all with one :meth:`move`. A process never changes node: ``node_rank`` stays."""

    __slots__ = ("_rank", "_world_size", "node_rank", "_moved")

    def __init__(self, rank: int, world_size: int, node_rank: int = 0) -> None:
        self._rank, self._world_size, self.node_rank = rank, world_size, node_rank
        self._moved: list[Callable[[int], None]] = []

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    def move(self, rank: int, world_size: int) -> None:
        """This process is ``rank`` of ``world_size`` now; then the holders that act on a new
        rank (:meth:`on_move`: the checkpoint writer commits the save in flight and is made
        anew) are told, in the order they asked, with the old rank."""
        old, self._rank, self._world_size = self._rank, rank, world_size
        for moved in self._moved:
            moved(old)

    def on_move(self, moved: Callable[[int], None]) -> None:
        """Call ``moved(old_rank)`` after every :meth:`move`."""
        self._moved.append(moved)

    def __repr__(self) -> str:
        return f"Place(rank={self.rank}, world_size={self.world_size}, node_rank={self.node_rank})"


class Placed:
    """A holder of the process's :class:`Place` (``place``): its ``rank`` and ``world_size``
    are the place's."""

    __slots__ = ()
    place: Place

    @property
    def rank(self) -> int:
        return self.place.rank

    @property
    def world_size(self) -> int:
        return self.place.world_size


class DistInfo(Placed):
    """Where this process sits in the job (torchrun's environment, or world size 1). ``rank``,
    ``world_size`` and ``node_rank`` are its :class:`Place`'s (``place``: given, the holders
    share it; None, a new one)."""

    __slots__ = ("place", "local_rank", "local_world_size", "restart_count", "device", "backend")

    def __init__(self, rank: int, local_rank: int, world_size: int, local_world_size: int,
                 node_rank: int, restart_count: int, device: torch.device, backend: str,
                 place: Place | None = None) -> None:
        self.place = Place(rank, world_size, node_rank) if place is None else place
        self.local_rank, self.local_world_size = local_rank, local_world_size
        self.restart_count, self.device, self.backend = restart_count, device, backend

    @property
    def node_rank(self) -> int:
        return self.place.node_rank

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    def moved_to(self, rank: int, world_size: int) -> DistInfo:
        """A copy at ``rank`` of ``world_size``, with a new :class:`Place` (for holders built
        anew: the trainer's regroup); this one's holders stay where they are."""
        return DistInfo(rank, self.local_rank, world_size, self.local_world_size,
                        self.node_rank, self.restart_count, self.device, self.backend)

    def __repr__(self) -> str:
        return (f"DistInfo(rank={self.rank}, local_rank={self.local_rank}, world_size="
                f"{self.world_size}, local_world_size={self.local_world_size}, node_rank="
                f"{self.node_rank}, restart_count={self.restart_count}, device={self.device}, "
                f"backend={self.backend!r})")


def dist_info(device: torch.device, backend: str, env: TorchrunEnv | None = None, *,
              rank: int | None = None, world_size: int | None = None) -> DistInfo:
    """This process's :class:`DistInfo` from torchrun's environment ``env`` (None: read it
    now), on ``device`` with ``backend``; ``rank``/``world_size``: the process group's where
    they differ from the environment's (a script's loop renumbered in place).

    Raises:
        ValueError: a variable of torchrun's that is not an integer.
    """
    env = TorchrunEnv.read() if env is None else env
    return DistInfo(rank=env.rank if rank is None else rank, local_rank=env.local_rank,
                    world_size=env.world_size if world_size is None else world_size,
                    local_world_size=env.local_world_size, node_rank=env.node_rank,
                    restart_count=env.restart_count, device=device, backend=backend)


def select_device(local_rank: int) -> torch.device:
    """``cuda:<local_rank>`` when CUDA is available, else CPU."""
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def open_device(local_rank: int) -> torch.device:
    """:func:`select_device`, and on CUDA create the device's context now (one allocation), so
    start-up reports its cost apart from the process group's (NCCL would create it there)."""
    device = select_device(local_rank)
    if device.type == "cuda":
        torch.empty(1, device=device)
    return device


def resolve_backend(requested: str, device: torch.device) -> str:
    if requested == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    return requested


def attempt_namespace(store: dist.Store, rank: int, world_size: int, timeout_s: float) -> str:
    """Agree on a namespace unique to this attempt among all ``world_size`` ranks.

    Protocol (a handshake on the shared store; ``clock`` is a store counter, so its values are
    unique and totally ordered across all processes ever connected to the store):

    * rank 0 draws ``t0 = add(clock)``, then waits until every rank r has announced
      ``hello/r = t_r`` with ``t_r > t0``. Such an announcement was made after rank 0 started, so
      it comes from this attempt (all workers of an earlier attempt are stopped before the agents
      rendezvous again). Rank 0 answers each with ``ack/r/t_r = namespace``.
    * rank r != 0 draws ``t_r = add(clock)``, writes ``hello/r``, and polls ``ack/r/t_r`` for every
      ``t_r`` it announced; it re-announces with a fresh ``t_r`` every second, which covers the case
      where it announced before rank 0 drew ``t0``.

    Returns:
        The namespace string (``"<t0>-<uuid4 hex>"``).

    Raises:
        TimeoutError: not all ranks took part within ``timeout_s`` seconds.
    """
    deadline = time.monotonic() + timeout_s
    if rank == 0:
        t0 = store.add(HandshakeKeys.CLOCK, 1)
        namespace = f"{t0}-{uuid.uuid4().hex}"
        pending = set(range(1, world_size))
        while pending:
            for r in sorted(pending):
                key = HandshakeKeys.hello(r)
                if not store.check([key]):
                    continue
                t_r = int(store.get(key))
                if t_r > t0:
                    store.set(HandshakeKeys.ack(r, t_r), namespace)
                    pending.discard(r)
            if pending:
                _check_deadline(deadline, timeout_s, f"ranks {sorted(pending)} to join")
                time.sleep(_POLL_S)
        return namespace
    announced: list[int] = []
    next_hello = 0.0
    while True:
        for t in announced:
            key = HandshakeKeys.ack(rank, t)
            if store.check([key]):
                return store.get(key).decode()
        now = time.monotonic()
        if now >= next_hello:
            t_r = store.add(HandshakeKeys.CLOCK, 1)
            announced.append(t_r)
            store.set(HandshakeKeys.hello(rank), str(t_r))
            next_hello = now + _HELLO_PERIOD_S
        _check_deadline(deadline, timeout_s, "rank 0 to answer")
        time.sleep(_POLL_S)


def _check_deadline(deadline: float, timeout_s: float, what: str) -> None:
    if time.monotonic() > deadline:
        raise TimeoutError(f"process-group handshake: waited {timeout_s:.0f} s for {what}")


def init_distributed(backend: str = "auto", timeout_s: float = 600.0,
                     store: dist.Store | None = None, eager_init: bool = True) -> DistInfo:
    """Initialise the default process group from torchrun's environment.

    Without ``WORLD_SIZE`` in the environment (no launcher) no process group is created and the
    run is world size 1. ``store``: the group's store (in-place recovery's generation store,
    see ``recovery/inplace.py``); without it, under torchrun with a shared agent store, the group's store
    is namespaced per attempt (see module docstring). ``eager_init``: on CUDA, pass the device
    as ``device_id`` (NCCL connects here, not at the first collective).
    """
    env = TorchrunEnv.read()
    rank, world_size = env.rank, env.world_size
    device = select_device(env.local_rank)
    backend = resolve_backend(backend, device)
    info = dist_info(device, backend, env)
    if not env.launched:
        return info
    timeout = timedelta(seconds=timeout_s)
    kwargs: dict[str, Any] = {"backend": backend, "timeout": timeout}
    if device.type == "cuda" and eager_init:
        kwargs["device_id"] = device
    if store is not None:
        kwargs.update(store=store, rank=rank, world_size=world_size)
    elif shares_agent_store():
        store = agent_store(timeout)
        namespace = attempt_namespace(store, rank, world_size, timeout_s)
        log.debug("rank %d: process-group namespace %s", rank, namespace)
        kwargs.update(store=dist.PrefixStore(HandshakeKeys.group_prefix(namespace), store))
        kwargs.update(rank=rank, world_size=world_size)
    dist.init_process_group(**kwargs)
    return info


def destroy_distributed() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def release_groups_of(*modules: Any) -> None:
    """Let the process groups of the device meshes that ``modules``' DTensor parameters
    (FSDP2) live on be freed by ``destroy_process_group``, not at the interpreter's exit
    (:func:`elastic_runner.compat.fsdp.release_mesh_groups`: a gloo group freed there may abort the
    process). Call it once a module's collectives are over (the trainer's close, a survivor
    leaving its group); a module without DTensor parameters: nothing."""
    from torch.distributed.tensor import DTensor

    meshes = {id(p.device_mesh): p.device_mesh for m in modules
              if isinstance(m, torch.nn.Module) for p in m.parameters()
              if isinstance(p, DTensor)}
    for mesh in meshes.values():
        release_mesh_groups(mesh)


def all_reduce_sums(values: dict[str, tuple[float, float]], device: torch.device
                    ) -> dict[str, tuple[float, float]]:
    """Sum ``{name: (sum, count)}`` over all ranks in float64 (one collective)."""
    if not (dist.is_available() and dist.is_initialized()):
        return dict(values)
    names = sorted(values)
    t = torch.tensor([x for n in names for x in values[n]], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    flat = t.tolist()
    return {n: (flat[2 * i], flat[2 * i + 1]) for i, n in enumerate(names)}


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Broadcast one picklable Python value from ``src`` to all ranks (identity without a group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def max_over_ranks(value: int, device: torch.device) -> int:
    """The largest ``value`` of any rank (``value`` without a group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def all_gather_object(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's ``obj``, by rank, over ``group`` (default: the default group; ``[obj]``
    without one)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    values: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(values, obj, group=group)
    return values


def checkpoint_group() -> dist.ProcessGroup | None:
    """A gloo group of every rank for background checkpoint collectives (collective: every rank
    calls it at the same point); None without a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.new_group(backend="gloo")


def release_group(group: dist.ProcessGroup | None) -> None:
    """Destroy ``group`` (from :func:`checkpoint_group`) while the default group still exists."""
    if group is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group(group)


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def assert_same_across_ranks(value: str, what: str) -> None:
    """All-gather ``value`` and raise ``RuntimeError`` naming the ranks that disagree."""
    values = all_gather_object(value)
    if len(set(values)) > 1:
        groups: dict[str, list[int]] = {}
        for r, v in enumerate(values):
            groups.setdefault(v, []).append(r)
        detail = "; ".join(f"ranks {rs}: {v}" for v, rs in groups.items())
        raise RuntimeError(f"{what} differs between ranks ({detail})")


def world_size() -> int:
    """The default process group's size (1 without one)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def current_rank() -> int:
    """This process's rank in the default process group (0 without one)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


# what gloo's TCP transport says when the other end of a collective died or stopped answering
# (it raises a plain RuntimeError); NCCL and the stores raise torch.distributed.DistError
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "gloo/transport",
              "Socket Timeout", "Timed out waiting")


def is_peer_failure(error: BaseException) -> bool:
    """Whether ``error`` (or an error it was raised from) is a collective or store operation
    that failed because another rank died or hung: the worker exits
    ``exit_codes.EXIT_PEER_LOST`` then, which does not spend ``--max-restarts``."""
    e: BaseException | None = error
    seen = 0
    while e is not None and seen < 8:
        if isinstance(e, dist.DistError) or (
                isinstance(e, RuntimeError) and any(s in str(e) for s in _PEER_GONE)):
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1
    return False
