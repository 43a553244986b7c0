"""Every ``ELASTIC_RUNNER_*`` environment variable, who sets it and who reads it, and the
readers of them (nobody outside :mod:`elastic_runner.protocol` names one as a string or reads
one with ``os.environ.get``).

The agent (``elastic-runner run``) sets most of them for the workers it starts; the workers,
spares and restarts inherit them. A reader returns None (or the documented default) where the
variable is unset; each reads the environment when called (the agent may change it between
two calls: a spare's assignment, a drill's override).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

Env = Mapping[str, str]

PREFIX = "ELASTIC_RUNNER_"
"""What every variable of this module's starts with (the fork server passes them per worker,
``agent/fork_server.py``)."""

# ------------------------------------------------------------ in-place recovery (agent -> workers)

INPLACE_ENV = "ELASTIC_RUNNER_INPLACE"
"""Set by the agent (``agent/node_attempt.py``) for its workers and spares: the recovery store,
a ``recovery.store.StoreLocation`` as JSON; read by ``recovery/inplace.py``. Unset: no
recovery in place (plain torchrun, ``recovery.mode: restart``)."""
SPARE_ENV = "ELASTIC_RUNNER_SPARE"
"""Set by the agent on a spare only (``agent/spares.py``, ``agent/joins.py``):
``<node rank>.<number>`` (a joining node's: ``<node>.``, to which the worker appends its local
rank); read by ``worker.py`` and ``recovery/script.py``."""
SPARE_NICE_ENV = "ELASTIC_RUNNER_SPARE_NICE"
"""Set by the agent on a spare started at a lower CPU priority: the nice value its threads go
back to once it takes a worker's place (the agent's); read and removed by
``recovery/group_formation.py``."""
GENERATION_ENV = "ELASTIC_RUNNER_GENERATION"
"""Set by the agent in a replacement's assignment (``agent/replacement.py``,
``agent/joins.py``): the generation whose group it joins; read by ``recovery/inplace.py`` and
``recovery/group_formation.py``."""
HEARTBEAT_ENV = "ELASTIC_RUNNER_HEARTBEAT_DIR"
"""Set by the agent: the directory of the node's heartbeat files (``recovery/heartbeat.py``),
where it also names a moved recovery store (``recovery/store.py``'s ``STORE_FILE``); read by
``recovery/heartbeat.py`` and ``recovery/store_client.py``."""
MIN_NODES_ENV = "ELASTIC_RUNNER_MIN_NODES"
"""Set by the agent: ``--nnodes`` MIN (a departure may not leave fewer nodes); read by
``recovery/inplace.py``."""

# ------------------------------------------------------------ a script's loop (run script.py)

TRACE_DIR_ENV = "ELASTIC_RUNNER_TRACE_DIR"
"""Set by ``run script.py --trace-samples DIR`` (``cli.py``): the sample trace's directory
(over ``fault_tolerant``'s ``trace_dir``); read by ``own_loop/``."""
NO_RESUME_ENV = "ELASTIC_RUNNER_NO_RESUME"
"""Set by ``run script.py --no-resume`` (``cli.py``): ``1``: the job's first attempt starts
from step 0 whatever ``checkpoint_dir`` holds (its restarts resume what it wrote); read by
``own_loop/loop.py``."""
CHECKPOINT_DIR_FILE_ENV = "ELASTIC_RUNNER_CHECKPOINT_DIR_FILE"
"""Set by ``run script.py`` (``cli.py``): a file of the agent's into which each node's local
rank 0 writes the ``checkpoint_dir`` its ``fault_tolerant`` loop was given (one line, absolute
unless a URL), so that the agent's crash-loop rule sees checkpoints committed between two
failures; written by ``own_loop/``."""
RECOVERY_ENV = "ELASTIC_RUNNER_RECOVERY"
"""Set by a user: a script's ``recovery`` settings (a YAML mapping of the ``recovery``
section's keys, e.g. ``{heartbeat_timeout_seconds: 5}``); read by ``run`` and by its workers
alike (``recovery/script.py``)."""

# ------------------------------------------------------------ drills and the rest

FAULTS_ENV = "ELASTIC_RUNNER_FAULTS"
"""Set by a user for a drill: a YAML list of fault specs (the ``faults.inject`` entries),
appended to the config's; read by ``config.py`` and ``own_loop/``."""
FAULTS_TRIGGER_ENV = "ELASTIC_RUNNER_FAULTS_TRIGGER"
"""Set by a user for a drill: a trigger file (``faults.trigger_file``); read by
``own_loop/``."""
METRICS_AGENT_ENV = "ELASTIC_RUNNER_METRICS_AGENT"
"""Set by the agent (``observe/node_metrics.py``) when it serves the node's metrics endpoint:
``1``; read by ``worker.py`` (a rank then serves none of its own)."""
STORE_OPS_DIR_ENV = "ELASTIC_RUNNER_STORE_OPS_DIR"
"""Set by a benchmark (``bench/store_traffic.py``): a directory where every process that
counts recovery-store operations writes its counts (``protocol/counting.py``); read there."""
IGNORE_CHECK_ENV = "ELASTIC_RUNNER_IGNORE_TORCH_CHECK"
"""Set by a user: ``1`` turns a required torch fix that cannot apply into a warning; read by
``compat/registry.py``."""


def _text(name: str, env: Env | None) -> str | None:
    return (os.environ if env is None else env).get(name)


def inplace_store(env: Env | None = None) -> str | None:
    """:data:`INPLACE_ENV` (a ``StoreLocation`` as JSON), None: unset or empty."""
    return _text(INPLACE_ENV, env) or None


def spare_name(env: Env | None = None) -> str | None:
    """:data:`SPARE_ENV` (None: not a spare)."""
    return _text(SPARE_ENV, env)


def generation(env: Env | None = None) -> int:
    """:data:`GENERATION_ENV` (0: unset). Raises ``ValueError`` when not an integer."""
    return int(_text(GENERATION_ENV, env) or 0)


def generation_of(assignment: Mapping[str, str]) -> int:
    """The generation a spare's ``assignment`` (its environment) joins.

    Raises:
        KeyError: the assignment has none.
    """
    return int(assignment[GENERATION_ENV])


def heartbeat_dir(env: Env | None = None) -> str | None:
    """:data:`HEARTBEAT_ENV` (None or empty: no heartbeat directory)."""
    return _text(HEARTBEAT_ENV, env)


def min_nodes(env: Env | None = None) -> int:
    """:data:`MIN_NODES_ENV` (1: unset)."""
    return int(_text(MIN_NODES_ENV, env) or 1)


def pop_spare_nice() -> str | None:
    """Remove :data:`SPARE_NICE_ENV` from this process's environment; its value, or None."""
    return os.environ.pop(SPARE_NICE_ENV, None)


def trace_dir(env: Env | None = None) -> str | None:
    """:data:`TRACE_DIR_ENV` (None or empty: unset)."""
    return _text(TRACE_DIR_ENV, env)


def no_resume(env: Env | None = None) -> bool:
    """Whether :data:`NO_RESUME_ENV` is ``1``."""
    return _text(NO_RESUME_ENV, env) == "1"


def checkpoint_dir_file(env: Env | None = None) -> str | None:
    """:data:`CHECKPOINT_DIR_FILE_ENV` (None or empty: unset)."""
    return _text(CHECKPOINT_DIR_FILE_ENV, env)


def recovery_settings(env: Env | None = None) -> str:
    """:data:`RECOVERY_ENV`, a YAML text (empty: unset)."""
    return _text(RECOVERY_ENV, env) or ""


def faults(env: Env | None = None) -> str | None:
    """:data:`FAULTS_ENV`, a YAML text (None: unset)."""
    return _text(FAULTS_ENV, env)


def faults_trigger(env: Env | None = None) -> str | None:
    """:data:`FAULTS_TRIGGER_ENV` (None: unset or empty)."""
    return _text(FAULTS_TRIGGER_ENV, env) or None


def metrics_agent(env: Env | None = None) -> bool:
    """Whether :data:`METRICS_AGENT_ENV` is set (non-empty): the agent serves the node's
    metrics."""
    return bool(_text(METRICS_AGENT_ENV, env))


def store_ops_dir(env: Env | None = None) -> str | None:
    """:data:`STORE_OPS_DIR_ENV` (None: unset or empty)."""
    return _text(STORE_OPS_DIR_ENV, env) or None


def ignore_torch_check(env: Env | None = None) -> bool:
    """:data:`IGNORE_CHECK_ENV` is ``1``."""
    return _text(IGNORE_CHECK_ENV, env) == "1"
