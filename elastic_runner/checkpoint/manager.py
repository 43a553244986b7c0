"""The checkpoint manager: cadence, atomic commit, async save, best, retention, resume, rollback.

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
"""

from __future__ import annotations

import logging
import pickle
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from ..dist import (
    all_gather_object,
    assert_same_across_ranks,
    broadcast_object,
    checkpoint_group,
    current_rank,
    is_peer_failure,
    release_group,
    world_size,
)
from . import dcp_format
from . import storage as ckpt
from .async_save import AsyncCheckpointer
from .fencing import Fence, NoFence

log = logging.getLogger(__name__)


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
    def checkpoint_loaded(self, info: ckpt.CheckpointInfo) -> None: ...


class _Quiet:
    def checkpoint_stall(self, seconds: float) -> None:
        pass

    def checkpoint_committed(self, event: CheckpointEvent) -> None:
        pass

    def checkpoint_loaded(self, info: ckpt.CheckpointInfo) -> None:
        pass


class _SyncWriter:
    """The synchronous twin of :class:`AsyncCheckpointer` (null object for ``async_save``)."""

    def save(self, state: Any, write: Callable[[Any], Any]) -> float:
        t0 = time.perf_counter()
        write(state)
        return time.perf_counter() - t0

    def wait(self) -> None:
        pass

    def close(self) -> None:
        pass


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
        rank: this process's rank (default: the process group's, 0 without one).
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
                 rank: int | None = None, fencing: bool = True, layout: str = "auto") -> None:
        for key, value in state.items():
            if not isinstance(value, Stateful):
                raise TypeError(f"checkpoint state {key!r}: {type(value).__name__} does not "
                                "implement torch's Stateful protocol (state_dict and "
                                "load_state_dict)")
        self.directory, self.state = directory, dict(state)
        self.every_steps, self.every_seconds = every_steps, every_seconds
        self.keep_last, self.keep_best = keep_last, keep_best
        self.extra, self.meta = dict(extra or {}), meta
        self.listener: CheckpointListener = listener or _Quiet()
        self.after_load, self.migrate = after_load, migrate
        self.rank = current_rank() if rank is None else rank
        self.resumed_from: str | None = None
        self.sharded = layout == "dcp" or (layout == "auto" and is_sharded(state.get("model")))
        if self.sharded and not all(k in self.state for k in dcp_format.SHARDED_KEYS):
            raise ValueError("a sharded (DCP) checkpoint needs the state keys 'model' and "
                             f"'optimizer'; got {', '.join(self.state)}")
        self._async = async_save
        # sharded: every rank writes its part; async, on a group of its own, so the background
        # collectives never interleave with training's on the default group
        self._writer = self._new_writer()
        # old checkpoints are deleted in a thread: unlinking GBs is not free (storage.prune)
        self._removals = ckpt.BackgroundRemovals()
        self._group: torch.distributed.ProcessGroup | None = None
        self.renew_group()
        self._last_save = time.monotonic()
        self._fences = fencing
        self.fence: Fence | NoFence = ckpt.UNFENCED

    def _new_writer(self) -> AsyncCheckpointer | _SyncWriter:
        """The writer of this rank: asynchronous where it writes (rank 0, or every rank when
        sharded) and ``async_save`` asks for it."""
        writes = self.rank == 0 or self.sharded
        return AsyncCheckpointer() if self._async and writes else _SyncWriter()

    @property
    def _fencing(self) -> bool:
        """Whether this rank claims the fencing token (rank 0, fencing on)."""
        return self._fences and self.rank == 0

    def renew_group(self) -> None:
        """The default group was re-formed in place (a script's FSDP2 loop): the background
        checkpoint group again, as the constructor made it. Collective: every member calls it
        where a replacement's constructor does."""
        if self.sharded and self._async:
            self._group = checkpoint_group()

    def renumber(self, rank: int) -> None:
        """This process is ``rank`` now (a regroup of a script's loop renumbered it): rank 0
        writes the replicated checkpoints and claims the fencing token (at the next
        :meth:`claim`). The save in flight is committed first."""
        if rank == self.rank:
            return
        self.wait()
        self._writer.close()
        self.rank = rank
        self._writer = self._new_writer()
        self.fence = ckpt.UNFENCED

    def claim(self) -> None:
        """Rank 0: claim a fencing token for this group (once; :meth:`load_latest` and the
        first :meth:`save` call it). Other ranks and ``fencing=False``: nothing."""
        if self._fencing and isinstance(self.fence, NoFence):
            self.fence = Fence.claim(self.directory)

    # ------------------------------------------------------------ saving

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
                   and time.monotonic() - self._last_save >= self.every_seconds)
        if self.sharded and self.every_seconds is not None:
            by_time = bool(broadcast_object(by_time))
        return self.due_by_steps(step) or by_time

    def maybe_save(self, step: int) -> bool:
        """:meth:`save` if :meth:`due`; True if it saved."""
        if self.due(step):
            self.save(step)
            return True
        return False

    def save(self, step: int, *, best: bool = False, step_checkpoint: bool = True) -> None:
        """Commit ``step-N`` (and ``best-step-N`` when ``best`` and ``keep_best``); all ranks
        call it, rank 0 writes. Asynchronous saves return after the snapshot; the next save,
        :meth:`wait` and :meth:`close` re-raise a failed background write.

        Raises:
            OSError / CheckpointError: a synchronous write failed (or the previous async one).
            FencedOut: a newer group claimed the directory (this save or the previous one).
        """
        names = [f"step-{step:08d}"] if step_checkpoint else []
        if best and self.keep_best:
            names.append(f"best-step-{step:08d}")
        if names and self.sharded:
            self._save_sharded(step, names)
            return
        if not names or self.rank != 0:
            return
        self._last_save = time.monotonic()
        self.claim()
        meta = {"step": step, **self.meta()}
        stall = self._writer.save(self.state_dict(), lambda s: self._write(names, s, meta))
        self.listener.checkpoint_stall(stall)
        log.info("checkpoint of step %d: training stalled %.3f s (%s)", step, stall,
                 "async" if self._async else "sync")

    def _write(self, names: list[str], state: dict[str, Any], meta: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        paths = ckpt.write_checkpoint(self.directory, names, state, meta, self.fence)
        self._committed(paths, meta["step"], t0, "checkpoint")

    def _committed(self, paths: list[str], step: int, t0: float, what: str) -> None:
        """After a commit (rank 0): retention, the log line, the listener's event."""
        seconds = time.perf_counter() - t0
        size = ckpt.inspect(paths[0]).size_bytes
        ckpt.prune(self.directory, self.keep_last, protect=self.resumed_from,
                   removals=self._removals)
        log.info("committed %s %s (written in %.2f s)", what, ", ".join(paths), seconds)
        self.listener.checkpoint_committed(CheckpointEvent(paths, step, seconds, size))

    def _save_sharded(self, step: int, names: list[str]) -> None:
        """Every rank snapshots its shards (and rank 0 the rest) and writes its DCP files into
        the staging directory rank 0 names, in the background when async (:meth:`_write_sharded`
        commits them)."""
        self._last_save = time.monotonic()
        staging, meta = None, {}
        if self.rank == 0:
            self.claim()
            self._writer.wait()  # the previous commit's prune runs before this staging exists
            staging = ckpt.staging_dir(self.directory, names, self.fence)
            meta = {"step": step, **self.meta()}
        staging = broadcast_object(staging)
        state = {"sharded": dcp_format.sharded_state(self.state["model"], self.state["optimizer"]),
                 "rest": self._rest() if self.rank == 0 else {}}
        stall = self._writer.save(state, lambda s: self._write_sharded(names, staging, s, meta))
        self.listener.checkpoint_stall(stall)
        if self.rank == 0:
            log.info("checkpoint of step %d: training stalled %.3f s (%s, sharded)", step, stall,
                     "async" if self._async else "sync")

    def _rest(self) -> dict[str, Any]:
        return {**{k: v.state_dict() for k, v in self.state.items()
                   if k not in dcp_format.SHARDED_KEYS}, **self.extra}

    def _write_sharded(self, names: list[str], staging: str, state: dict[str, Any],
                       meta: dict[str, Any]) -> None:
        """Write this rank's DCP files and hash them; rank 0 gathers every rank's hashes,
        writes the rest and the manifest and publishes under the fence. A rank that dies before
        its hashes arrive makes the gather fail on rank 0: nothing is published."""
        t0 = time.perf_counter()
        dcp_format.save_shards(staging, state["sharded"], self._group)
        mine = [n for n in ckpt.file_names(staging)
                if n.startswith(f"__{self.rank}_") and n.endswith(".distcp")]
        if self.rank == 0:
            mine.append(dcp_format.METADATA)
        gathered = all_gather_object(ckpt.hash_files(staging, mine), self._group)
        if self.rank != 0:
            return
        shard_files = {k: v for part in gathered for k, v in part.items()}
        paths = ckpt.commit_sharded(self.directory, names, staging, shard_files,
                                    state["rest"], meta, self.fence)
        self._committed(paths, meta["step"], t0,
                        f"sharded checkpoint ({len(shard_files) + 1} files)")

    def state_dict(self) -> dict[str, Any]:
        return {**{k: v.state_dict() for k, v in self.state.items()}, **self.extra}

    def wait(self) -> None:
        """Block until the in-flight save is committed (re-raises its error)."""
        self._writer.wait()

    def abandon(self) -> None:
        """A peer died (in-place recovery of sharded state): wait for the in-flight save, whose
        collectives fail with the peer (its error is logged, not raised: nothing of it was
        published), and forget the checkpoint group, which goes with the dead group."""
        try:
            self._writer.wait()
        except (Exception, CheckpointException) as e:  # DCP's is a BaseException
            log.warning("the sharded checkpoint in flight was abandoned: %s",
                        dcp_format.problem(e))
        self._group = None

    def close(self) -> None:
        """Commit the in-flight save, stop the writer thread, wait until the pruned checkpoints
        are deleted (in the background: :func:`~elastic_runner.checkpoint.storage.prune`) and
        release the checkpoint group (a gloo group left to the garbage collector after the
        default group is gone can block in its destructor)."""
        try:
            self._writer.close()
            self._removals.finish()
        finally:
            group, self._group = self._group, None
            release_group(group)

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
        choice = self._choose()
        if choice is None:
            log.info("no checkpoint in %s: starting from scratch", self.directory)
            return None
        raw = self.migrate(ckpt.load_state(choice, map_location=map_location, full=False))
        self.resumed_from = choice
        self._load(raw, choice)
        return raw

    def _choose(self) -> str | None:
        """The newest checkpoint whose files verify, the same on every rank (collective). Rank 0
        lists them; every rank hashes its share of each candidate's files (a sharded
        checkpoint's are spread over the ranks, not all read by rank 0)."""
        listed = None
        if self.rank == 0:
            self.claim()  # before choosing: no older group's later commit can go unseen
            listed = [(c.path, c.reason) for c in ckpt.newest_first(self.directory)]
        rank, world = self.rank, world_size()
        for path, reason in broadcast_object(listed):
            if not reason:
                problems = all_gather_object(ckpt.verify_files(path, rank, world))
                reason = next((p for p in problems if p), "")
            if not reason:
                if self.rank == 0:
                    self.listener.checkpoint_loaded(ckpt.inspect(path))
                return path
            if self.rank == 0:
                log.warning("skipping checkpoint %s: %s", path, reason)
        return None

    def _load(self, raw: dict[str, Any], source: str) -> None:
        if ckpt.is_sharded(source):
            self._apply_sharded(raw, source)
        else:
            self._apply(raw, source)
        self.after_load(raw)
        model = self.state.get("model")
        if isinstance(model, torch.nn.Module) and not is_sharded(model):
            # replicas must be identical after loading, or DDP would average diverged models
            assert_same_across_ranks(ckpt.tensors_digest(model.state_dict()),
                                     f"model parameters loaded from {source}")

    def _apply(self, raw: dict[str, Any], source: str) -> None:
        missing = sorted(set(self.state) - set(raw))
        if missing:
            raise ckpt.CheckpointError(f"checkpoint {source} has no state for "
                                       f"{', '.join(missing)} (written by another program?)")
        model = self.state.get("model")
        if isinstance(model, torch.nn.Module):
            ckpt.check_compatible(model.state_dict(), raw["model"], source)
        if is_sharded(model):  # a whole (rank-0) checkpoint into shards: each rank takes its own
            dcp_format.set_full_state(model, self.state["optimizer"], raw["model"],
                                      raw["optimizer"])
        for key, obj in self.state.items():
            if not (is_sharded(model) and key in dcp_format.SHARDED_KEYS):
                obj.load_state_dict(raw[key])

    def _apply_sharded(self, raw: dict[str, Any], source: str) -> None:
        """Load a sharded checkpoint: model and optimizer through DCP (resharded to this group,
        collective), the rest from its ``state.pt``."""
        missing = sorted(set(self.state) - set(raw) - set(dcp_format.SHARDED_KEYS))
        if missing or not all(k in self.state for k in dcp_format.SHARDED_KEYS):
            raise ckpt.CheckpointError(f"checkpoint {source} has no state for "
                                       f"{', '.join(missing) or 'model/optimizer'}")
        model = self.state["model"]
        try:
            shapes = dcp_format.model_shapes(dcp_format.read_metadata(source))
        except (OSError, pickle.UnpicklingError, EOFError) as e:
            raise ckpt.CheckpointError(f"checkpoint {source}: cannot read its DCP metadata: "
                                       f"{dcp_format.problem(e)}") from e
        ckpt.check_compatible(model.state_dict(),
                              {k: torch.empty(s, device="meta") for k, s in shapes.items()},
                              source)
        try:
            dcp_format.load_shards(source, model, self.state["optimizer"])
        except (Exception, CheckpointException) as e:  # DCP's is a BaseException
            if is_peer_failure(e):
                raise
            raise ckpt.CheckpointError(f"checkpoint {source}: cannot load its DCP files: "
                                       f"{dcp_format.problem(e)}") from e
        for key, obj in self.state.items():
            if key not in dcp_format.SHARDED_KEYS:
                obj.load_state_dict(raw[key])

    def load_weights(self, path: str) -> None:
        """Load only the model weights of the checkpoint at ``path`` (collective when either
        the checkpoint or the model is sharded): the best checkpoint for the test split."""
        model = self.state["model"]
        if ckpt.is_sharded(path):
            dcp_format.load_shards(path, model, None)
        elif is_sharded(model):
            dcp_format.set_full_model(model, ckpt.load_state(path)["model"])
        else:
            model.load_state_dict(ckpt.load_state(path)["model"])

    def load_from_peer(self, raw: dict[str, Any], peer: int) -> None:
        """Load ``raw`` (a live peer's :meth:`state_dict`, received during an in-place
        recovery) into ``state``; the model's tensors are checked first (not collective).

        Raises:
            CheckpointError: a missing state key or tensors that do not fit the model."""
        if self.sharded:
            raise ckpt.CheckpointError("a sharded model's state is not held whole by any peer")
        self._apply(raw, f"rank {peer}'s state")

    def local_copy(self, to_cpu: bool = True) -> dict[str, Any]:
        """This rank's part of the state, on the CPU (``to_cpu=False``: the shards stay on
        their device, for a caller that copies them into host memory itself): its local model
        and optimizer shards (:func:`~elastic_runner.checkpoint.dcp_format.local_shards`: on a
        CPU device the parameters' own storage, so copy it before the next step) and the rest
        (sampler, schedule, counters, RNG). What a peer keeps for an in-place recovery under
        FSDP (``recovery/peer_copies.py``); sharded layout only, not collective."""
        sharded = dcp_format.sharded_state(self.state["model"], self.state["optimizer"])
        return {"shards": dcp_format.local_shards(sharded, to_cpu), "rest": self._rest()}

    def load_local_copy(self, raw: dict[str, Any], source: str) -> None:
        """Load :meth:`local_copy`'s ``raw`` (taken on this rank's position of a mesh of the
        same shape) into ``state``. Not collective.

        Raises:
            CheckpointError: a missing key, or shards that do not fit (named)."""
        missing = sorted(set(self.state) - set(raw["rest"]) - set(dcp_format.SHARDED_KEYS))
        if missing:
            raise ckpt.CheckpointError(f"{source} has no state for {', '.join(missing)}")
        try:
            dcp_format.load_local_shards(self.state["model"], self.state["optimizer"],
                                         raw["shards"])
        except ValueError as e:
            raise ckpt.CheckpointError(f"{source}: {e}") from e
        for key, obj in self.state.items():
            if key not in dcp_format.SHARDED_KEYS:
                obj.load_state_dict(raw["rest"][key])

    def rollback(self, map_location: str | torch.device = "cpu") -> bool:
        """Wait for the in-flight save, then reload the newest valid checkpoint on all ranks;
        False if there is none."""
        self.wait()
        return self.load_latest(map_location) is not None


def is_sharded(model: Any) -> bool:
    """Whether ``model`` is a module with DTensor parameters (FSDP2's shards)."""
    if not isinstance(model, torch.nn.Module):
        return False
    return any(isinstance(p, DTensor) for p in model.parameters())
