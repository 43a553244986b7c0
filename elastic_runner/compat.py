"""Everything elastic-runner relies on in torch's private behaviour, listed and checked in one
module; most fixes live here too, and the patches that carry the agent's policies live with the
agent (fix 8's in ``agent/restart_budget.py``, fix 9's in ``agent/inplace_agent.py``).

Supported torch: :data:`SUPPORTED_TORCH` (mirrored by the torch requirement in pyproject.toml).
CI runs the whole suite on torch 2.13.0 (the CPU wheel pinned in constraints/cpu.txt) and the
fast tier plus three multi-process runs on :data:`NEWEST_TORCH` (``.ci/newest_torch``); 2.14.1
passed the same by hand, and 2.11 ran on GPUs (docs/gpu.md). The lower bound is the one the
project has always declared (the shared agent store that fixes 1 and 3 deal with appeared in
torch 2.4/2.5); releases between it and 2.11 have not been run here.

**The registry.** Each fix in :data:`FIXES` lists the private torch names it (and the code it
serves) relies on, in ``internals``; :func:`check_torch` verifies every one at start-up on
whatever torch is installed, before the fix's own check, and turns the fix off with its
warning when one is gone. Private names are imported inside the function that needs them, never
at module top, so a renamed one disables its fix instead of breaking ``import elastic_runner``.
Whatever a fix serves asks :func:`applies` whether the fix is on, so a fix the check reports
off is off. tests/test_compat.py scans the package for private torch names (attributes read or
written, both forms of import, names read by ``getattr``, and what the package's subclasses of
torch classes override) and fails on one no fix lists; it also takes the listed internals away
in a fresh interpreter, all at once and each alone, and checks that the package imports, that
each fix is reported off and that what it serves does without it.

A public API that could replace a fix: ``torch.distributed.shrink_group`` (torch 2.10; NCCL
only, through ``ncclCommShrink``; gloo raises ``TypeError``) shrinks a group without new
processes. It fits ``recovery.continue_shrunk`` on NCCL, where the survivors now form a new
group through the recovery store; it cannot add the rank a replacement brings (the common
in-place case), and the CPU CI could not test it, so it is not used yet.

Internals relied on (files under ``torch/distributed/`` of torch 2.13), and what the start-up check
does when one is gone (required: exit code 2 with one line; optional: a warning, the run goes on):

1. **Rendezvous store switch** (``elastic/rendezvous/dynamic_rendezvous.py``, required, agent).
   ``DynamicRendezvousHandler.next_rendezvous`` caches the workers' bootstrap store
   (``_bootstrap_store_info``, ``_shared_tcp_store_server``) of the first round and rebuilds it
   only when the node *becomes* rank 0, so a node whose rank changes from 0 to 1 (a node joined,
   or the old rank 0 left and came back) keeps pointing its workers at a store the new rank 0's
   workers do not use: the restarted group never forms. Torch's own switch
   ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` makes ``next_rendezvous`` return early with a fresh
   ``RendezvousStoreInfo.build(...)`` (``elastic/rendezvous/api.py``: rank 0 publishes a free port
   through that round's rendezvous store) every round, and ``use_agent_store`` False, so the
   workers' rank 0 hosts a new store per attempt. ``elastic-runner run`` sets it in the agent's
   environment (:data:`RDZV_SWITCHES`); it replaced a patch that reset the two cached attributes.
2. **Rendezvous outage tolerance** (``elastic/rendezvous/dynamic_rendezvous.py``, optional,
   agent). :func:`apply_rendezvous_fixes` wraps ``DynamicRendezvousHandler.num_nodes_waiting``
   (polled by the agent every ``--monitor-interval``; torch fails the whole job when it raises
   ``RendezvousConnectionError``) to report 0 waiting nodes while the backend is unreachable, and
   ``next_rendezvous`` to retry a ``RendezvousConnectionError`` every second until the join
   timeout (``self._settings.timeout.join``). Torch has no switch for either. Without them a
   backend (etcd) outage fails the job, as under plain torchrun. It also patches
   ``_BackendRendezvousStateHolder`` (``sync``, ``_sanitize``, ``_state``, ``_settings``; the
   handler's ``_state_holder`` and ``_this_node``) so that heartbeats nobody could write do not
   make nodes dead. Torch's ``_sanitize`` drops every node whose last keep-alive is older than
   ``keep_alive_interval * keep_alive_max_attempt``, on every read of the state, its own node
   included; and ``_should_keep_alive`` never beats again for a node that is no longer listed.
   So after an outage longer than that lapse every running node drops itself at its first read,
   stops beating, and the next node to arrive finds no participants and forms a rendezvous
   round of its own beside the running group (which fencing then stops). With the patch a node
   never expires its own heartbeat, and a node that saw the backend unreachable expires no
   heartbeat until one lapse after it is back, as etcd renews its leases after a leader change,
   so the running nodes beat again before anyone judges them.
3. **Agent store in the workers** (``rendezvous.py``: ``_torchelastic_use_agent_store``,
   ``_create_c10d_store``; ``elastic/agent/server/local_elastic_agent.py``: the workers'
   ``TORCHELASTIC_USE_AGENT_STORE``; optional, worker). With the shared store (plain torchrun
   without the switch) MASTER_ADDR/MASTER_PORT point at the agent's TCPStore, which outlives the
   attempts, and ``_create_c10d_store`` returns it with no per-attempt prefix, so
   :func:`elastic_runner.dist.init_distributed` agrees on a fresh namespace per attempt
   (:func:`shares_agent_store`, :func:`agent_store`). Without it a restarted group may read the
   dead workers' keys under plain torchrun (``elastic-runner run`` does not share the store).
4. **torchelastic metric names** (``elastic/metrics/api.py``: ``prof`` names a metric
   ``<qualname>.success|failure|duration.ms``; ``elastic/agent/server/api.py``:
   ``SimpleElasticAgent._rendezvous`` and ``_invoke_run``'s ``workers.<role>.remaining_restarts``
   and ``workers.<role>.<state>``; ``local_elastic_agent.py``: ``_start_workers``,
   ``_stop_workers``; optional, agent). :mod:`elastic_runner.observe.node_metrics` turns them into the
   node's agent series; without them those series stop changing.
5. **DDP comm-hook details** (``torch/nn/parallel/distributed.py``; optional, worker).
   ``register_comm_hook`` records ``(hook, state)`` in ``self._comm_hooks``
   (:func:`registered_comm_hook`), and ``_check_comm_hook`` requires the hook's second parameter
   to be named ``bucket`` and its annotations, if any, to be the real classes (not strings).
   Without the record a hook the user registered goes unnoticed (DDP then refuses the step vote's
   own hook: "can only be called once").
6. **etcd rendezvous options** (``elastic/rendezvous/etcd_rendezvous_backend.py`` and
   ``etcd_rendezvous.py``: ``_create_etcd_client``, ``create_rdzv_handler``;
   ``elastic/rendezvous/utils.py``: ``parse_rendezvous_endpoint``; tests only). The two etcd
   backends spell TLS files and the join timeout differently (:data:`ETCD_OPTION_SPELLINGS`) and
   default the join timeout to :data:`DEFAULT_JOIN_TIMEOUT_S`.
7. **torchrun's module functions** (``run.py``: ``get_args_parser``, ``config_from_args``,
   ``determine_local_world_size``; tests only): ``elastic-runner run`` parses its translated
   command line with torchrun's own parser. ``config_from_args`` sets ``OMP_NUM_THREADS=1`` with a
   banner when the variable is unset; ``elastic-runner run`` sets it first.

8. **Restart budget by cause** (``elastic/agent/server/local_elastic_agent.py``:
   ``LocalElasticAgent._monitor_workers`` returning a ``RunResult`` whose ``failures`` hold each
   failed rank's ``ProcessFailure.exitcode`` and ``message``; ``api.py``:
   ``SimpleElasticAgent._invoke_run`` restarting while ``self._remaining_restarts > 0`` and
   subtracting one; optional, agent).
   :func:`elastic_runner.agent.restart_budget.apply_agent_fixes` (the agent's policy, checked
   here by :func:`check_monitor_workers`) wraps ``_monitor_workers`` so
   that ``restart_budget.RestartBudget`` sets the remaining restarts after each failed attempt:
   0 after bad input (exit 2), a fenced-out writer (exit 3) or a crash loop; one more (refunding
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
   ``local_elastic_agent.py``: ``_start_workers``,
   ``_stop_workers``, ``_shutdown``, ``_monitor_workers``, ``self._pcontext`` and, when
   configured, ``_check_uninterruptible_state_timeout``; optional,
   agent). :func:`agent_class` makes ``launch_agent`` build
   :class:`~elastic_runner.agent.inplace_agent.InPlaceAgent`, which swaps a spare into a dead
   worker's slot; :func:`elastic_runner.agent.worker_start.forking` swaps that function for
   one that forks each worker from the agent's fork server. Without them ``run`` recovers by
   restarting every worker, each a new interpreter, as torchrun does.

10. **torchrun's ``--shutdown-timeout``** (``run.py``: ``get_args_parser``; optional, agent).
   ``elastic-runner run`` passes ``preemption.grace_seconds`` as this option, the SIGTERM ->
   SIGKILL gap of the agent's ``_shutdown`` (torch 2.13 made it configurable; earlier releases,
   torch 2.11 among them, have no such option and keep ``SubprocessContext.close``'s fixed 30
   s). :func:`shutdown_timeout_supported` tells; without it ``run`` leaves the option out (torch's
   parser would refuse it) and the start-up check warns that the grace is torch's 30 s.

11. **DCP internals of sharded checkpoints** (``checkpoint/default_planner.py``:
   ``_EmptyStateDictLoadPlanner``; ``checkpoint/state_dict_loader.py``: ``_load_state_dict`` with
   ``no_dist``; ``checkpoint/_nested_dict.py``: ``set_element``; optional, worker).
   :func:`dcp_internals` returns them to ``checkpoint/dcp_format.py``: the whole-state load of a
   sharded checkpoint in one process (``export``, ``evaluate``, ``generate``; torch's own
   ``format_utils.dcp_to_torch_save`` does it this way) and the planner's ``load_bytes``, which
   loads non-tensor values with ``weights_only=True`` where torch's uses ``weights_only=False``.
   Without them sharded checkpoints cannot be loaded: resume, export and the rest fail naming
   the checkpoint.
12. **DCP on fsspec URLs** (``checkpoint/_fsspec_filesystem.py``: ``FsspecReader(path)``,
   ``FsspecWriter(path, sync_files=...)``; optional, worker). :func:`dcp_fsspec` returns them to
   ``checkpoint/dcp_format.py`` for sharded checkpoints on object stores (``s3://``...); torch
   2.13 exports only the local ``FileSystemReader``/``FileSystemWriter``. Without them a sharded
   checkpoint on a URL cannot be written or read: the save or load fails naming it.
13. **A device mesh's own references to its groups** (``device_mesh.py``:
   ``DeviceMesh._pg_registry``, read only while ``torch.compile`` traces; optional, worker).
   Torch's caches of DTensor layouts keep every mesh, and so its groups, alive until the
   interpreter exits, also after ``destroy_process_group``; a gloo group destroyed during the
   exit may abort the process (SIGABRT: "terminate called without an active exception", seen
   on an FSDP bench worker after its last collective). :func:`release_mesh_groups` empties the
   registry (:func:`elastic_runner.dist.release_groups_of`, called when a trainer closes or a
   sharded survivor leaves its group), so that the group is freed while the interpreter runs.
   Without it a finished FSDP process may abort on its way out, and a group left by an
   in-place recovery keeps its threads and sockets.
14. **A user's DDP moved to a new group in place** (``nn/parallel/distributed.py``:
   ``DistributedDataParallel.__setstate__`` building the reducer on the default group from the
   attributes ``__getstate__`` keeps, ``_build_params_for_reducer``, ``broadcast_bucket_size``,
   ``parameters_to_ignore``, ``forward_sync_buffers``; the module functions
   ``_verify_param_shape_across_processes`` and ``_sync_module_states``; optional, worker).
   :func:`ddp_reattach` makes a script's own DDP object reduce over the group an in-place
   recovery formed, and :func:`ddp_construction_collectives` runs, on a survivor, the
   collectives a replacement's DDP constructor runs meanwhile. Without them a script's loop
   takes the restart path.

15. **A user's FSDP2 model moved to a new group in place** (``distributed/fsdp/_fully_shard``:
   ``FSDPModule._get_fsdp_state``, the state's ``_fsdp_param_groups``, each group's and
   parameter's ``mesh_info``/``post_forward_mesh_info``, whose ``FSDPMeshInfo`` caches
   ``shard_process_group`` at construction and which ``FSDPParamGroup`` reads for its
   all-gathers and reduce-scatters; ``DeviceMesh`` resolving its group by name; optional,
   worker). :func:`fsdp_reattach` resolves those cached groups again once an in-place recovery
   re-formed the default group at the same world size (a re-formed default group gets the
   default group's name again, which a 1-D mesh over the world holds). Without it a script's
   FSDP2 loop takes the restart path.

16. **A fused optimizer skips an update on the device** (``optim/adam.py``, ``optim/sgd.py``:
   ``_step_supports_amp_scaling``, set by a ``fused=True`` Adam, AdamW or SGD, whose ``step``
   then takes GradScaler's ``found_inf``; optional, worker).
   :func:`~elastic_runner.train.consensus.skips_on_device` reads it for the lagged step vote
   (``training.lagged_vote: auto``). Without it the vote reads the device every step.

Check 1 is the only required one: losing it breaks elastic membership changes silently (a hang
until the rendezvous times out). ``ELASTIC_RUNNER_IGNORE_TORCH_CHECK=1`` turns that error into a
warning for users who must run an untested torch.
"""

