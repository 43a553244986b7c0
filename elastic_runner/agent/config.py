"""The agent's sections of a config file: ``restarts`` and ``preemption``."""

from __future__ import annotations

from pydantic import Field, StrictInt

from ..config_base import Section


class RestartsConfig(Section):
    """Which failures spend torchrun's ``--max-restarts`` under ``elastic-runner run`` (the
    rules: ``agent/restart_budget.py`` and the README's "Restart budget"). Bad input (exit 2) and a
    fenced-out writer (exit 3) are never restarted; a crash spends one restart."""

    preemption: StrictInt = Field(100, ge=0)
    """Restarts after exit 143 that spend none of it."""
    peer_lost: StrictInt = Field(100, ge=0)
    """Restarts after a peer died or hung (exit 4: a membership change seen from this node) that
    spend none of it."""
    crash_loop: StrictInt = Field(3, ge=0)
    """This many identical failures in a row without a."""


class PreemptionConfig(Section):
    """How long workers have, after SIGTERM reaches the agent, to checkpoint and exit before the
    agent SIGKILLs them (``run`` passes it as torchrun's ``--shutdown-timeout``; under plain
    torchrun use that flag or ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``). Keep a pod's
    ``terminationGracePeriodSeconds`` above it."""

    grace_seconds: StrictInt = Field(30, ge=1)
