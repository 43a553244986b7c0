"""Atomic, verified checkpoints on a local/shared filesystem or an object store (fsspec).
Knows nothing about training.

Layout: one directory (prefix) per checkpoint inside ``checkpoint.dir``::

    step-00000120/         state.pt (torch.save of a dict of tensors and plain values)
                           manifest.json (written last: format, step, epoch, world_size, time,
                                          config hash, and bytes + sha256 of every file)
    best-step-00000100/    the same, for the best evaluation so far

A sharded checkpoint (``checkpoint.format: dcp``, manifest ``format_version`` 2) holds beside
``state.pt`` (the replicated state: sampler, schedule, counters) the model and optimizer state as
DCP wrote it: ``.metadata`` and one ``__<rank>_<n>.distcp`` per rank (``checkpoint/dcp_format.py``).
Every rank writes its files into the same staging directory, which rank 0 named; each hashes its
own; rank 0 gathers the hashes, writes ``state.pt`` and the manifest, and publishes as below. A
checkpoint whose manifest does not list every file, or lists one that is missing, is invalid.

Commit protocol, local paths: everything is written under ``.tmp-<name>-<pid>/`` in the same
directory, each file is flushed and fsynced, the manifest is written last and fsynced, the
temporary directory is fsynced, then ``os.replace``-d to its final name and the parent directory
is fsynced. A crash at any instant leaves either no directory of that name or a complete one;
stray ``.tmp-*`` entries (and ``.pruned-*``: a pruned checkpoint being deleted) are ignored and
removed by the next prune.

Commit protocol, URLs (``s3://``, ``gs://``, ... through fsspec): object stores have no atomic
rename, so files are written in place and the manifest is written last; a checkpoint without a
manifest, or whose files do not match it, is invalid. Rewriting a name deletes its manifest first.
A sharded checkpoint's ranks write their DCP files into its prefix the same way
(:func:`staging_dir`, :func:`commit_sharded`).

Either way a commit never replaces a checkpoint that another fencing token wrote
(``checkpoint/fencing.py``): one of an older token in the way (its step redone after a restart,
a corrupt one skipped by the resume) is set aside under ``.superseded-<name>-fence-<token>``
and kept for inspection; one of a newer token stops the commit (:class:`FencedOut`). A
checkpoint of the writer's own token is replaced (a step redone after an in-place roll-back).

Either way readers trust only checkpoints whose manifest verifies (sizes always, sha256 before
loading). Loading uses ``torch.load(..., weights_only=True)``: no arbitrary unpickling.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem

from .. import nested
from . import dcp_names
from .fencing import CommitFence, FencedOut, NoFence

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
SHARDED_FORMAT_VERSION = 2
MAX_FILES = 100_000  # a sharded checkpoint has one file per rank, and .metadata
STATE_FILE = "state.pt"
MANIFEST = "manifest.json"
UNFENCED = NoFence()
_NAME = re.compile(r"^(?P<kind>step|best-step)-(?P<step>\d{8})$")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used (corrupt, incomplete, or from another model)."""


@dataclass(frozen=True)
class CheckpointInfo:
    """One checkpoint as found in storage.

    ``path`` is a local path or a URL; ``size_bytes`` is the total of its files; ``valid`` is
    False with ``reason`` when the manifest is missing or unreadable or a file's size differs
    (``inspect(..., verify=True)`` also checks sha256).
    """

    path: str
    kind: str  # "step" or "best"
    step: int
    epoch: int | None
    world_size: int | None
    time: float | None  # unix seconds of the commit
    size_bytes: int
    valid: bool
    reason: str = ""
    config_hash: str | None = None
    fence: int = 0  # the writer's fencing token (checkpoint/fencing.py); 0 before fencing existed
    global_batch_size: int | None = None  # samples per step; None: not recorded (older ones)
    finished: bool = False  # written when training had finished (the run's last checkpoint)

    @property
    def order(self) -> tuple[int, int]:
        """Newest first by this key, descending: a newer group's checkpoints win over a stale
        group's whatever their step (checkpoint/fencing.py)."""
        return (self.fence, self.step)

    @property
    def name(self) -> str:
        return self.path.rstrip("/").rsplit("/", 1)[-1]


def _resolve(location: str | Path) -> tuple[fsspec.AbstractFileSystem, str]:
    fs, root = fsspec.core.url_to_fs(str(location))
    return fs, root.rstrip("/")


def _is_local(fs: fsspec.AbstractFileSystem) -> bool:
    return isinstance(fs, LocalFileSystem)


def _display(fs: fsspec.AbstractFileSystem, path: str) -> str:
    return path if _is_local(fs) else fs.unstrip_protocol(path)