from __future__ import annotations

import contextlib
import copy
import dis
import functools
import importlib
import inspect
import logging
import os
import time
import types
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from types import CodeType
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.rendezvous import RendezvousConnectionError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousTimeout,
)
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
from torch.distributed.run import config_from_args, determine_local_world_size, get_args_parser
from torch.nn.parallel import DistributedDataParallel
from torch.torch_version import TorchVersion

from .config_base import ConfigError
from .exit_codes import EXIT_BAD_INPUT
from .logs import first_line

__all__ = [
    "AGENT_STORE_ENV", "BELOW_TORCH", "DEFAULT_JOIN_TIMEOUT_S", "ETCD_BACKENDS", "ETCD_OPTION_SPELLINGS",
    "EXIT_BAD_INPUT", "IGNORE_CHECK_ENV", "METRICS_GROUP", "MIN_TORCH", "NEWEST_TORCH", "RDZV_SWITCHES", "REMAINING_RESTARTS",
    "RENDEZVOUS_DURATION", "RENDEZVOUS_SUCCESS", "SHARE_STORE_SWITCH", "SUPPORTED_TORCH",
    "WORKERS_STARTED", "WORKERS_STOPPED", "WORKER_GROUP", "TorchCompatError", "agent_store",
    "apply_rendezvous_fixes", "check_monitor_workers", "check_torch", "config_from_args", "determine_local_world_size",
    "get_args_parser", "in_supported_range", "parse_rendezvous_endpoint", "registered_comm_hook",
    "shares_agent_store", "shutdown_timeout_supported",
]

