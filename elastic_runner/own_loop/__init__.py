"""Fault tolerance for your own training loop, in a few changed lines.

    loader = elastic_dataloader(train_set, micro_batch_size=16, seed=0)
    ft = fault_tolerant(model, optimizer, loader, checkpoint_dir="runs/ckpt", every_steps=50)
    step, epoch = ft.resume()                   # newest valid checkpoint, or step 0
    while step < max_steps:
        loader.elastic_sampler.set_epoch(epoch)
        for x, y in loader:                     # this rank's remaining micro-batches
            optimizer.zero_grad()
            ft.backward(loss_fn(model(x), y))   # instead of loss.backward()
            if ft.should_commit():              # same answer on every rank
                optimizer.step()
            step = ft.step_done()               # cursor, metrics, checkpoint cadence, SIGTERM
            ...                                 # your work after the step (evaluate, log)
        epoch += 1
    ft.close()                                  # final checkpoint, committed

Under ``torchrun`` or ``elastic-runner run`` every (re)start resumes from the newest valid
checkpoint at the exact next step, at any world size (the sampler's global cursor); SIGTERM
(preemption) discards the step in flight on every rank, commits a checkpoint of the last applied
step and exits 143 (put an LR scheduler's ``step()`` inside ``if ft.should_commit():``); per-rank
metrics are recorded (served by ``elastic-runner run``'s agent, or on ``metrics.port +
local_rank`` under plain torchrun); a hang past the watchdog budget dumps stacks and exits. A
streak of non-finite steps fails the process, and the restart resumes from the last checkpoint.

The checkpoint of step N holds all of step N, the loop's own work after ``step_done()`` too (an
evaluation, early-stopping bookkeeping kept in ``state=``): ``step_done()`` decides whether step
N is checkpointed, and the snapshot is taken at the next boundary the loop reaches, the loader's
next batch, the next :meth:`FaultTolerantLoop.backward` or :meth:`FaultTolerantLoop.close`,
where the next step begins (its RNG streams reseeded, its watchdog budget armed). Between
``step_done()`` and that boundary the watchdog allows ``long_op_timeout_seconds``.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import yaml
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful
from torch.nn.parallel import DistributedDataParallel as DDP

from ..data.loader import ElasticDataLoader
from ..data.sampler import ElasticSampler
from ..dist import DistInfo, current_rank, dist_info
from ..logs import setup_logging
from ..observe.config import MetricsConfig
from ..observe.metrics import RankMetrics
from ..observe.reporting import Budgets, FaultInjection
from ..preempt import PreemptionFlag
from ..protocol import env
from ..protocol.env import CHECKPOINT_DIR_FILE_ENV
from ..protocol.torchrun_env import TorchrunEnv
from ..rank_session import CheckpointSpec, ReportingSpec, SessionSpec, assemble_session
from ..recovery.recoverable import RecoveryProfile
from ..recovery.script import ScriptProcess
from ..train.callbacks import Callback
from ..train.config import FaultConfig, FaultSpec
from ..train.consensus import CommHook, StepConsensus, make_consensus
from ..train.faults import FaultInjector
from ..train.session import SessionOptions
from .in_place import in_place_process
from .loop import FaultTolerantLoop
from .parts import LoopParts
from .script_collectives import ScriptCollectives
from .script_state import NoScriptState, ScriptState, StateRecord

__all__ = ["DEFAULT_EVERY_SECONDS", "FaultTolerantLoop", "fault_tolerant", "model_fingerprint"]

log = logging.getLogger(__name__)

DEFAULT_EVERY_SECONDS = 300.0  # fault_tolerant's checkpoint cadence when none is given


def fault_tolerant(model: nn.Module, optimizer: torch.optim.Optimizer,
                   loader: ElasticDataLoader, *, checkpoint_dir: str, every_steps: int = 0,
                   every_seconds: float | None = None, async_save: bool = True,
                   keep_last: int = 3, state: Mapping[str, Stateful] | None = None,
                   log_every_steps: int = 10, max_bad_steps: int = 3,
                   hang_timeout_seconds: float | None = 300.0,
                   long_op_timeout_seconds: float = 1800.0,
                   metrics: MetricsConfig | None = None, trace_dir: str | None = None,
                   comm_hook: CommHook | None = None, hook_state: Any = None,
                   callbacks: list[Callback] | None = None) -> FaultTolerantLoop:
    """Make a user's DDP or FSDP2 loop fault-tolerant (see the module docstring).

    Args:
        model: the model as trained: a ``DistributedDataParallel`` (its step vote then rides on
            the gradient all-reduce), a module sharded with ``fully_shard`` (FSDP2: checkpoints
            are sharded through DCP, every rank writes its part, a resume reshards to the world
            size; the vote travels in the gradients as on DDP) or a plain module (world size 1,
            or a vote by all-reduce).
        optimizer: its optimizer (checkpointed).
        loader: an :class:`~elastic_runner.data.loader.ElasticDataLoader` (its cursor is
            checkpointed and only finished steps move it).
        checkpoint_dir: local path or fsspec URL shared by all nodes.
        every_steps, every_seconds, async_save, keep_last: checkpoint cadence and retention;
            with neither ``every_steps`` nor ``every_seconds`` given, a checkpoint every
            :data:`DEFAULT_EVERY_SECONDS` seconds (logged once), so a crash never resumes
            from step 0 after a long run.
        state: more ``Stateful`` objects to checkpoint (an LR scheduler, a GradScaler, ...).
        log_every_steps: the loss is read from the device, averaged and logged this often.
        max_bad_steps: non-finite steps in a row before the process fails (and resumes).
        hang_timeout_seconds: a step that takes longer is a hang (None: no watchdog limit);
            the first step of an attempt and checkpoint I/O get ``long_op_timeout_seconds``.
        metrics: the ``metrics`` section (port, address, labels); default: recorded, not served.
        trace_dir: write the sample audit trace (``elastic-runner audit DIR``) there
            (``elastic-runner run script.py --trace-samples DIR`` sets another).
        comm_hook, hook_state: your own DDP comm hook, wrapped rather than replaced (the vote
            then costs one small all-reduce per step; without it, none).
        callbacks: your own :class:`~elastic_runner.train.callbacks.Callback` objects.

    The runner logs to stderr (rank 0: INFO, others: WARNING) unless the program configured
    logging (a handler on the root or the ``elastic_runner`` logger) before this call.

    Raises:
        TypeError: a value of ``state`` is not ``Stateful``.
    """
    return _assemble(_Request(model, optimizer, loader, checkpoint_dir, every_steps,
                              every_seconds, async_save, keep_last, state or {},
                              log_every_steps, max_bad_steps, hang_timeout_seconds,
                              long_op_timeout_seconds, metrics or MetricsConfig(), trace_dir,
                              comm_hook, hook_state, callbacks or []))


@dataclass(frozen=True)
class _Request:
    """:func:`fault_tolerant`'s arguments (its docstring says what each is)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    loader: ElasticDataLoader
    checkpoint_dir: str
    every_steps: int
    every_seconds: float | None
    async_save: bool
    keep_last: int
    state: Mapping[str, Stateful]
    log_every_steps: int
    max_bad_steps: int
    hang_timeout_seconds: float | None
    long_op_timeout_seconds: float
    metrics: MetricsConfig
    trace_dir: str | None
    comm_hook: CommHook | None
    hook_state: Any
    callbacks: list[Callback]


