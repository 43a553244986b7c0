"""Fencing tokens for checkpoint writers: no split-brain commit into one ``checkpoint.dir``.

A group that was declared dead (a starved heartbeat, a partitioned node) may go on training and
writing checkpoints beside the group that replaced it. Each writer therefore claims a *fencing
token* when its group starts (Kleppmann, "How to do distributed locking", 2016: a number that
grows with every grant of the lease; Burrows, "The Chubby lock service", 2006: sequencers): the
token is one more than any token claimed in that directory before, and it is stored as
``<checkpoint.dir>/fence/<token:012d>`` (JSON: host, pid, run id, restart count, unix time).
Claiming happens before the group chooses the checkpoint it resumes from, so every commit of an
older group that the new group did not see is refused:

* before each atomic publish (the rename on a filesystem, the manifest on an object store) the
  writer checks that no newer token exists, and raises :class:`FencedOut` otherwise;
* on a local or network filesystem the claim and the check-and-rename hold an exclusive
  ``flock`` on ``fence/.lock``, so no claim can fall between the check and the rename;
* on an object store a claim is a conditional create (``If-None-Match: *``, fsspec
  ``mode="create"``) and the check is a fresh listing just before the manifest is written; a
  claim that lands between that listing and the manifest's PUT is not seen (the store offers no
  compare-and-swap across keys), which is why resume orders checkpoints by (token, step): the
  newest group's checkpoints win over a stale group's, whatever their step.

A claim is also refused when it would take the directory back from a newer group. Each claim
records the job's rendezvous id (``TORCHELASTIC_RUN_ID``: one per ``elastic-runner run`` or
torchrun job, the same on every node and across its restarts). A job may claim the next token
only while the newest token is its own, or when it never claimed in the directory: once another
job claimed after it, the job is stale, whoever restarts its processes (torch's restart path,
an in-place replacement, a warm spare), and :meth:`Fence.claim` raises :class:`FencedOut` (the
worker exits 3). Seen before this rule: a frozen group woke, its agent replaced rank 0 in place,
and the replacement claimed a token above the newer group's and committed over its checkpoints.
Two jobs started with the same explicit ``--rdzv-id`` on one directory are one lineage to this
rule: only the tokens order them.

Every manifest records its writer's token (``fence``); checkpoints written before fencing count
as token 0. A commit never replaces a checkpoint written under another token
(:func:`~elastic_runner.checkpoint.storage.write_checkpoint`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from typing import Any, Protocol

import fsspec
from fsspec.implementations.local import LocalFileSystem

from ..protocol.torchrun_env import TorchrunEnv

log = logging.getLogger(__name__)

FENCE_DIR = "fence"
_LOCK = ".lock"


class FencedOut(RuntimeError):
    """A newer group claimed the checkpoint directory: this writer's group is stale and must
    stop without committing."""


class CommitFence(Protocol):
    """What a commit holds its publish under: :class:`Fence` (a claimed token) or
    :class:`NoFence` (not fenced, token 0)."""

    token: int

    def guard(self, what: str) -> contextlib.AbstractContextManager[None]:
        """Held around the atomic publish of ``what``.

        Raises:
            FencedOut: a newer token exists."""
        ...

    def check(self, what: str) -> None:
        """Raises :class:`FencedOut` when a newer token exists (before publishing ``what``)."""
        ...


class Fence:
    """This group's fencing token in one checkpoint directory (see the module docstring).

    Use :meth:`claim` to get one; :meth:`guard` wraps the atomic publish of a commit.
    """

    def __init__(self, directory: str, token: int) -> None:
        self.directory, self.token = directory, token
        self._fs, root = fsspec.core.url_to_fs(str(directory))
        self._root = f"{root.rstrip('/')}/{FENCE_DIR}"
        self._local = isinstance(self._fs, LocalFileSystem)

    @classmethod
    def claim(cls, directory: str, run_id: str | None = None) -> Fence:
        """Claim the next token in ``directory`` (created if missing) for the job ``run_id``
        (default: ``TORCHELASTIC_RUN_ID``; None or empty: no lineage, any claim is allowed).

        Raises:
            FencedOut: ``run_id`` claimed in ``directory`` before, and another job claimed a
                newer token since (module docstring).
            OSError: the directory cannot be written.
        """
        torchrun = TorchrunEnv.read()
        run_id = torchrun.run_id if run_id is None else run_id
        fence = cls(directory, 0)
        fence._fs.makedirs(fence._root, exist_ok=True)
        owner = {"host": socket.gethostname(), "pid": os.getpid(), "run_id": run_id,
                 "restart": torchrun.restart_count_text, "time": time.time()}
        with fence._lock():
            while True:
                newest = fence.newest()
                fence._refuse_if_superseded(newest, run_id)
                token = owner["token"] = newest + 1
                try:
                    fence._fs.pipe_file(fence._path(token), json.dumps(owner).encode(),
                                        mode="create")
                    break
                except FileExistsError:  # another writer took it first: look again
                    continue
        fence.token = token
        log.info("checkpoint fencing token %d claimed in %s", token, directory)
        return fence

    def _refuse_if_superseded(self, newest: int, run_id: str | None) -> None:
        """Raise :class:`FencedOut` when job ``run_id`` claimed here before and the newest
        token (``newest``) is another job's."""
        if not run_id or newest == 0:
            return
        last = self.owner(newest)
        if last.get("run_id") == run_id:
            return
        mine = next((t for t in range(newest - 1, 0, -1)
                     if self.owner(t).get("run_id") == run_id), 0)
        if mine:
            raise FencedOut(
                f"not claiming {self.directory}: this job (run id {run_id}) held fencing token "
                f"{mine}, and a newer group claimed token {newest} since (run id "
                f"{last.get('run_id')}, host {last.get('host')} pid {last.get('pid')}): this "
                "job is stale and stops, whichever of its processes restarts; the newer group "
                "goes on. To take the directory over, start a new job (another --rdzv-id)")

    def _path(self, token: int) -> str:
        return f"{self._root}/{token:012d}"

    def newest(self) -> int:
        """The largest token claimed in the directory (0: none)."""
        self._fs.invalidate_cache(self._root)  # object-store listings are cached
        try:
            names = [p.rstrip("/").rsplit("/", 1)[-1] for p in self._fs.ls(self._root,
                                                                         detail=False)]
        except FileNotFoundError:
            return 0
        return max((int(n) for n in names if n.isdigit()), default=0)

    def owner(self, token: int) -> dict[str, Any]:
        """What the claim of ``token`` recorded (empty if unreadable)."""
        try:
            return json.loads(self._fs.cat_file(self._path(token)))
        except (OSError, ValueError):
            return {}

    @contextlib.contextmanager
    def guard(self, what: str) -> Iterator[None]:
        """Hold off claims (filesystems) and check that this token is still the newest; the
        block publishes the commit ``what``.

        Raises:
            FencedOut: a newer token was claimed; nothing of ``what`` is published."""
        with self._lock():
            newest = self.newest()
            if newest > self.token:
                o = self.owner(newest)
                raise FencedOut(
                    f"not committing {what}: {self.directory} was claimed by a newer group "
                    f"(fencing token {newest}, host {o.get('host')} pid {o.get('pid')}, "
                    f"restart {o.get('restart')}) while this group holds token {self.token}: "
                    "this group is stale (was its node declared dead, e.g. a missed rendezvous "
                    "keep-alive?) and stops; the newer group goes on")
            yield

    def check(self, what: str) -> None:
        """Fail early, before writing anything of ``what``: :meth:`guard` around nothing.

        Raises:
            FencedOut: a newer token was claimed."""
        with self.guard(what):
            pass

    @contextlib.contextmanager
    def _lock(self) -> Iterator[None]:
        if not self._local:
            yield
            return
        fd = os.open(os.path.join(self._root, _LOCK), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the lock


class NoFence:
    """The null object: commits are not fenced (a single writer by construction: tests,
    ``export``); token 0."""

    token = 0

    @contextlib.contextmanager
    def guard(self, what: str) -> Iterator[None]:
        yield

    def check(self, what: str) -> None:
        pass