def _clear(fs: fsspec.AbstractFileSystem, path: str) -> None:
    """Remove ``path`` and everything under it if it exists, looking past the listing cache
    (another process may have written it since this one listed)."""
    fs.invalidate_cache(path)
    if fs.exists(path):
        fs.rm(path, recursive=True)


def _ls(fs: fsspec.AbstractFileSystem, path: str) -> list[dict[str, Any]]:
    """``fs.ls(path, detail=True)`` past the listing cache: object-store clients (s3fs, gcsfs)
    cache listings per process and never expire them, so other processes' commits and deletions
    would stay invisible to a reader that listed before (a no-op on local filesystems)."""
    fs.invalidate_cache(path)
    return fs.ls(path, detail=True)


class _HashingWriter:
    """File wrapper that counts and hashes what ``torch.save`` writes: in line, or, given
    ``behind``, by telling that thread how far the file is written."""

    def __init__(self, f: BinaryIO, behind: _HashBehind | None = None) -> None:
        self.f, self.sha, self.size, self.behind = f, hashlib.sha256(), 0, behind
        self.told = 0  # bytes ``behind`` may read

    def write(self, data: bytes | memoryview) -> int:
        self.size += len(data)
        if self.behind is None:
            self.sha.update(data)
            return self.f.write(data)
        n = self.f.write(data)
        if self.size - self.told >= _HASH_CHUNK:  # a flush per chunk, not per pickle opcode
            self.f.flush()
            self.behind.written(self.size)
            self.told = self.size
        return n

    def flush(self) -> None:
        self.f.flush()


_HASH_CHUNK = 8 << 20  # bytes read back and hashed at a time


