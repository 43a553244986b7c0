"""The observability sections of a config file: ``logging``, ``watchdog`` and ``metrics``."""

from __future__ import annotations

import importlib.util

from pydantic import Field, StrictBool, field_validator

from ..config_base import Float, Port, Section, invalid


class LoggingConfig(Section):
    """What rank 0 reports besides its log."""

    progress_bar: StrictBool = True
    """A tqdm progress bar on rank 0's terminal (only when it is one)."""
    tensorboard_dir: str | None = None
    """Rank 0 writes TensorBoard scalars (loss, learning rate, evaluation metrics) here; null: off.
    Needs the ``tensorboard`` extra."""

    @field_validator("tensorboard_dir")
    @classmethod
    def _tensorboard_installed(cls, value: str | None) -> str | None:
        # checked when the config is read, on the launching machine: not at rank 0's first step
        if value is not None and importlib.util.find_spec("tensorboard") is None:
            raise invalid("needs TensorBoard, which is not installed: "
                          "pip install 'elastic-runner[tensorboard]', or set it to null")
        return value


class WatchdogConfig(Section):
    """Hang detection: a rank whose step (or long operation) exceeds its budget dumps the stack
    traces of all its threads to the log and exits, so torchrun restarts the group."""

    hang_timeout_seconds: Float | None = 300.0
    """Budget of one optimizer step, in seconds; null: off."""
    long_op_timeout_seconds: Float = 1800.0
    """Budget of the first step of an attempt, of checkpoint I/O and of an evaluation, in seconds."""
    dump_grace_seconds: Float = 2.0
    """Wait this long (seconds) before exiting, so stuck peers dump their stacks too."""


class MetricsConfig(Section):
    """Prometheus metrics and health endpoints (see ``observe/metrics.py`` and ``observe/health.py``)."""

    enabled: StrictBool = True
    """Record per-rank series (off: no recording, no endpoint)."""
    port: Port = None
    """The node's HTTP endpoint (`/metrics`, `/healthz`, `/readyz`, `/health`), served by `run`'s
    agent; plain torchrun workers serve `port + local_rank` themselves; null: no endpoint."""
    address: str = "127.0.0.1"
    """The endpoint's bind address; `0.0.0.0` to be scraped from other hosts (pods)."""
    job: str = ""
    """The `job` label; empty: the rendezvous id."""
    node: str = ""
    """The `node` label; empty: the host name (the pod name on Kubernetes)."""
    heartbeat_timeout_seconds: Float | None = Field(None, gt=0)
    """Silence of a training rank, in seconds, before `/healthz` calls it unhealthy; null:
    `watchdog.hang_timeout_seconds`, or 300 when that is off."""
    straggler_threshold: Float = 1.5
    """Log a rank whose local step time exceeds this multiple of the median over the ranks; 0: no
    exchange of step times."""
    linger_seconds: Float = Field(0.0, ge=0)
    """Keep serving this long (seconds) after the job ended, so a last scrape sees how it ended (not
    after SIGTERM)."""

    @field_validator("straggler_threshold")
    @classmethod
    def _ratio_or_off(cls, value: float) -> float:
        if value != 0 and value <= 1:
            raise invalid("must be > 1 (a ratio to the median) or 0 (off)")
        return value
