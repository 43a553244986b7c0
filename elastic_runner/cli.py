"""Command line: ``elastic-runner {run,train,validate,schema,checkpoints,audit,export,evaluate,
generate}``.

Options and ``key.path=value`` overrides may come in any order after the command (and ``-v``
before or after it).

Exit codes: :mod:`elastic_runner.exit_codes` (listed by ``elastic-runner --help``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .agent.restart_budget import RestartBudget
from .checkpoint.storage import (
    CheckpointError,
    newest_checkpoint_step,
    newest_checkpoint_step_named_in,
)
from .config_base import ConfigError
from .exit_codes import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, described

log = logging.getLogger("elastic_runner.cli")

if TYPE_CHECKING:
    from .data.audit import EpochReport



class _IntermixedParser(argparse.ArgumentParser):
    """A subcommand parser that accepts options between and after its positionals
    (``run c.yaml --nnodes 2 training.max_steps=10``), through ``parse_known_intermixed_args``,
    and ``-v/--verbose`` after the subcommand too."""

    _intermixing = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # SUPPRESS: when not given here, the main parser's value stands
        self.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                          help="debug logging")

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None
                         ) -> tuple[argparse.Namespace, list[str]]:
        if self._intermixing:  # the intermixed parse calls back in here (Python < 3.13)
            return super().parse_known_args(args, namespace)
        self._intermixing = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._intermixing = False


def _add_config(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="YAML config file")
    p.add_argument("overrides", nargs="*", metavar="key.path=value",
                   help="config overrides, values parsed as YAML (e.g. optimizer.lr=3e-4)")


def _add_trace(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace-samples", metavar="DIR", default=None,
                   help="record the sample indices of every committed optimizer step, one JSONL "
                        "file per rank in DIR (same as audit.trace_dir=DIR); check with "
                        "'elastic-runner audit DIR'")


def _overrides(args: argparse.Namespace) -> list[str]:
    extra = [f"audit.trace_dir={args.trace_samples}"] if args.trace_samples else []
    return [*args.overrides, *extra]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="elastic-runner",
        description="Fault-tolerant elastic DDP and FSDP2 training on torchrun: in-place "
                    "recovery, atomic checkpoints, automatic resume, rank-0 early stopping.",
        epilog="exit codes: " + "; ".join(f"{code} {name.removeprefix('EXIT_').lower().replace('_', ' ')}"
                                          for name, code, _ in described()))
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                parser_class=_IntermixedParser)

    _add_run(sub)
    _add_other_commands(sub)
    return parser


def _add_run(sub: Any) -> None:
    p = sub.add_parser("run", help="launch the workers with torchrun's elastic agent "
                                   "(in this process)",
                       description="Launch the workers with torchrun's elastic agent in this "
                                   "process. Options left unset fall back to torchrun's PET_* "
                                   "environment variables, then to the defaults shown. "
                                   "With PET_MASTER_ADDR (Kubeflow Trainer v2) and no "
                                   "rendezvous endpoint, the rendezvous is c10d at "
                                   "PET_MASTER_ADDR:PET_MASTER_PORT, hosted by node rank 0.")
    p.add_argument("config", help="YAML config file, or your own training script (a .py file "
                                  "using elastic_runner.fault_tolerant)")
    p.add_argument("overrides", nargs="*", metavar="key.path=value",
                   help="config overrides, values parsed as YAML (e.g. optimizer.lr=3e-4); for "
                        "a script: its arguments, after '--'")
    p.add_argument("--nproc-per-node", type=int, default=None,
                   help="workers on this node (default: one per GPU, 2 on CPU)")
    p.add_argument("--nnodes", default=None, metavar="MIN:MAX",
                   help="number of nodes, or an elastic range such as 1:4 (default 1)")
    p.add_argument("--rdzv-backend", choices=["c10d", "etcd", "etcd-v2"], default=None,
                   help="rendezvous backend (default: embedded c10d store, standalone)")
    p.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                   help="rendezvous endpoint (etcd client URL host:port, default port 2379; or "
                        "the c10d store host); an etcd endpoint is checked before the agent "
                        "starts")
    p.add_argument("--rdzv-id", default=None,
                   help="job id shared by all nodes of one job; new for every job on a "
                        "persistent etcd (an ended job's rendezvous stays closed for 2 h)")
    p.add_argument("--rdzv-conf", action="append", metavar="KEY=VALUE",
                   help="extra rendezvous options passed to torchrun (repeatable or "
                        "comma-separated), e.g. join_timeout=600, last_call_timeout=30, "
                        "read_timeout=60; etcd TLS: protocol=https, cacert=CA.pem, "
                        "cert=CLIENT.pem, key=CLIENT.key (etcd-v2's spellings ca_cert, ssl_cert, "
                        "ssl_cert_key also work)")
    p.add_argument("--max-restarts", type=int, default=None,
                   help="worker-group restarts before the job fails (default 3)")
    p.add_argument("--monitor-interval", type=float, default=None, metavar="S",
                   help="seconds between the agent's worker health checks (default 0.1 with "
                        "in-place recovery, else 1.0)")
    p.add_argument("--no-resume", action="store_true", help="ignore existing checkpoints")
    p.add_argument("--recovery", dest="recovery_mode", choices=["in_place", "restart"],
                   default=None,
                   help="a script's recovery (default in_place: a failed worker is replaced "
                        "from a warm spare, the others keep their process; restart: every "
                        "worker restarts from the newest checkpoint); a config sets "
                        "recovery.mode instead")
    p.add_argument("--no-fork-server", dest="fork_server", action="store_false",
                   help="start every worker, replacement and spare as a new interpreter "
                        "(subprocess.Popen, as torchrun does) instead of forking it from the "
                        "node's fork server, which has imported torch and the runner once")
    p.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="serve the node's metrics and health endpoints on PORT (same as "
                        "metrics.port=PORT)")
    _add_trace(p)
    p.set_defaults(func=cmd_run)


def _add_other_commands(sub: Any) -> None:
    p = sub.add_parser("train", help="worker entry point (started by torchrun, or alone as "
                                     "world size 1)")
    _add_config(p)
    p.add_argument("--no-resume", action="store_true", help="ignore existing checkpoints")
    _add_trace(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("validate", help="check a config and print the resolved values")
    _add_config(p)
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("schema",
                       help="print the JSON Schema of a config file",
                       description="Print the JSON Schema (draft 2020-12) of a config file, for "
                                   "editors and CI. The data/model sections are open unless "
                                   "--task names the task that types them.")
    p.add_argument("--task", default=None,
                   help="type the data/model sections with this task's classes (built-in name, "
                        "installed entry point or package.module:build)")
    p.set_defaults(func=cmd_schema)

    p = sub.add_parser("checkpoints", help="list checkpoints (step, epoch, world size, time, "
                                           "size, validity)")
    p.add_argument("dir", help="checkpoint directory (checkpoint.dir)")
    p.add_argument("--verify", action="store_true", help="also check every file's sha256")
    p.set_defaults(func=cmd_checkpoints)

    p = sub.add_parser("audit", help="check a sample trace: per epoch, expected samples, seen "
                                     "once, missing, duplicated")
    p.add_argument("trace", help="trace directory (--trace-samples / audit.trace_dir)")
    p.set_defaults(func=cmd_audit)

    p = sub.add_parser("export", help="write weights (safetensors), config, preprocessing and "
                                      "tokenizer; a transformers model in its save_pretrained "
                                      "layout (loadable with from_pretrained)")
    p.add_argument("checkpoint", help="checkpoint directory, or a checkpoint.dir (newest)")
    p.add_argument("out_dir")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("evaluate", help="report the task's metrics on its test split")
    _add_config(p)
    p.add_argument("--checkpoint", required=True,
                   help="checkpoint directory, or a checkpoint.dir (newest valid)")
    p.add_argument("--split", choices=["train", "val", "test"], default="test")
    p.set_defaults(func=cmd_evaluate)

    p = sub.add_parser("generate", help="print a sample from a generative task's checkpoint")
    p.add_argument("checkpoint", help="checkpoint directory, or a checkpoint.dir (newest)")
    p.add_argument("--prompt", default="def ")
    p.add_argument("--max-new-tokens", type=int, default=300,
                   help="characters (char_lm) or tokens (a transformers model, capped by its "
                        "context)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_generate)


def cmd_run(args: argparse.Namespace) -> int:
    from .agent.launch import launch
    from .config import load_config

    if args.config.endswith(".py"):
        return _run_script(args)
    if args.recovery_mode is not None:
        raise ConfigError("--recovery applies to scripts; a config sets recovery.mode "
                          f"(recovery.mode={args.recovery_mode})")
    args.overrides = _overrides(args)
    if args.metrics_port is not None:
        args.overrides.append(f"metrics.port={args.metrics_port}")
    cfg = load_config(args.config, args.overrides)  # fail fast, before any worker starts
    args.shutdown_timeout = cfg.preemption.grace_seconds
    args.metrics = cfg.metrics
    args.recovery = cfg.recovery
    args.batch = cfg.batch  # which world sizes a node's departure may leave
    args.restarts = RestartBudget(cfg.restarts.preemption, cfg.restarts.peer_lost,
                                  cfg.restarts.crash_loop,
                                  newest_checkpoint_step(cfg.checkpoint.dir))
    return launch(args)


def _run_script(args: argparse.Namespace) -> int:
    """``run SCRIPT.py ... -- ARGS``: the agent starts your own training script (see
    ``examples/own_loop.py``) instead of the built-in trainer; the preemption grace and the
    metrics endpoint take the config's defaults and ``--metrics-port``."""
    from .agent.config import PreemptionConfig
    from .agent.launch import launch
    from .observe.config import MetricsConfig
    from .protocol.env import CHECKPOINT_DIR_FILE_ENV, NO_RESUME_ENV, TRACE_DIR_ENV
    from .protocol.scoped_env import environment
    from .recovery.script import script_recovery_config

    if not Path(args.config).is_file():
        raise ConfigError(f"training script {args.config} not found")
    # the workers read them (own_loop.fault_tolerant), the spares and restarts too
    if args.trace_samples:
        os.environ[TRACE_DIR_ENV] = str(args.trace_samples)
    if args.no_resume:
        os.environ[NO_RESUME_ENV] = "1"
    args.script, args.script_args = args.config, list(args.overrides)
    args.shutdown_timeout = PreemptionConfig().grace_seconds
    args.metrics = MetricsConfig(port=args.metrics_port)
    # in place when the script's loop is fault_tolerant (recovery/script.py); a script that
    # is not recovers through the restart path all the same: its workers exit on a failure
    args.recovery = script_recovery_config(args.recovery_mode)
    args.batch = None  # the runner does not know a script's batch: any world size
    # the restart budget's defaults; a crash loop looks at the checkpoints of the directory
    # the script's fault_tolerant loop names in a file of ours (by the failures alone without)
    with tempfile.TemporaryDirectory(prefix="elastic-runner-") as ours:
        named_in = os.path.join(ours, "checkpoint_dir")
        args.restarts = RestartBudget(progress=newest_checkpoint_step_named_in(named_in))
        with environment({CHECKPOINT_DIR_FILE_ENV: named_in}):
            return launch(args)


