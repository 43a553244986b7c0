"""The checkpoint manager: one facade over cadence, commit, resume, rollback, best weights and
peer-state I/O.

It holds a ``dict[str, Stateful]`` (torch's ``torch.distributed.checkpoint.stateful.Stateful``
protocol: ``state_dict()`` / ``load_state_dict()``) and never reaches inside; it knows nothing of
the training loop. The storage format and commit protocol are ``checkpoint/storage.py``'s (one
``state.pt`` per checkpoint plus a manifest written last; atomic rename on filesystems, manifest
last on object stores). Rank 0 writes; every rank loads the checkpoint rank 0 chose. With the
sharded layout (``layout="dcp"``, or ``"auto"`` and a model of DTensors: FSDP2) every rank writes
its part of ``state["model"]`` and ``state["optimizer"]`` through DCP (``checkpoint/dcp_format.py``)
and rank 0 the rest and the manifest; a load reshards to the current world size.

Usage from any loop (see ``examples/own_loop.py``)::

    ckpt = CheckpointManager("runs/ckpt", {"model": model, "optimizer": opt, "sampler": s},
                             every_steps=100)
    ckpt.load_latest()                      # newest valid checkpoint, or nothing
    for step in ...:
        ...
        ckpt.maybe_save(step)               # every 100 steps (and/or every_seconds)
    ckpt.save(step); ckpt.close()           # final one, committed before close returns

Each job is a class of its own module: when to save (:mod:`.cadence`), the writes and commits
under the fence with their process group (:mod:`.commit`), resuming (:mod:`.resume`), best
weights (:mod:`.best`), peer-state I/O (:mod:`.peer_state`), the events (:mod:`.events`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful

from ..dist import Place, current_rank, world_size
from . import dcp_format
from .best import checkpoint_names, load_weights
from .cadence import Cadence
from .commit import CheckpointCommitter, SnapshotWriter
from .events import CheckpointListener, QuietListener
from .fencing import CommitFence
from .layout import is_sharded, whole_state
from .peer_state import PeerState
from .resume import Resumer

__all__ = ["CheckpointManager"]


class CheckpointManager:
    """Saves and restores ``state`` (``{name: Stateful}``) in ``directory``.

    Args:
        directory: local path or fsspec URL (``s3://bucket/run``); shared by all nodes.
        state: what a checkpoint holds; every value must implement ``Stateful``.
        every_steps: save when the step is a multiple of it (0: never by steps).
        every_seconds: save when this much wall-clock time passed since the last save (rank 0
            decides; the decision is taken by all ranks through :meth:`due`'s ``agree``).
        async_save: snapshot into reused host buffers and write in a background thread.
        keep_last: valid step checkpoints kept (older ones are deleted after each commit; the
            checkpoint resumed from is never deleted).
        keep_best: also commit ``best-step-N`` when :meth:`save` is called with ``best=True``.
        extra: plain values saved beside the state (e.g. the resolved config); not loaded.
        meta: called at each save; its dict goes into the manifest (epoch, world size, ...).
        listener: receives stall / commit / load events (metrics).
        after_load: called with the loaded raw state after loading, before the replicas are
            compared.
        migrate: rewrites a loaded raw state before it is applied (checkpoints of older
            releases); identity by default.
        rank: this process's rank (default: the process group's, 0 without one), or its
            :class:`~elastic_runner.dist.Place`, which a regroup moves: rank 0 then writes the
            replicated checkpoints and claims the fencing token, after the save in flight is
            committed.
        layout: ``rank0`` (one ``state.pt`` by rank 0), ``dcp`` (sharded: every rank writes
            its part of ``state["model"]`` and ``state["optimizer"]``), ``auto``: ``dcp`` when
            the model's parameters are DTensors (FSDP2), else ``rank0``. Loading follows the
            checkpoint's layout, whatever this one is.
        fencing: rank 0 claims a fencing token in ``directory`` (``checkpoint/fencing.py``) before it
            chooses the checkpoint to resume from (or before its first save), and every commit
            is refused with :class:`~elastic_runner.checkpoint.fencing.FencedOut` once a newer group has
            claimed the directory. False: commits are not fenced (one writer by construction).

    Raises:
        TypeError: a value of ``state`` does not implement ``Stateful``.
        ValueError: the sharded layout without ``model`` and ``optimizer`` in ``state``.
    """

    def __init__(self, directory: str, state: Mapping[str, Stateful], *, every_steps: int = 0,
                 every_seconds: float | None = None, async_save: bool = True,
                 keep_last: int = 3, keep_best: bool = True,
                 extra: Mapping[str, Any] | None = None,
                 meta: Callable[[], dict[str, Any]] = dict,
                 listener: CheckpointListener | None = None,
                 after_load: Callable[[dict[str, Any]], None] = lambda raw: None,
                 migrate: Callable[[dict[str, Any]], dict[str, Any]] = lambda raw: raw,
                 rank: int | Place | None = None, fencing: bool = True, layout: str = "auto") -> None:
        for key, value in state.items():
            if not isinstance(value, Stateful):
                raise TypeError(f"checkpoint state {key!r}: {type(value).__name__} does not "
                                "implement torch's Stateful protocol (state_dict and "
                                "load_state_dict)")
        self.directory, self.state = directory, dict(state)
        self.keep_last, self.keep_best = keep_last, keep_best
        self.extra, self.meta = dict(extra or {}), meta
        self.listener: CheckpointListener = listener or QuietListener()
        self.after_load, self.migrate = after_load, migrate
        self.place = rank if isinstance(rank, Place) else Place(
            current_rank() if rank is None else rank, world_size())
        self.place.on_move(self._moved)
        rank = self.place.rank
        self.sharded = layout == "dcp" or (layout == "auto" and is_sharded(state.get("model")))
        if self.sharded and not all(k in self.state for k in dcp_format.SHARDED_KEYS):
            raise ValueError("a sharded (DCP) checkpoint needs the state keys 'model' and "
                             f"'optimizer'; got {', '.join(self.state)}")
        self.cadence = Cadence(every_steps, every_seconds, self.place, self.sharded)
        self.commits = CheckpointCommitter(
            directory, self.state, extra=self.extra, meta=meta, keep_last=keep_last,
            listener=self.listener, rank=rank, sharded=self.sharded, async_save=async_save,
            fencing=fencing, protect=lambda: self.resumed_from)
        self.resumer = Resumer(directory, self.state, listener=self.listener,
                               after_load=after_load, migrate=migrate,
                               place=self.place, claim=self.claim)
        self.peers = PeerState(self.state, self.extra, self.sharded)

    @property
    def rank(self) -> int:
        """This process's rank (its :attr:`place`'s)."""
        return self.place.rank

    @property
    def every_steps(self) -> int:
        return self.cadence.every_steps

    @property
    def every_seconds(self) -> float | None:
        return self.cadence.every_seconds

    @property
    def resumed_from(self) -> str | None:
        """The checkpoint last loaded by :meth:`load_latest` (never pruned), or None."""
        return self.resumer.resumed_from

    @property
    def fence(self) -> CommitFence:
        """This group's fencing token (:class:`~.fencing.NoFence` until :meth:`claim`)."""
        return self.commits.fence

    @property
    def _writer(self) -> SnapshotWriter:
        return self.commits.writer

    @property
    def _last_save(self) -> float:
        return self.cadence.last_save

    @_last_save.setter
    def _last_save(self, value: float) -> None:
        self.cadence.last_save = value

    def renew_group(self) -> None:
        """The default group was re-formed in place (a script's FSDP2 loop): the background
        checkpoint group again, as the constructor made it. Collective: every member calls it
        where a replacement's constructor does."""
        self.commits.renew_group()

    def _moved(self, old_rank: int) -> None:
        """The place moved (a regroup of a script's loop renumbered this process): rank 0
        writes the replicated checkpoints and claims the fencing token (at the next
        :meth:`claim`). The save in flight is committed first."""
        if self.place.rank != old_rank:
            self.commits.renumber(self.place.rank)

    def claim(self) -> None:
        """Rank 0: claim a fencing token for this group (once; :meth:`load_latest` and the
        first :meth:`save` call it). Other ranks and ``fencing=False``: nothing."""
        self.commits.claim()

    # ------------------------------------------------------------ saving

    def due_by_steps(self, step: int) -> bool:
        """Whether ``every_steps`` asks for a checkpoint after ``step`` (the same answer on
        every rank)."""
        return self.cadence.due_by_steps(step)

    def due(self, step: int) -> bool:
        """Whether the cadence asks for a checkpoint after ``step`` (:meth:`.Cadence.due`:
        collective when sharded with ``every_seconds``)."""
        return self.cadence.due(step)

    def maybe_save(self, step: int) -> bool:
        """:meth:`save` if :meth:`due`; True if it saved."""
        if self.due(step):
            self.save(step)
            return True
        return False

    def save(self, step: int, *, best: bool = False, step_checkpoint: bool = True) -> None:
        """Commit ``step-N`` (and ``best-step-N`` when ``best`` and ``keep_best``); all ranks
        call it, rank 0 writes (every rank its shards when sharded). Asynchronous saves return
        after the snapshot; the next save, :meth:`wait` and :meth:`close` re-raise a failed
        background write.

        Raises:
            OSError / CheckpointError: a synchronous write failed (or the previous async one).
            FencedOut: a newer group claimed the directory (this save or the previous one).
        """
        names = checkpoint_names(step, best=best, keep_best=self.keep_best,
                                 step_checkpoint=step_checkpoint)
        if names and self.sharded:
            self.cadence.saved()
            self.commits.save_sharded(step, names)
        elif names and self.rank == 0:
            self.cadence.saved()
            self.commits.save_whole(step, names)

    def state_dict(self) -> dict[str, Any]:
        """Every value's ``state_dict()`` with ``extra``'s values (what a rank-0 save writes)."""
        return whole_state(self.state, self.extra)

    def wait(self) -> None:
        """Block until the in-flight save is committed (re-raises its error)."""
        self.commits.wait()

    def abandon(self) -> None:
        """A peer died (in-place recovery of sharded state): wait for the in-flight save, whose
        collectives fail with the peer (its error is logged, not raised: nothing of it was
        published), and forget the checkpoint group, which goes with the dead group."""
        self.commits.abandon()

    def close(self) -> None:
        """Commit the in-flight save, stop the writer thread, wait until the pruned checkpoints
        are deleted (in the background: :func:`~elastic_runner.checkpoint.storage.prune`) and
        release the checkpoint group (a gloo group left to the garbage collector after the
        default group is gone can block in its destructor)."""
        self.commits.close()

    # ------------------------------------------------------------ loading

    def load_latest(self, map_location: str | torch.device = "cpu") -> dict[str, Any] | None:
        """Load the newest valid checkpoint into ``state`` on every rank (collective).

        Rank 0 picks it (a truncated, bit-flipped or partial newer one is skipped with a
        warning) and broadcasts its path; every rank loads it with ``weights_only=True``. A
        ``torch.nn.Module`` under the key ``model`` is checked tensor by tensor first, and after
        loading the replicas' parameters are compared across ranks.

        Returns:
            The loaded raw state (with ``extra``'s keys), or None when there is no checkpoint.

        Raises:
            CheckpointError: unreadable file, tensors that do not fit the model (named), a
                missing state key; RuntimeError: the replicas differ after loading.
        """
        return self.resumer.load_latest(map_location)

    def load_weights(self, path: str) -> None:
        """Load only the model weights of the checkpoint at ``path`` (collective when either
        the checkpoint or the model is sharded): the best checkpoint for the test split."""
        load_weights(self.state["model"], path)

    def load_from_peer(self, raw: dict[str, Any], peer: int) -> None:
        """Load ``raw`` (a live peer's :meth:`state_dict`, received during an in-place
        recovery) into ``state``; the model's tensors are checked first (not collective).

        Raises:
            CheckpointError: a missing state key or tensors that do not fit the model."""
        self.peers.load_from_peer(raw, peer)

    def local_copy(self, to_cpu: bool = True) -> dict[str, Any]:
        """This rank's part of the state, on the CPU (``to_cpu=False``: the shards stay on
        their device, for a caller that copies them into host memory itself): its local model
        and optimizer shards (:func:`~elastic_runner.checkpoint.dcp_format.local_shards`: on a
        CPU device the parameters' own storage, so copy it before the next step) and the rest
        (sampler, schedule, counters, RNG). What a peer keeps for an in-place recovery under
        FSDP (``recovery/peer_copies.py``); sharded layout only, not collective."""
        return self.peers.local_copy(to_cpu)

    def load_local_copy(self, raw: dict[str, Any], source: str) -> None:
        """Load :meth:`local_copy`'s ``raw`` (taken on this rank's position of a mesh of the
        same shape) into ``state``. Not collective.

        Raises:
            CheckpointError: a missing key, or shards that do not fit (named)."""
        self.peers.load_local_copy(raw, source)

    def rollback(self, map_location: str | torch.device = "cpu") -> bool:
        """Wait for the in-flight save, then reload the newest valid checkpoint on all ranks;
        False if there is none."""
        self.wait()
        return self.load_latest(map_location) is not None
