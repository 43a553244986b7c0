"""``elastic-runner train``: the per-rank entry point that torchrun starts (or a user, alone).

Each rank: set up logging, join the process group (namespaced per attempt, see ``dist.py``),
build the trainer, load the newest valid checkpoint, train, and always destroy the process group.
Errors are written to torch elastic's error file (``TORCHELASTIC_ERROR_FILE``) so the agent can
name the failing rank's root cause.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from .compat.registry import check_torch
from .config import Config, load_config
from .config_base import ConfigError
from .dist import DistInfo, destroy_distributed, is_peer_failure, open_device
from .exit_codes import EXIT_OK, EXIT_PEER_LOST
from .logs import first_line, setup_logging
from .observe.config import MetricsConfig
from .observe.goodput import process_start_time
from .observe.health import MetricsServer
from .observe.metrics import RankMetrics
from .protocol import env
from .protocol.torchrun_env import TorchrunEnv
from .recovery.heartbeat import Heartbeat
from .recovery.inplace import InPlaceRecovery, JobFinished, Regroup
from .recovery.rejoin import rejoin
from .recovery.runtime import RecoveryService, RecoveryTail, join_group, spare_name, take_place
from .tasks.base import TaskBundle
from .train.callbacks import JOINING
from .train.endings import expected_exit
from .trainer.build import build_optimizer, build_task, build_trainer
from .trainer.loop import Trainer

log = logging.getLogger("elastic_runner.worker")


def main(config_path: str, overrides: list[str], resume: bool = True, verbose: bool = False
         ) -> int:
    """Train one rank; returns the process exit code (2 for bad config or checkpoint, 143
    preempted, 3 fenced out: a newer group claimed the checkpoint directory, 4 a peer died or
    hung: see ``agent/restart_budget.py``)."""
    entered = time.time()
    setup_logging(TorchrunEnv.read().rank, verbose)
    try:
        return _train(config_path, overrides, resume, entered, verbose)
    except Exception as e:
        code = expected_exit(e, log)
        if code is not None:
            return code
        if not is_peer_failure(e):
            raise
        # another rank died or hung: a membership change for the agent's restart budget
        log.error("lost a peer: %s", first_line(e))
        return EXIT_PEER_LOST


@record
def _train(config_path: str, overrides: list[str], resume: bool, entered: float,
           verbose: bool = False) -> int:
    check_torch("worker")
    # --no-resume: nothing stored is reused, neither checkpoints nor task artifacts
    cfg = load_config(config_path, [*overrides, *([] if resume else ["checkpoint.resume=false"])])
    recovery = InPlaceRecovery.from_env(cfg.recovery)
    spare = spare_name(recovery)
    task = stand_by(cfg, recovery, spare, verbose) if spare else None
    heartbeat = Heartbeat.from_env(cfg.recovery.heartbeat_timeout_seconds
                                   if recovery.active else None)
    watch = recovery.watch()  # several nodes: a partitioned peer's collective is left
    metrics, server = worker_metrics(cfg.metrics)
    metrics.phase("starting", None)  # joining the process group is not a hang
    joined = False
    trainer = None
    linger = 0.0
    try:
        marks = [process_start_time(), entered]
        open_device(TorchrunEnv.read().local_rank)
        marks.append(time.time())
        try:
            info = join_group(recovery, cfg.distributed.backend, cfg.distributed.timeout_seconds,
                              cfg.distributed.eager_init)
        except JobFinished as e:  # a replacement ready after the last step
            log.warning("%s", e)
            return EXIT_OK
        joined = True
        marks.append(time.time())
        trainer = start(cfg, info, RecoveryTail(recovery), metrics, task, marks)
        trainer = fit(cfg, trainer, metrics, joined=task is not None)
        recovery.announce_finished(trainer.info.rank)
        linger = cfg.metrics.linger_seconds  # a final scrape sees the ending (not on errors)
    finally:
        if trainer is not None:
            trainer.close()  # flushes TensorBoard: the worker may leave without teardown
        # on its way out the process is not hung; the group's teardown and the collection
        # below may keep the heartbeat thread from running (a heartbeat silent for 2 s after
        # training ended got a finished worker killed as hung, and the job then waited for
        # its replacement until the test's timeout)
        heartbeat.close()
        if joined:
            destroy_distributed()
        # the trainer is not freed here: a gloo group's destructor, run by the collector with
        # the GIL held, waits for the group's worker thread, which may wait for the GIL to
        # free a finished collective's tensor (seen: a finished worker hung for good, in 1 of
        # about 70 restart-path runs). A normal return leaves without the interpreter's
        # teardown (__main__._leave); a sharded model's groups were released at the trainer's
        # close (compat fix 13)
        if server is not None:
            threading.Event().wait(linger)
            server.close()
        watch.close()
    return EXIT_OK


def start(cfg: Config, info: DistInfo, tail: RecoveryTail, metrics: RankMetrics,
          task: TaskBundle | None, marks: list[float]) -> Trainer:
    """Build the trainer in the formed group and bring it to the group's state: a replacement
    (``task`` built while it stood by) receives it from the survivors, any other rank loads the
    newest checkpoint (when ``checkpoint.resume``). ``marks``: wall-clock times (seconds) of
    the start-up so far; rank 0 logs where it went."""
    recovery = tail.recovery
    if info.rank == 0:
        log.info("process group: backend %s, world size %d, rank 0 on %s%s", info.backend,
                 info.world_size, info.device, _device_name(info.device))
    with _building(cfg, recovery):
        trainer = build_trainer(cfg, info, metrics, task, joining=task is not None,
                                job_global_batch=recovery.job_global_batch())
    trainer.attach(tail)
    trainer.preempt.install()
    marks.append(time.time())
    if task is not None:
        trainer.session.callbacks.on_phase("recovering", JOINING, True)
        rejoin(trainer, joining=True)
    elif cfg.checkpoint.resume:
        trainer.resume()
    marks.append(time.time())
    recovery.announce_built(info.rank)
    if info.rank == 0 and task is None:
        log_startup(marks)
    return trainer


def fit(cfg: Config, trainer: Trainer, metrics: RankMetrics, joined: bool) -> Trainer:
    """Train to the end; each regroup (continue shrunk) rebuilds the trainer in this process.
    Returns the trainer that finished."""
    first = trainer
    while True:
        try:
            trainer.fit(joined=joined)
            return trainer
        except Regroup as r:
            trainer, joined = regroup(cfg, trainer, metrics, r), True
        except BaseException:
            if trainer is not first:  # the caller closes the first one
                trainer.close()
            raise


def regroup(cfg: Config, old: Trainer, metrics: RankMetrics, r: Regroup) -> Trainer:
    """Go on as rank ``r.rank`` of ``r.world_size``: the same task (data and model objects),
    this process's state, a new process group, a trainer built for the new world size (the
    sampler's global cursor keeps every sample exactly once; the accumulation is re-derived
    from the global batch the job keeps), then the group agrees on the state (``rejoin``,
    through the process's :class:`~elastic_runner.recovery.runtime.RecoveryTail`). Sharded
    state (FSDP2) cannot move to the new group: a new module of the same structure is sharded on
    it, and ``rejoin`` loads it from the peer copies (or the newest checkpoint)."""
    sharded = old.checkpoints.sharded
    state, after = ({} if sharded else old.checkpoints.state_dict()), old.after_done
    goodput = old.checkpoints.state["goodput"].state_dict()
    bundle = dataclasses.replace(old.bundle,
                                 model=old.parallelism.module_for_new_group(old.model))
    tail = old.tail
    destroy_distributed()

    def moved() -> Trainer:
        info = old.info.moved_to(r.rank, r.world_size)  # a new place: its holders are new
        metrics.world(r.world_size)
        with _building(cfg, tail.recovery):
            trainer = build_trainer(cfg, info, metrics, (bundle, old.profile.fingerprint),
                                    joining=True,
                                    job_global_batch=old.cfg.batch.global_batch_size)
        trainer.attach(tail)
        trainer.preempt.install()
        if sharded:
            trainer.checkpoints.state["goodput"].load_state_dict(goodput)
        else:
            trainer.checkpoints.load_from_peer(state, r.rank)
        # the new trainer's clock goes on from the old one's account, not the process start
        trainer.checkpoints.state["goodput"].on_recovered(trainer.state.step, True,
                                                          trainer.sampler.last_step)
        trainer.after_done = after
        return trainer

    return tail.regroup(r, r.report, old.info.rank, moved)  # type: ignore[return-value]


def _building(cfg: Config, recovery: RecoveryService
              ) -> contextlib.AbstractContextManager[None]:
    """Under FSDP the trainer's build makes groups inside the current one (an HSDP mesh's, the
    checkpoint group): a peer can wait on this rank in them, so recovery cuts their sockets too.
    DDP's build makes none, and a task's own connections (an object store's) must not be cut."""
    if cfg.distributed.strategy != "fsdp":
        return contextlib.nullcontext()
    return recovery.sockets.forming(subgroups=True)


def stand_by(cfg: Config, recovery: RecoveryService, spare: str, verbose: bool
             ) -> tuple[TaskBundle, str]:
    """A warm spare: build the task's data and model now, then wait until the agent hands
    this process a failed worker's place (its RANK, LOCAL_RANK, ... become this process's
    environment: :func:`~elastic_runner.recovery.runtime.take_place`). Stored task artifacts
    are read, never remade (the job made them)."""
    reuse = cfg.model_copy(deep=True)
    reuse.checkpoint.resume = True
    task = build_task(reuse)
    # what building the trainer imports lazily (an optimizer imports torch._dynamo: ~1 s) is
    # imported now, not while the survivors wait
    build_optimizer(cfg, task[0].model, task[0])
    take_place(recovery, spare, verbose)
    return task


def log_startup(marks: list[float]) -> None:
    """One line saying where a (re)start's time went: ``marks`` are wall-clock times (seconds)
    of process creation, entry into ``main`` (after the interpreter started and imported the
    package), the device opened (the CUDA context created; ~0 on CPU), process group formed,
    trainer built (data and model), checkpoint loaded."""
    spans = [b - a for a, b in zip(marks, marks[1:], strict=False)]
    log.info("startup: interpreter and imports %.3f s, device %.3f s, process group %.3f s, "
             "data and model %.3f s, checkpoint load %.3f s", *spans)


def _device_name(device: torch.device) -> str:
    return f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""


def worker_metrics(m: MetricsConfig) -> tuple[RankMetrics, MetricsServer | None]:
    """This rank's series (config section ``m``), and its own endpoint on ``m.port +
    local_rank`` when no elastic-runner agent serves the node's (plain torchrun).

    Raises:
        ConfigError: the port cannot be bound.
    """
    here = TorchrunEnv.read()
    local_rank = here.local_rank
    metrics = RankMetrics(m, here.rank, local_rank,
                          cuda=torch.cuda.is_available())
    if not (m.enabled and m.port) or env.metrics_agent():
        return metrics, None
    try:
        server = MetricsServer(metrics.registry, m.address, m.port + local_rank,
                               expected_local_ranks=1)
    except OSError as e:
        raise ConfigError(e.strerror) from e
    return metrics, server