def _assemble(q: _Request) -> FaultTolerantLoop:
    """The loop :func:`fault_tolerant` returns, assembled from its parts."""
    model, optimizer, loader, state = q.model, q.optimizer, q.loader, q.state
    _tell_the_agent(q.checkpoint_dir)
    inner = model.module if isinstance(model, DDP) else model
    rank, sampler = current_rank(), loader.elastic_sampler
    own_logging = (not logging.getLogger("elastic_runner").handlers
                   and not logging.getLogger().handlers)
    if own_logging:
        setup_logging(rank)  # the runner's lines (resumed from, checkpoints) unless you log
    preempt = PreemptionFlag()
    preempt.install()
    rank_metrics, closing = _metrics(q.metrics)
    reporting = ReportingSpec(rank_metrics, Budgets(q.hang_timeout_seconds,
                                                    q.long_op_timeout_seconds),
                              env.trace_dir() or q.trace_dir)
    process = in_place_process(model)
    fingerprint = model_fingerprint(inner, sampler)
    closing_flag = [False]  # the manifest's "finished": the checkpoint of close()

    def vote() -> StepConsensus:  # a membership change's step boundary stops it too
        return make_consensus(model, lambda: preempt.stop_asked, q.comm_hook, q.hook_state)

    info = _dist_info(rank, sampler.world_size, next(inner.parameters()).device)
    faults = _faults(rank)
    session, ours = assemble_session(SessionSpec(
        info=info, sampler=sampler, stateful={"model": inner, "optimizer": optimizer},
        checkpoint=CheckpointSpec(q.checkpoint_dir, fingerprint, lambda: closing_flag[0],
                                  every_steps=q.every_steps,
                                  every_seconds=_cadence(q.every_steps, q.every_seconds, rank),
                                  async_save=q.async_save, keep_last=q.keep_last),
        reporting=reporting, consensus=vote(),
        options=SessionOptions(sampler.seed, q.log_every_steps, q.max_bad_steps),
        lr=lambda: optimizer.param_groups[0]["lr"], callbacks=q.callbacks,
        faults=faults, more_state=state, fetched=loader.take_fetched))
    # an FSDP2 loop's shards cannot take another world size in its process
    profile = RecoveryProfile(fingerprint, regroups=not session.checkpoints.sharded)
    parts = LoopParts(info, preempt, profile, process, model, loader, vote, closing_flag,
                      rank_metrics, lambda r, w: reporting.callbacks(r, w, sampler), ours,
                      own_logging, _script_state(state, rank, process))
    loop = FaultTolerantLoop(session, [p for p in inner.parameters() if p.requires_grad],
                             closing, parts)
    loop.attach(ScriptCollectives(loop.in_place, faults.injector.pause_before if faults
                                  else _no_pause) if process.recovery.active else None)
    return loop


