"""The collectives a script's loop calls itself, recovered in place when a peer dies inside one.

Under ``elastic-runner run`` (in-place recovery on), :func:`install` replaces the
``torch.distributed`` collectives in :data:`GUARDED` and ``torch.nn.utils.clip_grad_norm_``
with guards that pass every call through unchanged, except where the loop's own code runs
(:class:`ScriptCollectives` knows where from the loop):

* **In the window** (the loop's work after ``step_done()`` returned step S: an evaluation's
  ``all_reduce``, a decision's ``broadcast_object_list``). Each call is recorded with a copy of
  its tensors and lists. When one fails because a peer died, the group is re-formed in place,
  and the survivor calls again, in the new group, the window's earlier collectives with their
  recorded arguments (results dropped) and then the failed one with its own arguments as they
  were before it: the replacement runs the window of S from its start in its first, discarded
  pass (``own_loop/script_state.py``), so both sides make the same calls in the same order,
  and the failed call returns what it returns in an uninterrupted run. The survivor's code
  runs on from there; nothing of the window is done twice.
* **Between ``ft.backward()`` and ``ft.should_commit()``** (FSDP2's ``clip_grad_norm_``
  all-reduces the norm): the step in flight is discarded on every rank, as when the step's own
  collectives fail, and the call returns a stand-in (``clip_grad_norm_``: a zero norm;
  a collective: None) for the step nobody applies.

Elsewhere (the runner's own calls, the step's forward and backward, which the loop guards
itself, and any thread but the loop's, such as an asynchronous checkpoint's) the guards do
nothing. Not guarded: a call with ``async_op=True`` (its error comes
from ``wait()``), a process group the script made itself (it goes with the failed group),
and a collective imported by name before :func:`elastic_runner.fault_tolerant` ran
(``from torch.distributed import all_reduce``).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ..nested import each_tensor, tensor_bytes

log = logging.getLogger("elastic_runner.own_loop")

GUARDED = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
           "reduce_scatter_tensor", "all_to_all_single", "barrier", "broadcast_object_list",
           "all_gather_object", "gather_object", "scatter_object_list")
"""The ``torch.distributed`` functions guarded (their first argument is the one they write)."""

Call = tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]

RECORD_LIMIT_BYTES = 256 * 2**20
"""The window's recorded tensors at most: past it the window is no longer recorded (logged
once), and a peer's death later in it is not recovered in place, its error ends the process
(an evaluation over a large set would otherwise keep every batch its DDP forward broadcast
buffers for)."""


class Recovery(Protocol):
    """What the guards use of the loop's in-place recovery (``own_loop/in_place.py``)."""

    def collective(self, call: Callable[..., Any], *args: Any) -> bool: ...

    def recover_in_window(self, error: RuntimeError) -> None: ...


class Guards(Protocol):
    """The loop's own collectives as the loop drives them: :class:`ScriptCollectives` or its
    null object :class:`NoScriptCollectives`."""

    in_window: bool

    def window(self, step: int) -> None: ...

    def after_backward(self, step: int) -> None: ...

    def runner(self) -> None: ...

    def call(self, name: str, fn: Callable[..., Any], args: tuple[Any, ...],
             kwargs: dict[str, Any], stand_in: Callable[[], Any]) -> Any: ...


class NoScriptCollectives:
    """In-place recovery off: nothing is guarded."""

    in_window = False

    def call(self, name: str, fn: Callable[..., Any], args: tuple[Any, ...],
             kwargs: dict[str, Any], stand_in: Callable[[], Any]) -> Any:
        return fn(*args, **kwargs)

    def window(self, step: int) -> None:
        pass

    def after_backward(self, step: int) -> None:
        pass

    def runner(self) -> None:
        pass


