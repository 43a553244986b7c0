"""``elastic-runner run``: start the workers through torch.distributed.run, in this process.

The command line is translated into torchrun's own arguments and parsed by torchrun's parser, so
everything torchrun documents holds, including defaults from the ``PET_*`` environment variables
that the Kubeflow training operator sets. The agent runs in this process (no shell-out); the
workers run ``python -m elastic_runner train CONFIG [overrides]``.
"""

from __future__ import annotations

import argparse
import logging
import os
import uuid

import torch
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import elastic_launch
from torch.distributed.run import config_from_args, get_args_parser

log = logging.getLogger(__name__)


def default_nproc_per_node() -> int:
    """One worker per GPU; two on a CPU-only machine."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def torchrun_argv(args: argparse.Namespace) -> list[str]:
    """torchrun arguments for a ``run`` invocation (see ``elastic-runner run --help``).

    An option left unset on our command line is left to torchrun, which reads the matching
    ``PET_*`` variable (as set by the Kubeflow operator) and falls back to our default otherwise.
    """
    argv: list[str] = []

    def opt(flag: str, value: object, default: object = None) -> None:
        env = "PET_" + flag.lstrip("-").upper().replace("-", "_")
        if value is None and env not in os.environ:
            value = default
        if value is not None:
            argv.extend([flag, str(value)])

    opt("--nproc-per-node", args.nproc_per_node, default_nproc_per_node())
    opt("--nnodes", args.nnodes)
    endpoint, run_id = args.rdzv_endpoint, args.rdzv_id
    if (args.rdzv_backend in (None, "c10d") and not endpoint
            and "PET_RDZV_ENDPOINT" not in os.environ):
        # what torchrun --standalone does (in torchrun's run(), which we bypass), on loopback
        endpoint, run_id = "127.0.0.1:0", run_id or str(uuid.uuid4())
    opt("--rdzv-backend", args.rdzv_backend, "c10d")
    opt("--rdzv-endpoint", endpoint)
    opt("--rdzv-id", run_id)
    opt("--rdzv-conf", ",".join(args.rdzv_conf) if args.rdzv_conf else None)
    opt("--max-restarts", args.max_restarts, 3)
    opt("--monitor-interval", args.monitor_interval, 1.0)
    argv += ["--module", "elastic_runner", "train", str(args.config), *args.overrides]
    if args.no_resume:
        argv.append("--no-resume")
    return argv


def launch(args: argparse.Namespace) -> int:
    """Run the agent until the job ends; returns the process exit code."""
    targs = get_args_parser().parse_args(torchrun_argv(args))
    config, cmd, cmd_args = config_from_args(targs)
    try:
        elastic_launch(config, cmd)(*cmd_args)
    except ChildFailedError as e:
        print(f"elastic-runner: job failed: {root_cause_line(e)}", flush=True)
        return 1
    return 0


def root_cause_line(err: ChildFailedError) -> str:
    """One line naming the first failing rank, its exit code and its recorded error (the error
    file written by ``@record``, or the signal that killed it)."""
    rank, failure = err.get_first_failure()
    lines = str(failure.message or "").strip().splitlines()
    message = lines[0] if lines else "(no error recorded)"
    return (f"rank {rank} (local_rank {failure.local_rank}) exited with code "
            f"{failure.exitcode}: {message}")
