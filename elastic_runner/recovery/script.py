"""In-place recovery for a user's own training script: the process's side.

Under ``elastic-runner run SCRIPT.py`` every worker process runs the user's script, the spares
too. :func:`init_distributed` (``elastic_runner.init_distributed``, the first call a script makes
to the runner) is where the process joins the job:

* a worker of the job's start joins generation 0 of the recovery store
  (:mod:`elastic_runner.recovery.inplace`) instead of a group of its own;
* a **spare** (the agent set :data:`~elastic_runner.protocol.env.SPARE_ENV`; it has run the
  script's imports, so torch is loaded) tells its agent it is ready and blocks here until the agent
  hands it a failed worker's place; then it joins the running group as that rank, and the
  script goes on as it would: builds its model, wraps it in DDP (whose construction collectives
  the survivors run with it: :func:`elastic_runner.compat.ddp_construction_collectives`), and
  :meth:`~elastic_runner.own_loop.FaultTolerantLoop.resume` receives the state of a survivor
  instead of reading a checkpoint.

Everything else (a failed collective in the loop, the group re-formed, the state agreed) is the
built-in trainer's protocol, driven by :class:`~elastic_runner.own_loop.FaultTolerantLoop`.

Without the agent's variables (plain ``torchrun``, ``python script.py``) the process gets
:class:`NoScriptRecovery`: torch's restart path, as before.
"""

from __future__ import annotations

import atexit
import importlib
import logging
import multiprocessing

import torch.distributed as dist
import yaml
from pydantic import ValidationError

from ..config_base import ConfigError
from ..dist import DistInfo
from ..dist import init_distributed as init_group
from ..logs import first_line, setup_logging
from ..protocol import env
from ..protocol.env import RECOVERY_ENV
from ..protocol.torchrun_env import TorchrunEnv, take_place
from .config import RecoveryConfig
from .heartbeat import Heartbeat, NoHeartbeat
from .inplace import GenerationWatch, InPlaceRecovery, JobFinished, NoRecovery, NoWatch

log = logging.getLogger(__name__)


class NoScriptRecovery:
    """No agent recovers this process in place (plain torchrun, no launcher)."""

    recovery = NoRecovery()
    joining = False

    def close(self) -> None:
        pass


class ScriptRecovery:
    """This process's in-place recovery (its store client, heartbeat and generation watch)
    and whether it joins a running group as a replacement (``joining``)."""

    def __init__(self, recovery: InPlaceRecovery, joining: bool,
                 heartbeat: Heartbeat | NoHeartbeat, watch: GenerationWatch | NoWatch) -> None:
        self.recovery, self.joining = recovery, joining
        self._heartbeat, self._watch = heartbeat, watch
        self._closed = False

    def close(self) -> None:
        """Stop the heartbeat and the watch (idempotent; also at the interpreter's exit)."""
        if self._closed:
            return
        self._closed = True
        self._heartbeat.close()
        self._watch.close()


def script_recovery_config(mode: str | None = None) -> RecoveryConfig:
    """The ``recovery`` section for a script: :data:`RECOVERY_ENV` over the defaults, and
    ``mode`` (``run --recovery``) when given.

    Raises:
        ConfigError: the variable is not a mapping of valid ``recovery`` keys (named).
    """
    text = env.recovery_settings()
    try:
        values = yaml.safe_load(text) if text.strip() else {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{RECOVERY_ENV}: not YAML ({first_line(e)})") from None
    if not isinstance(values, dict):
        raise ConfigError(f"{RECOVERY_ENV}: expected a mapping of recovery settings, e.g. "
                          "'{heartbeat_timeout_seconds: 5}'")
    if mode is not None:
        values = {**values, "mode": mode}
    try:
        cfg = RecoveryConfig.model_validate(values)
    except ValidationError as e:
        err = e.errors()[0]
        key = ".".join(map(str, err["loc"])) or "(section)"
        raise ConfigError(f"{RECOVERY_ENV}: recovery.{key}: {err['msg']}") from None
    if cfg.continue_shrunk:  # a script's loop cannot go on at another world size in place
        raise ConfigError(f"{RECOVERY_ENV}: recovery.continue_shrunk: true applies to the "
                          "built-in trainer; a script's loop waits for the replacement")
    return cfg


_current: list[ScriptRecovery | NoScriptRecovery] = [NoScriptRecovery()]


def current() -> ScriptRecovery | NoScriptRecovery:
    """This process's recovery, as :func:`init_distributed` set it up."""
    return _current[0]


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
    spare = env.spare_name()
    if spare is not None:
        if spare.endswith("."):  # a joining node's worker: named by its local rank
            spare += str(TorchrunEnv.read().local_rank)
        _warm_up()
        place = take_place(recovery.wait_assignment(spare))
        setup_logging(place.rank)
        log.warning("spare %s replaces rank %s (local_rank %s) in generation %d", spare,
                    place.rank, place.local_rank, recovery.generation)
    process = ScriptRecovery(recovery, spare is not None,
                             Heartbeat.from_env(cfg.heartbeat_timeout_seconds), recovery.watch())
    atexit.register(process.close)
    _current[0] = process
    try:
        store = recovery.group_store()
    except JobFinished as e:  # a replacement ready after the last step
        log.warning("%s", e)
        process.close()
        raise SystemExit(0) from None
    with recovery.sockets.forming():
        info = init_group(backend, timeout_s, store)
    recovery.backend = info.backend
    return info


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
    """What the script imports lazily after this call (the runner's loop; torch's optimizers
    import torch._dynamo on first use: 0.5 s), imported while the spare stands by rather than
    while the survivors wait for it."""
    import torch

    importlib.import_module("elastic_runner.own_loop")
    torch.optim.AdamW(torch.nn.Linear(1, 1).parameters())