def cmd_train(args: argparse.Namespace) -> int:
    from .worker import main as worker_main

    return worker_main(args.config, _overrides(args), resume=not args.no_resume,
                       verbose=args.verbose)


def cmd_validate(args: argparse.Namespace) -> int:
    from .config import dump_yaml, load_config

    cfg = load_config(args.config, args.overrides)
    print(f"# {args.config}: valid (config hash {cfg.fingerprint()})")
    print(dump_yaml(cfg), end="")
    return EXIT_OK


def cmd_schema(args: argparse.Namespace) -> int:
    from .config import config_schema

    print(json.dumps(config_schema(args.task), indent=2))
    return EXIT_OK


def cmd_checkpoints(args: argparse.Namespace) -> int:
    from .checkpoint import storage as ckpt

    infos = ckpt.list_checkpoints(args.dir)
    if not infos:
        print(f"no checkpoints in {args.dir}")
        return EXIT_OK
    print(f"{'name':<20} {'step':>8} {'epoch':>5} {'world':>5} {'time (UTC)':<19} "
          f"{'size':>10}  status")
    for c in infos:
        if args.verify and c.valid:
            c = ckpt.inspect(c.path, verify=True)
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(c.time)) if c.time else "-"
        print(f"{c.name:<20} {c.step:>8} {_dash(c.epoch):>5} {_dash(c.world_size):>5} "
              f"{when:<19} {c.size_bytes / 2**20:>8.2f}MB  "
              f"{'valid' if c.valid else 'INVALID: ' + c.reason}")
    return EXIT_OK