class _HashBehind:
    """sha256 of a file being written, computed by a thread that reads back (from the page
    cache) what the writer has flushed, until :meth:`digest`.

    sha256 runs at ~1 GB/s: hashed in line as ``torch.save`` wrote, a synchronous save of a
    1.4 GB CUDA state took 1.45x as long as ``torch.save`` + fsync on an H200 (1.0-1.05x
    hashed behind, with :func:`prune`'s deletion in the background).
    ``torch.save`` lends its buffers to ``write`` only during the call (a CUDA tensor's host
    copy is freed right after), so a thread that is to keep hashing during the other tensors'
    copies and the fsync reads the file itself: the same bytes, in order, at memory speed.
    Both ``os.preadv`` and hashlib release the GIL."""

    def __init__(self, fd: int) -> None:
        self.fd, self.sha = fd, hashlib.sha256()
        self._written, self._final, self._stop = 0, False, False
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="ckpt-sha256", daemon=True)
        self._thread.start()

    def written(self, size: int, final: bool = False) -> None:
        """The file's first ``size`` bytes are in the OS's hands (flushed); ``final``: all
        of it."""
        with self._cond:
            self._written, self._final = size, final
            self._cond.notify()

    def digest(self) -> str:
        """The sha256 (hex) of the file, once :meth:`written` said ``final``."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self.sha.hexdigest()

    def stop(self) -> None:
        """Abandon the hash (the write failed)."""
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join()

    def _run(self) -> None:
        buf = memoryview(bytearray(_HASH_CHUNK))
        done = 0
        try:
            while True:
                with self._cond:
                    while done == self._written and not self._final and not self._stop:
                        self._cond.wait()
                    end, final = self._written, self._final
                    if self._stop:
                        return
                while done < end:
                    n = os.preadv(self.fd, [buf[:min(_HASH_CHUNK, end - done)]], done)
                    if n <= 0:
                        raise OSError(f"{STATE_FILE} shrank while it was written ({done} of "
                                      f"{end} bytes read back)")
                    self.sha.update(buf[:n])
                    done += n
                if final:
                    return
        except BaseException as e:  # raised by digest(), in the writer's thread
            self._error = e


def _save_hashed(f: BinaryIO, state: dict[str, Any]) -> dict[str, Any]:
    """``torch.save(state, f)``; the size and sha256 of what it wrote. A local file is also
    fsynced; opened readable (``wb+``) it is hashed by :class:`_HashBehind`, the hash
    overlapping the write and the fsync, else (object stores) in line."""
    try:
        fd: int | None = f.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError
        fd = None
    behind = _HashBehind(fd) if fd is not None and f.readable() else None
    try:
        w = _HashingWriter(f, behind)
        torch.save(state, w)
        w.flush()
        if behind is not None:
            behind.written(w.size, final=True)
        if fd is not None:
            os.fsync(fd)
        sha = behind.digest() if behind is not None else w.sha.hexdigest()
    except BaseException:
        if behind is not None:
            behind.stop()
        raise
    return {"bytes": w.size, "sha256": sha}


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(fs: fsspec.AbstractFileSystem, path: str) -> str:
    h = hashlib.sha256()
    with fs.open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _manifest(meta: dict[str, Any], files: dict[str, Any]) -> bytes:
    version = SHARDED_FORMAT_VERSION if dcp_names.METADATA in files else FORMAT_VERSION
    return json.dumps({"format_version": version, "time": time.time(), **meta,
                       "files": files}, indent=1).encode()


def write_checkpoint(directory: str | Path, names: str | list[str], state: dict[str, Any],
                     meta: dict[str, Any], fence: CommitFence = UNFENCED) -> list[str]:
    """Write ``state`` once and commit it under each of ``names`` (e.g. a step and a best
    checkpoint of the same step; later names hard-link, or copy, the first one's file).

    ``meta`` (step, epoch, world_size, config_hash, ...) goes into the manifest, with
    ``fence``'s token. An existing checkpoint of the same name is replaced when ``fence``'s
    token wrote it, else set aside (module docstring).

    Returns:
        The committed checkpoints' paths (local) or URLs.

    Raises:
        FencedOut: a newer group claimed ``directory`` (``fence``); nothing was published.
    """
    names = [names] if isinstance(names, str) else names
    meta = {**meta, "fence": fence.token}
    fs, root = _resolve(directory)
    if _is_local(fs):
        return [str(p) for p in _write_local(Path(root), names, state, meta, fence)]
    return [_display(fs, p) for p in _write_object_store(fs, root, names, state, meta, fence)]


def _write_local(directory: Path, names: list[str], state: dict[str, Any],
                 meta: dict[str, Any], fence: CommitFence) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    try:
        staged = _stage_local(directory, names, state, meta)
    except OSError:
        # a stale writer's staging directory is fair game for the newer group's prune: when it
        # vanished under us, say that we are fenced out rather than a bare FileNotFoundError
        fence.check(", ".join(names))
        raise
    return _publish_local(directory, staged, names, fence)


def _publish_local(directory: Path, staged: list[Path], names: list[str],
                   fence: CommitFence) -> list[Path]:
    """Rename each complete staging directory to its name, under the fence."""
    finals = []
    try:
        with fence.guard(", ".join(names)):
            for tmp, name in zip(staged, names, strict=True):
                final = directory / name
                if final.exists() and _set_aside(LocalFileSystem(), str(final), fence) is None:
                    old = directory / f".tmp-old-{name}-{os.getpid()}"  # this token's: redone
                    os.replace(final, old)
                    shutil.rmtree(old)
                os.replace(tmp, final)
                finals.append(final)
            _fsync_dir(directory)
    except FencedOut:
        for tmp in staged:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return finals


def staging_dir(directory: str | Path, names: list[str], fence: CommitFence = UNFENCED
                ) -> str:
    """Where every rank writes its DCP files of a sharded checkpoint of ``names``: in a local
    ``directory`` a fresh, empty staging directory (this process's pid in its name: a prune by
    this process spares it, one by another removes it); on an object store the first name's
    own prefix, emptied (published by its manifest, written last: :func:`commit_sharded`).

    Raises:
        FencedOut: on an object store, a newer group claimed ``directory``.
    """
    fs, root = _resolve(directory)
    if not _is_local(fs):
        final = f"{root}/{names[0]}"
        fence.check(", ".join(names))  # fail early: a stale writer overwrites nothing
        _set_aside(fs, final, fence)
        _clear(fs, final)  # no manifest before the commit: nothing trusts it meanwhile
        return _display(fs, final)
    tmp = Path(root) / f".tmp-{names[0]}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return str(tmp)


def _set_aside(fs: fsspec.AbstractFileSystem, path: str, fence: CommitFence) -> str | None:
    """Before ``fence``'s commit takes the name of the checkpoint at ``path``: set it aside
    when another token wrote it (module docstring). Returns where it went; None when there is
    nothing to keep (no checkpoint there: no manifest; or one of ``fence``'s own token).

    Raises:
        FencedOut: a newer token wrote it."""
    fs.invalidate_cache(path)
    try:
        raw = fs.cat_file(f"{path}/{MANIFEST}")
    except FileNotFoundError:
        return None
    try:
        token = json.loads(raw).get("fence", 0)
    except (ValueError, AttributeError):
        token = "unreadable"
    if token == fence.token:
        return None
    parent, name = path.rsplit("/", 1)
    if isinstance(token, int) and token > fence.token:
        raise FencedOut(f"not committing {name}: {_display(fs, path)} was written under fencing "
                        f"token {token}, newer than this group's {fence.token}")
    aside = f"{parent}/.superseded-{name}-fence-{token}"
    _clear(fs, aside)
    if _is_local(fs):
        os.replace(path, aside)
    else:  # object stores have no rename (and no directories to move): file by file
        for f in fs.find(path):
            fs.copy(f, aside + f[len(path):])
        _clear(fs, path)
    log.warning("checkpoint %s was written under fencing token %s, not this group's %d: kept as "
                "%s (remove it when it is no longer needed)", _display(fs, path), token,
                fence.token, _display(fs, aside))
    return aside


def file_names(directory: str | Path) -> list[str]:
    """The names of the files directly in ``directory`` (local or URL), fresh (not cached)."""
    fs, root = _resolve(directory)
    if not fs.exists(root):
        return []
    return sorted(e["name"].rstrip("/").rsplit("/", 1)[-1] for e in _ls(fs, root))


def hash_files(directory: str | Path, names: list[str]) -> dict[str, Any]:
    """``{name: {"bytes", "sha256"}}`` of the files ``names`` in the local ``directory``."""
    fs, root = _resolve(directory)
    return {n: {"bytes": fs.size(f"{root}/{n}"), "sha256": _sha256(fs, f"{root}/{n}")}
            for n in names}


def commit_sharded(directory: str | Path, names: list[str], staging: str | Path,
                   shard_files: dict[str, Any], state: dict[str, Any], meta: dict[str, Any],
                   fence: CommitFence = UNFENCED) -> list[str]:
    """Complete and publish a sharded checkpoint whose DCP files every rank wrote into
    ``staging`` (:func:`staging_dir`) and hashed (``shard_files``): write ``state`` (the
    replicated rest) as ``state.pt``, then the manifest, and publish under each of ``names``
    (later names hard-link the files) as :func:`write_checkpoint` does.

    Raises:
        CheckpointError: ``staging`` holds a file no rank hashed, or lacks one that was.
        FencedOut: a newer group claimed ``directory``; nothing was published.
    """
    meta = {**meta, "fence": fence.token}
    present = set(file_names(staging))
    unknown = sorted(present - set(shard_files))
    missing = sorted(set(shard_files) - present)
    fs, _ = _resolve(directory)
    if unknown or missing:
        fs.rm(_resolve(staging)[1], recursive=True)
        raise CheckpointError(f"sharded checkpoint {names[0]}: files not accounted for "
                              f"(unhashed: {unknown[:4]}, missing: {missing[:4]})")
    if not _is_local(fs):
        return _commit_sharded_object_store(fs, _resolve(staging)[1], names, shard_files, state,
                                            meta, fence)
    staging = Path(staging)
    try:
        with open(staging / STATE_FILE, "wb+") as f:  # fsynced and read back: _save_hashed
            files = {**shard_files, STATE_FILE: _save_hashed(f, state)}
        staged = [staging]
        for name in names[1:]:
            tmp = Path(staging.parent) / f".tmp-{name}-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            for fname in files:
                _link_or_copy(staging / fname, tmp / fname)
            staged.append(tmp)
        for tmp in staged:
            with open(tmp / MANIFEST, "wb") as f:
                f.write(_manifest(meta, files))
                f.flush()
                os.fsync(f.fileno())
            _fsync_dir(tmp)
    except OSError:
        fence.check(", ".join(names))  # a newer group's prune removed our staging
        raise
    return [str(p) for p in _publish_local(staging.parent, staged, names, fence)]


def _commit_sharded_object_store(fs: fsspec.AbstractFileSystem, final: str, names: list[str],
                                 shard_files: dict[str, Any], state: dict[str, Any],
                                 meta: dict[str, Any], fence: CommitFence) -> list[str]:
    """Object store: the DCP files are in the first name's prefix already; write ``state.pt``,
    copy the files to the other names' prefixes, then each manifest last, under the fence."""
    with fs.open(f"{final}/{STATE_FILE}", "wb") as f:
        files = {**shard_files, STATE_FILE: _save_hashed(f, state)}
    parent = final.rsplit("/", 1)[0]
    finals = [final, *(f"{parent}/{name}" for name in names[1:])]
    for other in finals[1:]:
        _set_aside(fs, other, fence)
        _clear(fs, other)
        for fname in files:
            fs.copy(f"{final}/{fname}", f"{other}/{fname}")
    with fence.guard(", ".join(names)):
        for path in finals:
            fs.pipe_file(f"{path}/{MANIFEST}", _manifest(meta, files))
    return [_display(fs, p) for p in finals]


def is_sharded(path: str | Path) -> bool:
    """Whether the checkpoint at ``path`` holds DCP files (``.metadata``)."""
    fs, p = _resolve(path)
    return fs.exists(f"{p}/{dcp_names.METADATA}")


def _stage_local(directory: Path, names: list[str], state: dict[str, Any],
                 meta: dict[str, Any]) -> list[Path]:
    """Write each of ``names`` complete (state, manifest, fsync) under ``.tmp-<name>-<pid>``."""
    staged: list[Path] = []
    files: dict[str, Any] = {}
    for name in names:
        tmp = directory / f".tmp-{name}-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        if not staged:
            with open(tmp / STATE_FILE, "wb+") as f:  # fsynced and read back: _save_hashed
                files[STATE_FILE] = _save_hashed(f, state)
        else:
            _link_or_copy(staged[0] / STATE_FILE, tmp / STATE_FILE)
        with open(tmp / MANIFEST, "wb") as f:
            f.write(_manifest(meta, files))
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        staged.append(tmp)
    return staged


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)
        with open(dst, "rb+") as f:
            os.fsync(f.fileno())


def _write_object_store(fs: fsspec.AbstractFileSystem, root: str, names: list[str],
                        state: dict[str, Any], meta: dict[str, Any],
                        fence: CommitFence) -> list[str]:
    finals = [f"{root}/{name}" for name in names]
    fence.check(", ".join(names))  # fail early: a stale writer overwrites nothing
    for final in finals:  # invalidate before overwriting: no manifest, no trust
        _set_aside(fs, final, fence)
        _clear(fs, final)
        fs.makedirs(final, exist_ok=True)
    with fs.open(f"{finals[0]}/{STATE_FILE}", "wb") as f:
        files = {STATE_FILE: _save_hashed(f, state)}
    for final in finals[1:]:
        fs.copy(f"{finals[0]}/{STATE_FILE}", f"{final}/{STATE_FILE}")
    with fence.guard(", ".join(names)):
        for final in finals:
            fs.pipe_file(f"{final}/{MANIFEST}", _manifest(meta, files))
    return finals


def _manifest_problem(manifest: Any) -> str:
    """Why a parsed manifest cannot be trusted ('' when it can): it names only this format's
    files, by plain name (a hostile one could point outside the directory, or leave
    state.pt unverified), each with an int size and a sha256, and its fields are typed."""
    if not isinstance(manifest, dict):
        return f"manifest is a JSON {type(manifest).__name__}, not an object"
    version = manifest.get("format_version")
    if version not in (FORMAT_VERSION, SHARDED_FORMAT_VERSION):
        return (f"format version {str(version)[:40]} is not one of {FORMAT_VERSION} (one "
                f"state.pt) or {SHARDED_FORMAT_VERSION} (sharded)")
    sharded = version == SHARDED_FORMAT_VERSION
    allowed = (f"{STATE_FILE}, {dcp_names.METADATA}, __<rank>_<n>.distcp" if sharded
               else STATE_FILE)
    files = manifest.get("files")
    if not isinstance(files, dict):
        return "manifest has no 'files' object"
    if len(files) > MAX_FILES:
        return f"manifest lists {len(files)} files, more than {MAX_FILES}"
    for fname in files:
        shown = repr(fname[:200]) + ("..." if len(fname) > 200 else "")
        if "/" in fname or "\\" in fname or fname in ("", ".", ".."):
            return (f"manifest names file {shown}: a path outside the checkpoint directory "
                    f"(only plain names: {allowed})")
        ours = fname == STATE_FILE or (sharded and (fname == dcp_names.METADATA
                                                   or dcp_names.SHARD_FILE.match(fname)))
        if not ours:
            return f"manifest names file {shown}, not one of this format ({allowed})"
    for fname in (STATE_FILE, dcp_names.METADATA) if sharded else (STATE_FILE,):
        desc = files.get(fname)
        if not isinstance(desc, dict):
            return f"manifest does not list {fname} (its size and sha256 are unknown)"
    for fname, desc in files.items():
        if not isinstance(desc, dict) or type(desc.get("bytes")) is not int \
                or not isinstance(desc.get("sha256"), str):
            return f"manifest entry of {fname[:80]} lacks an int 'bytes' or a 'sha256'"
    typed = {"step": (int,), "epoch": (int, type(None)), "world_size": (int, type(None)),
             "time": (int, float, type(None)), "global_batch_size": (int, type(None))}
    wrong = [k for k, ok in typed.items() if type(manifest.get(k)) not in ok]
    if type(manifest.get("fence", 0)) is not int:
        wrong.append("fence")
    return f"manifest field {wrong[0]!r} has the wrong type" if wrong else ""


def inspect(path: str | Path, verify: bool = False) -> CheckpointInfo:
    """Describe the checkpoint at ``path`` (directory or URL); ``verify`` also checks every
    file's sha256."""
    fs, p = _resolve(path)
    display = _display(fs, p)
    m = _NAME.match(p.rsplit("/", 1)[-1])
    kind = "best" if m and m["kind"] == "best-step" else "step"
    step = int(m["step"]) if m else -1
    try:
        entries = _ls(fs, p)
    except FileNotFoundError:
        entries = []
    sizes = {e["name"].rstrip("/").rsplit("/", 1)[-1]: e["size"] for e in entries
             if e["type"] == "file"}
    # a link is refused, never followed: nothing outside the checkpoint directory is read
    links = sorted(e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries if e.get("islink"))
    size = sum(sizes.values())

    def bad(reason: str) -> CheckpointInfo:
        return CheckpointInfo(display, kind, step, None, None, None, size, False, reason)

    if links:
        return bad(f"{links[0][:80]!r} is a symbolic link (refused: a checkpoint's files must "
                   "lie in its directory)")
    if MANIFEST not in sizes:
        return bad("no manifest (incomplete write)")
    if sizes[MANIFEST] > 1 << 20:  # a few hundred bytes when written here: never read a huge one
        return bad(f"{MANIFEST} has {sizes[MANIFEST]} bytes, more than a manifest's 1 MiB")
    try:
        manifest = json.loads(fs.cat_file(f"{p}/{MANIFEST}"))
    except (OSError, ValueError) as e:
        return bad(f"unreadable manifest: {e}")
    problem = _manifest_problem(manifest)
    if problem:
        return bad(problem)
    unlisted = sorted(set(sizes) - set(manifest["files"]) - {MANIFEST})
    if unlisted and manifest["format_version"] == SHARDED_FORMAT_VERSION:
        return bad(f"{unlisted[0][:80]!r} is not in the manifest (DCP would read it unverified)")
    for fname, desc in manifest["files"].items():
        if fname not in sizes:
            return bad(f"{fname} missing")
        if sizes[fname] != desc["bytes"]:
            return bad(f"{fname} has {sizes[fname]} bytes, manifest says {desc['bytes']}")
        if verify and _sha256(fs, f"{p}/{fname}") != desc["sha256"]:
            return bad(f"{fname} sha256 mismatch (corrupt)")
    return CheckpointInfo(display, kind, manifest["step"], manifest.get("epoch"),
                          manifest.get("world_size"), manifest.get("time"), size, True, "",
                          manifest.get("config_hash"), int(manifest.get("fence", 0)),
                          manifest.get("global_batch_size"), bool(manifest.get("finished")))


def list_checkpoints(directory: str | Path) -> list[CheckpointInfo]:
    """All checkpoints in ``directory`` (valid or not), oldest step first."""
    fs, root = _resolve(directory)
    try:
        entries = _ls(fs, root)
    except FileNotFoundError:
        return []
    found = [inspect(_display(fs, e["name"].rstrip("/"))) for e in entries
             if e["type"] == "directory" and _NAME.match(e["name"].rstrip("/").rsplit("/", 1)[-1])]
    return sorted(found, key=lambda c: (c.step, c.kind))


def latest_valid(directory: str | Path, kind: str = "step") -> CheckpointInfo | None:
    """The newest checkpoint of ``kind`` whose files verify (sha256): the highest step of the
    highest fencing token (a stale group's checkpoints lose to a newer group's whatever their
    step); invalid newer ones are skipped with a warning naming the reason."""
    for info in newest_first(directory, kind):
        checked = inspect(info.path, verify=True) if info.valid else info
        if checked.valid:
            return checked
        log.warning("skipping checkpoint %s: %s", info.path, checked.reason)
    return None


def newest_complete(directory: str | Path) -> CheckpointInfo | None:
    """The step checkpoint that resume tries first among those whose manifest and sizes check
    (no sha256: cheap enough before a process group agrees on one), or None."""
    return next((c for c in newest_first(directory) if c.valid), None)


def newest_first(directory: str | Path, kind: str = "step") -> list[CheckpointInfo]:
    """The checkpoints of ``kind``, in the order resume tries them (:func:`latest_valid`);
    checked by manifest and sizes, not yet by sha256 (:func:`verify_files`)."""
    found = [c for c in list_checkpoints(directory) if c.kind == kind]
    # an invalid one's token is unknown (its manifest may be what is broken): rank it as the
    # newest group's, so a damaged newer checkpoint is still named when it is skipped
    newest = max((c.fence for c in found if c.valid), default=0)
    return sorted(found, key=lambda c: c.order if c.valid else (newest, c.step), reverse=True)


def verify_files(path: str | Path, part: int = 0, parts: int = 1) -> str:
    """Check the sha256 of every ``parts``-th file of the checkpoint at ``path`` (in name order,
    from the ``part``-th), against its manifest: how ``parts`` ranks share verifying a sharded
    checkpoint. Returns why it fails ('' when it does not).

    Raises:
        nothing: an unreadable manifest or file is a failure reason.
    """
    fs, p = _resolve(path)
    try:
        manifest = json.loads(fs.cat_file(f"{p}/{MANIFEST}"))
        problem = _manifest_problem(manifest)
        if problem:
            return problem
        for fname in sorted(manifest["files"])[part::parts]:
            if _sha256(fs, f"{p}/{fname}") != manifest["files"][fname]["sha256"]:
                return f"{fname} sha256 mismatch (corrupt)"
    except (OSError, ValueError) as e:
        return f"cannot verify: {e}"
    return ""


def load_state(path: str | Path, map_location: str | torch.device = "cpu",
               full: bool = True) -> dict[str, Any]:
    """Load a checkpoint's state (``weights_only=True``).

    ``path`` is a checkpoint directory/URL or its ``state.pt``. A sharded checkpoint's model
    and optimizer are assembled whole on the CPU in this process when ``full`` (export,
    inspection; optimizer state keyed by parameter name), else left out (a group loads them
    sharded: :func:`~elastic_runner.checkpoint.dcp_format.load_shards`).

    Raises:
        CheckpointError: a file is missing or cannot be unpickled safely.
    """
    raw = _load_state_file(path, map_location)
    if full and not str(path).endswith(".pt") and is_sharded(path):
        from torch.distributed.checkpoint.api import CheckpointException

        from . import dcp_format  # DCP itself: only for a sharded checkpoint (dcp_names)

        try:
            fs, p = _resolve(path)
            raw.update(dcp_format.load_full(p if _is_local(fs) else str(path)))
        except (Exception, CheckpointException) as e:  # DCP's is a BaseException
            raise CheckpointError(f"checkpoint {path}: cannot load its DCP files: "
                                  f"{dcp_format.problem(e)}") from e
    return raw


def _load_state_file(path: str | Path, map_location: str | torch.device) -> dict[str, Any]:
    fs, p = _resolve(path)
    f = p if p.endswith(".pt") else f"{p}/{STATE_FILE}"
    try:
        if _is_local(fs):
            # mapped, then each tensor copied out of the page cache once: 1.4x faster than
            # torch.load from a file object at 1 GB (bench.state_transfer --load), and no
            # tensor stays backed by the file (a later write to a mapped one faults in 4 kB
            # pages, 3x slower; a file truncated under it would SIGBUS)
            return _owned(torch.load(f, map_location=map_location, weights_only=True,
                                     mmap=True), {})
        with fs.open(f, "rb") as fh:
            return torch.load(fh, map_location=map_location, weights_only=True)
    except FileNotFoundError as e:
        raise CheckpointError(f"checkpoint {path}: {STATE_FILE} not found") from e
    except Exception as e:  # torch raises UnpicklingError/RuntimeError for damaged files
        raise CheckpointError(f"checkpoint {path}: cannot load {STATE_FILE}: {_load_problem(e)}"
                              ) from e


def _owned(obj: Any, copies: dict[tuple[Any, ...], torch.Tensor]) -> Any:
    """``obj`` (a loaded state: dicts, lists, tuples, tensors) with each CPU tensor copied into
    memory of its own (dicts and lists changed in place: a state_dict's class and _metadata
    stay); exact aliases (tied weights) stay one tensor."""
    def own(_: Any, t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            return t
        key = nested.alias_key(t)
        if key is None:
            return t.clone()
        if key not in copies:
            copies[key] = t.clone()
        return copies[key]

    return nested.map_leaves(own, obj, rebuild=nested.Rebuild.IN_PLACE)


def _load_problem(e: Exception) -> str:
    """torch.load's error on one line. A weights_only refusal spans many lines and advises
    ``weights_only=False``: keep only what was refused (never advise running the file's code)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e))  # torch's message carries terminal bold
    refused = re.search(r"WeightsUnpickler error:\s*([^\n]*)", text)
    if refused:
        what = refused.group(1).split(". ")[0].rstrip(".")
        return f"Weights only load failed (torch.load(weights_only=True) refused it): {what}"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return (lines[0] if lines else type(e).__name__)[:300]


class Removals:
    """How :func:`prune` deletes a checkpoint: at once (this class; :data:`AT_ONCE`)."""

    def remove(self, fs: fsspec.AbstractFileSystem, info: CheckpointInfo) -> None:
        fs.rm(_resolve(info.path)[1], recursive=True)

    def finish(self) -> None:
        """Wait until every removal asked for is done."""


AT_ONCE = Removals()


class BackgroundRemovals(Removals):
    """A local checkpoint of at least ``min_bytes`` is renamed out of the way at once
    (``.pruned-<name>-<n>-<pid>``: no longer listed, its name reusable) and its files are
    deleted by this object's thread. Unlinking a GB-sized ``state.pt`` drops its pages from the
    page cache, 0.3 s per 1.4 GB: a synchronous save need not wait for that. A removal left
    unfinished (the process died) is a stray ``.pruned-*`` for the next :func:`prune`."""

    def __init__(self, min_bytes: int = 64 << 20) -> None:
        self.min_bytes = min_bytes  # below this, deleting costs less than a thread hand-off
        self._ids = itertools.count()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-prune")

    def remove(self, fs: fsspec.AbstractFileSystem, info: CheckpointInfo) -> None:
        if not _is_local(fs) or info.size_bytes < self.min_bytes:
            return super().remove(fs, info)
        path = Path(info.path)
        trash = path.parent / f".pruned-{path.name}-{next(self._ids)}-{os.getpid()}"
        os.replace(path, trash)
        self._pool.submit(shutil.rmtree, trash, ignore_errors=True)

    def finish(self) -> None:
        self._pool.submit(lambda: None).result()  # one thread, in order: after them all


def prune(directory: str | Path, keep_last: int, protect: str | Path | None = None,
          removals: Removals = AT_ONCE) -> list[str]:
    """Delete all but the newest ``keep_last`` valid step checkpoints and all but the newest
    valid best one, never ``protect`` (the checkpoint this run resumed from), plus stray local
    temporary directories of dead writers (``.tmp-*``, ``.pruned-*``). Invalid checkpoints are
    left for inspection. ``removals``: at once, or :class:`BackgroundRemovals`.

    Returns the removed paths."""
    fs, root = _resolve(directory)
    keep = str(protect) if protect is not None else None
    infos = [c for c in list_checkpoints(directory) if c.valid and c.path != keep]
    steps = sorted((c for c in infos if c.kind == "step"), key=lambda c: c.order)
    bests = sorted((c for c in infos if c.kind == "best"), key=lambda c: c.order)
    doomed = steps[:-keep_last] + bests[:-1]
    for info in doomed:
        removals.remove(fs, info)
    removed = [c.path for c in doomed]
    if _is_local(fs):
        for pattern in (".tmp-*", ".pruned-*"):
            for p in Path(root).glob(pattern):
                if not p.name.endswith(f"-{os.getpid()}"):
                    shutil.rmtree(p, ignore_errors=True)
                    removed.append(str(p))
    return removed


def tensors_digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 (hex, 16 chars) over names, dtypes, shapes and raw bytes of ``tensors``."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        # hashed over the tensor's own memory (the buffer protocol): no copy of the bytes
        h.update(t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b"")
    return h.hexdigest()[:16]


def check_compatible(model_state: dict[str, torch.Tensor], ckpt_state: dict[str, torch.Tensor],
                     source: str) -> None:
    """Raise :class:`CheckpointError` naming every mismatched tensor if ``ckpt_state`` cannot be
    loaded strictly into a model whose state_dict is ``model_state``."""
    missing = sorted(set(model_state) - set(ckpt_state))
    unexpected = sorted(set(ckpt_state) - set(model_state))
    shapes = [
        f"{k}: checkpoint {tuple(ckpt_state[k].shape)} vs model {tuple(model_state[k].shape)}"
        for k in sorted(set(model_state) & set(ckpt_state))
        if tuple(model_state[k].shape) != tuple(ckpt_state[k].shape)
    ]
    if not (missing or unexpected or shapes):
        return

    def fmt(label: str, items: list[str]) -> str:
        more = f" (+{len(items) - 8} more)" if len(items) > 8 else ""
        return f"\n  {label} ({len(items)}): " + ", ".join(items[:8]) + more if items else ""

    raise CheckpointError(
        f"checkpoint {source} does not match this model (another task or model config?)"
        + fmt("missing in checkpoint", missing)
        + fmt("unexpected in checkpoint", unexpected)
        + fmt("shape mismatch", shapes)
    )


def newest_checkpoint_step(directory: str) -> Callable[[], int]:
    """``progress`` for :class:`~elastic_runner.agent.restart_budget.RestartBudget`: the highest
    step of a checkpoint with a complete manifest in ``directory`` (no sha256: called on the
    agent at each failure)."""
    def step() -> int:
        try:
            return max((c.step for c in list_checkpoints(directory) if c.valid), default=-1)
        except OSError:
            return -1

    return step


def newest_checkpoint_step_named_in(named_in: str) -> Callable[[], int]:
    """``progress`` for the restart budget of ``run script.py``: :func:`newest_checkpoint_step`
    of the directory written into the file ``named_in`` by the script's loop
    (``protocol.env.CHECKPOINT_DIR_FILE_ENV``); -1 while the file is missing or empty."""
    def step() -> int:
        try:
            directory = Path(named_in).read_text().strip()
        except OSError:
            return -1
        return newest_checkpoint_step(directory)() if directory else -1

    return step
