"""In-place recovery for a user's own training script: the process's side.

Under ``elastic-runner run SCRIPT.py`` every worker process runs the user's script, the spares
too. ``er.init_distributed`` (:func:`elastic_runner.own_loop.joining.init_distributed`, the
first call a script makes to the runner) is where the process joins the job, through
:mod:`elastic_runner.recovery.runtime` as the built-in trainer's worker does:

* a worker of the job's start joins generation 0 of the recovery store
  (:mod:`elastic_runner.recovery.inplace`) instead of a group of its own;
* a **spare** (the agent set :data:`~elastic_runner.protocol.env.SPARE_ENV`; it has run the
  script's imports, so torch is loaded) tells its agent it is ready and blocks here until the agent
  hands it a failed worker's place; then it joins the running group as that rank, and the
  script goes on as it would: builds its model, wraps it in DDP (whose construction collectives
  the survivors run with it: :func:`elastic_runner.compat.ddp.ddp_construction_collectives`), and
  :meth:`~elastic_runner.own_loop.FaultTolerantLoop.resume` receives the state of a survivor
  instead of reading a checkpoint.

Everything else (a failed collective in the loop, the group re-formed, the state agreed) is the
built-in trainer's protocol, driven by :class:`~elastic_runner.own_loop.FaultTolerantLoop`.

Without the agent's variables (plain ``torchrun``, ``python script.py``) the process gets
:class:`NoScriptRecovery`: torch's restart path, as before.
"""

from __future__ import annotations

import atexit
import logging
from typing import Any, Protocol

import yaml
from pydantic import ValidationError

from ..config_base import ConfigError
from ..logs import first_line
from ..protocol import env
from ..protocol.env import RECOVERY_ENV
from .background import Stoppable
from .config import RecoveryConfig
from .heartbeat import Heartbeat
from .inplace import InPlaceRecovery, NoRecovery

log = logging.getLogger(__name__)


class ScriptProcess(Protocol):
    """This process's recovery as a script's loop holds it: :class:`ScriptRecovery` or its
    null object :class:`NoScriptRecovery`."""

    recovery: Any  # InPlaceRecovery | NoRecovery (recovery.runtime.RecoveryService)
    joining: bool

    def close(self) -> None: ...


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
                 heartbeat: Stoppable, watch: Stoppable) -> None:
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


_current: list[ScriptProcess] = [NoScriptRecovery()]


def current() -> ScriptProcess:
    """This process's recovery, as ``er.init_distributed`` set it up
    (:func:`elastic_runner.own_loop.joining.init_distributed`)."""
    return _current[0]


def start(cfg: RecoveryConfig, recovery: InPlaceRecovery, joining: bool) -> ScriptRecovery:
    """This process's recovery from now on (its heartbeat and generation watch started, both
    stopped at the interpreter's exit); ``joining``: it replaces a failed worker."""
    process = ScriptRecovery(recovery, joining, Heartbeat.from_env(cfg.heartbeat_timeout_seconds),
                             recovery.watch())
    atexit.register(process.close)
    _current[0] = process
    return process