log = logging.getLogger(__name__)

MIN_TORCH = "2.4"
BELOW_TORCH = "2.16"
SUPPORTED_TORCH = f">={MIN_TORCH},<{BELOW_TORCH}"
NEWEST_TORCH = "2.15.0"  # the newest release CI tests (.ci/newest_torch), beside the pinned 2.13
IGNORE_CHECK_ENV = "ELASTIC_RUNNER_IGNORE_TORCH_CHECK"


class TorchCompatError(ConfigError):
    """The installed torch lacks an internal that a required fix relies on (exit code 2)."""


# --- 1. rendezvous store switch ---

SHARE_STORE_SWITCH = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
RDZV_SWITCHES: dict[str, str] = {SHARE_STORE_SWITCH: "1"}
"""Environment the agent runs with (``elastic-runner run`` sets each unless the user did)."""


def _check_share_store_switch() -> str | None:
    prop = inspect.getattr_static(DynamicRendezvousHandler, "use_agent_store", None)
    if not isinstance(prop, property) or prop.fget is None:
        return "DynamicRendezvousHandler.use_agent_store is gone"
    if not _mentions(prop.fget, SHARE_STORE_SWITCH):
        return f"DynamicRendezvousHandler.use_agent_store no longer reads {SHARE_STORE_SWITCH}"
    if not _mentions(DynamicRendezvousHandler.next_rendezvous, SHARE_STORE_SWITCH):
        return f"DynamicRendezvousHandler.next_rendezvous no longer reads {SHARE_STORE_SWITCH}"
    return None


# --- 2. rendezvous outage tolerance ---

_RETRY_S = 1.0
_MARK = "_elastic_runner_fix"


def _check_outage_patch() -> str | None:
    for name in ("next_rendezvous", "num_nodes_waiting"):
        fn = getattr(DynamicRendezvousHandler, name, None)
        if fn is None or list(inspect.signature(fn).parameters) != ["self"]:
            return f"DynamicRendezvousHandler.{name}(self) is gone or takes other arguments"
    if not _mentions_name(inspect.unwrap(DynamicRendezvousHandler.__init__), "_settings"):
        return "DynamicRendezvousHandler no longer keeps its settings in self._settings"
    if not isinstance(inspect.getattr_static(RendezvousTimeout, "join", None), property):
        return "RendezvousTimeout.join is gone"
    init = inspect.unwrap(DynamicRendezvousHandler.__init__)
    for name in ("_state_holder", "_this_node"):
        if not _mentions_name(init, name):
            return f"DynamicRendezvousHandler no longer keeps self.{name}"
    holder = _state_holder_class()
    for name in ("sync", "_sanitize"):
        fn = getattr(holder, name, None)
        if fn is None or list(inspect.signature(fn).parameters) != ["self"]:
            return f"_BackendRendezvousStateHolder.{name}(self) is gone or takes other arguments"
    if not all(_mentions_name(inspect.unwrap(holder._sanitize), n)
               for n in ("_state", "last_heartbeats", "_dead_nodes")):
        return "_BackendRendezvousStateHolder._sanitize no longer expires self._state.last_heartbeats"
    return None