class ScriptCollectives:
    """Where the loop's own code runs now, and the window's calls so far (module docstring).

    Args:
        recovery: the loop's in-place recovery.
        pause: a drill's pause before a named call (``train/faults.py``: ``pause rank=R
            at=NAME``), called with the name and the step.
    """

    def __init__(self, recovery: Recovery, pause: Callable[[str, int], None]) -> None:
        self._recovery, self._pause = recovery, pause
        self._mode = "runner"  # "window", "step" (after backward) or "runner"
        self._thread = threading.get_ident()  # the loop's: another thread's calls (an
        # asynchronous checkpoint's) pass through
        self._step = 0
        self._calls: list[Call] = []
        self._bytes = 0  # of the tensors recorded in this window
        self._busy = False  # a recovery in progress: its own collectives pass through
        self._warned = False

    @property
    def in_window(self) -> bool:
        """The loop's work after a step runs now."""
        return self._mode == "window" and not self._busy

    def window(self, step: int) -> None:
        """``step_done()`` returned ``step``: the window of ``step`` begins (again)."""
        self._mode, self._step, self._calls, self._bytes = "window", step, [], 0
        self._thread = threading.get_ident()

    def after_backward(self, step: int) -> None:
        """``ft.backward()`` returned for step ``step``."""
        self._mode, self._step = "step", step

    def runner(self) -> None:
        """The runner's code runs (a call into the loop's API)."""
        self._mode = "runner"

    def call(self, name: str, fn: Callable[..., Any], args: tuple[Any, ...],
             kwargs: dict[str, Any], stand_in: Callable[[], Any]) -> Any:
        """``fn(*args, **kwargs)`` as guarded where the loop's code runs (module docstring).

        Raises:
            RuntimeError: the call's error, when no peer died or recovery cannot go on.
        """
        if (self._mode == "runner" or self._busy or kwargs.get("async_op")
                or threading.get_ident() != self._thread):
            return fn(*args, **kwargs)
        self._pause(name, self._step)
        if self._mode == "step":
            out: list[Any] = []
            self._busy = True
            try:
                if self._recovery.collective(lambda: out.append(fn(*args, **kwargs))):
                    return out[0]
            finally:
                self._busy = False
            log.warning("the loop's own %s in step %d failed with a peer: the step is "
                        "discarded on every rank", name, self._step)
            return stand_in()
        return self._in_window(name, fn, args, kwargs)

    def _in_window(self, name: str, fn: Callable[..., Any], args: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> Any:
        kwargs = _default_group(kwargs)  # the group a recovery makes is the default one
        if self._bytes > RECORD_LIMIT_BYTES:  # no longer recorded: nothing can be called again
            return fn(*args, **kwargs)
        saved = (_copy(args), _copy(kwargs))
        self._bytes += tensor_bytes(saved)
        if self._bytes > RECORD_LIMIT_BYTES and not self._warned:
            self._warned = True
            log.warning("the loop's work after step %d made collectives of more than %d MiB: "
                        "the rest of such work is not recorded, and a peer's death there is "
                        "not recovered in place", self._step, RECORD_LIMIT_BYTES >> 20)
        earlier, self._calls = self._calls, [*self._calls, (fn, *saved)]
        again = False
        while True:
            try:
                if again:
                    for f, a, k in earlier:  # the replacement makes these calls now too
                        f(*_copy(a), **_copy(k))
                    _restore(args, saved[0])
                return fn(*args, **kwargs)
            except RuntimeError as e:
                self._busy = True
                try:
                    self._recovery.recover_in_window(e)
                finally:
                    self._busy = False
                log.warning("the loop's own %s after step %d failed with a peer: called again "
                            "in the new group, after %d earlier call(s) of that work", name,
                            self._step, len(earlier))
                again = True


_current: list[Guards] = [NoScriptCollectives()]


def install(collectives: ScriptCollectives) -> None:
    """Route the guarded calls of this process through ``collectives`` (the newest loop's;
    the functions are replaced once per process)."""
    if isinstance(_current[0], NoScriptCollectives):
        for name in GUARDED:
            setattr(dist, name, _guard(name, getattr(dist, name), _none))
        torch.nn.utils.clip_grad_norm_ = _guard(  # type: ignore[assignment]
            "clip_grad_norm_", torch.nn.utils.clip_grad_norm_, _zero_norm)
    _current[0] = collectives


def _guard(name: str, fn: Callable[..., Any], stand_in: Callable[[], Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        current = _current[0]
        if isinstance(current, NoScriptCollectives):
            return fn(*args, **kwargs)
        return current.call(name, fn, args, kwargs, stand_in)

    return guarded


def _default_group(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` without ``group=dist.group.WORLD`` (that object is the failed group once a
    recovery made the new default group)."""
    if "group" in kwargs and kwargs["group"] is dist.group.WORLD:
        return {k: v for k, v in kwargs.items() if k != "group"}
    return kwargs


def _none() -> None:
    return None


def _zero_norm() -> torch.Tensor:
    return torch.zeros(())


def _copy(x: Any) -> Any:
    """``x`` with its tensors cloned and its lists, tuples and dicts rebuilt (other objects,
    a process group among them, shared)."""
    return each_tensor(lambda t: t.detach().clone(), x)


def _restore(args: tuple[Any, ...], saved: tuple[Any, ...]) -> None:
    """The call's first argument (the one it writes) as it was before the failed call."""
    if not args:
        return
    target, before = args[0], saved[0]
    if isinstance(target, torch.Tensor):
        with torch.no_grad():
            target.copy_(before)
    elif isinstance(target, list):
        target[:] = before
