"""Every commit into a local ``checkpoint.dir``, recorded from outside while it happens.

The checks of a split brain must see every checkpoint that was ever published, not the few
that retention (``checkpoint.keep_last``) leaves at the end. :class:`CommitLog` watches the
directory with inotify (the ``watchdog`` library) and records, as they happen:

* each **commit**: a staging directory ``.tmp-<name>-<pid>`` renamed to its final name (the
  local commit protocol's publish, ``elastic_runner/checkpoint/storage.py``), with the writer's
  pid from the staging name and the step and fencing token read from its manifest at once
  (retention removes a checkpoint only ``keep_last`` commits later);
* each **set-aside**: a checkpoint renamed to ``.superseded-<name>-fence-<token>`` because a
  writer of another token took its name;
* each **fencing claim**: ``fence/<token>`` created (``elastic_runner/checkpoint/fencing.py``).

Times are the test's ``time.time()`` when the event was handled (seconds).
"""

from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer

_STAGING = re.compile(r"^\.tmp-(.+)-(\d+)$")


@dataclass(frozen=True)
class Commit:
    """One published checkpoint: its name, its manifest's step and fencing token (None: the
    manifest could not be read), the writing process's pid and when it was seen."""

    name: str
    step: int | None
    fence: int | None
    pid: int
    time: float


@dataclass(frozen=True)
class Claim:
    token: int
    time: float


class CommitLog(FileSystemEventHandler):
    """The commits, set-asides and claims in ``directory`` (created if missing) from
    :meth:`__enter__` until :meth:`__exit__`; thread-safe to read meanwhile."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.commits: list[Commit] = []
        self.set_aside: list[str] = []
        self.claims: list[Claim] = []
        self._lock = threading.Lock()
        self._observer = Observer()

    def __enter__(self) -> CommitLog:
        self.directory.mkdir(parents=True, exist_ok=True)
        self._observer.schedule(self, str(self.directory), recursive=True)
        self._observer.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._observer.stop()
        self._observer.join(timeout=30)

    def on_moved(self, event: FileSystemEvent) -> None:
        src, dest = Path(str(event.src_path)), Path(str(event.dest_path))
        if dest.parent != self.directory:
            return
        staged = _STAGING.match(src.name)
        if staged and staged[1] == dest.name and event.is_directory:
            self._commit(dest, int(staged[2]))
        elif dest.name.startswith(".superseded-"):
            with self._lock:
                self.set_aside.append(dest.name)

    def on_created(self, event: FileSystemEvent) -> None:
        path = Path(str(event.src_path))
        if path.parent == self.directory / "fence" and path.name.isdigit():
            with self._lock:  # inotify may report a created file twice
                if int(path.name) not in {c.token for c in self.claims}:
                    self.claims.append(Claim(int(path.name), time.time()))

    def _commit(self, path: Path, pid: int) -> None:
        seen = time.time()
        try:
            manifest = json.loads((path / "manifest.json").read_text())
            step, fence = int(manifest["step"]), int(manifest.get("fence", 0))
        except (OSError, ValueError, KeyError):
            step, fence = None, None
        with self._lock:
            self.commits.append(Commit(path.name, step, fence, pid, seen))

    def snapshot(self) -> tuple[list[Commit], list[str], list[Claim]]:
        """Copies of the commits, set-asides and claims recorded so far."""
        with self._lock:
            return list(self.commits), list(self.set_aside), list(self.claims)

    def claimed(self, token: int) -> float | None:
        """When ``token`` was claimed (None: not yet)."""
        return next((c.time for c in self.snapshot()[2] if c.token == token), None)
