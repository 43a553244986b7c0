"""One rank's :class:`~elastic_runner.train.session.TrainingSession`, assembled with its
:class:`~elastic_runner.checkpoint.manager.CheckpointManager` and its reporting callbacks from a
:class:`SessionSpec`. Both loops make theirs here (the built-in trainer in
``trainer/build.py``, a script's loop in :func:`elastic_runner.fault_tolerant`), so what a
checkpoint holds, what its manifest records and the order in which the callbacks see each event
are decided in one place."""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .checkpoint.manager import CheckpointManager
from .data.sampler import ElasticSampler
from .dist import DistInfo
from .observe.goodput import Goodput
from .observe.metrics import RankMetrics
from .observe.reporting import Budgets, FaultInjection, runner_callbacks
from .train.callbacks import Callback, Callbacks
from .train.config import EarlyStoppingConfig
from .train.consensus import StepConsensus
from .train.early_stop import EarlyStopping
from .train.session import SessionOptions, TrainingSession
from .train.state import RNGState, TrainState
from .train.stop import StopPolicy
from .train.straggler import StragglerMonitor


@dataclass
class CheckpointSpec:
    """Where and how often the session checkpoints (the
    :class:`~elastic_runner.checkpoint.manager.CheckpointManager`'s arguments of the same
    names), and what each manifest says of the run: ``fingerprint`` (its ``config_hash``: what
    the run built) and ``finished`` (True while the run's last checkpoint is taken)."""

    directory: str
    fingerprint: str
    finished: Callable[[], bool]
    every_steps: int = 0
    every_seconds: float | None = None
    async_save: bool = True
    keep_last: int = 3
    keep_best: bool = False
    layout: str = "auto"
    extra: Mapping[str, Any] = field(default_factory=dict)
    after_load: Callable[[dict[str, Any]], None] = lambda raw: None
    migrate: Callable[[dict[str, Any]], dict[str, Any]] = lambda raw: raw


@dataclass
class ReportingSpec:
    """The runner's rank-bound reporting (:func:`~elastic_runner.observe.reporting.
    runner_callbacks`): this rank's series, the watchdog's budgets, the sample trace's directory
    (None: no trace), the steps in the run (0: not known) and the seconds a hang's stack dump
    may take."""

    metrics: RankMetrics
    budgets: Budgets
    trace_dir: str | None = None
    total_steps: int = 0
    dump_grace_seconds: float = 2.0

    def callbacks(self, rank: int, world_size: int, sampler: ElasticSampler) -> list[Callback]:
        """The callbacks for ``rank`` of ``world_size`` (a regrouped rank makes them anew)."""
        return runner_callbacks(self.metrics, self.budgets, rank, world_size,
                                sampler.num_samples, self.total_steps, self.trace_dir,
                                self.dump_grace_seconds, sampler.last_step)


@dataclass
class SessionSpec:
    """What one rank's session is made of.

    Attributes:
        info: the rank (its :class:`~elastic_runner.dist.Place`, which the sampler, the session
            and the checkpoints refer to), the world size and the device.
        sampler: the loader's sampler (its cursor is checkpointed).
        stateful: the loop's own objects (model, optimizer, ...), checkpointed first, under
            these names; then the sampler, the step counters, ``stop``, the RNG streams,
            ``goodput`` and ``more_state``.
        stop: the loop's stop policy, checkpointed; None: the loop decides when it stops, and
            the session never stops it (not checkpointed).
        goodput: the job's time account, reported after the runner's callbacks.
        callbacks: more callbacks, after those; ``faults``: fault injection, the last one (a
            kill comes after the step is reported).
        straggler_threshold: the straggler exchange's threshold (0: off).
        fetched: the loader's record of what it handed out (the sample trace).
    """

    info: DistInfo
    sampler: ElasticSampler
    stateful: Mapping[str, Any]
    checkpoint: CheckpointSpec
    reporting: ReportingSpec
    consensus: StepConsensus
    options: SessionOptions
    lr: Callable[[], float]
    stop: StopPolicy | None = None
    goodput: Goodput | None = None
    callbacks: Sequence[Callback] = ()
    faults: FaultInjection | None = None
    more_state: Mapping[str, Any] = field(default_factory=dict)
    straggler_threshold: float = 0.0
    fetched: Callable[[], list[list[int]]] | None = None


def assemble_session(spec: SessionSpec) -> tuple[TrainingSession, list[Callback]]:
    """The session ``spec`` describes, and the rank-bound callbacks in it (a regroup swaps
    them for the new rank's: :meth:`~elastic_runner.train.callbacks.Callbacks.swap`).

    Raises:
        TypeError: a value of ``stateful`` or ``more_state`` is not ``Stateful``.
    """
    info, sampler = spec.info, spec.sampler
    sampler.follow(info.place)  # one place: a regroup moves the sampler, session, checkpoints
    runner = spec.reporting.callbacks(info.rank, info.world_size, sampler)
    reporting = Callbacks([*runner, *([spec.goodput] if spec.goodput else []),
                           *spec.callbacks, *([spec.faults] if spec.faults else [])])
    state = TrainState()
    stop = spec.stop or StopPolicy(None, sys.maxsize, EarlyStopping(EarlyStoppingConfig()))
    checkpoints = _checkpoints(spec, state, reporting)
    session = TrainingSession(
        state=state, sampler=sampler, checkpoints=checkpoints, consensus=spec.consensus,
        stop=stop, callbacks=reporting,
        straggler=StragglerMonitor(spec.straggler_threshold, info.rank, info.world_size,
                                   info.device),
        device=info.device, options=spec.options, lr=spec.lr,
        poisoned=spec.faults.poisoned if spec.faults else (lambda step: False),
        fetched=spec.fetched)
    return session, runner


def _checkpoints(spec: SessionSpec, state: TrainState, listener: Callbacks
                 ) -> CheckpointManager:
    """The session's checkpoints, in the order :class:`SessionSpec` names."""
    c, sampler = spec.checkpoint, spec.sampler
    held = {**spec.stateful, "sampler": sampler, "train_state": state,
            **({"stop": spec.stop} if spec.stop else {}), "rng": RNGState(),
            **({"goodput": spec.goodput} if spec.goodput else {}), **spec.more_state}
    return CheckpointManager(
        c.directory, held, every_steps=c.every_steps, every_seconds=c.every_seconds,
        async_save=c.async_save, keep_last=c.keep_last, keep_best=c.keep_best, extra=c.extra,
        # the sampler's world size: a regrouped script loop's moves with it
        meta=lambda: {"epoch": sampler.epoch, "cursor": sampler.cursor,
                      "world_size": sampler.world_size,
                      "global_batch_size": sampler.global_batch_size,
                      "config_hash": c.fingerprint, "finished": c.finished()},
        listener=listener, after_load=c.after_load, migrate=c.migrate, rank=spec.info.place,
        layout=c.layout)
