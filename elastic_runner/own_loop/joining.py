"""``er.init_distributed``: where a script's process joins the job. Every worker of the job's
start joins the recovery store's generation 0 (under ``elastic-runner run``), a spare waits here
for a failed worker's place and then joins the running group as that rank
(:mod:`elastic_runner.recovery.script` says what happens next); without a launcher the process
gets a group of one. The joining itself is the runtime's (:mod:`elastic_runner.recovery.runtime`),
shared with the built-in trainer's worker."""

from __future__ import annotations

import logging
import multiprocessing

import torch
import torch.distributed as dist

from ..config_base import ConfigError
from ..dist import DistInfo
from ..dist import init_distributed as init_group
from ..protocol.torchrun_env import TorchrunEnv
from ..recovery.inplace import InPlaceRecovery, JobFinished
from ..recovery.runtime import join_group, spare_name, take_place
from ..recovery.script import script_recovery_config, start

log = logging.getLogger("elastic_runner.recovery.script")


def init_distributed(backend: str = "auto", timeout_s: float = 600.0) -> DistInfo:
    """Join the job's default process group (``torchrun``'s environment; world size 1 without
    one), and under ``elastic-runner run`` its in-place recovery: a spare waits here for the
    place of a failed worker (module docstring).

    Args:
        backend: ``gloo``, ``nccl`` or ``auto`` (NCCL on CUDA, else gloo).
        timeout_s: the collectives' timeout, seconds.

    Returns:
        This process's rank, local_rank, world_size, node_rank and device
        (:class:`~elastic_runner.dist.DistInfo`). Without a launcher the default group is one
        process (world size 1), so ``dist.get_rank()`` and DDP work as under torchrun.

    Raises:
        SystemExit(0): a spare whose job finished before it was needed.
        ConfigError: :data:`RECOVERY_ENV` is not valid; a process started by
            ``torch.multiprocessing.spawn`` without torchrun's environment.
        TimeoutError: the group did not form within ``recovery.join_timeout_seconds``.
    """
    if not TorchrunEnv.read().launched:
        return _alone(backend, timeout_s)
    cfg = script_recovery_config()
    recovery = InPlaceRecovery.from_env(cfg)
    if not isinstance(recovery, InPlaceRecovery):
        return init_group(backend, timeout_s)
    spare = spare_name(recovery)
    if spare is not None:
        _warm_up()
        take_place(recovery, spare)
    process = start(cfg, recovery, joining=spare is not None)
    try:
        return join_group(recovery, backend, timeout_s)
    except JobFinished as e:  # a replacement ready after the last step
        log.warning("%s", e)
        process.close()
        raise SystemExit(0) from None


def _alone(backend: str, timeout_s: float) -> DistInfo:
    """No launcher (``python script.py``, as one debugs): a process group of one, so that the
    script's ``dist.get_rank()`` and its DDP work unchanged at world size 1.

    Raises:
        ConfigError: this process was started by ``multiprocessing`` (``torch.multiprocessing.spawn``,
            the DDP tutorial's way), whose workers would each train alone.
    """
    if multiprocessing.parent_process() is not None:
        raise ConfigError("er.init_distributed(): this process was started by multiprocessing "
                          "(torch.multiprocessing.spawn?) without torchrun's environment: start "
                          "the workers with `elastic-runner run script.py` or `torchrun`")
    info = init_group(backend, timeout_s)
    if not dist.is_initialized():
        dist.init_process_group(info.backend, store=dist.HashStore(), rank=0, world_size=1)
    return info


def _warm_up() -> None:
    """What the script's optimizer imports lazily (torch._dynamo, on first use: 0.5 s),
    imported while the spare stands by rather than while the survivors wait for it (the
    runner's loop is imported already: this module is part of it)."""
    torch.optim.AdamW(torch.nn.Linear(1, 1).parameters())
