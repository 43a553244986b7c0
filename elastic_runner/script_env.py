"""The environment variables through which ``elastic-runner run script.py`` (and a user, for
drills) configures the runner's parts of a script's loop: read by
:func:`elastic_runner.fault_tolerant` and :func:`elastic_runner.init_distributed` in every
worker, spare and restart, since they inherit the agent's environment. They are defined, with
who sets and who reads each, in :mod:`elastic_runner.protocol.env`; this module keeps their
names where they were."""

from .protocol.env import (
    CHECKPOINT_DIR_FILE_ENV,
    FAULTS_ENV,
    FAULTS_TRIGGER_ENV,
    NO_RESUME_ENV,
    RECOVERY_ENV,
    TRACE_DIR_ENV,
)

__all__ = ["CHECKPOINT_DIR_FILE_ENV", "FAULTS_ENV", "FAULTS_TRIGGER_ENV", "NO_RESUME_ENV",
           "RECOVERY_ENV", "TRACE_DIR_ENV"]
