"""Assemble the built-in trainer from a config: task, model, parallelism (DDP or FSDP2),
optimizer, schedule, data, checkpoints, step consensus, stop policy and reporting callbacks, for
one rank."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..checkpoint import storage as ckpt
from ..config import Config, fingerprint
from ..config_base import ConfigError
from ..data.batches import check_samples
from ..data.loader import ElasticDataLoader
from ..data.sampler import ElasticSampler
from ..dist import DistInfo, assert_same_across_ranks
from ..observe.goodput import Goodput, process_start_time
from ..observe.metrics import RankMetrics
from ..observe.reporting import Budgets, FaultInjection, ProgressBar, TensorBoardScalars
from ..parallel.base import Parallelism
from ..parallel.choose import make_parallelism
from ..preempt import PreemptionFlag
from ..rank_session import CheckpointSpec, ReportingSpec, SessionSpec, assemble_session
from ..recovery.recoverable import RecoveryProfile
from ..recovery.runtime import renew_exchanges
from ..task_registry import task_builder
from ..tasks.base import TaskBundle, check_same_build, task_fingerprint
from ..train import faults as fault_injection
from ..train.callbacks import Callback
from ..train.config import BatchConfig
from ..train.consensus import StepConsensus, make_consensus, skips_on_device
from ..train.early_stop import EarlyStopping
from ..train.session import SessionOptions, TrainingSession
from ..train.state import seed_everything, use_deterministic_algorithms
from ..train.stop import StopPolicy, StopReason
from .engine import StepEngine, precision_dtype
from .loop import Trainer, lr_factor

log = logging.getLogger("elastic_runner.train.loop")


def build_optimizer(cfg: Config, model: nn.Module, bundle: TaskBundle | None = None
                    ) -> torch.optim.Optimizer:
    """The task's ``optimizer_fn(model)``, else the ``optimizer`` section's over the task's
    ``param_groups(model)`` (default: all parameters in one group), fused where
    ``optimizer.fused`` says (auto: when the model is on CUDA)."""
    if bundle is not None and bundle.optimizer_fn is not None:
        return bundle.optimizer_fn(model)
    params: Any = model.parameters()
    if bundle is not None and bundle.param_groups is not None:
        params = bundle.param_groups(model)
    o = cfg.optimizer
    fused = o.fused_on(_device_of(model))
    if o.name == "sgd":
        return torch.optim.SGD(params, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay,
                               fused=fused)
    return torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay,
                             fused=fused)


def _device_of(model: nn.Module) -> torch.device:
    return next(model.parameters(), torch.empty(0)).device


def build_scheduler(cfg: Config, optimizer: torch.optim.Optimizer, total_steps: int,
                    bundle: TaskBundle | None = None) -> torch.optim.lr_scheduler.LRScheduler:
    """The task's ``scheduler_fn(optimizer, total_steps)``, else the ``schedule`` section's
    warm-up and cosine (or constant) schedule, stepped once per optimizer step."""
    if bundle is not None and bundle.scheduler_fn is not None:
        return bundle.scheduler_fn(optimizer, total_steps)
    s = cfg.schedule
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, s.warmup_steps, total_steps, s.min_lr_ratio,
                                          cosine=s.name == "cosine"))


def build_task(cfg: Config) -> tuple[TaskBundle, str]:
    """The task's data and model (seeded), its samples checked; and its fingerprint.

    Raises:
        ConfigError: fp16 without CUDA; a wrong sample type; errors of the task's build.
    """
    if cfg.training.precision == "fp16" and not torch.cuda.is_available():
        raise ConfigError("training.precision: 'fp16' needs CUDA (GradScaler); use 'bf16' on CPU")
    use_deterministic_algorithms(cfg.training.deterministic)
    seed_everything(cfg.seed)
    bundle: TaskBundle = task_builder(cfg.task)(cfg)
    for split in ("train", "val"):  # a wrong sample type fails here, once, with exit code 2
        check_samples(getattr(bundle, split), split, bundle.collate_fn, cfg.task)
    return bundle, task_fingerprint(bundle)


def build_trainer(cfg: Config, info: DistInfo, metrics: RankMetrics | None = None,
                  task: tuple[TaskBundle, str] | None = None, joining: bool = False,
                  job_global_batch: int | None = None) -> Trainer:
    """Build everything one rank trains with; ``metrics`` (default: recording only) receives
    the rank's series. ``task``: :func:`build_task`'s result when already built (a warm
    spare); ``joining``: this process replaces a failed worker in a running group, whose
    members check the build and wrap the model together (``recovery/rejoin.py``).
    ``job_global_batch``: the global batch (samples) the job keeps, when the caller knows it
    (a regrouped survivor's, a joiner's from its group); else the newest checkpoint's, else
    this world size's (:meth:`~elastic_runner.train.config.BatchConfig.kept`). The trainer's
    ``cfg`` has it as ``batch.global_batch_size``.

    Raises:
        ConfigError: fp16 without CUDA; a global batch this world size does not divide; errors
            of the task's build.
    """
    if cfg.training.precision == "fp16" and info.device.type != "cuda":
        raise ConfigError("training.precision: 'fp16' needs CUDA (GradScaler); use 'bf16' on CPU")
    cfg = keep_global_batch(cfg, info.world_size, job_global_batch)
    bundle, built = task or build_task(cfg)
    if not joining:
        _check_same_task(cfg, built)
    parallelism = _parallelism(cfg, info, bundle)
    model = bundle.model.to(info.device)
    # a replacement's DDP is made with the group's (rejoin); shards before the optimizer exists
    net = model if joining and not parallelism.sharded else parallelism.wrap(model)
    loader = _loader(cfg, info, bundle)
    sampler = loader.elastic_sampler
    total = sampler.steps_per_epoch() * cfg.training.max_epochs
    if cfg.training.max_steps:
        total = min(total, cfg.training.max_steps)
    optimizer = build_optimizer(cfg, model, bundle)
    scheduler = build_scheduler(cfg, optimizer, total, bundle)
    scaler = torch.amp.GradScaler(info.device.type, enabled=cfg.training.precision == "fp16")
    log.info("task %s: %d train / %d val / %d test samples; world size %d; global batch %d "
             "(%d x micro-batch %d x accumulation %d); %d steps per epoch; %d steps in total",
             cfg.task, len(bundle.train), len(bundle.val), len(bundle.test), info.world_size,
             sampler.global_batch_size, info.world_size, cfg.batch.micro_batch_size,
             sampler.grad_accum_steps, sampler.steps_per_epoch(), total)
    engine = StepEngine(net, model, optimizer, scheduler, bundle.loss_fn, info.device,
                        precision_dtype(cfg.training.precision), cfg.training.grad_clip_norm,
                        scaler, parallelism)
    metrics = metrics or RankMetrics(cfg.metrics, info.rank, info.local_rank,
                                     cuda=info.device.type == "cuda")
    metrics.count_tokens(bundle.tokens_per_sample)
    metrics.world(info.world_size)
    preempt = PreemptionFlag()
    stateful = {"model": model, "optimizer": optimizer, "scheduler": scheduler,
                "scaler": scaler}
    session = _session(cfg, info, net, stateful, loader, total, metrics, preempt, built,
                       joining)
    trainer = Trainer(cfg=cfg, info=info, bundle=bundle, model=model, optimizer=optimizer,
                      scheduler=scheduler, loader=loader, engine=engine, session=session,
                      total_steps=total, preempt=preempt,
                      profile=RecoveryProfile(built, cfg.batch, cfg.distributed.fsdp.replicas),
                      parallelism=parallelism)
    session.save = trainer.save
    trainer.rewrap = lambda in_sync: _rewrap(cfg, info, trainer, parallelism, in_sync)
    return trainer


def keep_global_batch(cfg: Config, world_size: int, job_global_batch: int | None) -> Config:
    """``cfg`` with the global batch the job keeps as ``batch.global_batch_size``
    (:meth:`~elastic_runner.train.config.BatchConfig.kept`): ``job_global_batch``, else the
    newest checkpoint's (its manifest; one written before manifests recorded it: its world size
    at this config's accumulation), else ``world_size``'s. Unchanged when the config sets the
    global batch or lets it follow the world size."""
    b = cfg.batch
    if b.global_batch_size is not None or b.follows_world_size:
        return cfg
    if job_global_batch is None and cfg.checkpoint.resume:
        job_global_batch = _checkpointed_global_batch(cfg.checkpoint.dir, b)
    kept = b.kept(world_size, job_global_batch)
    here = world_size * b.micro_batch_size * b.grad_accum_steps
    if kept.global_batch_size != here:
        log.info("global batch %d samples kept from the job's start (batch.keep_global_batch; "
                 "world size %d x micro-batch %d x grad_accum_steps %d would be %d)",
                 kept.global_batch_size, world_size, b.micro_batch_size, b.grad_accum_steps,
                 here)
    return cfg.model_copy(update={"batch": kept})


def _checkpointed_global_batch(directory: str, b: BatchConfig) -> int | None:
    """The global batch of the checkpoint a resume tries first (None: none, or unreadable:
    the resume names the problem)."""
    try:
        newest = ckpt.newest_complete(directory)
    except OSError:
        return None
    if newest is None:
        return None
    if newest.global_batch_size is not None:
        return newest.global_batch_size
    return newest.world_size and newest.world_size * b.micro_batch_size * b.grad_accum_steps


def _parallelism(cfg: Config, info: DistInfo, bundle: TaskBundle) -> Parallelism:
    """``distributed.strategy`` for this process's group (the model as it is without one)."""
    d = cfg.distributed
    bf16 = cfg.training.precision == "bf16"
    return make_parallelism(d.strategy, d.ddp, d.fsdp, info.distributed, info.world_size,
                            info.device, torch.bfloat16 if bf16 else None, bundle.shard_units)


