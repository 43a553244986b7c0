"""Off-by-default fault injection for tests and drills (config section ``faults``).

A drill on a real cluster, without editing the config::

    ELASTIC_RUNNER_FAULTS='[{kind: sigterm, rank: 1, step: 200}]' elastic-runner run job.yaml

Kinds (each a real event, not a simulation of the runner's reaction):

* ``sigkill``: the rank sends itself SIGKILL (a crash without any cleanup);
* ``sigterm``: the rank sends itself SIGTERM (what an eviction delivers);
* ``raise``: the rank raises ``InjectedFault`` (a Python error, recorded in the error file);
* ``hang``: the rank blocks forever inside its next step (a stuck collective / data loader);
* ``nan``: the rank's loss becomes NaN for ``count`` steps;
* ``slow``: each of ``count`` steps takes ``seconds`` longer on the rank (a straggler: a slow
  disk, a throttled device, a noisy neighbour).

Faults requested from outside while the job runs (``faults.trigger_file: PATH``, off by
default): before each step every rank ``stat``-s PATH (nothing more while it is missing or
empty; no trigger configured: a null object, not even the ``stat``). Each line is a request:

* ``nan rank=R``: rank R's next loss becomes NaN, once (so every rank skips that update, see
  ``train/consensus.py``), and R removes the line; it logs ``fault injection: rank R poisons its loss
  at step S (trigger file PATH)``;
* ``slow rank=R seconds=S``: a standing request: while the line is in the file, rank R sleeps
  S seconds before each step (a straggler made and ended from outside, as in a drill of the
  straggler log and alerts); R logs when it starts and when it ends;
* ``pause rank=R at=NAME``: rank R blocks forever just before the next call named NAME that its
  script's own loop makes in that step or the work after it (a ``torch.distributed`` collective
  such as ``all_reduce`` or ``broadcast_object_list``, or ``clip_grad_norm_``;
  ``own_loop/script_collectives.py``), and removes the line; it logs ``fault injection: rank R
  pauses before its NAME at step S``. A drill kills it there, so its peers wait inside that
  very call when it dies.

A rank reads and rewrites the file under an exclusive ``flock`` of PATH, so writers must take it
too, e.g. ``flock PATH -c 'echo "nan rank=1" >> PATH'`` (``bench/soak.py`` does this from
Python). A line that does not parse is removed with a warning naming it; a line for a rank
outside the group stays (every rank then reads the file at each step until it is removed).
``R`` is a global rank of the current group: a rank renumbered in place answers to its new one.
"""

from __future__ import annotations

import dataclasses
import fcntl
import logging
import os
import re
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from .config import FaultConfig, FaultSpec

log = logging.getLogger(__name__)


class InjectedFault(RuntimeError):
    """Raised by a ``raise`` fault."""


