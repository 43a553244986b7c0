"""Atomic, verified checkpoints on a (shared) filesystem. Knows nothing about training.

Layout: one directory per checkpoint inside ``checkpoint.dir``::

    step-00000120/         state.pt (torch.save of a dict of tensors and plain values)
                           manifest.json (written last: format, step, epoch, world_size, time,
                                          config hash, and bytes + sha256 of every file)
    best-step-00000100/    the same, for the best evaluation so far

Commit protocol: everything is written under ``.tmp-<name>-<pid>/`` in the same directory, each
file is flushed and fsynced, the manifest is written last and fsynced, the temporary directory is
fsynced, then ``os.replace``-d to its final name and the parent directory is fsynced. A crash at
any instant leaves either no directory of that name or a complete one; stray ``.tmp-*`` entries are
ignored and removed by the next prune. Readers trust only directories whose manifest verifies.

Loading uses ``torch.load(..., weights_only=True)``: no arbitrary unpickling.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
STATE_FILE = "state.pt"
MANIFEST = "manifest.json"
_NAME = re.compile(r"^(?P<kind>step|best-step)-(?P<step>\d{8})$")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used (corrupt, incomplete, or from another model)."""


@dataclass(frozen=True)
class CheckpointInfo:
    """One checkpoint directory as found on disk.

    ``size_bytes`` is the total of its files; ``valid`` is False with ``reason`` when the manifest
    is missing or unreadable or a file's size differs (``verify`` also checks sha256).
    """

    path: Path
    kind: str  # "step" or "best"
    step: int
    epoch: int | None
    world_size: int | None
    time: float | None  # unix seconds of the commit
    size_bytes: int
    valid: bool
    reason: str = ""
    config_hash: str | None = None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _write_synced(path: Path, write) -> None:
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def write_checkpoint(directory: Path, names: str | list[str], state: dict[str, Any],
                     meta: dict[str, Any]) -> list[Path]:
    """Write ``state`` once and atomically commit it under each of ``names`` (e.g. a step and a
    best checkpoint of the same step; later names hard-link the first one's file, or copy it
    where links are not supported). ``meta`` (step, epoch, world_size, config_hash, ...) goes
    into the manifest. An existing checkpoint of the same name is replaced (its step was redone
    after a restart). Returns the final paths.
    """
    names = [names] if isinstance(names, str) else names
    directory.mkdir(parents=True, exist_ok=True)
    staged = []
    for i, name in enumerate(names):
        tmp = directory / f".tmp-{name}-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        if i == 0:
            _write_synced(tmp / STATE_FILE, lambda f: torch.save(state, f))
            files = {STATE_FILE: {"bytes": (tmp / STATE_FILE).stat().st_size,
                                  "sha256": _sha256(tmp / STATE_FILE)}}
        else:
            _link_or_copy(staged[0] / STATE_FILE, tmp / STATE_FILE)
        manifest = {"format_version": FORMAT_VERSION, "time": time.time(), **meta,
                    "files": files}
        _write_synced(tmp / MANIFEST, lambda f, m=manifest: f.write(json.dumps(m, indent=1)
                                                                     .encode()))
        _fsync_dir(tmp)
        staged.append(tmp)
    finals = []
    for tmp, name in zip(staged, names, strict=True):
        final = directory / name
        if final.exists():  # same step written again after a restart: retire the old one first
            old = directory / f".tmp-old-{name}-{os.getpid()}"
            os.replace(final, old)
            shutil.rmtree(old)
        os.replace(tmp, final)
        finals.append(final)
    _fsync_dir(directory)
    return finals


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)
        with open(dst, "rb+") as f:
            os.fsync(f.fileno())


def inspect(path: Path, verify: bool = False) -> CheckpointInfo:
    """Describe the checkpoint at ``path``; ``verify`` also checks every file's sha256."""
    m = _NAME.match(path.name)
    kind = "best" if m and m["kind"] == "best-step" else "step"
    step = int(m["step"]) if m else -1
    size = sum(p.stat().st_size for p in path.iterdir() if p.is_file()) if path.is_dir() else 0

    def bad(reason: str) -> CheckpointInfo:
        return CheckpointInfo(path, kind, step, None, None, None, size, False, reason)

    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        return bad("no manifest (incomplete write)")
    except (OSError, ValueError) as e:
        return bad(f"unreadable manifest: {e}")
    if manifest.get("format_version") != FORMAT_VERSION:
        return bad(f"format version {manifest.get('format_version')} != {FORMAT_VERSION}")
    for fname, desc in manifest.get("files", {}).items():
        f = path / fname
        if not f.is_file():
            return bad(f"{fname} missing")
        if f.stat().st_size != desc["bytes"]:
            return bad(f"{fname} has {f.stat().st_size} bytes, manifest says {desc['bytes']}")
        if verify and _sha256(f) != desc["sha256"]:
            return bad(f"{fname} sha256 mismatch (corrupt)")
    return CheckpointInfo(path, kind, manifest["step"], manifest.get("epoch"),
                          manifest.get("world_size"), manifest.get("time"), size, True, "",
                          manifest.get("config_hash"))


def list_checkpoints(directory: str | Path) -> list[CheckpointInfo]:
    """All checkpoint directories in ``directory`` (valid or not), oldest step first."""
    d = Path(directory)
    if not d.is_dir():
        return []
    found = [inspect(p) for p in d.iterdir() if p.is_dir() and _NAME.match(p.name)]
    return sorted(found, key=lambda c: (c.step, c.kind))


def latest_valid(directory: str | Path, kind: str = "step") -> CheckpointInfo | None:
    """The newest checkpoint of ``kind`` whose files verify (sha256); invalid newer ones are
    skipped with a warning naming the reason."""
    for info in reversed([c for c in list_checkpoints(directory) if c.kind == kind]):
        checked = inspect(info.path, verify=True) if info.valid else info
        if checked.valid:
            return checked
        log.warning("skipping checkpoint %s: %s", info.path, checked.reason)
    return None


def load_state(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load a checkpoint's state (``weights_only=True``).

    ``path`` is a checkpoint directory or its ``state.pt``.

    Raises:
        CheckpointError: the file is missing or cannot be unpickled safely.
    """
    p = Path(path)
    f = p / STATE_FILE if p.is_dir() else p
    try:
        return torch.load(f, map_location=map_location, weights_only=True)
    except FileNotFoundError as e:
        raise CheckpointError(f"checkpoint {p}: {f.name} not found") from e
    except Exception as e:  # torch raises UnpicklingError/RuntimeError for damaged files
        raise CheckpointError(f"checkpoint {p}: cannot load {f.name}: {e}") from e


def prune(directory: str | Path, keep_last: int, protect: Path | None = None) -> list[Path]:
    """Delete all but the newest ``keep_last`` valid step checkpoints and all but the newest
    valid best one, never ``protect`` (the checkpoint this run resumed from), plus stray
    temporary directories of dead writers. Invalid checkpoints are left for inspection.
    Returns the removed paths."""
    d = Path(directory)
    removed = []
    infos = [c for c in list_checkpoints(d) if c.valid and c.path != protect]
    steps = [c for c in infos if c.kind == "step"]
    bests = [c for c in infos if c.kind == "best"]
    doomed = [c.path for c in steps[:-keep_last]] + [c.path for c in bests[:-1]]
    doomed += [p for p in d.glob(".tmp-*") if not p.name.endswith(f"-{os.getpid()}")]
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    return removed


def tensors_digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 (hex, 16 chars) over names, dtypes, shapes and raw bytes of ``tensors``."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
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