def _state_holder_class() -> type:
    """torch's ``_BackendRendezvousStateHolder`` (private: imported here, where fix 2 needs it).

    Raises:
        ImportError: this torch has no such class."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        _BackendRendezvousStateHolder,
    )

    return _BackendRendezvousStateHolder


def apply_rendezvous_fixes(cls: type = DynamicRendezvousHandler,
                           holder: type | None = None) -> bool:
    """Patch ``cls`` (torch's ``DynamicRendezvousHandler``; a subclass in tests) and ``holder``
    (its state holder class; default torch's) in this process with the outage tolerance of
    fix 2 (idempotent). Returns False, without patching, when the methods no longer look as
    expected (:func:`check_torch` has said so)."""
    if getattr(cls.__dict__.get("next_rendezvous"), _MARK, False):
        return True
    if not applies(FIX_OUTAGE):
        return False
    holder = holder or _state_holder_class()
    cls.next_rendezvous = _retry_until_join_timeout(cls.next_rendezvous)  # type: ignore
    cls.num_nodes_waiting = _tolerate_outage(cls.num_nodes_waiting)  # type: ignore
    if not getattr(holder.__dict__.get("sync"), _MARK, False):
        holder.sync = _grace_after_outage(holder.sync)  # type: ignore
        holder._sanitize = _spare_own_heartbeat(holder._sanitize)  # type: ignore
    return True


_GRACE_UNTIL = "_elastic_runner_grace_until"  # monotonic s; inf while the backend is unreachable
_SYNC_STARTED = "_elastic_runner_sync_started"  # monotonic s: when the running sync began
_OWN_NODE = "_elastic_runner_node"


def _lapse_s(holder: Any) -> float:
    """The keep-alive lapse after which torch expires a node (seconds)."""
    s = holder._settings
    return (s.keep_alive_interval * s.keep_alive_max_attempt).total_seconds()


def _grace_after_outage(sync: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``sync`` that starts a grace period when the backend answers again: while it lasts
    (one keep-alive lapse) ``_sanitize`` expires nobody, so the nodes that could not beat during
    the outage beat again before they are judged. An outage is a sync that failed to connect,
    or one that hung (a stopped server: the read returns once it runs again, and no error is
    raised; :func:`_spare_own_heartbeat` sees that from the sync's start time)."""
    @functools.wraps(sync)
    def wrapper(self: Any) -> Any:
        setattr(self, _SYNC_STARTED, time.monotonic())
        try:
            result = sync(self)
        except RendezvousConnectionError:
            setattr(self, _GRACE_UNTIL, float("inf"))
            raise
        if getattr(self, _GRACE_UNTIL, 0.0) == float("inf"):
            _start_grace(self)
        return result

    setattr(wrapper, _MARK, True)
    return wrapper


def _start_grace(holder: Any) -> None:
    setattr(holder, _GRACE_UNTIL, time.monotonic() + _lapse_s(holder))
    log.warning("rendezvous backend reachable again: no node's keep-alive expires for %.0f s, "
                "so the running nodes beat again first", _lapse_s(holder))


def _spare_own_heartbeat(sanitize: Callable[[Any], None]) -> Callable[[Any], None]:
    """``_sanitize`` that expires nobody during the grace after an outage and never expires
    this process's own node (which is alive: it is running this code)."""
    @functools.wraps(sanitize)
    def wrapper(self: Any) -> None:
        started = getattr(self, _SYNC_STARTED, None)
        if started is not None and time.monotonic() - started \
                > self._settings.keep_alive_interval.total_seconds():
            # this read waited on a hung backend (seen: etcd SIGSTOPped; torch then reports a
            # RendezvousTimeoutError, not a connection error): every beat is stale alike
            _start_grace(self)
        if time.monotonic() < getattr(self, _GRACE_UNTIL, 0.0):
            self._dead_nodes = []
            return
        beats = self._state.last_heartbeats
        node = getattr(self, _OWN_NODE, None)
        own = beats.pop(node, None) if node is not None else None
        try:
            sanitize(self)
        finally:
            if own is not None:
                beats[node] = own

    return wrapper


def _retry_until_join_timeout(next_rendezvous: Callable[[Any], Any]) -> Callable[[Any], Any]:
    @functools.wraps(next_rendezvous)
    def wrapper(self: DynamicRendezvousHandler) -> Any:
        setattr(self._state_holder, _OWN_NODE, self._this_node)
        deadline = time.monotonic() + self._settings.timeout.join.total_seconds()
        while True:
            try:
                return next_rendezvous(self)
            except RendezvousConnectionError as e:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise
                log.warning("rendezvous backend unreachable (%s); retrying for up to %.0f s "
                            "(join_timeout)", first_line(e), left)
                time.sleep(_RETRY_S)

    setattr(wrapper, _MARK, True)
    return wrapper


def _tolerate_outage(num_nodes_waiting: Callable[[Any], int]) -> Callable[[Any], int]:
    last_warning = [0.0]

    @functools.wraps(num_nodes_waiting)
    def wrapper(self: DynamicRendezvousHandler) -> int:
        try:
            return num_nodes_waiting(self)
        except RendezvousConnectionError as e:
            if time.monotonic() - last_warning[0] > 30:
                last_warning[0] = time.monotonic()
                log.warning("rendezvous backend unreachable (%s): training continues; nodes "
                            "cannot join until it is back", first_line(e))
            return 0

    return wrapper


# --- 3. agent store in the workers ---

AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"


def shares_agent_store(env: Mapping[str, str] = os.environ) -> bool:
    """Whether torchrun's agent told this worker that MASTER_ADDR/MASTER_PORT is its own,
    long-lived store (read as torch's ``_torchelastic_use_agent_store`` reads it), and fix 3
    applies: False where it is off, and the worker's group is initialised as torch does."""
    return env.get(AGENT_STORE_ENV) == str(True) and applies(FIX_AGENT_STORE)


def agent_store(timeout: timedelta) -> dist.Store:
    """A client of the agent's store at MASTER_ADDR:MASTER_PORT (see :func:`shares_agent_store`)."""
    return dist.TCPStore(host_name=os.environ["MASTER_ADDR"], port=int(os.environ["MASTER_PORT"]),
                         is_master=False, timeout=timeout)


def _check_agent_store_env() -> str | None:
    rendezvous = importlib.import_module("torch.distributed.rendezvous")
    reader = getattr(rendezvous, "_torchelastic_use_agent_store", None)
    if reader is None or not _mentions(reader, AGENT_STORE_ENV):
        return f"torch.distributed.rendezvous no longer reads {AGENT_STORE_ENV}"
    if not _mentions(LocalElasticAgent._start_workers, AGENT_STORE_ENV):
        return f"LocalElasticAgent no longer sets {AGENT_STORE_ENV} for its workers"
    return None


# --- 4. torchelastic metric names (group "torchelastic", see module docstring) ---

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
                or not _mentions_name(fn, "put_metric")):
            return f"the agent's {method} is no longer timed by torchelastic's metrics.prof"
    run = SimpleElasticAgent._invoke_run
    if not (_mentions(run, WORKER_GROUP) and _mentions(run, REMAINING_RESTARTS)):
        return "SimpleElasticAgent._invoke_run no longer puts workers.<role>.* metrics"
    return None


# --- 5. DDP comm-hook details ---

def registered_comm_hook(ddp: DistributedDataParallel
                         ) -> tuple[Callable[..., Any], object] | None:
    """``(hook, state)`` of the Python comm hook registered on ``ddp`` with
    ``register_comm_hook`` (by the user, or by torch for ``mixed_precision``), None without one.

    Built-in C++ hooks (the private ``_register_builtin_comm_hook``) are not recorded by DDP and
    not reported; DDP refuses a second hook of any kind ("can only be called once"). None, too,
    where fix 5 is off."""
    hooks = getattr(ddp, "_comm_hooks", None) if applies(FIX_COMM_HOOK) else None
    if not hooks:
        return None
    hook, state = hooks[-1]
    return hook, state


def _check_comm_hook_record() -> str | None:
    if not _mentions_name(DistributedDataParallel.register_comm_hook, "_comm_hooks"):
        return "DistributedDataParallel.register_comm_hook no longer records self._comm_hooks"
    check = getattr(DistributedDataParallel, "_check_comm_hook", None)
    if check is None or not _mentions(check, "bucket"):
        return "DistributedDataParallel no longer checks a comm hook's 'bucket' parameter"
    return None


# --- 14. a user's DDP moved to a new group in place ---

_DDP_GROUP_ATTRS = ("process_group", "reducer", "logger")  # what DDP's __getstate__ drops


def ddp_reattach(ddp: DistributedDataParallel) -> None:
    """Fix 14: make ``ddp`` (the user's object) reduce over the current default process group,
    in place: a new reducer with fresh buckets and no comm hook, the same module and options.

    Torch's own unpickling path (``DistributedDataParallel.__setstate__``: "the process group
    should be the default one") builds the reducer from the DDP's attributes; its
    ``__getstate__`` refuses a DDP whose group is no longer the default one, so the state it
    would return (the attributes less :data:`_DDP_GROUP_ATTRS`) is taken here. Collective-free.
    """
    state = {k: v for k, v in ddp.__dict__.items() if k not in _DDP_GROUP_ATTRS}
    for k in _DDP_GROUP_ATTRS:
        ddp.__dict__.pop(k, None)  # the old reducer goes, and with it its autograd hooks
    ddp.__setstate__(state)


def ddp_construction_collectives(ddp: DistributedDataParallel, src_is_peer: bool) -> None:
    """Fix 14: the collectives ``DistributedDataParallel(module)`` runs on construction
    (``init_sync``: the parameter shapes all-gathered, the parameters and buffers broadcast from
    rank 0), over the current default group, for a member whose peer constructs a DDP now (a
    replacement running the user's script). ``src_is_peer``: rank 0 is that peer, whose
    parameters are not the group's: they are received into a copy and dropped. Buffers are
    broadcast when ``ddp`` syncs them in forward (``forward_sync_buffers``)."""
    from torch.nn.parallel import distributed as ddp_module

    group = dist.group.WORLD
    parameters, _ = ddp._build_params_for_reducer()
    ddp_module._verify_param_shape_across_processes(group, parameters)
    module = copy.deepcopy(ddp.module) if src_is_peer else ddp.module
    ddp_module._sync_module_states(
        module=module, process_group=group, broadcast_bucket_size=ddp.broadcast_bucket_size,
        src=0, params_and_buffers_to_ignore=ddp.parameters_to_ignore,
        broadcast_buffers=getattr(ddp, "forward_sync_buffers", True))


def ddp_reattach_supported() -> bool:
    """Whether fix 14 applies on this torch (its internals and :func:`_check_ddp_reattach`)."""
    return applies(FIX_DDP_REATTACH)


def _check_ddp_reattach() -> str | None:
    from torch.nn.parallel import distributed as ddp_module

    for name in ("_verify_param_shape_across_processes", "_sync_module_states"):
        if not callable(getattr(ddp_module, name, None)):
            return f"torch.nn.parallel.distributed.{name} is gone"
    if not _mentions_name(DistributedDataParallel.__setstate__, "_ddp_init_helper"):
        return "DistributedDataParallel.__setstate__ no longer builds the reducer"
    for name in ("_build_params_for_reducer", "broadcast_bucket_size"):
        if not _mentions_name(DistributedDataParallel.__init__, name):
            return f"DistributedDataParallel.__init__ no longer uses {name}"
    return None


# --- 15. a user's FSDP2 model moved to a new group in place ---


def fsdp_reattach(model: torch.nn.Module) -> None:
    """Fix 15: make the FSDP2 modules of ``model`` (the user's object, sharded with
    ``fully_shard`` on a 1-D mesh over the default group: :func:`fsdp_reattach_refusal`) all-gather
    and reduce-scatter over the current default group, in place: each mesh info's cached
    groups are resolved again from its device mesh, which names its group (a re-formed default
    group has the same name). Shards keep their shapes: the same world size only.
    Collective-free."""
    for info in _fsdp_mesh_infos(model):
        info.shard_process_group = info.mesh.get_group(info.shard_mesh_dim)
        info.reduce_scatter_process_group = None  # a dedicated one went with the old group
    _reset_iteration(model)


def _reset_iteration(model: torch.nn.Module) -> None:
    """The failed iteration's FSDP2 state dropped (torch's public ``reset_iter_state`` on the
    root module, torch >= 2.13: shards registered again, in-flight reductions discarded);
    where that is missing or fails, each module reshards (public ``reshard``): the failed
    group's work raising again while it is waited on, or torch 2.13's reset on a root that never
    ran a forward (a replacement's: its comm context has no ``all_gather_state`` yet,
    AttributeError)."""
    from torch.distributed.fsdp import FSDPModule

    _drop_unreduced_grads(model)
    reset = getattr(model, "reset_iter_state", None)
    if isinstance(model, FSDPModule) and callable(reset):
        try:
            reset()
            return
        except (RuntimeError, dist.DistError, AttributeError) as e:
            log.debug("FSDP2 reset_iter_state after the recovery: %s", e)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _drop_unreduced_grads(model: torch.nn.Module) -> None:
    """The failed iteration's gradients that were never reduced, dropped: an unsharded
    parameter's ``.grad`` (autograd accumulated it; its group's post-backward, which
    reduce-scatters and clears it, never ran: the root's, which runs at backward's end, when a
    peer died in a unit's reduce-scatter) and a group's accumulated gradient (``no_sync``
    under mixed precision; torch 2.15 derives it from ``.grad``). torch 2.13's
    ``reset_iter_state`` keeps both, and the redone step's backward would add to them (the
    root's gradients of that step doubled)."""
    for group in _fsdp_param_groups(model):
        for param in group.fsdp_params:
            unsharded = getattr(param, "_unsharded_param", None)
            if unsharded is not None:
                unsharded.grad = None
            if not _derived_accumulated_grad():  # torch <= 2.14 keeps it apart from .grad
                param.unsharded_accumulated_grad = None


def _derived_accumulated_grad() -> bool:
    """Whether ``FSDPParam.unsharded_accumulated_grad`` is read from the unsharded parameter's
    ``.grad`` (torch 2.15: a property) rather than kept apart (an attribute, torch <= 2.14)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    return isinstance(getattr(FSDPParam, "unsharded_accumulated_grad", None), property)


def fsdp_reattach_refusal(model: torch.nn.Module) -> str | None:
    """Why ``model``'s FSDP2 modules cannot move to a re-formed default group in place (None:
    they can): fix 15 does not apply on this torch, or a mesh is not 1-D over the default group
    (HSDP, a 2-D mesh, a subgroup), whose groups a re-formed default group does not bring
    back."""
    problem = _problem(FIX_FSDP_REATTACH)
    if problem is not None:
        return f"torch {torch.__version__}: {problem} (compat fix 15)"
    world = dist.group.WORLD.group_name if dist.is_initialized() else None
    for info in _fsdp_mesh_infos(model):
        if info.mesh.ndim != 1 or hasattr(info, "replicate_process_group"):
            return "an FSDP2 mesh of more than one dimension (HSDP or a 2-D mesh)"
        if info.mesh.get_group().group_name != world:
            return "an FSDP2 mesh over a group other than the default one"
    return None


def _fsdp_mesh_infos(model: torch.nn.Module) -> list[Any]:
    """The distinct FSDP mesh infos of ``model``'s FSDP2 modules (their param groups' and
    parameters', for the forward and after it)."""
    infos: dict[int, Any] = {}
    for group in _fsdp_param_groups(model):
        for info in (group.mesh_info, group.post_forward_mesh_info,
                     *(i for p in group.fsdp_params
                       for i in (p.mesh_info, p.post_forward_mesh_info))):
            if info is not None:
                infos[id(info)] = info
    return list(infos.values())


