"""A script's ``state=`` (``fault_tolerant(..., state={...})``) as rank 0 holds it, through any
in-place replacement, rank 0's included.

The pattern trainer classes follow is *rank 0 decides, then broadcasts*: an early stopper's
best value and count of bad evaluations only rank 0 updates. A restart resumes every rank with
rank 0's values, since rank 0 writes the checkpoint; in place the same holds:

* **The window.** The loop's own work after ``step_done()`` returned step S (an evaluation,
  its bookkeeping) runs until step S + 1's boundary. After an in-place recovery during step
  S + 1, every rank runs the window of S again: a survivor because ``step_done()`` returns S
  again for the discarded step, a replacement because its first pass through the loop is a
  discarded step too (:meth:`~elastic_runner.own_loop.loop.FaultTolerantLoop.resume`). So
  every rank first goes back to rank 0's values at the window's start, which every rank
  records at ``step_done()`` (host memory; nothing waits for the device). After a recovery at
  the boundary itself (its checkpoint's or peer copies' collectives) nothing is redone, and
  every rank goes on with rank 0's values at the boundary.
* **Rank 0's versions.** At each boundary rank 0 compares its values with those of the window's
  start. When the window changed a key, the key's last :data:`KEPT_VERSIONS` values, each with
  the step of its window, go to the recovery store (``rank0_state``): one small write per
  window that changed something (an evaluation), none for a step that changed nothing there.
  The write comes before rank 0 enters any collective of the next step, so no survivor can be
  past a window whose result the store lacks.
* **The agreement** (collective, in every rejoin): a survivor that was rank 0 sends its values;
  without one, the lowest surviving rank sends its own with the store's version of each key
  rank 0's windows changed. A key whose values differ between survivors and that no window of
  rank 0 changed cannot be reconciled: it is logged once, naming the key, and every rank goes
  on with the sender's value.

Not recorded (a survivor's value is kept, as before): a value whose ``state_dict()`` holds
tensors (reading them at every step would wait for the device), a GradScaler (its
``state_dict()`` reads the scale from the device; the scale is the same on every rank), and a
value that ``torch.load(weights_only=True)`` cannot load (named once).
"""

from __future__ import annotations

import hashlib
import io
import logging
import pickle
from collections.abc import Mapping
from typing import Any, Protocol

import torch
from torch.distributed.checkpoint.stateful import Stateful

from ..dist import all_gather_object, broadcast_object
from ..nested import holds_tensor

log = logging.getLogger("elastic_runner.own_loop")

KEPT_VERSIONS = 3
"""Versions of a key rank 0 keeps in the store (a redo needs the one before its window)."""


class Rank0Store(Protocol):
    """Where rank 0's versions live (``recovery.inplace.InPlaceRecovery``)."""

    def keep_rank0_state(self, blob: bytes) -> None: ...

    def rank0_state(self) -> bytes | None: ...


class StateRecord(Protocol):
    """``state=`` as the loop records it: :class:`ScriptState` (in place) or its null object
    :class:`NoScriptState`."""

    def committed(self, step: int) -> None: ...

    def window_done(self, step: int) -> None: ...

    def restore(self) -> None: ...

    def agree(self, rank: int, joining: bool, phase: str, step: int) -> bool: ...


class NoScriptState:
    """No in-place recovery (plain torchrun, recovery off): a restart reads rank 0's checkpoint,
    nothing to record."""

    def committed(self, step: int) -> None:
        pass

    def window_done(self, step: int) -> None:
        pass

    def restore(self) -> None:
        pass

    def agree(self, rank: int, joining: bool, phase: str, step: int) -> bool:
        return False