def checkpoint_layout(cfg: Config) -> str:
    """``checkpoint.format`` resolved: ``dcp`` or ``rank0``.

    Raises:
        ConfigError: ``rank0`` with FSDP (no rank holds the whole state).
    """
    c, fsdp = cfg.checkpoint, cfg.distributed.strategy == "fsdp"
    layout = ("dcp" if fsdp else "rank0") if c.format == "auto" else c.format
    if layout == "rank0" and fsdp:
        raise ConfigError("checkpoint.format: 'rank0' with distributed.strategy: 'fsdp': no rank "
                          "holds the whole sharded state; use 'dcp' or 'auto'")
    return layout


def _rewrap(cfg: Config, info: DistInfo, trainer: Trainer, parallelism: Parallelism,
            in_sync: bool) -> None:
    """After the process group was re-formed (in-place recovery): a new DDP over the same
    module on the new group (a sharded module was built on it), and the step vote and
    straggler exchange that go with it. ``in_sync``: every rank's model already holds the
    group's values, so the new DDP skips its construction broadcast from rank 0 (a second
    pass over the parameters: 0.4-1.5 s at GPT-2-small width on 2 CPU ranks)."""
    net = trainer.model if parallelism.sharded else parallelism.wrap(trainer.model,
                                                                      init_sync=not in_sync)
    session = trainer.session
    trainer.engine.rebind(net)
    renew_exchanges(session, _consensus(cfg, info, net, trainer.optimizer, trainer.preempt),
                    info, cfg.metrics.straggler_threshold)


