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

from .compat import check_torch
from .config import Config, load_config
from .config_base import ConfigError
from .dist import destroy_distributed, init_distributed, is_peer_failure, open_device
from .exit_codes import EXIT_OK, EXIT_PEER_LOST
from .logs import first_line, setup_logging
from .observe.config import MetricsConfig
from .observe.goodput import process_start_time
from .observe.health import MetricsServer
from .observe.metrics import RankMetrics
from .protocol import env
from .protocol.torchrun_env import TorchrunEnv, set_rank, take_place
from .recovery.heartbeat import Heartbeat
from .recovery.inplace import InPlaceRecovery, JobFinished, NoRecovery, Regroup
from .recovery.rejoin import rejoin
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
    spare = env.spare_name() if recovery.active else None
    if spare and spare.endswith("."):  # a joining node's worker: named by its local rank
        spare += str(TorchrunEnv.read().local_rank)
    task = stand_by(cfg, recovery, spare, verbose) if spare else None
    heartbeat = Heartbeat.from_env(cfg.recovery.heartbeat_timeout_seconds
                                   if recovery.active else None)
    watch = recovery.watch()  # several nodes: a partitioned peer's collective is left
    metrics, server = worker_metrics(cfg.metrics)
    metrics.phase("starting", None)  # joining the process group is not a hang
    info = None
    trainer = None
    linger = 0.0
    try:
        marks = [process_start_time(), entered]
        open_device(TorchrunEnv.read().local_rank)
        marks.append(time.time())
        try:
            store = recovery.group_store() if recovery.active else None
        except JobFinished as e:  # a replacement ready after the last step
            log.warning("%s", e)
            return EXIT_OK
        with recovery.sockets.forming():
            info = init_distributed(cfg.distributed.backend, cfg.distributed.timeout_seconds,
                                    store, cfg.distributed.eager_init)
        recovery.backend = info.backend
        marks.append(time.time())
        if info.rank == 0:
            log.info("process group: backend %s, world size %d, rank 0 on %s%s", info.backend,
                     info.world_size, info.device, _device_name(info.device))
        with _building(cfg, recovery):
            trainer = build_trainer(cfg, info, metrics, task, joining=task is not None,
                                    job_global_batch=recovery.job_global_batch())
        trainer.attach(recovery)
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
        trainer = fit(cfg, trainer, recovery, metrics, joined=task is not None)
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
        if info is not None:
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


def fit(cfg: Config, trainer: Trainer, recovery: InPlaceRecovery | NoRecovery,
        metrics: RankMetrics, joined: bool) -> Trainer:
    """Train to the end; each regroup (continue shrunk) rebuilds the trainer in this process.
    Returns the trainer that finished."""
    first = trainer
    while True:
        try:
            trainer.fit(joined=joined)
            return trainer
        except Regroup as r:
            trainer, joined = regroup(cfg, trainer, recovery, metrics, r), True
        except BaseException:
            if trainer is not first:  # the caller closes the first one
                trainer.close()
            raise


def regroup(cfg: Config, old: Trainer, recovery: InPlaceRecovery | NoRecovery,
            metrics: RankMetrics, r: Regroup) -> Trainer:
    """Go on as rank ``r.rank`` of ``r.world_size``: the same task (data and model objects),
    this process's state, a new process group, a trainer built for the new world size (the
    sampler's global cursor keeps every sample exactly once; the accumulation is re-derived
    from the global batch the job keeps), then the group agrees on the state (``rejoin``). Sharded
    state (FSDP2) cannot move to the new group: a new module of the same structure is sharded on
    it, and ``rejoin`` loads it from the peer copies (or the newest checkpoint)."""
    sharded = old.checkpoints.sharded
    state, after = ({} if sharded else old.checkpoints.state_dict()), old.after_done
    goodput = old.checkpoints.state["goodput"].state_dict()
    bundle = dataclasses.replace(old.bundle,
                                 model=old.parallelism.module_for_new_group(old.model))
    destroy_distributed()
    t0 = time.perf_counter()
    recovery.form_group(r.rank, r.world_size, r.generation)
    t1 = time.perf_counter()
    set_rank(r.rank, r.world_size)
    if r.rank != old.info.rank:  # renumbered: a new rank 0 logs what rank 0 logs
        setup_logging(r.rank)
    info = dataclasses.replace(old.info, rank=r.rank, world_size=r.world_size)
    metrics.world(r.world_size)
    with _building(cfg, recovery):
        trainer = build_trainer(cfg, info, metrics, (bundle, old.profile.fingerprint), joining=True,
                                job_global_batch=old.cfg.batch.global_batch_size)
    trainer.attach(recovery)
    trainer.preempt.install()
    if sharded:
        trainer.checkpoints.state["goodput"].load_state_dict(goodput)
    else:
        trainer.checkpoints.load_from_peer(state, r.rank)
    # the new trainer's clock goes on from the old one's account, not from the process start
    trainer.checkpoints.state["goodput"].on_recovered(trainer.state.step, True,
                                                      trainer.sampler.last_step)
    trainer.after_done = after
    rejoin(trainer, joining=False, report=r.report)
    if r.report is not None:
        r.report.phases.update(group=t1 - t0, state=time.perf_counter() - t1)
        trainer.recovered_at(r.report)
    return trainer


def _building(cfg: Config, recovery: InPlaceRecovery | NoRecovery
              ) -> contextlib.AbstractContextManager[None]:
    """Under FSDP the trainer's build makes groups inside the current one (an HSDP mesh's, the
    checkpoint group): a peer can wait on this rank in them, so recovery cuts their sockets too.
    DDP's build makes none, and a task's own connections (an object store's) must not be cut."""
    if cfg.distributed.strategy != "fsdp":
        return contextlib.nullcontext()
    return recovery.sockets.forming(subgroups=True)


def stand_by(cfg: Config, recovery: InPlaceRecovery, spare: str, verbose: bool
             ) -> tuple[TaskBundle, str]:
    """A warm spare: build the task's data and model now, then wait until the agent hands
    this process a failed worker's place (its RANK, LOCAL_RANK, ... become this process's
    environment). Stored task artifacts are read, never remade (the job made them)."""
    reuse = cfg.model_copy(deep=True)
    reuse.checkpoint.resume = True
    task = build_task(reuse)
    # what building the trainer imports lazily (an optimizer imports torch._dynamo: ~1 s) is
    # imported now, not while the survivors wait
    build_optimizer(cfg, task[0].model, task[0])
    t0 = time.time()
    place = take_place(recovery.wait_assignment(spare))
    setup_logging(place.rank, verbose)
    log.warning("spare %s replaces rank %s (local_rank %s) in generation %d, after standing by "
                "%.1f s", spare, place.rank, place.local_rank, recovery.generation,
                time.time() - t0)
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