class ScriptState:
    """The script's ``state=`` objects, rank 0's through in-place recovery (module docstring).

    Args:
        objects: the ``state=`` mapping (name -> ``Stateful``).
        rank: this process's rank (a replacement's: the rank it takes).
        store: the recovery store's keys for rank 0's versions.
    """

    def __init__(self, objects: Mapping[str, Stateful], rank: int, store: Rank0Store) -> None:
        self._objects, self._rank, self._store = dict(objects), rank, store
        self._kept: dict[str, Stateful] | None = None  # decided at the first record
        self._start: dict[str, bytes] = {}  # each kept value (pickled) at the window's start
        self._step = -1  # the window's step (-1: none recorded in this process)
        self._published = -1
        self._versions: dict[str, list[tuple[int, Any]]] = {}
        self._warned: set[str] = set()

    # ------------------------------------------------------------ every step

    def committed(self, step: int) -> None:
        """Step ``step`` is committed and its window begins: record every kept value (every
        rank; a survivor may have to send them)."""
        self._start, self._step = self._now(), step

    def window_done(self, step: int) -> None:
        """Step ``step + 1``'s boundary, before its collectives: rank 0 writes the versions of
        the keys the window of ``step`` changed.

        Store errors are logged once, not raised (a recovery then lacks rank 0's values and
        says so)."""
        if self._rank != 0 or step != self._step or self._published == step:
            return
        self._published = step
        now = self._now()
        changed = [k for k, b in now.items() if b != self._start.get(k)]
        if not changed:
            return
        for key in changed:
            versions = self._versions.setdefault(key, [(step - 1, _value(self._start[key]))])
            versions.append((step, _value(now[key])))
            del versions[:-KEPT_VERSIONS]
        try:
            self._store.keep_rank0_state(_save(self._versions))
        except (RuntimeError, torch.distributed.DistError) as e:
            self._warn_once("(store)", "rank 0's state= versions could not be written to the "
                            f"recovery store ({e}): a replacement of rank 0 goes on with a "
                            "survivor's values")

    def restore(self) -> None:
        """A step redone in the same group (a refused join): back to the window's start, as
        the window of the step before runs again."""
        for key, blob in self._start.items():
            self._objects[key].load_state_dict(_value(blob))

    # ------------------------------------------------------------ a rejoin

    def agree(self, rank: int, joining: bool, phase: str, step: int) -> bool:
        """Every member of a new group goes on with rank 0's values (collective; module
        docstring). ``phase``: where this survivor's loop was: ``step`` (it runs the window of
        ``step``, the group's committed step, again), ``window`` (inside that window, which it
        goes on with: its values stay, a replacement takes rank 0's of the window's start) or
        ``boundary`` (past the window: nothing is redone). Returns whether the group redoes the
        window (a replacement then begins with a discarded pass)."""
        redo = phase != "boundary"
        recorded = self._step == step
        start = self._start if redo and recorded else self._now()
        mine = {"joining": joining, "was_rank0": self._rank == 0 and not joining,
                "phase": phase, "recorded": recorded,
                "digests": {k: hashlib.sha256(b).hexdigest() for k, b in start.items()}}
        everyone = all_gather_object(mine)
        survivors = [r for r, s in enumerate(everyone) if not s["joining"]]
        self._rank = rank
        if not survivors:  # every member loaded the newest checkpoint
            return False
        src = next((r for r in survivors if everyone[r]["was_rank0"]), survivors[0])
        phase = everyone[src]["phase"]
        redo = phase != "boundary"
        blob = broadcast_object(self._payload(start, everyone, survivors, src, redo, step)
                                if rank == src else None, src)
        values, self._versions = torch.load(io.BytesIO(blob), weights_only=True)
        if joining or phase != "window":  # a survivor inside the window goes on with its own
            for key, value in values.items():
                self._objects[key].load_state_dict(value)
            self._start, self._step = self._now() if redo else {}, step if redo else -1
            self._published = -1
        return redo

    def _payload(self, start: dict[str, bytes], everyone: list[dict[str, Any]],
                 survivors: list[int], src: int, redo: bool, step: int) -> bytes:
        """The sender's values, rank 0's versions laid over them when rank 0 is gone; the
        versions a redone window will write again are dropped."""
        values = {k: _value(b) for k, b in start.items()}
        rank0 = everyone[src]["was_rank0"]
        versions = self._versions if rank0 else self._stored()
        last = step - 1 if redo else step  # the newest window whose result stands
        versions = {k: [(w, v) for w, v in vs if w <= last] for k, vs in versions.items()}
        for key, vs in versions.items():
            if vs and key in values and not rank0:  # rank 0's own values are exact
                values[key] = vs[-1][1]
        if redo and not everyone[src]["recorded"] and values:
            self._warn_once("(start)", f"the loop's work after step {step} runs again from "
                            "the values it left (no record of its start at that step: the "
                            "process resumed a checkpoint, or rolled back to peer copies, "
                            "since): state= changed there is changed twice")
        differ = {k for k in start if len({everyone[r]["digests"].get(k) for r in survivors}) > 1}
        for key in sorted(differ - set(versions)):
            self._warn_once(key, f"state[{key!r}] differs between ranks and was not changed "
                            f"by rank 0's work after a step: every rank goes on with rank "
                            f"{src}'s value")
        return _save((values, {k: vs for k, vs in versions.items() if vs}))

    def _stored(self) -> dict[str, list[tuple[int, Any]]]:
        try:
            blob = self._store.rank0_state()
        except (RuntimeError, torch.distributed.DistError) as e:
            self._warn_once("(store)", f"rank 0's state= versions could not be read from the "
                            f"recovery store ({e}): every rank goes on with a survivor's values")
            return {}
        return {} if blob is None else torch.load(io.BytesIO(blob), weights_only=True)

    # ------------------------------------------------------------ what is recorded

    def _now(self) -> dict[str, bytes]:
        if self._kept is None:
            self._kept = {k: o for k, o in self._objects.items() if self._recordable(k, o)}
        return {k: pickle.dumps(o.state_dict()) for k, o in self._kept.items()}

    def _recordable(self, key: str, obj: Stateful) -> bool:
        if isinstance(obj, torch.amp.GradScaler):
            return False
        value = obj.state_dict()
        if holds_tensor(value):
            log.debug("state[%r] holds tensors: a replacement takes a survivor's", key)
            return False
        try:
            torch.load(io.BytesIO(_save(value)), weights_only=True)
        except Exception as e:  # noqa: BLE001 - whatever the unpickler refuses, named once
            self._warn_once(key, f"state[{key!r}] cannot be loaded with weights_only=True "
                            f"({type(e).__name__}): a replacement of rank 0 takes a "
                            "survivor's value")
            return False
        return True

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning("%s", message)


def _value(blob: bytes) -> Any:
    return pickle.loads(blob)  # noqa: S301 - this process's own bytes, never a peer's


def _save(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()
