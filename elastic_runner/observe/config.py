"""The observability sections of a config file: ``logging``, ``watchdog`` and ``metrics``."""

from __future__ import annotations

from pydantic import Field, StrictBool, field_validator

from ..config_base import Float, Port, Section, invalid


class LoggingConfig(Section):
    progress_bar: StrictBool = True
    """Rank 0 only."""
    tensorboard_dir: str | None = None
    """Rank 0 writes scalars when set."""


class WatchdogConfig(Section):
    """Hang detection: a rank whose step (or long operation) exceeds its budget dumps the stack
    traces of all its threads to the log and exits, so torchrun restarts the group."""

    hang_timeout_seconds: Float | None = 300.0
    """One optimizer step; None: off."""
    long_op_timeout_seconds: Float = 1800.0
    """First step of an attempt, checkpoint I/O, eval."""
    dump_grace_seconds: Float = 2.0
    """Wait before exiting, so stuck peers dump their stacks too."""


class MetricsConfig(Section):
    """Prometheus metrics and health endpoints (see ``observe/metrics.py`` and ``observe/health.py``)."""

    enabled: StrictBool = True
    """Record per-rank series (off: no recording, no endpoint)."""
    port: Port = None
    """The node's endpoint, served by `run`; plain torchrun workers serve port + local_rank
    themselves; None: no endpoint."""
    address: str = "127.0.0.1"
    """Bind address; 0.0.0.0 to be scraped from other hosts (pods)."""
    job: str = ""
    """`job` label; empty: the rendezvous id."""
    node: str = ""
    """`node` label; empty: the hostname (the pod name on Kubernetes)."""
    heartbeat_timeout_seconds: Float | None = Field(None, gt=0)
    """Silence of a training rank before it is unhealthy; None: watchdog.hang_timeout_seconds, or
    300 when it is off."""
    straggler_threshold: Float = 1.5
    """Log a rank whose step time exceeds this x the median; 0: no exchange of step times."""
    linger_seconds: Float = Field(0.0, ge=0)
    """Keep serving after the job ended, for a scrape."""

    @field_validator("straggler_threshold")
    @classmethod
    def _ratio_or_off(cls, value: float) -> float:
        if value != 0 and value <= 1:
            raise invalid("must be > 1 (a ratio to the median) or 0 (off)")
        return value
