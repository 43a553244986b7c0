"""Recovery time: from a fault to the first completed optimizer step after the group resumed,
split into phases, for c10d and etcd-v2 rendezvous.

Scenarios (digits task, one gloo worker per CPU core, checkpoint every 10 steps, metrics on):

* ``sigkill``: one node, 2 workers; rank 1 SIGKILLs itself after step 35 (the runner's fault
  injection), the agent restarts the group (a *failure* restart);
* ``sigterm``: one node, 2 workers; rank 1 gets SIGTERM after step 35 (a preempted worker: all
  ranks checkpoint that step, exit 143, the agent restarts them);
* ``node-leave``: two agents ("nodes", 1 worker each, ``--nnodes 1:2``); node B's agent and
  worker are SIGKILLed after step 15; node A's worker fails in its next collective and A goes
  on alone (a new rendezvous round that waits ``last_call_timeout`` for more nodes);
* ``node-join``: then node C starts; A notices a waiting node at its next monitor tick, stops its
  worker (SIGTERM: it checkpoints the step) and both rendezvous (2 = max nodes: no last call).

Phases, read from the surviving agent's log (millisecond stamps; see ``worker.log_startup`` and
``agent_metrics.AgentMonitor``); they add up to the total by construction:

* ``detection``: fault (the fault's log line, the kill, or node C's launch) -> the agent acts
  (it signals the surviving workers, records the failed group, or stops workers for a new node);
* ``stop``: -> the agent enters the rendezvous (surviving workers exited);
* ``rendezvous``: torchelastic's ``_rendezvous`` duration (for ``node-leave`` mostly the last
  call);
* ``start+import``: -> the new worker enters ``main`` (spawn, interpreter, ``import torch``);
* ``process group``: ``init_process_group`` plus the per-attempt store namespace;
* ``data+model``: the task's data and model, DDP's parameter broadcast (digits imports
  scikit-learn here, ~1.3 s);
* ``ckpt load``: finding, verifying and loading the newest checkpoint;
* ``first step``: -> the first committed optimizer step after the resume.

``steps redone`` = the last step finished before the fault minus the step the group resumed
from. Times are medians over repeats (min-max in the JSON); every scenario runs in each repeat,
so drift on this shared machine hits all alike.

    python -m bench.recovery [--repeats 2] [--scenarios sigkill node-leave ...]
                             [--backends c10d etcd-v2] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import shutil
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

from elastic_runner.audit import read_entries
from tests.procs import CONFIGS, Job, cli, wait_until

from .common import etcd_server, free_port, spread

SCENARIOS = ("sigkill", "sigterm", "node-leave", "node-join")
BACKENDS = ("c10d", "etcd-v2")
PHASES = ("detection", "stop", "rendezvous", "start+import", "process group", "data+model",
          "ckpt load", "first step")
FAULT_STEP = 35
# as in tests/test_multinode.py: a lost node is declared dead after 1 s x 8 missed keep-alives
RDZV_CONF = "last_call_timeout=4,join_timeout=120,keep_alive_interval=1,keep_alive_max_attempt=8"
RUN_TIMEOUT_S = 180

_STAMP = r"(\d\d:\d\d:\d\d\.\d\d\d)"
_TORCH_STAMP = r"[WE]\d{4} (\d\d:\d\d:\d\d\.\d{3})\d*"
_DETECT = re.compile(rf"^(?:{_TORCH_STAMP} .*Sending process \d+ closing signal"
                     rf"|{_STAMP} INFO elastic_runner\.agent_metrics: (?:worker group "
                     r"(?:failed|unhealthy)|workers stopped for a membership change))")
_RDZV = re.compile(rf"^{_STAMP} INFO elastic_runner\.agent_metrics: rendezvous round \d+ took "
                   r"([\d.]+) s")
_STARTUP = re.compile(rf"^{_STAMP} \[rank0\] INFO elastic_runner\.worker: startup: interpreter "
                      r"and imports ([\d.]+) s, process group ([\d.]+) s, data and model "
                      r"([\d.]+) s, checkpoint load ([\d.]+) s")
_FAULT = re.compile(rf"^{_STAMP} \[rank1\] WARNING elastic_runner\.faults: fault")
_RESUMED = re.compile(rf"^{_STAMP} \[rank0\] INFO elastic_runner\.session: resumed from \S+: "
                      r"step (\d+)")


def _epoch(day: str, hms: str) -> float:
    return datetime.strptime(f"{day} {hms}", "%Y-%m-%d %H:%M:%S.%f").timestamp()


def phases(log: str, t_fault: float, first_step_time: float) -> dict[str, float]:
    """The phases (seconds) of the first recovery after ``t_fault`` in an agent's ``log``;
    ``first_step_time``: wall-clock time of the first step committed after the resume.

    Raises:
        RuntimeError: a line of the timeline is missing from the log.
    """
    day = datetime.fromtimestamp(t_fault).strftime("%Y-%m-%d")
    lines = log.splitlines()

    def first(pattern: re.Pattern[str], after: float) -> tuple[float, re.Match[str]]:
        for ln in lines:
            if (m := pattern.match(ln)) and (t := _epoch(day, m[1] or m[2])) >= after - 1e-3:
                return t, m
        raise RuntimeError(f"no line matching {pattern.pattern!r} after {after:.3f} in the "
                           f"log:\n{log[-3000:]}")

    t_detect, _ = first(_DETECT, t_fault)
    t_rdzv, m = first(_RDZV, t_detect)
    t_rdzv_start = t_rdzv - float(m[2])
    t_loaded, m = first(_STARTUP, t_rdzv)
    imports, group, data, load = (float(m[i]) for i in range(2, 6))
    t_main = t_loaded - load - data - group
    return {"detection": t_detect - t_fault, "stop": t_rdzv_start - t_detect,
            "rendezvous": t_rdzv - t_rdzv_start, "start+import": t_main - t_rdzv,
            "process group": group, "data+model": data, "ckpt load": load,
            "first step": first_step_time - t_loaded, "total": first_step_time - t_fault,
            "process start+import (worker's own clock)": imports}


def _trace_steps(trace: Path) -> list[tuple[float, int, int]]:
    """(time, step, world_size) of the committed steps in the sample trace (rank files)."""
    return sorted({(e["time"], e["step"], e["world_size"]) for e in read_entries(trace)
                   if "time" in e})


def _run_argv(backend: str, endpoint: str, rdzv_id: str, ck: Path, trace: Path, nnodes: str,
              nproc: int, max_steps: int, *extra: str, is_host: bool = True) -> list[str]:
    # c10d: the first node hosts the TCPStore at the endpoint (if it left, the rendezvous
    # would go with it; etcd has no such node); is_host says which one, no bind race
    conf = RDZV_CONF + (f",is_host={str(is_host).lower()}" if backend == "c10d" else "")
    return cli("run", str(CONFIGS / "digits.yaml"), "logging.tensorboard_dir=null",
               "early_stopping.enabled=false", f"checkpoint.dir={ck}",
               "checkpoint.every_steps=10", "training.log_every_steps=1",
               f"training.max_steps={max_steps}", "training.max_epochs=1000",
               f"metrics.port={free_port()}", *extra,
               "--nnodes", nnodes, "--nproc-per-node", str(nproc), "--rdzv-backend", backend,
               "--rdzv-endpoint", endpoint, "--rdzv-id", rdzv_id,
               "--rdzv-conf", conf, "--max-restarts", "3", "--monitor-interval", "0.1",
               "--trace-samples", str(trace))


def single_node(kind: str, backend: str, endpoint: str, workdir: Path) -> dict[str, float]:
    """``sigkill`` or ``sigterm`` of rank 1 after step 35 on one node with 2 workers."""
    ck, trace = workdir / "ck", workdir / "trace"
    workdir.mkdir(parents=True)
    t_start = time.time()
    job = Job(_run_argv(backend, endpoint, f"bench-{time.time_ns()}", ck, trace, "1", 2, FAULT_STEP + 10,
                        f"faults.inject=[{{kind: {kind}, rank: 1, step: {FAULT_STEP}}}]"),
              workdir / "node.log")
    try:
        if job.wait(RUN_TIMEOUT_S) != 0:
            raise RuntimeError(f"{kind}/{backend}: run failed:\n{job.output[-3000:]}")
    finally:
        job.kill_all()
    log = job.output
    day = datetime.fromtimestamp(t_start).strftime("%Y-%m-%d")
    t_fault = _epoch(day, next(m[1] for ln in log.splitlines() if (m := _FAULT.match(ln))))
    # a SIGTERM after FAULT_STEP makes every rank discard the next step and checkpoint this one
    return _measure(log, t_fault, trace, FAULT_STEP)


def _measure(log: str, t_fault: float, trace: Path, last_done: int) -> dict[str, float]:
    t_resumed, resumed_step = _resumed(log, t_fault)
    t_first = min(t for t, _, _ in _trace_steps(trace) if t > t_resumed)
    out = phases(log, t_fault, t_first)
    out["steps_redone"] = last_done - resumed_step
    return out


def _resumed(log: str, after: float) -> tuple[float, int]:
    """Time and step of the first "resumed from" line of rank 0 at or after ``after``."""
    day = datetime.fromtimestamp(after).strftime("%Y-%m-%d")
    return next((t, int(m[2])) for ln in log.splitlines()
                if (m := _RESUMED.match(ln)) and (t := _epoch(day, m[1])) >= after - 1e-3)


def node_leave_join(backend: str, endpoint: str, workdir: Path
                    ) -> tuple[dict[str, float], dict[str, float]]:
    """Nodes A and B (1 worker each), B lost (SIGKILL of agent and worker) at world size 2,
    then C joins; the phases of both recoveries, read from A's log."""
    ck, trace = workdir / "ck", workdir / "trace"
    rdzv_id = f"bench-{time.time_ns()}"
    workdir.mkdir(parents=True)

    def start(name: str) -> Job:  # each node serves its metrics on a port of its own
        return Job(_run_argv(backend, endpoint, rdzv_id, ck, trace, "1:2", 1, 100000,
                             "batch.micro_batch_size=4", "batch.global_batch_size=16",
                             is_host=name == "a"), workdir / f"node-{name}.log")

    jobs = [start("a")]
    try:
        jobs.append(start("b"))

        def world(ws: int, n: int, after: float = 0.0) -> bool:
            return sum(1 for t, _, w in _trace_steps(trace) if w == ws and t > after) >= n

        wait_until(lambda: world(2, 15), RUN_TIMEOUT_S, "15 steps at world size 2")
        t_kill = time.time()
        jobs[1].kill_all()
        last_done = max(s for _, s, _ in _trace_steps(trace))
        wait_until(lambda: world(1, 10, t_kill), RUN_TIMEOUT_S,
                   "10 steps at world size 1 after node B was lost")
        leave = _measure(jobs[0].output, t_kill, trace, last_done)
        t_join = time.time()
        jobs.append(start("c"))
        wait_until(lambda: world(2, 3, t_join), RUN_TIMEOUT_S,
                   "3 steps at world size 2 after node C joined")
        log = jobs[0].output
        # the steps A finished before it stopped its worker for C
        last_done = max(s for t, s, w in _trace_steps(trace)
                        if w == 1 and t < _resumed(log, t_join)[0])
        join = _measure(log, t_join, trace, last_done)
    finally:
        for job in jobs:
            job.kill_all()
    return leave, join