def _fsdp_param_groups(model: torch.nn.Module) -> list[Any]:
    """The FSDP param groups of ``model``'s FSDP2 modules (torch's private ``FSDPParamGroup``)."""
    from torch.distributed.fsdp import FSDPModule

    groups: list[Any] = []
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        state = module._get_fsdp_state()
        own = getattr(state, "_fsdp_param_groups", None)
        if own is None:  # a torch with one param group per module
            own = [g for g in (getattr(state, "_fsdp_param_group", None),) if g is not None]
        groups.extend(own)
    return groups


def _check_fsdp_reattach() -> str | None:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard import _fsdp_common, _fsdp_param, _fsdp_param_group

    if not callable(getattr(FSDPModule, "_get_fsdp_state", None)):
        return "FSDPModule._get_fsdp_state is gone"
    param = _fsdp_param.FSDPParam
    if not _mentions_name(param.init_unsharded_param, "_unsharded_param"):
        return "FSDPParam no longer keeps its unsharded parameter in _unsharded_param"
    if not (_derived_accumulated_grad()
            or _mentions_name(param.__init__, "unsharded_accumulated_grad")):
        return "FSDPParam no longer keeps unsharded_accumulated_grad"
    if not _mentions_name(_fsdp_common.FSDPMeshInfo.__post_init__, "shard_process_group"):
        return "FSDPMeshInfo no longer caches shard_process_group"
    group = _fsdp_param_group.FSDPParamGroup
    for name in ("_all_gather_process_group", "_reduce_scatter_process_group"):
        prop = getattr(group, name, None)
        if not isinstance(prop, property) or not _mentions_name(prop.fget, "shard_process_group"):
            return f"FSDPParamGroup.{name} no longer reads the mesh info's shard_process_group"
    return None


