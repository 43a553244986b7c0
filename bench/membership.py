"""ETTR with a node preempted and returning, restart path vs in place, in one run.

Two "nodes" (network namespaces with their own addresses, ``tests/netns.py``; needs root and
iproute2), one worker each, digits with ``batch.global_batch_size=64`` (so world sizes 1 and 2
train the same global batch), c10d with the store on node 0, ``--nnodes 1:2`` and
``last_call_timeout=1`` (the round completes 1 s after it has the minimum). For each path
(``recovery.mode``: ``restart``, then ``in_place``) the job runs ``--seconds`` (300); every
``--interval`` (60) seconds node 1's agent gets SIGTERM (a spot notice or an eviction) and, once
it exited, node 1 starts again (the replacement pod). On the restart path every change stops
every worker and resumes from the newest checkpoint; in place, node 1's workers leave at a step
boundary and the new ones join at one, node 0's worker keeping its process.

Measured from rank 0's metrics (node 0's agent serves them): the ETTR (productive seconds / job
wall seconds, ``observe/goodput.py``) and the seconds by cause, once node 1 has rejoined the last time
and rank 0 published after it; the membership changes and restarts the logs show next to the
signals sent.

Run: ``python -m bench.membership [--seconds 300] [--interval 60] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import RANK0_STEP, REPO
from bench.recovery import GOODPUT_CAUSES, scrape_goodput
from tests.netns import Nodes
from tests.procs import Job, wait_until

PATHS = ("restart", "in_place")
RDZV_PORT = 29400
METRICS_PORT = 9400
LOG_EVERY = 20
START_TIMEOUT_S = 300.0
_JOINED = re.compile(r"membership: node\(s\) \[\d+\] join after step")
_LEFT = re.compile(r"membership: node\(s\) \[\d+\] preempted after step")
_RESUMED = re.compile(r"\[rank0\] INFO elastic_runner\.train\.session: resumed from")
_AT_TWO = re.compile(r"\[rank0\] INFO elastic_runner\.[\w.]+: task \w+: .* world size 2;")


def _argv(nodes: Nodes, i: int, path: str, workdir: Path) -> list[str]:
    return nodes.argv(i, [
        sys.executable, "-m", "elastic_runner", "run", str(REPO / "configs" / "digits.yaml"),
        "logging.tensorboard_dir=null", "early_stopping.enabled=false", "eval.every_steps=0",
        "training.max_steps=100000000", "training.max_epochs=100000000",
        "checkpoint.every_steps=50", f"checkpoint.dir={workdir / 'ck'}",
        f"training.log_every_steps={LOG_EVERY}", "batch.global_batch_size=64",
        f"recovery.mode={path}", "recovery.spare=false", "metrics.address=0.0.0.0",
        "faults.inject=[{kind: slow, rank: 0, step: 1, count: 1000000000, seconds: 0.02}]",
        "--metrics-port", str(METRICS_PORT), "--nnodes", "1:2", "--nproc-per-node", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{nodes.address(0)}:{RDZV_PORT}",
        "--rdzv-id", "bench", "--max-restarts", "1000",
        "--rdzv-conf", f"is_host={'true' if i == 0 else 'false'},last_call_timeout=1"])


def _start(nodes: Nodes, i: int, path: str, workdir: Path, n: int) -> Job:
    return Job(_argv(nodes, i, path, workdir), workdir / f"node{i}-{n}.log", env=nodes.env(i))


def _last_step(log: str) -> int:
    steps = RANK0_STEP.findall(log)
    return int(steps[-1]) if steps else 0


def run_path(path: str, seconds: float, interval: float, workdir: Path) -> dict[str, Any]:
    """One job on ``path`` for ``seconds`` with node 1 preempted and restarted every
    ``interval`` seconds; its ETTR and seconds by cause (rank 0's account), the signals sent
    and what the logs show."""
    nodes = Nodes(2)
    workdir.mkdir(parents=True)
    jobs = [_start(nodes, 0, path, workdir, 0), _start(nodes, 1, path, workdir, 0)]
    preempted = 0
    try:
        wait_until(lambda: _last_step(jobs[0].output) > 0, START_TIMEOUT_S, "the first step")
        t0 = time.time()
        next_change = t0 + interval
        back = 0
        while next_change < t0 + seconds:  # pacing the preemptions, not waiting for an event
            time.sleep(max(0.0, next_change - time.time()))
            jobs[-1].proc.send_signal(signal.SIGTERM)
            preempted += 1
            jobs[-1].wait(timeout=120)
            back = len(_AT_TWO.findall(jobs[0].output))  # rank 0's builds at world size 2
            jobs.append(_start(nodes, 1, path, workdir, preempted))
            next_change += interval
        time.sleep(max(0.0, t0 + seconds - time.time()))
        # the figures of a live rank 0 that logged after node 1 came back the last time
        wait_until(lambda: len(_AT_TWO.findall(jobs[0].output)) > back, START_TIMEOUT_S,
                   "node 1 back")
        settled = _last_step(jobs[0].output)
        wait_until(lambda: _last_step(jobs[0].output) > settled + LOG_EVERY, START_TIMEOUT_S,
                   "a logging step after node 1 came back")
        if jobs[0].proc.poll() is not None:
            raise RuntimeError(f"{path}: node 0's job ended:\n{jobs[0].output[-3000:]}")
        figures = scrape_goodput(METRICS_PORT, nodes.address(0))
        log = jobs[0].output
    finally:
        for job in jobs:
            job.kill_all()
        nodes.close()
    wall = figures["productive"] / figures["ettr"] if figures.get("ettr") else float("nan")
    return {**figures, "wall": wall, "preempted": preempted,
            "left_in_place": len(_LEFT.findall(log)), "joined_in_place": len(_JOINED.findall(log)),
            "resumed_from_checkpoint": len(_RESUMED.findall(log))}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=300.0)
    p.add_argument("--interval", type=float, default=60.0)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    out: dict[str, Any] = {"seconds": args.seconds, "interval": args.interval,
                           "date": time.strftime("%Y-%m-%d"), "paths": {}}
    with tempfile.TemporaryDirectory(prefix="bench-membership-") as tmp:
        for path in PATHS:
            out["paths"][path] = run_path(path, args.seconds, args.interval, Path(tmp) / path)
    print(f"{'path':<10}{'ETTR':>7}{'wall':>8}{'preempt':>9}{'left':>6}{'joined':>8}"
          f"{'resumed':>9}" + "".join(f"{c:>12}" for c in GOODPUT_CAUSES))
    for path, r in out["paths"].items():
        print(f"{path:<10}{r.get('ettr', float('nan')):>7.3f}{r['wall']:>8.1f}"
              f"{r['preempted']:>9}{r['left_in_place']:>6}{r['joined_in_place']:>8}"
              f"{r['resumed_from_checkpoint']:>9}"
              + "".join(f"{r.get(c, 0.0):>12.1f}" for c in GOODPUT_CAUSES))
    print("(ETTR = productive seconds / job wall seconds, rank 0's account; left/joined: "
          "membership changes in place; resumed: rank 0's loads of a checkpoint)")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