def run_repeat(scenarios: list[str], backends: list[str], etcd: str | None,
               workdir: Path) -> dict[str, dict[str, float]]:
    """One run of every (scenario, backend) pair; keyed ``"scenario/backend"``."""
    out: dict[str, dict[str, float]] = {}
    for backend in backends:
        endpoint = etcd if backend == "etcd-v2" and etcd else f"127.0.0.1:{free_port()}"
        for kind in ("sigkill", "sigterm"):
            if kind in scenarios:
                out[f"{kind}/{backend}"] = single_node(kind, backend, endpoint,
                                                       workdir / f"{kind}-{backend}")
        if {"node-leave", "node-join"} & set(scenarios):
            leave, join = node_leave_join(backend, endpoint, workdir / f"nodes-{backend}")
            for kind, result in (("node-leave", leave), ("node-join", join)):
                if kind in scenarios:
                    out[f"{kind}/{backend}"] = result
    return out


def summarize(repeats: list[dict[str, dict[str, float]]]) -> dict[str, dict]:
    """Per ``scenario/backend``: median/min/max of each phase, the total and steps redone."""
    keys = [*PHASES, "total", "steps_redone"]
    return {case: {k: spread([r[case][k] for r in repeats]) for k in keys}
            for case in repeats[0]}


def print_table(summary: dict[str, dict]) -> None:
    cols = [*PHASES, "total"]
    print(f"{'scenario/backend':<20}" + "".join(f"{c:>14}" for c in cols) + f"{'redone':>8}")
    for case, s in summary.items():
        print(f"{case:<20}" + "".join(f"{s[c]['median']:>14.2f}" for c in cols)
              + f"{s['steps_redone']['median']:>8.0f}")
    print("(seconds, medians; fault -> first committed step after the resume; see the module "
          "docstring for the phases)")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    p.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    p.add_argument("--dir", default=None, help="keep the runs' logs here (default: a temporary "
                   "directory, removed)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    backends = list(args.backends)
    if "etcd-v2" in backends and shutil.which("etcd") is None:
        print("etcd not on PATH (Debian: apt-get install etcd-server): etcd-v2 skipped",
              file=sys.stderr)
        backends.remove("etcd-v2")
    with contextlib.ExitStack() as stack:
        d = args.dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="recovery-"))
        etcd = stack.enter_context(etcd_server()) if "etcd-v2" in backends else None
        repeats = [run_repeat(args.scenarios, backends, etcd, Path(d) / str(i))
                   for i in range(args.repeats)]
    summary = summarize(repeats)
    print_table(summary)
    result = {"rdzv_conf": RDZV_CONF, "monitor_interval_s": 0.1, "repeats": repeats,
              "summary": summary}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
