"""Committing checkpoints: the synchronous or asynchronous write of the rank-0 layout or of the
sharded one (DCP, on a process group of its own when async), under this group's fencing token,
then retention and the listener's events.

Its log lines keep the manager's logger (``elastic_runner.checkpoint.manager``): operators and
the benchmarks read them by that name.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful

from ..dist import all_gather_object, broadcast_object, checkpoint_group, release_group
from . import dcp_format
from . import storage as ckpt
from .async_save import AsyncCheckpointer
from .events import CheckpointEvent, CheckpointListener
from .fencing import CommitFence, Fence, NoFence
from .layout import rest_state, whole_state

log = logging.getLogger("elastic_runner.checkpoint.manager")


class SnapshotWriter(Protocol):
    """Runs one checkpoint's ``write`` of a snapshot of ``state``
    (:class:`~.async_save.AsyncCheckpointer` in the background, :class:`SyncWriter` at once)."""

    def save(self, state: Any, write: Callable[[Any], Any]) -> float:
        """Snapshot ``state`` and write it; returns the seconds training stalled."""
        ...

    def wait(self) -> Any:
        """Block until the write in flight is done (re-raises its error)."""
        ...

    def close(self) -> None:
        """:meth:`wait`, then stop (a background thread)."""
        ...


class SyncWriter:
    """The synchronous :class:`SnapshotWriter` (null object for ``async_save``): writes at
    once; the stall is the whole write."""

    def save(self, state: Any, write: Callable[[Any], Any]) -> float:
        t0 = time.perf_counter()
        write(state)
        return time.perf_counter() - t0

    def wait(self) -> None:
        pass

    def close(self) -> None:
        pass


class CheckpointCommitter:
    """Writes and commits the checkpoints of ``state`` in ``directory`` for one rank.

    Args:
        directory, state, extra, meta, keep_last, listener, rank, fencing: as
            :class:`~.manager.CheckpointManager`'s.
        sharded: every rank writes its part of ``model`` and ``optimizer`` through DCP.
        async_save: write in the background where this rank writes.
        protect: the checkpoint retention must not delete (the one resumed from), or None.
    """

    def __init__(self, directory: str, state: Mapping[str, Stateful], *,
                 extra: Mapping[str, Any], meta: Callable[[], dict[str, Any]], keep_last: int,
                 listener: CheckpointListener, rank: int, sharded: bool, async_save: bool,
                 fencing: bool, protect: Callable[[], str | None]) -> None:
        self.directory, self.state, self.extra, self.meta = directory, state, extra, meta
        self.keep_last, self.listener, self.protect = keep_last, listener, protect
        self.rank, self.sharded, self.async_save = rank, sharded, async_save
        # sharded: every rank writes its part; async, on a group of its own, so the background
        # collectives never interleave with training's on the default group
        self.writer = self._new_writer()
        # old checkpoints are deleted in a thread: unlinking GBs is not free (storage.prune)
        self._removals = ckpt.BackgroundRemovals()
        self.group: torch.distributed.ProcessGroup | None = None
        self.renew_group()
        self._fences = fencing
        self.fence: CommitFence = ckpt.UNFENCED

    def _new_writer(self) -> SnapshotWriter:
        """Asynchronous where this rank writes (rank 0, or every rank when sharded) and
        ``async_save`` asks for it."""
        writes = self.rank == 0 or self.sharded
        return AsyncCheckpointer() if self.async_save and writes else SyncWriter()

    def renew_group(self) -> None:
        """The background checkpoint group again (collective, sharded and async only)."""
        if self.sharded and self.async_save:
            self.group = checkpoint_group()

    def renumber(self, rank: int) -> None:
        """This process is ``rank`` now: the save in flight is committed, the writer made anew
        and the fencing token claimed again at the next :meth:`claim`."""
        self.wait()
        self.writer.close()
        self.rank = rank
        self.writer = self._new_writer()
        self.fence = ckpt.UNFENCED

    def claim(self) -> None:
        """Rank 0 with fencing on: claim a fencing token for this group (once)."""
        if self._fences and self.rank == 0 and isinstance(self.fence, NoFence):
            self.fence = Fence.claim(self.directory)

    def save_whole(self, step: int, names: list[str]) -> None:
        """Rank 0: commit ``names`` of the whole state (the rank-0 layout).

        Raises:
            OSError / CheckpointError / FencedOut: as :meth:`~.manager.CheckpointManager.save`.
        """
        self.claim()
        meta = {"step": step, **self.meta()}
        stall = self.writer.save(whole_state(self.state, self.extra),
                                 lambda s: self._write(names, s, meta))
        self.listener.checkpoint_stall(stall)
        log.info("checkpoint of step %d: training stalled %.3f s (%s)", step, stall,
                 "async" if self.async_save else "sync")

    def _write(self, names: list[str], state: dict[str, Any], meta: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        paths = ckpt.write_checkpoint(self.directory, names, state, meta, self.fence)
        self._committed(paths, meta["step"], t0, "checkpoint")

    def _committed(self, paths: list[str], step: int, t0: float, what: str) -> None:
        """After a commit (rank 0): retention, the log line, the listener's event."""
        seconds = time.perf_counter() - t0
        size = ckpt.inspect(paths[0]).size_bytes
        ckpt.prune(self.directory, self.keep_last, protect=self.protect(),
                   removals=self._removals)
        log.info("committed %s %s (written in %.2f s)", what, ", ".join(paths), seconds)
        self.listener.checkpoint_committed(CheckpointEvent(paths, step, seconds, size))

    def save_sharded(self, step: int, names: list[str]) -> None:
        """Every rank snapshots its shards (and rank 0 the rest) and writes its DCP files into
        the staging directory rank 0 names, in the background when async
        (:meth:`_write_sharded` commits them). Collective."""
        staging, meta = None, {}
        if self.rank == 0:
            self.claim()
            self.writer.wait()  # the previous commit's prune runs before this staging exists
            staging = ckpt.staging_dir(self.directory, names, self.fence)
            meta = {"step": step, **self.meta()}
        staging = broadcast_object(staging)
        state = {"sharded": dcp_format.sharded_state(self.state["model"], self.state["optimizer"]),
                 "rest": rest_state(self.state, self.extra) if self.rank == 0 else {}}
        stall = self.writer.save(state, lambda s: self._write_sharded(names, staging, s, meta))
        self.listener.checkpoint_stall(stall)
        if self.rank == 0:
            log.info("checkpoint of step %d: training stalled %.3f s (%s, sharded)", step, stall,
                     "async" if self.async_save else "sync")

    def _write_sharded(self, names: list[str], staging: str, state: dict[str, Any],
                       meta: dict[str, Any]) -> None:
        """Write this rank's DCP files and hash them; rank 0 gathers every rank's hashes,
        writes the rest and the manifest and publishes under the fence. A rank that dies before
        its hashes arrive makes the gather fail on rank 0: nothing is published."""
        t0 = time.perf_counter()
        dcp_format.save_shards(staging, state["sharded"], self.group)
        mine = [n for n in ckpt.file_names(staging)
                if n.startswith(f"__{self.rank}_") and n.endswith(".distcp")]
        if self.rank == 0:
            mine.append(dcp_format.METADATA)
        gathered = all_gather_object(ckpt.hash_files(staging, mine), self.group)
        if self.rank != 0:
            return
        shard_files = {k: v for part in gathered for k, v in part.items()}
        paths = ckpt.commit_sharded(self.directory, names, staging, shard_files,
                                    state["rest"], meta, self.fence)
        self._committed(paths, meta["step"], t0,
                        f"sharded checkpoint ({len(shard_files) + 1} files)")

    def wait(self) -> None:
        """Block until the in-flight save is committed (re-raises its error)."""
        self.writer.wait()

    def abandon(self) -> None:
        """Wait for the in-flight save, whose collectives fail with a dead peer (its error is
        logged, not raised: nothing of it was published), and forget the checkpoint group."""
        try:
            self.writer.wait()
        except (Exception, CheckpointException) as e:  # DCP's is a BaseException
            log.warning("the sharded checkpoint in flight was abandoned: %s",
                        dcp_format.problem(e))
        self.group = None

    def close(self) -> None:
        """Commit the in-flight save, stop the writer thread, wait for the pruned checkpoints'
        deletion and release the checkpoint group (a gloo group left to the garbage collector
        after the default group is gone can block in its destructor)."""
        try:
            self.writer.close()
            self._removals.finish()
        finally:
            group, self.group = self.group, None
            release_group(group)