def _cadence(every_steps: int, every_seconds: float | None, rank: int) -> float | None:
    """The checkpoint cadence by time: ``every_seconds``, or :data:`DEFAULT_EVERY_SECONDS` when
    no cadence is given (said once), so a crash never resumes from step 0 after a long run."""
    if every_steps or every_seconds is not None:
        return every_seconds
    if rank == 0:
        log.info("fault_tolerant: no checkpoint cadence given (every_steps, every_seconds): a "
                 "checkpoint every %g s", DEFAULT_EVERY_SECONDS)
    return DEFAULT_EVERY_SECONDS


def _script_state(state: Mapping[str, Stateful], rank: int,
                  process: ScriptProcess) -> StateRecord:
    """Rank 0's ``state=`` through a replacement of any rank, and whether a recovery's group
    runs the loop's window again (``own_loop/script_state.py``): in place only."""
    if not process.recovery.active:
        return NoScriptState()
    return ScriptState(state, rank, process.recovery)


def _tell_the_agent(checkpoint_dir: str) -> None:
    """Under ``run script.py``: write ``checkpoint_dir`` into the agent's file
    (``CHECKPOINT_DIR_FILE_ENV``), from each node's local rank 0, whole or not at all; a
    failure to write it is a warning, not an error."""
    named_in = env.checkpoint_dir_file()
    if not named_in or TorchrunEnv.read().local_rank != 0:
        return
    where = checkpoint_dir if "://" in checkpoint_dir else os.path.abspath(checkpoint_dir)
    try:
        Path(f"{named_in}.tmp").write_text(where + "\n")
        os.replace(f"{named_in}.tmp", named_in)
    except OSError as e:  # the agent then judges a crash loop by the failures alone
        log.warning("could not name the checkpoint directory to the agent (%s): %s",
                    CHECKPOINT_DIR_FILE_ENV, e)


def _dist_info(rank: int, world_size: int, device: torch.device) -> DistInfo:
    return dist_info(device, dist.get_backend() if dist.is_initialized() else "",
                     rank=rank, world_size=world_size)


def model_fingerprint(model: nn.Module, sampler: ElasticSampler) -> str:
    """What a replacement must have built like the survivors: the model's parameter and
    buffer names, shapes and dtypes, and the data's size and order (samples, seed,
    micro-batch). Hex SHA-256."""
    parts = [f"{n}:{tuple(t.shape)}:{t.dtype}" for n, t in model.state_dict().items()
             if isinstance(t, torch.Tensor)]
    parts.append(f"data:{sampler.num_samples}:{sampler.seed}:{sampler.micro_batch_size}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _metrics(cfg: MetricsConfig) -> tuple[RankMetrics, list[Any]]:
    """This rank's series, served on ``port + local_rank`` when no elastic-runner agent serves
    the node's (plain torchrun)."""
    from ..worker import worker_metrics

    metrics, server = worker_metrics(cfg)
    return metrics, [server] if server is not None else []


def _no_pause(name: str, step: int) -> None:
    pass


def _faults(rank: int) -> FaultInjection | None:
    """Fault drills through ``ELASTIC_RUNNER_FAULTS`` (a YAML list of fault specs) and
    ``ELASTIC_RUNNER_FAULTS_TRIGGER`` (a trigger file: ``faults.trigger_file``)."""
    text, trigger = env.faults(), env.faults_trigger()
    if not text and not trigger:
        return None
    specs = [FaultSpec(**spec) for spec in yaml.safe_load(text or "[]")]
    restart = TorchrunEnv.read().restart_count
    return FaultInjection(FaultInjector(FaultConfig(inject=specs, trigger_file=trigger), rank,
                                        restart))