def _dash(v: object) -> str:
    return "-" if v is None else str(v)


def cmd_audit(args: argparse.Namespace) -> int:
    """Exit 0 when every complete epoch trained each expected sample exactly once, else 1."""
    from .data.audit import audit

    reports = audit(args.trace)
    if not reports:
        print(f"no trace entries in {args.trace}")
        return EXIT_FAILED
    print(f"{'epoch':>5} {'status':<11} {'steps':>6} {'expected':>8} {'seen once':>9} "
          f"{'missing':>7} {'duplicated':>10} {'unexpected':>10} {'dropped tail':>12} "
          f"{'repaired':>8}")
    for r in reports:
        _print_epoch(r)
    return EXIT_OK if all(r.ok for r in reports) else EXIT_FAILED


def _print_epoch(r: EpochReport) -> None:
    """One epoch's row of ``audit``, then the indices that are wrong and how many entries hold
    the sampler's plan rather than the loader's record of the fetch."""
    status = ("ok" if r.ok else "FAILED") if r.complete else "in progress"

    def known(v: int) -> int | str:  # only a complete epoch knows what it expected
        return v if r.complete else "-"

    print(f"{r.epoch:>5} {status:<11} {r.steps:>6} {_dash(r.expected):>8} {r.seen_once:>9} "
          f"{known(len(r.missing)):>7} {len(r.duplicated):>10} {known(len(r.unexpected)):>10} "
          f"{known(r.dropped):>12} {r.repaired:>8}")
    for label, items in (("missing", r.missing), ("duplicated", r.duplicated),
                         ("unexpected", r.unexpected)):
        if items:
            print(f"      {label}: {items[:20]}{' ...' if len(items) > 20 else ''}")
    if r.wrong_tail:
        print(f"      dropped tail: {r.wrong_tail}")
    if r.repaired:
        print(f"      repaired: {r.repaired} entries written from the sampler for ranks that "
              "died before writing them")
    if r.planned:
        print(f"      planned: {r.planned} entries hold the sampler's plan, not the fetch")


def cmd_export(args: argparse.Namespace) -> int:
    from .tasks.export import export

    out, files = export(args.checkpoint, args.out_dir)
    print(f"exported to {out}: {', '.join(files)}")
    return EXIT_OK


def cmd_evaluate(args: argparse.Namespace) -> int:
    from .config import load_config
    from .tasks.export import evaluate_split, model_from_checkpoint

    cfg = load_config(args.config, args.overrides)
    _, bundle, model, state = model_from_checkpoint(cfg, args.checkpoint)
    metrics = evaluate_split(bundle, model, args.split)
    print(json.dumps({"step": state["train_state"]["step"], **metrics}, indent=1))
    return EXIT_OK


def cmd_generate(args: argparse.Namespace) -> int:
    from .tasks.export import model_from_checkpoint, sample

    cfg, bundle, model, _ = model_from_checkpoint(None, args.checkpoint)
    text = sample(bundle, model, args.prompt, args.max_new_tokens, args.seed)
    if text is None:
        print(f"elastic-runner: task {cfg.task!r} is not generative", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(text)
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s.%(msecs)03d %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except (ConfigError, CheckpointError) as e:
        print(f"elastic-runner: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