# --- 6. etcd rendezvous options ---

ETCD_BACKENDS = ("etcd-v2", "etcd")  # torchrun's --rdzv-backend names of its two etcd backends
# (etcd-v2 spelling, legacy etcd spelling) of the same rendezvous option
ETCD_OPTION_SPELLINGS = (("ca_cert", "cacert"), ("ssl_cert", "cert"), ("ssl_cert_key", "key"),
                         ("join_timeout", "timeout"))
DEFAULT_JOIN_TIMEOUT_S = 600  # both backends' default join timeout, seconds


# --- 8. restart budget by cause (the policy and its patch: agent/restart_budget.py) ---

def check_monitor_workers() -> str | None:
    """Fix 8's internals: None when they look as expected, else what changed."""
    fn = getattr(LocalElasticAgent, "_monitor_workers", None)
    if fn is None or list(inspect.signature(fn).parameters) != ["self", "worker_group"]:
        return "LocalElasticAgent._monitor_workers(self, worker_group) is gone"
    if not _mentions_name(SimpleElasticAgent._invoke_run, "_remaining_restarts"):
        return "SimpleElasticAgent._invoke_run no longer counts self._remaining_restarts"
    return None


# --- 9. in-place recovery ---

def _check_inplace_agent() -> str | None:
    from torch.distributed.elastic.multiprocessing.api import SubprocessContext
    from torch.distributed.launcher import api as launcher_api

    if "LocalElasticAgent" not in launcher_api.launch_agent.__code__.co_names:
        return "torch.distributed.launcher.api.launch_agent no longer builds LocalElasticAgent"
    for name in ("_start_workers", "_stop_workers", "_shutdown", "_monitor_workers"):
        if not callable(getattr(LocalElasticAgent, name, None)):
            return f"LocalElasticAgent.{name} is gone"
    if not _mentions_name(SubprocessContext._start, "subprocess_handlers"):
        return "SubprocessContext no longer keeps subprocess_handlers"
    if not _mentions_name(SubprocessContext._start, "get_subprocess_handler"):
        return "SubprocessContext no longer builds its handlers with get_subprocess_handler"
    return None


@contextlib.contextmanager
def agent_class(factory: Callable[..., Any]) -> Iterator[bool]:
    """Within the block, torch's ``launch_agent`` builds its agent with ``factory`` (same
    arguments as ``LocalElasticAgent``). Yields False, changing nothing, when fix 9's internals
    are gone."""
    from torch.distributed.launcher import api as launcher_api

    problem = _problem(FIX_INPLACE)
    if problem is not None:
        log.warning("in-place recovery is off (%s): a failed worker restarts all of them",
                    problem)
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


# --- start-up check ---

@dataclass(frozen=True)
class _Fix:
    name: str
    roles: tuple[str, ...]  # "agent" (elastic-runner run) and/or "worker" (each rank)
    required: bool
    check: Callable[[], str | None]
    without: str  # what happens when it cannot apply
    # every private torch name the fix (and the code it serves) relies on, as "module" or
    # "module:Name.attr" (an attribute of a class, or one its methods assign): the start-up
    # check verifies each, and tests/test_compat.py fails on a private torch name the package
    # uses that no fix lists
    internals: tuple[str, ...] = ()


def _no_check() -> None:
    return None


def _resolves(ref: str) -> bool:
    """Whether ``ref`` ("module" or "module:Name.attr") exists in this torch: the module
    imports, each name is an attribute, and the last is a class attribute or assigned by a
    method of the class (an instance attribute)."""
    module, _, path = ref.partition(":")
    try:
        obj: Any = importlib.import_module(module)
    except ImportError:
        return False
    *owners, name = path.split(".") if path else [""]
    for owner in owners:
        obj = getattr(obj, owner, None)
        if obj is None:
            return False
    if not name or hasattr(obj, name) or name in getattr(obj, "__annotations__", {}):
        return True
    return isinstance(obj, type) and any(
        _assigns(inspect.unwrap(f), name) for klass in obj.__mro__
        for f in vars(klass).values() if inspect.isfunction(f))


def _assigns(fn: Any, name: str) -> bool:
    """Whether ``fn`` assigns the attribute ``name`` (``self.name = ...``)."""
    return _mentions_name(fn, name) and any(
        i.opname == "STORE_ATTR" and i.argval == name for i in dis.get_instructions(fn))


def _problem(fix: _Fix) -> str | None:
    """Why ``fix`` cannot apply on this torch (None: it can): a listed internal is gone, or
    its own check failed."""
    try:
        gone = next((ref for ref in fix.internals if not _resolves(ref)), None)
        return f"{gone} is gone" if gone is not None else fix.check()
    except Exception as e:  # an internal so changed that inspecting it fails
        return first_line(e)


def dcp_internals() -> tuple[type, Callable[..., Any], Callable[..., Any]]:
    """Fix 11: torch's ``(_EmptyStateDictLoadPlanner, _load_state_dict, set_element)``.

    Raises:
        ImportError, AttributeError: this torch has moved or removed one of them.
    """
    found = _dcp_internals()  # a name that is gone raises here, as torch's import does
    if not applies(FIX_DCP_LOAD):
        raise ImportError(f"{FIX_DCP_LOAD.name} is off: {_problem(FIX_DCP_LOAD)}")
    return found


def _dcp_internals() -> tuple[type, Callable[..., Any], Callable[..., Any]]:
    from torch.distributed.checkpoint import _nested_dict, default_planner, state_dict_loader

    return (default_planner._EmptyStateDictLoadPlanner, state_dict_loader._load_state_dict,
            _nested_dict.set_element)


def dcp_fsspec() -> tuple[type, type]:
    """Fix 12: torch's ``(FsspecReader, FsspecWriter)``, DCP on any fsspec URL (object stores),
    from the private ``torch.distributed.checkpoint._fsspec_filesystem`` in torch 2.13.

    Raises:
        ImportError, AttributeError: this torch has moved or removed them.
    """
    found = _dcp_fsspec()  # a name that is gone raises here, as torch's import does
    if not applies(FIX_DCP_FSSPEC):
        raise ImportError(f"{FIX_DCP_FSSPEC.name} is off: {_problem(FIX_DCP_FSSPEC)}")
    return found


def _dcp_fsspec() -> tuple[type, type]:
    from torch.distributed.checkpoint import _fsspec_filesystem

    return _fsspec_filesystem.FsspecReader, _fsspec_filesystem.FsspecWriter


