"""The agent's sections of a config file: ``restarts`` and ``preemption``."""

from __future__ import annotations

from pydantic import Field, StrictInt

from ..config_base import Section


class RestartsConfig(Section):
    """Which failures spend torchrun's ``--max-restarts`` under ``elastic-runner run`` (the
    rules: ``agent/restart_budget.py`` and ``docs/guides/faults.md``). Bad input (exit 2) and a
    fenced-out writer (exit 3) are never restarted; a crash spends one restart."""

    preemption: StrictInt = Field(100, ge=0)
    """Restarts after a preemption (exit 143) that spend none of `--max-restarts`."""
    peer_lost: StrictInt = Field(100, ge=0)
    """Restarts after a peer died or hung (exit 4: seen from this node, a membership change) that
    spend none of it."""
    crash_loop: StrictInt = Field(3, ge=0)
    """This many identical failures in a row without a newer checkpoint stop the job at once (exit
    5); 0: off."""


class PreemptionConfig(Section):
    """How long workers have, after SIGTERM reaches the agent, to checkpoint and exit before the
    agent SIGKILLs them (``run`` passes it as torchrun's ``--shutdown-timeout``; under plain
    torchrun use that flag or ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``). Keep a pod's
    ``terminationGracePeriodSeconds`` above it."""

    grace_seconds: StrictInt = Field(30, ge=1)
    """Seconds the workers have, after SIGTERM reaches the agent, to checkpoint and exit before it
    SIGKILLs them."""