def lagged_vote(cfg: Config, info: DistInfo, optimizer: torch.optim.Optimizer) -> bool:
    """Whether this rank takes the step vote on the device and reads it a step later
    (``training.lagged_vote``; auto: on CUDA with NCCL or at world size 1, a fused optimizer,
    and no sample trace, which reads every step's loss).

    Raises:
        ConfigError: ``training.lagged_vote: true`` with an optimizer that cannot skip an
            update on the device.
    """
    want = cfg.training.lagged_vote
    capable = skips_on_device(optimizer)
    if want is True and not capable:
        raise ConfigError("training.lagged_vote: true needs an optimizer that skips an update "
                          "on the device (torch's fused Adam, AdamW or SGD: optimizer.fused: "
                          f"true), got {type(optimizer).__name__} without fused=True")
    if want != "auto":
        return bool(want)
    return (capable and info.device.type == "cuda" and cfg.audit.trace_dir is None
            and (info.backend == "nccl" or info.world_size == 1))


def _consensus(cfg: Config, info: DistInfo, net: nn.Module, optimizer: torch.optim.Optimizer,
               preempt: PreemptionFlag) -> StepConsensus:
    lagged = lagged_vote(cfg, info, optimizer)
    return make_consensus(net, lambda: preempt.stop_asked,
                          lagged_on=info.device if lagged else None)


def _check_same_task(cfg: Config, built: str) -> None:
    """Every rank must have built the same data and tokenizer (``built``: this rank's
    :func:`task_fingerprint`); a tokenizer trained or a split drawn without a fixed seed would
    silently give ranks different token ids or samples.

    Raises:
        ConfigError: naming the ranks and what each built.
    """
    try:
        assert_same_across_ranks(built, f"task {cfg.task}'s build")
    except RuntimeError as e:
        raise ConfigError(f"{e}: build(cfg) must give the same splits, samples and tokenizer "
                          "on every rank and every restart: seed what it draws at random, and "
                          "make what it trains (a tokenizer) once per job with "
                          "elastic_runner.tasks.base.job_artifact") from e


def _loader(cfg: Config, info: DistInfo, bundle: TaskBundle) -> ElasticDataLoader:
    sampler = ElasticSampler(len(bundle.train), cfg.seed, cfg.batch.micro_batch_size,
                             cfg.batch.accumulation_for(info.world_size), info.rank,
                             info.world_size, global_batch_size=cfg.batch.global_batch_size)
    return ElasticDataLoader(bundle.train, sampler, collate_fn=bundle.collate_fn,
                             num_workers=cfg.data.num_workers, pin_memory=cfg.data.pin_memory)