def _check_dcp_fsspec() -> str | None:
    try:
        reader, writer = _dcp_fsspec()
    except (ImportError, AttributeError) as e:
        return first_line(e)
    if "path" not in inspect.signature(reader.__init__).parameters:
        return "FsspecReader no longer takes a path"
    if "sync_files" not in inspect.signature(writer.__init__).parameters:
        return "FsspecWriter no longer takes sync_files"
    return None


def release_mesh_groups(mesh: Any) -> None:
    """Fix 13: drop ``mesh``'s own references to its process groups (torch 2.13's
    ``DeviceMesh._pg_registry``, read only while ``torch.compile`` traces; otherwise a mesh
    resolves its groups by name), here and in its root mesh.

    Why: torch's caches of DTensor layouts and redistribution plans keep every mesh alive until
    the interpreter exits, and with it the groups in that registry, also after
    ``destroy_process_group``. A gloo group destroyed that late, during the interpreter's
    teardown, aborted the process ("terminate called without an active exception", SIGABRT)
    in 2 of 20 exits here (a group kept past ``destroy_process_group``; 0 of 30 without), which
    is how an FSDP worker that had finished its work could die with -6. Released, the group is
    freed by ``destroy_process_group`` while the interpreter still runs. A no-op where the
    attribute is gone (:func:`_check_mesh_registry` warns at start-up)."""
    if not applies(FIX_MESH_RELEASE):
        return
    for m in (mesh, getattr(mesh, "_root_mesh", None)):
        registry = getattr(m, "_pg_registry", None)
        if isinstance(registry, dict):
            registry.clear()


def _check_mesh_registry() -> str | None:
    from torch.distributed.device_mesh import DeviceMesh

    if "_pg_registry" not in getattr(DeviceMesh, "__annotations__", {}):
        return "DeviceMesh no longer declares _pg_registry"
    return None


def _check_dcp_internals() -> str | None:
    try:
        _, load, set_element = _dcp_internals()
    except (ImportError, AttributeError) as e:
        return first_line(e)
    wanted = ("state_dict", "storage_reader", "planner", "no_dist")
    missing = [p for p in wanted if p not in inspect.signature(load).parameters]
    if missing:
        return f"state_dict_loader._load_state_dict takes no {', '.join(missing)}"
    if len(inspect.signature(set_element).parameters) != 3:
        return "_nested_dict.set_element no longer takes (root, path, value)"
    return None


_DR = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"
_API = "torch.distributed.elastic.agent.server.api:SimpleElasticAgent"
_LOCAL = "torch.distributed.elastic.agent.server.local_elastic_agent:LocalElasticAgent"
_DDP = "torch.nn.parallel.distributed"
_FSDP = "torch.distributed.fsdp._fully_shard"

FIX_OUTAGE = _Fix(
    "the rendezvous outage tolerance", ("agent",), False, _check_outage_patch,
    "an unreachable rendezvous backend fails the job, as under plain torchrun",
    (f"{_DR}:DynamicRendezvousHandler._settings", f"{_DR}:DynamicRendezvousHandler._state_holder",
     f"{_DR}:DynamicRendezvousHandler._this_node", f"{_DR}:_BackendRendezvousStateHolder",
     f"{_DR}:_BackendRendezvousStateHolder._sanitize",
     f"{_DR}:_BackendRendezvousStateHolder._state",
     f"{_DR}:_BackendRendezvousStateHolder._dead_nodes"))

FIX_STORE_SWITCH = _Fix(
    "the rendezvous store switch (node join/leave)", ("agent",), True, _check_share_store_switch,
    "a node whose rank changes between rounds may hang the restarted group")
FIX_RESTART_BUDGET = _Fix(
    "the restart budget by cause", ("agent",), False, check_monitor_workers,
    "every failure spends one of --max-restarts: bad input (exit 2), preemptions (143) and "
    "crash loops alike",
    (f"{_LOCAL}._monitor_workers", f"{_LOCAL}._pcontext", f"{_API}._invoke_run",
     f"{_API}._remaining_restarts"))
