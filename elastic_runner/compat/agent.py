"""Torch's elastic agent and torchrun: what elastic-runner relies on in them (files under
``torch/distributed/`` of torch 2.13). The patches that carry the agent's policies live with
the agent (fix 8's in ``agent/restart_budget.py``, fix 9's in ``agent/inplace_agent.py``);
here are their checks and the names they read.

3. **Agent store in the workers** (``rendezvous.py``: ``_torchelastic_use_agent_store``,
   ``_create_c10d_store``; ``elastic/agent/server/local_elastic_agent.py``: the workers'
   ``TORCHELASTIC_USE_AGENT_STORE``; optional, worker). With the shared store (plain torchrun
   without the switch of fix 1) MASTER_ADDR/MASTER_PORT point at the agent's TCPStore, which
   outlives the attempts, and ``_create_c10d_store`` returns it with no per-attempt prefix, so
   :func:`elastic_runner.dist.init_distributed` agrees on a fresh namespace per attempt
   (:func:`shares_agent_store`, :func:`agent_store`). Without it a restarted group may read the
   dead workers' keys under plain torchrun (``elastic-runner run`` does not share the store).
4. **torchelastic metric names** (``elastic/metrics/api.py``: ``prof`` names a metric
   ``<qualname>.success|failure|duration.ms``; ``elastic/agent/server/api.py``:
   ``SimpleElasticAgent._rendezvous`` and ``_invoke_run``'s ``workers.<role>.remaining_restarts``
   and ``workers.<role>.<state>``; ``local_elastic_agent.py``: ``_start_workers``,
   ``_stop_workers``; optional, agent). :mod:`elastic_runner.observe.node_metrics` turns them
   into the node's agent series; without them those series stop changing.
7. **torchrun's module functions** (``run.py``: ``get_args_parser``, ``config_from_args``,
   ``determine_local_world_size``; tests only): ``elastic-runner run`` parses its translated
   command line with torchrun's own parser. ``config_from_args`` sets ``OMP_NUM_THREADS=1`` with
   a banner when the variable is unset; ``elastic-runner run`` sets it first.
8. **Restart budget by cause** (``local_elastic_agent.py``: ``LocalElasticAgent._monitor_workers``
   returning a ``RunResult`` whose ``failures`` hold each failed rank's
   ``ProcessFailure.exitcode`` and ``message``; ``api.py``: ``SimpleElasticAgent._invoke_run``
   restarting while ``self._remaining_restarts > 0`` and subtracting one; optional, agent).
   :func:`elastic_runner.agent.restart_budget.apply_agent_fixes` (the agent's policy, checked
   here by :func:`check_monitor_workers`) wraps ``_monitor_workers`` so that
   ``restart_budget.RestartBudget`` sets the remaining restarts after each failed attempt: 0
   after bad input (exit 2), a fenced-out writer (exit 3) or a crash loop; one more (refunding
   torch's subtraction) after a preemption (143) or a lost peer (4). Torch has no switch for it
   (``--max-restarts`` counts every failure alike). Without it every failure spends a restart,
   as under plain torchrun. Before torch's poll (``SubprocessContext._poll``, which closes the
   remaining workers with a fixed 30 s SIGTERM -> SIGKILL gap when one failed), the wrapper
   stops what is left of a failed (not preempted) group itself, with
   ``restart_budget.FAILED_STOP_SECONDS``; the ranks that had exited before that are the ones
   its one line names (``agent/first_death.py``: torch's poll would name a rank it stopped).
9. **In-place recovery** (``launcher/api.py``: ``launch_agent`` constructs the module global
   ``LocalElasticAgent``; ``elastic/multiprocessing/api.py``: ``SubprocessContext`` keeps one
   ``SubprocessHandler`` (``proc``, ``close``) per local rank in ``subprocess_handlers``, built
   by the module global ``get_subprocess_handler``, and its ``envs``/``args``/``entrypoint``;
   ``local_elastic_agent.py``: ``_start_workers``, ``_stop_workers``, ``_shutdown``,
   ``_monitor_workers``, ``self._pcontext`` and, when configured,
   ``_check_uninterruptible_state_timeout``; optional, agent). :func:`agent_class` makes
   ``launch_agent`` build :class:`~elastic_runner.agent.inplace_agent.InPlaceAgent`, which swaps
   a spare into a dead worker's slot; :func:`elastic_runner.agent.worker_start.forking` swaps
   that function for one that forks each worker from the agent's fork server. Without them
   ``run`` recovers by restarting every worker, each a new interpreter, as torchrun does.
10. **torchrun's ``--shutdown-timeout``** (``run.py``: ``get_args_parser``; optional, agent).
   ``elastic-runner run`` passes ``preemption.grace_seconds`` as this option, the SIGTERM ->
   SIGKILL gap of the agent's ``_shutdown`` (torch 2.13 made it configurable; earlier releases,
   torch 2.11 among them, have no such option and keep ``SubprocessContext.close``'s fixed 30
   s). :func:`shutdown_timeout_supported` tells; without it ``run`` leaves the option out
   (torch's parser would refuse it) and the start-up check warns that the grace is torch's 30 s.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import logging
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.run import get_args_parser

from ..protocol.torchrun_env import USE_AGENT_STORE, TorchrunEnv
from .fix import Fix, applies, mentions, mentions_name, problem

log = logging.getLogger(__name__)

_DR = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"
_API = "torch.distributed.elastic.agent.server.api:SimpleElasticAgent"
_LOCAL = "torch.distributed.elastic.agent.server.local_elastic_agent:LocalElasticAgent"

# --- 3. agent store in the workers ---

AGENT_STORE_ENV = USE_AGENT_STORE  # what fix 3 checks torch still reads and sets


def _check_agent_store_env() -> str | None:
    rendezvous = importlib.import_module("torch.distributed.rendezvous")
    reader = getattr(rendezvous, "_torchelastic_use_agent_store", None)
    if reader is None or not mentions(reader, AGENT_STORE_ENV):
        return f"torch.distributed.rendezvous no longer reads {AGENT_STORE_ENV}"
    if not mentions(LocalElasticAgent._start_workers, AGENT_STORE_ENV):
        return f"LocalElasticAgent no longer sets {AGENT_STORE_ENV} for its workers"
    return None


FIX_AGENT_STORE = Fix(
    "the per-attempt process-group namespace", ("worker",), False, _check_agent_store_env,
    "under plain torchrun a restarted group may read the dead workers' store keys",
    ("torch.distributed.rendezvous:_torchelastic_use_agent_store",))


def shares_agent_store(env: Mapping[str, str] | None = None) -> bool:
    """Whether torchrun's agent told this worker that MASTER_ADDR/MASTER_PORT is its own,
    long-lived store (read as torch's ``_torchelastic_use_agent_store`` reads it), and fix 3
    applies: False where it is off, and the worker's group is initialised as torch does.
    ``env``: the environment to read (default: this process's)."""
    return TorchrunEnv.read(env).agent_store and applies(FIX_AGENT_STORE)


def agent_store(timeout: timedelta) -> dist.Store:
    """A client of the agent's store at MASTER_ADDR:MASTER_PORT (see :func:`shares_agent_store`)."""
    where = TorchrunEnv.read()
    return dist.TCPStore(host_name=where.master_addr, port=where.master_port, is_master=False,
                         timeout=timeout)


# --- 4. torchelastic metric names (group "torchelastic") ---

METRICS_GROUP = "torchelastic"
RENDEZVOUS_DURATION = "._rendezvous.duration.ms"  # suffixes: the prefix is the agent's class
RENDEZVOUS_SUCCESS = "._rendezvous.success"
WORKERS_STARTED = "._start_workers.success"
WORKERS_STOPPED = "._stop_workers.success"
WORKER_GROUP = "workers."  # workers.<role>.<state in lower case> = 1, every monitor interval
REMAINING_RESTARTS = ".remaining_restarts"  # workers.<role>.remaining_restarts


def _check_metric_names() -> str | None:
    for fn, method in ((SimpleElasticAgent._rendezvous, "_rendezvous"),
                       (LocalElasticAgent._start_workers, "_start_workers"),
                       (LocalElasticAgent._stop_workers, "_stop_workers")):
        inner = getattr(fn, "__wrapped__", None)
        if (inner is None or not inner.__qualname__.endswith("." + method)
                or not mentions_name(fn, "put_metric")):
            return f"the agent's {method} is no longer timed by torchelastic's metrics.prof"
    run = SimpleElasticAgent._invoke_run
    if not (mentions(run, WORKER_GROUP) and mentions(run, REMAINING_RESTARTS)):
        return "SimpleElasticAgent._invoke_run no longer puts workers.<role>.* metrics"
    return None


FIX_AGENT_METRICS = Fix(
    "the agent metrics", ("agent",), False, _check_metric_names,
    "the elastic_runner_agent_state, restarts and rendezvous series stop changing",
    (f"{_API}._rendezvous", f"{_API}._invoke_run", f"{_LOCAL}._start_workers",
     f"{_LOCAL}._stop_workers"))


# --- 8. restart budget by cause (the policy and its patch: agent/restart_budget.py) ---

def check_monitor_workers() -> str | None:
    """Fix 8's internals: None when they look as expected, else what changed."""
    fn = getattr(LocalElasticAgent, "_monitor_workers", None)
    if fn is None or list(inspect.signature(fn).parameters) != ["self", "worker_group"]:
        return "LocalElasticAgent._monitor_workers(self, worker_group) is gone"
    if not mentions_name(SimpleElasticAgent._invoke_run, "_remaining_restarts"):
        return "SimpleElasticAgent._invoke_run no longer counts self._remaining_restarts"
    return None


FIX_RESTART_BUDGET = Fix(
    "the restart budget by cause", ("agent",), False, check_monitor_workers,
    "every failure spends one of --max-restarts: bad input (exit 2), preemptions (143) and "
    "crash loops alike",
    (f"{_LOCAL}._monitor_workers", f"{_LOCAL}._pcontext", f"{_API}._invoke_run",
     f"{_API}._remaining_restarts"))


# --- 9. in-place recovery ---

def _check_inplace_agent() -> str | None:
    from torch.distributed.elastic.multiprocessing.api import SubprocessContext
    from torch.distributed.launcher import api as launcher_api

    if "LocalElasticAgent" not in launcher_api.launch_agent.__code__.co_names:
        return "torch.distributed.launcher.api.launch_agent no longer builds LocalElasticAgent"
    for name in ("_start_workers", "_stop_workers", "_shutdown", "_monitor_workers"):
        if not callable(getattr(LocalElasticAgent, name, None)):
            return f"LocalElasticAgent.{name} is gone"
    if not mentions_name(SubprocessContext._start, "subprocess_handlers"):
        return "SubprocessContext no longer keeps subprocess_handlers"
    if not mentions_name(SubprocessContext._start, "get_subprocess_handler"):
        return "SubprocessContext no longer builds its handlers with get_subprocess_handler"
    return None


FIX_INPLACE = Fix(
    "in-place recovery", ("agent",), False, _check_inplace_agent,
    "a failed worker makes the agent restart every worker",
    (f"{_LOCAL}._start_workers", f"{_LOCAL}._stop_workers", f"{_LOCAL}._shutdown",
     f"{_LOCAL}._pcontext", f"{_LOCAL}._monitor_workers",
     f"{_LOCAL}._check_uninterruptible_state_timeout",
     f"{_LOCAL}._uninterruptible_state_timeout", f"{_API}._exit_barrier",
     f"{_API}._restart_workers", f"{_API}._rendezvous", f"{_API}._worker_group",
     f"{_API}._remaining_restarts",
     "torch.distributed.elastic.multiprocessing.api:SubprocessContext._start",
     f"{_DR}:DynamicRendezvousHandler._stop_heartbeats",
     "torch.distributed.elastic.rendezvous.utils:_matches_machine_hostname"))


@contextlib.contextmanager
def agent_class(factory: Callable[..., Any]) -> Iterator[bool]:
    """Within the block, torch's ``launch_agent`` builds its agent with ``factory`` (same
    arguments as ``LocalElasticAgent``). Yields False, changing nothing, when fix 9's internals
    are gone."""
    from torch.distributed.launcher import api as launcher_api

    why = problem(FIX_INPLACE)
    if why is not None:
        log.warning("in-place recovery is off (%s): a failed worker restarts all of them", why)
        yield False
        return
    saved = launcher_api.LocalElasticAgent
    launcher_api.LocalElasticAgent = factory  # type: ignore[misc]
    try:
        yield True
    finally:
        launcher_api.LocalElasticAgent = saved  # type: ignore[misc]


# --- 10. the preemption grace as torchrun's --shutdown-timeout ---

TORCH_FIXED_SHUTDOWN_S = 30  # SubprocessContext.close's timeout before torch 2.13


@functools.cache
def shutdown_timeout_supported() -> bool:
    """Whether torchrun's parser takes ``--shutdown-timeout`` (torch >= 2.13)."""
    return any("--shutdown-timeout" in a.option_strings for a in get_args_parser()._actions)


def _check_shutdown_timeout() -> str | None:
    if shutdown_timeout_supported():
        return None
    return "torchrun has no --shutdown-timeout"


FIX_SHUTDOWN_TIMEOUT = Fix(
    "the preemption grace (torchrun --shutdown-timeout)", ("agent",), False,
    _check_shutdown_timeout,
    f"the agent SIGKILLs its workers {TORCH_FIXED_SHUTDOWN_S} s after SIGTERM, whatever "
    "preemption.grace_seconds says")

FIXES: tuple[Fix, ...] = (FIX_RESTART_BUDGET, FIX_INPLACE, FIX_AGENT_METRICS,
                          FIX_SHUTDOWN_TIMEOUT, FIX_AGENT_STORE)