def _session(cfg: Config, info: DistInfo, net: nn.Module, stateful: dict[str, Any],
             loader: ElasticDataLoader, total: int, metrics: RankMetrics,
             preempt: PreemptionFlag, task: str, joining: bool = False) -> TrainingSession:
    """The session (:func:`~elastic_runner.rank_session.assemble_session`); a joining
    replacement gets its vote and straggler exchange (collectives) from ``_rewrap``, together
    with the group it joins."""
    sampler, model = loader.elastic_sampler, stateful["model"]
    stop = StopPolicy(cfg.training.max_steps, cfg.training.max_epochs,
                      EarlyStopping(cfg.early_stopping))
    faults = fault_injection.FaultInjector(cfg.faults, info.rank, info.restart_count)

    def after_load(raw: dict[str, Any]) -> None:
        fault_injection.perturb_replica(cfg.faults, info.rank, model)
        resumed_from = session.checkpoints.resumed_from
        check_same_build(raw, cfg.to_dict(), task, resumed_from or cfg.checkpoint.dir)
        if fingerprint(raw["config"]) != cfg.fingerprint():
            log.warning("checkpoint %s was written with a different config; resuming anyway",
                        resumed_from or "")

    w = cfg.watchdog
    session, _ = assemble_session(SessionSpec(
        info=info, sampler=sampler, stateful=stateful,
        checkpoint=_checkpoint_spec(cfg, task, stop, after_load),
        reporting=ReportingSpec(
            metrics, Budgets(w.hang_timeout_seconds, w.long_op_timeout_seconds,
                             cfg.metrics.heartbeat_timeout_seconds),
            cfg.audit.trace_dir, total, w.dump_grace_seconds),
        consensus=_consensus(cfg, info, net, stateful["optimizer"], preempt),
        options=SessionOptions(cfg.seed, cfg.training.log_every_steps,
                               cfg.training.max_bad_steps),
        lr=lambda: stateful["scheduler"].get_last_lr()[0], stop=stop,
        goodput=Goodput(process_start_time(), metrics.goodput),
        callbacks=_callbacks(cfg, info, total),
        faults=FaultInjection(faults) if faults.active else None,
        straggler_threshold=0.0 if joining else cfg.metrics.straggler_threshold,
        # the trace records what the loader fetched
        fetched=loader.take_fetched))
    return session


def _checkpoint_spec(cfg: Config, task: str, stop: StopPolicy,
                     after_load: Callable[[dict[str, Any]], None]) -> CheckpointSpec:
    """The ``checkpoint`` section's cadence, retention and layout; the manifest records the
    config's hash and, once the stop policy stopped, that the run finished."""
    c = cfg.checkpoint
    return CheckpointSpec(
        c.dir, cfg.fingerprint(), lambda: stop.stopped, every_steps=c.every_steps,
        every_seconds=c.every_seconds, async_save=c.async_save, keep_last=c.keep_last,
        keep_best=c.keep_best, layout=checkpoint_layout(cfg),
        extra={"config": cfg.to_dict(), "task_fingerprint": task}, after_load=after_load,
        migrate=migrate_checkpoint)


def migrate_checkpoint(raw: dict[str, Any]) -> dict[str, Any]:
    """Checkpoints of earlier releases, in today's layout: :func:`legacy_stop_state`, and no
    goodput figures (the job's goodput then counts from the resume)."""
    raw = legacy_stop_state(raw)
    if "goodput" not in raw:
        now = time.time()
        raw = {**raw, "goodput": {"job_start": now, "seconds": {}, "saved_at": now}}
    return raw


def legacy_stop_state(raw: dict[str, Any]) -> dict[str, Any]:
    """Checkpoints written before the stop policy was its own state kept the stop reason as
    text in ``train_state`` and the early-stopping state beside it: rebuild ``stop`` from
    them."""
    if "stop" in raw or "early_stopping" not in raw:
        return raw
    message = raw.get("train_state", {}).get("stop_reason", "")
    finished = raw.get("train_state", {}).get("finished", False)
    reason = StopReason.from_message(message) if finished else None
    return {**raw, "stop": {"reason": reason.value if reason else None, "message": message,
                            "early_stopping": raw["early_stopping"]}}


def _callbacks(cfg: Config, info: DistInfo, total: int) -> list[Callback]:
    """The trainer's reporting besides the runner's, goodput's and the faults': TensorBoard
    and the progress bar when they are on."""
    out: list[Callback] = []
    if info.is_main and cfg.logging.tensorboard_dir:
        out.append(TensorBoardScalars(cfg.logging.tensorboard_dir))
    if ProgressBar.wanted(info.is_main, cfg.logging.progress_bar):
        out.append(ProgressBar(total))
    return out