FIX_INPLACE = _Fix(
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
FIX_AGENT_METRICS = _Fix(
    "the agent metrics", ("agent",), False, _check_metric_names,
    "the elastic_runner_agent_state, restarts and rendezvous series stop changing",
    (f"{_API}._rendezvous", f"{_API}._invoke_run", f"{_LOCAL}._start_workers",
     f"{_LOCAL}._stop_workers"))
FIX_SHUTDOWN_TIMEOUT = _Fix(
    "the preemption grace (torchrun --shutdown-timeout)", ("agent",), False,
    _check_shutdown_timeout,
    f"the agent SIGKILLs its workers {TORCH_FIXED_SHUTDOWN_S} s after SIGTERM, whatever "
    "preemption.grace_seconds says")
FIX_AGENT_STORE = _Fix(
    "the per-attempt process-group namespace", ("worker",), False, _check_agent_store_env,
    "under plain torchrun a restarted group may read the dead workers' store keys",
    ("torch.distributed.rendezvous:_torchelastic_use_agent_store",))
FIX_COMM_HOOK = _Fix(
    "the DDP comm-hook detection", ("worker",), False, _check_comm_hook_record,
    "a comm hook registered before the step vote's goes unnoticed",
    (f"{_DDP}:DistributedDataParallel._comm_hooks",
     f"{_DDP}:DistributedDataParallel._check_comm_hook"))
FIX_LAGGED_VOTE = _Fix(
    "the lagged step vote (a fused optimizer skips an update on the device)", ("worker",),
    False, _no_check,
    "the step vote reads the device every step (training.lagged_vote: auto turns it off)",
    ("torch.optim.adam:Adam._step_supports_amp_scaling",
     "torch.optim.sgd:SGD._step_supports_amp_scaling"))
FIX_DCP_LOAD = _Fix(
    "the sharded checkpoints' loading (DCP internals)", ("worker",), False,
    _check_dcp_internals,
    "sharded (DCP) checkpoints cannot be loaded: resume and export fail naming the checkpoint",
    ("torch.distributed.checkpoint.default_planner:_EmptyStateDictLoadPlanner",
     "torch.distributed.checkpoint.state_dict_loader:_load_state_dict",
     "torch.distributed.checkpoint._nested_dict"))
FIX_DCP_FSSPEC = _Fix(
    "sharded checkpoints on object stores (DCP's fsspec reader and writer)", ("worker",),
    False, _check_dcp_fsspec,
    "a sharded (DCP) checkpoint on an s3:// (or other fsspec) URL cannot be written or read: "
    "the save or load fails naming the checkpoint",
    ("torch.distributed.checkpoint._fsspec_filesystem",))
FIX_MESH_RELEASE = _Fix(
    "the release of a sharded model's process groups (DeviceMesh._pg_registry)", ("worker",),
    False, _check_mesh_registry,
    "under FSDP a destroyed gloo group lives until the interpreter exits, where it may abort "
    "the finished process (SIGABRT); a replaced group keeps its threads and sockets",
    ("torch.distributed.device_mesh:DeviceMesh._pg_registry",
     "torch.distributed.device_mesh:DeviceMesh._root_mesh"))
FIX_DDP_REATTACH = _Fix(
    "a script's DDP moved to a new group in place (DDP's unpickling path and its construction "
    "collectives)", ("worker",), False, _check_ddp_reattach,
    "a script's own loop recovers through torch's restart path: a failed worker restarts "
    "every worker",
    (f"{_DDP}:DistributedDataParallel._build_params_for_reducer",
     f"{_DDP}:DistributedDataParallel._ddp_init_helper",
     f"{_DDP}:_verify_param_shape_across_processes", f"{_DDP}:_sync_module_states"))
FIX_FSDP_REATTACH = _Fix(
    "a script's FSDP2 model moved to a new group in place (its mesh infos' cached process "
    "groups)", ("worker",), False, _check_fsdp_reattach,
    "a script's FSDP2 loop recovers through torch's restart path: a failed worker restarts "
    "every worker",
    ("torch.distributed.fsdp:FSDPModule._get_fsdp_state",
     f"{_FSDP}._fsdp_state:FSDPState._fsdp_param_group",
     f"{_FSDP}._fsdp_param:FSDPParam._unsharded_param",
     f"{_FSDP}._fsdp_common:FSDPMeshInfo",
     f"{_FSDP}._fsdp_param_group:FSDPParamGroup._all_gather_process_group",
     f"{_FSDP}._fsdp_param_group:FSDPParamGroup._reduce_scatter_process_group"))

FIXES = (FIX_STORE_SWITCH, FIX_OUTAGE, FIX_RESTART_BUDGET, FIX_INPLACE, FIX_AGENT_METRICS,
         FIX_SHUTDOWN_TIMEOUT, FIX_AGENT_STORE, FIX_COMM_HOOK, FIX_LAGGED_VOTE, FIX_DCP_LOAD,
         FIX_DCP_FSSPEC, FIX_MESH_RELEASE, FIX_DDP_REATTACH, FIX_FSDP_REATTACH)


@functools.cache
def applies(fix: _Fix) -> bool:
    """Whether ``fix`` applies on the installed torch: each of its internals resolves and its
    own check passes. Every piece of code a fix serves gates on this, so a fix that
    :func:`check_torch` reports off is off (tests/test_compat.py takes each internal away and
    checks both). Decided once per process (torch does not change under a running process;
    some gates are asked every step)."""
    return _problem(fix) is None


def private_torch_names() -> set[str]:
    """Every private name (a path component starting with one ``_``) of the internals the
    fixes list: what the package may use of torch's private API."""
    return {part for fix in FIXES for ref in fix.internals
            for part in ref.replace(":", ".").split(".")
            if part.startswith("_") and not part.startswith("__")}


def in_supported_range(version: str | None = None) -> bool:
    """Whether ``version`` (default: the installed torch) is in :data:`SUPPORTED_TORCH`."""
    v = TorchVersion(version or torch.__version__)
    return v >= MIN_TORCH and v < BELOW_TORCH


def check_torch(role: str) -> list[str]:
    """Verify, at start-up, the torch internals that ``role``'s fixes rely on (``"agent"``:
    ``elastic-runner run``; ``"worker"``: each rank). Each message names the torch version, the
    fix and what to do. Optional fixes are logged as warnings (in a worker by rank 0 only) and
    returned, with a warning when torch is outside :data:`SUPPORTED_TORCH`.

    Raises:
        TorchCompatError: a required fix cannot apply (unless ``ELASTIC_RUNNER_IGNORE_TORCH_CHECK``
            is 1, which turns it into a warning).
    """
    version = torch.__version__
    warnings: list[str] = []
    for fix in FIXES:
        if role not in fix.roles:
            continue
        problem = _problem(fix)
        if problem is None:
            continue
        if fix.required and os.environ.get(IGNORE_CHECK_ENV) != "1":
            raise TorchCompatError(
                f"torch {version}: {fix.name} cannot apply ({problem}); install torch"
                f"{SUPPORTED_TORCH}, the range elastic-runner supports, or set "
                f"{IGNORE_CHECK_ENV}=1 to run anyway ({fix.without})")
        warnings.append(f"torch {version}: {fix.name} is off ({problem}): {fix.without}; "
                        f"elastic-runner supports torch{SUPPORTED_TORCH}")
    if not in_supported_range(version):
        warnings.append(f"torch {version} is outside the range elastic-runner supports "
                        f"(torch{SUPPORTED_TORCH}); the internals it relies on look unchanged")
    if role != "worker" or os.environ.get("RANK", "0") == "0":
        for w in warnings:
            log.warning("%s", w)
    return warnings


# --- helpers ---

def _code(fn: object) -> CodeType | None:
    fn = inspect.unwrap(fn) if callable(fn) else fn  # type: ignore[arg-type]
    return getattr(fn, "__code__", None)


def _constants(code: CodeType) -> Iterator[object]:
    yield from _flatten(code.co_consts)


def _flatten(consts: tuple[object, ...] | frozenset[object]) -> Iterator[object]:
    for c in consts:
        if isinstance(c, CodeType):
            yield from _constants(c)
        elif isinstance(c, (tuple, frozenset)):
            yield from _flatten(c)
        else:
            yield c


def _mentions(fn: object, text: str) -> bool:
    """Whether the source of ``fn`` (unwrapped) has the string constant ``text``."""
    code = _code(fn)
    return code is not None and text in set(_constants(code))


def _mentions_name(fn: object, name: str) -> bool:
    """Whether ``fn`` itself (not unwrapped), its comprehensions and lambdas included, uses the
    global or attribute ``name``."""
    code = getattr(fn, "__code__", None)
    return code is not None and _code_names(code, name)


def _code_names(code: types.CodeType, name: str) -> bool:
    return name in code.co_names or any(
        _code_names(c, name) for c in code.co_consts if isinstance(c, types.CodeType))


def names_this_machine(host: str) -> bool:
    """Whether ``host`` (a name or address) is this machine, by torch's own rule for whether an
    agent hosts the c10d rendezvous store (``_matches_machine_hostname`` in
    ``torch.distributed.elastic.rendezvous.utils``, private; kept here with the other uses of
    torch internals). Without it (a torch that renamed it): whether ``host`` is this machine's
    host name, fully qualified name or a loopback address."""
    try:
        from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname
    except ImportError:
        import socket

        return host in ("localhost", "127.0.0.1", "::1", socket.gethostname(),
                        socket.getfqdn())
    return _matches_machine_hostname(host)



def leave_rendezvous_open(handler: Any) -> None:
    """Make ``handler.shutdown()`` (torch's agent calls it when it ends) stop this node's
    keep-alive heartbeats without closing the rendezvous: a node that left a running job in
    place ends, the others go on in it. The heartbeats must stop: their timer thread (a daemon)
    would otherwise still be inside a store call when the interpreter exits, and a daemon
    thread that finalization stops in C++ code aborts the process ("terminate called without an
    active exception", exit -6; seen after a partition healed). ``_stop_heartbeats`` is private
    to torch's ``DynamicRendezvousHandler`` (etcd-v2 and c10d); other handlers keep theirs."""
    stop = getattr(handler, "_stop_heartbeats", lambda: None)

    def shutdown() -> bool:
        stop()
        return False

    handler.shutdown = shutdown
