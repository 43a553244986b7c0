"""``elastic-runner run``: start the workers through torch.distributed.run, in this process.

The command line is translated into torchrun's own arguments and parsed by torchrun's parser, so
everything torchrun documents holds, including defaults from the ``PET_*`` environment variables
that the Kubeflow training operator sets (Kubeflow Trainer v2's ``PET_MASTER_ADDR`` and
``PET_MASTER_PORT`` become a c10d rendezvous at node 0: :func:`trainer_rendezvous`). The agent
runs in this process (no shell-out); the workers run
``python -m elastic_runner train CONFIG [overrides]``.

With an etcd rendezvous (``--rdzv-backend etcd-v2`` or legacy ``etcd``) an option given in the
other backend's spelling (``cacert`` for ``ca_cert``, ``join_timeout`` for ``timeout``, ...; see
:mod:`elastic_runner.agent.etcd_check`) is added in the chosen backend's spelling, and the server is
checked before the agent starts, so that an unreachable or misconfigured etcd ends in one line,
not a traceback. Rendezvous errors (closed, timed out) end in one line too.

Before the agent starts, :func:`elastic_runner.compat.registry.check_torch` verifies the torch
internals the agent relies on (exit code 2 when a required one is gone) and the agent runs with
torch's ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (a fresh workers' store every rendezvous round;
see :mod:`elastic_runner.compat.rendezvous`, fix 1) and, unless the user set it,
``OMP_NUM_THREADS`` = cores / workers (torchrun would otherwise set 1 and print a banner about
it), both for this run only.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import os
import sys
import tempfile
import uuid
from collections.abc import Iterator
from typing import Any

import etcd
import torch
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousError,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
from torch.distributed.launcher.api import elastic_launch
from torch.distributed.run import config_from_args, determine_local_world_size, get_args_parser

from ..compat.agent import agent_class, shutdown_timeout_supported
from ..compat.registry import TorchCompatError, check_torch
from ..compat.rendezvous import (
    DEFAULT_JOIN_TIMEOUT_S,
    ETCD_BACKENDS,
    RDZV_SWITCHES,
    names_this_machine,
)
from ..exit_codes import (
    EXIT_BAD_INPUT,
    EXIT_CRASH_LOOP,
    EXIT_FAILED,
    EXIT_FENCED,
    EXIT_OK,
    EXIT_PREEMPTED,
)
from ..logs import first_line
from ..observe.node_metrics import NodeEndpoint
from ..protocol.scoped_env import environment
from ..protocol.torchrun_env import PetEnv
from ..recovery.membership import Policy
from ..recovery.store import C10D_DEFAULT_PORT, StoreLocation
from . import worker_start
from .etcd_check import (
    EtcdCheckError,
    check_etcd,
    parse_conf,
    wait_seconds,
    with_aliases,
)
from .inplace_agent import InPlaceAgent
from .rendezvous_outage import apply_rendezvous_fixes
from .restart_budget import apply_agent_fixes, cause_rank

log = logging.getLogger(__name__)

TRAINER_PORT = 29400  # Kubeflow Trainer v2's PET_MASTER_PORT (constants.ContainerTrainerPort)


def default_nproc_per_node() -> int:
    """One worker per GPU; two on a CPU-only machine."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def omp_threads(nproc_per_node: int, cores: int | None = None) -> int:
    """Threads per worker for intra-op parallelism: this process's usable cores (``cores``, by
    default its CPU affinity) shared among the node's workers, at least 1."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        cores = cores or os.cpu_count() or 1
    return max(1, cores // max(nproc_per_node, 1))


@contextlib.contextmanager
def agent_environment(nproc_per_node: int, cores: int | None = None) -> Iterator[dict[str, str]]:
    """Set, for the ``with`` block (the agent and the workers it starts inherit them), the
    variables this run needs and the user did not set: torch's rendezvous switches
    (:data:`~elastic_runner.compat.rendezvous.RDZV_SWITCHES`) and ``OMP_NUM_THREADS`` (see
    :func:`omp_threads`; logged in one line). Yields what was set; restores the environment."""
    env: dict[str, str] = {}
    if "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(omp_threads(nproc_per_node, cores))
        log.info("OMP_NUM_THREADS=%s for each of the %d workers on this node (cores / workers; "
                 "set OMP_NUM_THREADS to choose)", env["OMP_NUM_THREADS"], nproc_per_node)
    for key, value in RDZV_SWITCHES.items():
        if key not in os.environ:
            env[key] = value
        elif os.environ[key] != value:
            log.warning("%s=%s (not %s): a node whose rank changes between rendezvous rounds "
                        "may hang the restarted group", key, os.environ[key], value)
    with environment(env):
        yield env


def torchrun_argv(args: argparse.Namespace) -> list[str]:
    """torchrun arguments for a ``run`` invocation (see ``elastic-runner run --help``).

    An option left unset on our command line is left to torchrun, which reads the matching
    ``PET_*`` variable (as set by the Kubeflow operator) and falls back to our default otherwise.
    """
    argv: list[str] = []
    pet = PetEnv.read()

    def opt(flag: str, value: object, default: object = None) -> None:
        if value is None and not pet.sets(flag):
            value = default
        if value is not None:
            argv.extend([flag, str(value)])

    # some training-operator releases inject PET_N_PROC_PER_NODE, which torchrun does not read
    nproc = args.nproc_per_node
    if nproc is None and not pet.sets("--nproc-per-node"):
        nproc = pet.n_proc_per_node
    opt("--nproc-per-node", nproc, default_nproc_per_node())
    opt("--nnodes", args.nnodes)
    endpoint, run_id = args.rdzv_endpoint, args.rdzv_id
    conf = ",".join(args.rdzv_conf) if args.rdzv_conf else None
    if (args.rdzv_backend in (None, "c10d") and not endpoint
            and not pet.sets("--rdzv-endpoint")):
        if pet.master_addr is not None and pet.rdzv_backend in (None, "c10d"):  # Kubeflow Trainer v2: c10d at node 0's agent
            endpoint, conf = trainer_rendezvous(conf)
        else:  # what torchrun --standalone does (in torchrun's run(), which we bypass)
            endpoint, run_id = "127.0.0.1:0", run_id or str(uuid.uuid4())
    opt("--rdzv-backend", args.rdzv_backend, "c10d")
    opt("--rdzv-endpoint", endpoint)
    opt("--rdzv-id", run_id)
    backend = args.rdzv_backend or pet.rdzv_backend
    if backend in ETCD_BACKENDS:  # either backend's spelling of TLS files and join timeout
        conf = conf if conf is not None else pet.rdzv_conf
        conf = ",".join(f"{k}={v}" for k, v in with_aliases(parse_conf(conf), backend).items())
        conf = conf or None
    opt("--rdzv-conf", conf)
    opt("--max-restarts", args.max_restarts, 3)
    # in-place recovery: the agent notices a dead worker within a tenth of a second
    opt("--monitor-interval", args.monitor_interval, 0.1 if in_place(args) else 1.0)
    # SIGTERM -> SIGKILL gap when the agent stops its workers (eviction): preemption.grace_seconds
    if shutdown_timeout_supported():
        opt("--shutdown-timeout", getattr(args, "shutdown_timeout", None))
    # torch's error files of the workers (what the root-cause line reads): in a directory
    # this run removes when it ends (torch's default, a fresh torchelastic_* directory in the
    # temp directory per run, was never removed); PET_LOG_DIR, if set, is kept
    opt("--log-dir", None if pet.sets("--log-dir") else getattr(args, "log_dir", None))
    if getattr(args, "script", None):  # a user's own training script and its arguments
        return [*argv, str(args.script), *args.script_args]
    argv += ["--module", "elastic_runner", "train", str(args.config), *args.overrides]
    if args.no_resume:
        argv.append("--no-resume")
    return argv


def trainer_rendezvous(conf: str | None) -> tuple[str, str | None]:
    """The c10d rendezvous endpoint and ``--rdzv-conf`` for a pod of a Kubeflow Trainer v2
    TrainJob, from what its torch plugin injects (``pkg/runtime/framework/plugins/torch``):
    ``PET_MASTER_ADDR`` (``<trainjob>-node-0-0.<trainjob>``, node 0's pod), ``PET_MASTER_PORT``
    (29400, :data:`TRAINER_PORT` when unset) and ``PET_NODE_RANK`` (the Job completion index).

    torchrun reads the first two only for its ``static`` rendezvous, which cannot re-form the
    group after a failure, so ``run`` uses them as the c10d endpoint instead: node 0's agent hosts
    the rendezvous store there (``is_host=true``; every other node ``is_host=false``, so no
    node's role depends on how the pod's host name resolves). ``conf`` (``k=v,...``, the
    user's ``--rdzv-conf`` or ``PET_RDZV_CONF``) wins where it sets ``is_host`` itself.
    """
    pet = PetEnv.read()
    port = pet.master_port or TRAINER_PORT
    endpoint = f"{pet.master_addr}:{port}"
    conf = conf if conf is not None else pet.rdzv_conf
    node_rank = pet.node_rank
    if node_rank is not None and "is_host" not in parse_conf(conf):
        conf = ",".join(filter(None, [conf, f"is_host={str(node_rank == '0').lower()}"]))
    log.info("rendezvous: c10d at %s (PET_MASTER_ADDR/PET_MASTER_PORT, Kubeflow Trainer), "
             "node rank %s", endpoint, node_rank)
    return endpoint, conf


def in_place(args: argparse.Namespace) -> bool:
    """Whether this ``run`` recovers in place (``recovery.mode: in_place``: the built-in
    trainer's config, or a script's ``--recovery``); otherwise a failed worker makes torchrun
    restart all of them."""
    recovery = getattr(args, "recovery", None)
    return recovery is not None and recovery.mode == "in_place"


def hosts_c10d_store(targs: argparse.Namespace) -> bool:
    """Whether this node hosts the c10d rendezvous store (torch's rule in
    ``c10d_rendezvous_backend._create_tcp_store``: ``is_host`` in ``--rdzv-conf``, else whether
    the endpoint's host names this machine)."""
    if targs.rdzv_backend != "c10d":
        return False
    conf = parse_conf(targs.rdzv_conf)
    if "is_host" in conf:
        return conf["is_host"].lower() in ("1", "true", "yes", "y")
    host, _ = parse_rendezvous_endpoint(targs.rdzv_endpoint, default_port=C10D_DEFAULT_PORT)
    return names_this_machine(host)


def multi_node(targs: argparse.Namespace) -> bool:
    """Whether more than one node may join (``--nnodes``' maximum above 1)."""
    return str(targs.nnodes).split(":")[-1] != "1"


def recovery_location(targs: argparse.Namespace) -> StoreLocation | None:
    """Where the in-place recovery store lives: None on one node (the agent hosts it), else
    the rendezvous backend's store (:mod:`elastic_runner.recovery.store`)."""
    if not multi_node(targs):
        return None
    return StoreLocation.for_rendezvous(targs.rdzv_backend, targs.rdzv_endpoint, targs.rdzv_id)


def launch(args: argparse.Namespace) -> int:
    """Run the agent until the job ends; returns the process exit code: 0 done; 2 a torch
    without an internal that a required fix relies on, or an etcd that cannot serve the
    rendezvous (both checked before the agent starts), or a worker's bad input (not
    restarted); 3 fenced out (``EXIT_FENCED``); 5 a crash loop stopped the job
    (``EXIT_CRASH_LOOP``); 143 preempted; 1 any other failed rendezvous or
    worker (e.g. ``--max-restarts`` spent)."""
    with tempfile.TemporaryDirectory(prefix="elastic-runner-") as log_dir:
        args.log_dir = log_dir
        return _launch(args)


def _launch(args: argparse.Namespace) -> int:
    targs = get_args_parser().parse_args(torchrun_argv(args))
    try:
        check_torch("agent")
    except TorchCompatError as e:
        print(f"elastic-runner: error: {e}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    apply_rendezvous_fixes()
    apply_agent_fixes(budget=getattr(args, "restarts", None))
    if targs.rdzv_backend in ETCD_BACKENDS:
        conf = parse_conf(targs.rdzv_conf)
        try:
            version = check_etcd(targs.rdzv_endpoint, conf,
                                 wait_seconds(conf, targs.rdzv_backend), targs.rdzv_backend)
        except EtcdCheckError as e:
            print(f"elastic-runner: error: {e}", file=sys.stderr, flush=True)
            return EXIT_BAD_INPUT
        log.info("rendezvous: etcd %s at %s (%s), run id %r", version, targs.rdzv_endpoint,
                 targs.rdzv_backend, targs.rdzv_id)
    with agent_environment(_local_world_size(targs.nproc_per_node)):
        return _launch_agent(args, targs)


def _local_world_size(nproc_per_node: str) -> int:
    try:
        return determine_local_world_size(nproc_per_node)
    except ValueError:  # config_from_args says what is wrong with it
        return 1


def _launch_agent(args: argparse.Namespace, targs: argparse.Namespace) -> int:
    config, cmd, cmd_args = config_from_args(targs)
    metrics = getattr(args, "metrics", None)
    endpoint = None
    if metrics is not None and metrics.enabled and metrics.port:
        try:  # before the rendezvous: the endpoint answers while the node waits for peers
            endpoint = NodeEndpoint(metrics, targs.rdzv_id, config.nproc_per_node)
        except OSError as e:
            print(f"elastic-runner: error: {e.strerror}", file=sys.stderr, flush=True)
            return EXIT_BAD_INPUT
    code = EXIT_FAILED
    agent = contextlib.nullcontext()
    location = None
    if in_place(args):
        try:
            location = recovery_location(targs)
        except ValueError as e:
            log.warning("recovery: %s; a failed worker restarts every worker", e)
    if in_place(args) and (location is not None or not multi_node(targs)):
        log.info("recovery: in place (a failed worker is replaced from a warm spare; the "
                 "others keep their process); recovery store: %s",
                 location.describe() if location else "this node's agent")
        if location is not None and args.recovery.continue_shrunk:
            log.warning("recovery.continue_shrunk applies on one node only: across nodes the "
                        "survivors wait for the replacement")
        policy = Policy.for_batch(config.min_nodes, getattr(args, "batch", None))
        agent = agent_class(functools.partial(
            InPlaceAgent, recovery=args.recovery, location=location, policy=policy,
            hosts_store=location is not None and hosts_c10d_store(targs),
            script=bool(getattr(args, "script", None)),
            on_replacement=endpoint.monitor.replaced if endpoint is not None else None))
    try:
        with agent, worker_start.forking(getattr(args, "fork_server", True)):
            code = _run_agent(targs, config, cmd, cmd_args)
        restarts = getattr(args, "restarts", None)
        if code == EXIT_FAILED and restarts is not None and restarts.looped:
            code = EXIT_CRASH_LOOP  # permanent for an operator, unlike a spent budget
    finally:
        if endpoint is not None:
            endpoint.close({EXIT_OK: "succeeded", EXIT_PREEMPTED: "stopped"}.get(code, "failed"))
    return code


def _run_agent(targs: argparse.Namespace, config: Any, cmd: Any, cmd_args: list[str]) -> int:
    """Run torch's elastic agent; each expected way it ends becomes one line and an exit code."""
    try:
        elastic_launch(config, cmd)(*cmd_args)
    except ChildFailedError as e:
        print(f"elastic-runner: job failed: {root_cause_line(e)}", flush=True)
        # fenced out (3), bad input (2: config, task, checkpoint) and preempted (143) keep
        # their meaning, whichever rank failed first
        codes = {f.exitcode for f in e.failures.values()}
        return next((c for c in (EXIT_FENCED, EXIT_BAD_INPUT, EXIT_PREEMPTED)
                     if c in codes), EXIT_FAILED)
    except SignalException as e:
        # the agent got SIGTERM/SIGINT (eviction) and stopped the workers, which checkpointed
        print(f"elastic-runner: stopped by {e.sigval.name}; workers checkpointed at their last "
              "step boundary", flush=True)
        return EXIT_PREEMPTED
    except RendezvousClosedError:
        kept = " (etcd keeps its state for 2 h)" if targs.rdzv_backend in ETCD_BACKENDS else ""
        print(f"elastic-runner: error: rendezvous {targs.rdzv_id!r} at {targs.rdzv_endpoint} "
              f"({targs.rdzv_backend}) is closed: a job with this --rdzv-id has already "
              f"ended{kept}; start the job with a new --rdzv-id", file=sys.stderr, flush=True)
        return EXIT_FAILED
    except RendezvousTimeoutError:
        key = "timeout" if targs.rdzv_backend == "etcd" else "join_timeout"
        limit = config.rdzv_configs.get(key, DEFAULT_JOIN_TIMEOUT_S)
        print(f"elastic-runner: error: rendezvous {targs.rdzv_id!r} at {targs.rdzv_endpoint} "
              f"({targs.rdzv_backend}) timed out: fewer than {config.min_nodes} node(s) "
              f"(--nnodes {targs.nnodes}) joined within {limit} s ({key}); start the other "
              "nodes with the same --rdzv-endpoint and --rdzv-id, or raise --rdzv-conf "
              "join_timeout=S", file=sys.stderr, flush=True)
        return EXIT_FAILED
    except (RendezvousError, etcd.EtcdException) as e:  # e.g. etcd lost during the run
        print(f"elastic-runner: error: rendezvous at {targs.rdzv_endpoint} "
              f"({targs.rdzv_backend}) failed: {rendezvous_cause(e)}", file=sys.stderr,
              flush=True)
        return EXIT_FAILED
    return EXIT_OK


def rendezvous_cause(err: BaseException) -> str:
    """``Type: first line`` of a rendezvous error and of the error it wraps (torch's etcd errors
    say "See inner exception for details")."""
    parts = []
    e: BaseException | None = err
    while e is not None and len(parts) < 2:
        parts.append(first_line(e))
        e = e.__cause__ or e.__context__
    return " <- ".join(parts)


def root_cause_line(err: ChildFailedError) -> str:
    """One line naming the first failing rank, its exit code and its recorded error (the error
    file written by ``@record``, or the signal that killed it). A rank that failed on its own
    comes before one that only lost it (exit 4) or that the agent stopped (SIGTERM), whatever
    their timestamps: torch's ``get_first_failure`` orders by error-file timestamps in whole
    seconds, so a crash and its peer's loss in the same second named the peer."""
    rank, failure = min(err.failures.items(),
                        key=lambda kv: (cause_rank(kv[1].exitcode), kv[1].timestamp, kv[0]))
    message = failure.message
    if isinstance(message, dict):  # the error-file layout written by @record / ErrorHandler
        message = message.get("message", "")
    lines = str(message or "").strip().splitlines()
    message = lines[0] if lines else "(no error recorded)"
    return (f"rank {rank} (local_rank {failure.local_rank}) exited with code "
            f"{failure.exitcode}: {message}")