class FaultInjector:
    """Evaluates the configured faults for one rank of one restart attempt."""

    def __init__(self, cfg: FaultConfig, rank: int, restart_count: int) -> None:
        # (index in cfg.inject, spec): the index names the fault identically on every node
        self.trigger: Trigger = (
            TriggerFile(Path(cfg.trigger_file), rank) if cfg.trigger_file else NoTrigger())
        self.specs = [(i, f) for i, f in enumerate(cfg.inject)
                      if f.rank == rank and restart_count < f.attempts]
        self.rank, self.restart_count = rank, restart_count
        self.once_dir = Path(cfg.once_dir) if cfg.once_dir else None
        self._fired: set[tuple[int, int]] = set()  # (spec index, step) already fired
        self._requests = NO_REQUESTS  # the trigger file's, read at the current step's begin

    def _due(self, spec: FaultSpec, step: int, steps_this_attempt: int, span: int = 1) -> bool:
        if spec.step is not None:
            return spec.step <= step < spec.step + span
        return spec.after_steps is not None and (
            spec.after_steps <= steps_this_attempt < spec.after_steps + span)

    def _take(self, i: int, spec: FaultSpec, step: int) -> bool:
        if (i, step) in self._fired and not spec.repeat:
            return False
        self._fired.add((i, step))
        if self.once_dir is not None:  # once per job, across restarts and nodes
            self.once_dir.mkdir(parents=True, exist_ok=True)
            try:
                os.close(os.open(self.once_dir / f"fault-{i}-step-{step}",
                                 os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                return False
        return True

    @property
    def active(self) -> bool:
        """Whether this rank has anything to inject: a configured fault or a watched trigger
        file (the trainer installs the fault callbacks only then)."""
        return bool(self.specs) or not isinstance(self.trigger, NoTrigger)

    def poison_loss(self, step: int, steps_this_attempt: int) -> bool:
        """True if the step about to run (global ``step``, 1-based) must produce a NaN loss: a
        configured ``nan`` fault is due, or the trigger file asked for one at this step's
        :meth:`begin_step` (consumed here)."""
        if any(spec.kind == "nan" and self._due(spec, step, steps_this_attempt, spec.count)
               and self._take(i, spec, step) for i, spec in self.specs):
            return True
        if not self._requests.nan:
            return False
        self._requests = dataclasses.replace(self._requests, nan=False)
        log.warning("fault injection: rank %d poisons its loss at step %d (trigger file %s)",
                    self.rank, step, self.trigger.path)
        return True

    def begin_step(self, step: int, steps_this_attempt: int) -> None:
        """Before the step about to run: block forever if a ``hang`` fault is due, read the
        trigger file's requests (once a step), and sleep for the ``slow`` faults and the
        standing ``slow`` request that cover the step (seconds added, not overlapped)."""
        self.hang_now(step, steps_this_attempt)
        self._requests = self.trigger.poll()
        delay = self._requests.slow_seconds + sum(
            spec.seconds for _, spec in self.specs
            if spec.kind == "slow" and self._due(spec, step, steps_this_attempt, spec.count))
        if delay > 0:
            time.sleep(delay)

    def pause_before(self, name: str, step: int) -> None:
        """Block forever if the trigger file asked this rank to pause before ``name`` (read at
        the step's :meth:`begin_step`; consumed)."""
        if self._requests.pause != name:
            return
        self._requests = dataclasses.replace(self._requests, pause="")
        log.warning("fault injection: rank %d pauses before its %s at step %d (trigger file %s)",
                    self.rank, name, step, self.trigger.path)
        for handler in logging.getLogger("elastic_runner").handlers:
            handler.flush()
        _hang_forever()

    def hang_now(self, step: int, steps_this_attempt: int) -> None:
        """Block forever if a ``hang`` fault is due at the step about to run."""
        for i, spec in self.specs:
            if spec.kind == "hang" and self._due(spec, step, steps_this_attempt) \
                    and self._take(i, spec, step):
                log.warning("fault injection: rank %d hangs in step %d", self.rank, step)
                _hang_forever()

    def after_step(self, step: int, steps_this_attempt: int, during: str = "step") -> None:
        """Fire ``sigkill`` / ``sigterm`` / ``raise`` faults due after ``step`` completed
        (``during``: ``"step"``), while its checkpoint is written (``"checkpoint"``), as its
        evaluation begins (``"evaluation"``) or as a replacement joins a running group
        (``"joining"``)."""
        for i, spec in self.specs:
            if spec.kind not in ("sigkill", "sigterm", "raise") or spec.during != during:
                continue
            if not (self._due(spec, step, steps_this_attempt) and self._take(i, spec, step)):
                continue
            where = "after" if during == "step" else f"during the {during} of"
            log.warning("fault injection: rank %d %s %s step %d (%d steps of attempt %d)",
                        self.rank, spec.kind, where, step, steps_this_attempt,
                        self.restart_count)
            if spec.kind == "raise":
                raise InjectedFault(f"fault injection: rank {self.rank} raises {where} step "
                                    f"{step}")
            for handler in logging.getLogger("elastic_runner").handlers:
                handler.flush()
            os.kill(os.getpid(), signal.SIGKILL if spec.kind == "sigkill" else signal.SIGTERM)


@dataclass(frozen=True)
class Requests:
    """What the trigger file asks of one rank at one step: a NaN loss (once), the seconds of
    its standing ``slow`` request (0: none), and the call to pause before (once; "": none)."""

    nan: bool = False
    slow_seconds: float = 0.0
    pause: str = ""


NO_REQUESTS = Requests()


class Trigger(Protocol):
    """Where a rank's runtime fault requests come from: :class:`TriggerFile`, or
    :class:`NoTrigger` without one."""

    path: Path | None

    def poll(self) -> Requests:
        """The requests standing now for this rank."""
        ...


class NoTrigger:
    """No trigger file configured: nothing is ever requested (no file system access)."""

    path = None

    def poll(self) -> Requests:
        return NO_REQUESTS


class TriggerFile:
    """``faults.trigger_file`` as seen by one rank (see the module docstring)."""

    NAN = re.compile(r"^nan\s+rank=(\d+)$")
    SLOW = re.compile(r"^slow\s+rank=(\d+)\s+seconds=(\d+(?:\.\d*)?|\.\d+)$")
    PAUSE = re.compile(r"^pause\s+rank=(\d+)\s+at=([A-Za-z_]\w*)$")

    def __init__(self, path: Path, rank: int) -> None:
        self.path, self.rank = path, rank
        self._warned = False
        self._slow = 0.0  # the standing slow request last seen (logged when it changes)

    def poll(self) -> Requests:
        """This rank's requests in the file now: a ``nan`` or ``pause`` line of this rank (one
        of each per call) and any line that does not parse are removed; ``slow`` lines stay.
        Never raises:
        an unreadable file is logged once and counts as empty."""
        try:
            if os.stat(self.path).st_size == 0:
                return self._seen(Requests())
            with open(self.path, "r+") as f:
                fcntl.flock(f, fcntl.LOCK_EX)  # released by close(): writers lock it too
                lines = [ln.strip() for ln in f.read().splitlines() if ln.strip()]
                keep, requests = self._consume(lines)
                if len(keep) != len(lines):
                    f.seek(0)
                    f.truncate()
                    f.write("".join(f"{ln}\n" for ln in keep))
            return self._seen(requests)
        except FileNotFoundError:
            return self._seen(Requests())
        except OSError as e:
            if not self._warned:
                self._warned = True
                log.warning("faults.trigger_file %s: cannot read it (%s); no faults from it",
                            self.path, e)
            return self._seen(Requests())

    def _consume(self, lines: list[str]) -> tuple[list[str], Requests]:
        keep, nan, slow, pause = [], False, 0.0, ""
        for ln in lines:
            m_nan, m_slow, m_pause = self.NAN.match(ln), self.SLOW.match(ln), self.PAUSE.match(ln)
            if m_nan is None and m_slow is None and m_pause is None:
                log.warning("faults.trigger_file %s: removed the line %r (allowed: 'nan rank=R', "
                            "'slow rank=R seconds=S', 'pause rank=R at=NAME', R a global rank)",
                            self.path, ln)
                continue
            if m_nan is not None and not nan and int(m_nan[1]) == self.rank:
                nan = True
                continue
            if m_pause is not None and not pause and int(m_pause[1]) == self.rank:
                pause = m_pause[2]
                continue
            if m_slow is not None and int(m_slow[1]) == self.rank:
                slow = float(m_slow[2])
            keep.append(ln)
        return keep, Requests(nan=nan, slow_seconds=slow, pause=pause)

    def _seen(self, requests: Requests) -> Requests:
        if requests.slow_seconds != self._slow:
            self._slow = requests.slow_seconds
            log.warning("fault injection: rank %d %s (trigger file %s)", self.rank,
                        f"sleeps {self._slow:g} s before each step" if self._slow
                        else "no longer sleeps before each step", self.path)
        return requests


def _hang_forever() -> None:
    threading.Event().wait()


def planted_metric(cfg: FaultConfig, eval_index: int) -> float | None:
    """The planted value of evaluation ``eval_index`` (the last one repeats), or None."""
    if not cfg.planted_metric:
        return None
    return cfg.planted_metric[min(eval_index, len(cfg.planted_metric) - 1)]


@torch.no_grad()
def perturb_replica(cfg: FaultConfig, rank: int, model: torch.nn.Module) -> None:
    """Make this rank's replica diverge after a checkpoint load (tests the replica check)."""
    if cfg.perturb_rank == rank:
        log.warning("fault injection: rank %d perturbs its parameters after loading", rank)
        next(iter(model.parameters())).add_(1e-3)
