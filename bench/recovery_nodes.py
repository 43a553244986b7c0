"""In-place recovery across nodes: kill -> first committed step, per world size and backend.

Each "node" is a network namespace with its own address (``tests/netns.py``; needs root and
iproute2), running its own ``elastic-runner run`` of digits with a slowed rank 0 (so a fault
never lands after the run ends). For each layout (nodes x workers per node) and rendezvous
backend (c10d with the store on node 0, or etcd-v2 on the bridge), the benchmark waits until
the target node's warm spare is ready, then

* ``sigkill``: SIGKILLs a worker of the last node (not the c10d store's host), or
* ``sigstop``: freezes it with SIGSTOP (its agent finds it by its heartbeat,
  ``recovery.heartbeat_timeout_seconds``, and kills it),

and measures, from the sample trace's commit times, the seconds from the signal to the first
step that every rank committed after the signal and after the victim's own last one (no rank
can commit that step before the victim's place is filled), and the steps redone (the last step
committed before the signal minus the step the group went on from, plus one if positive). Recoveries are counted from the logs
(``in-place recovery N done``), not from the signals sent; a fault that did not lead to an
in-place recovery (a restart) is reported in ``restarts``.

Run: ``python -m bench.recovery_nodes [--faults N] [--layouts 2x1,2x2,4x2] [--backends
c10d,etcd-v2] [--out docs/bench/recovery-nodes.json]``.
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

import psutil

from bench.common import IN_PLACE_DONE, REPO, spread
from tests.etcd import EtcdServer
from tests.netns import Nodes
from tests.procs import Job, wait_until

HEARTBEAT_S = 2.0
_REPLACED = re.compile(r"rank\(s\) \[(\d+)\] exited with code\(s\) \[(-?\d+)\]: replaced in "
                       r"place by (\w+) spare\(s\) pid\(s\) \[(\d+)\]")
_READY = re.compile(r"spare (\S+) ready")


def _argv(nodes: Nodes, i: int, workdir: Path, nproc: int, backend: str,
          endpoint: str) -> list[str]:
    conf = ["--rdzv-conf", f"is_host={'true' if i == 0 else 'false'}"] if backend == "c10d" \
        else []
    return nodes.argv(i, [
        sys.executable, "-m", "elastic_runner", "run", str(REPO / "configs" / "digits.yaml"),
        "logging.tensorboard_dir=null", "early_stopping.enabled=false", "eval.every_steps=0",
        "training.max_steps=100000", "training.max_epochs=100000", "checkpoint.every_steps=50",
        f"checkpoint.dir={workdir / 'ck'}", "recovery.spare_delay_seconds=1",
        f"recovery.heartbeat_timeout_seconds={HEARTBEAT_S}",
        "faults.inject=[{kind: slow, rank: 0, step: 1, count: 1000000, seconds: 0.05}]",
        "--trace-samples", str(workdir / "trace"), "--nnodes", str(nodes.count),
        "--nproc-per-node", str(nproc), "--rdzv-backend", backend, "--rdzv-endpoint", endpoint,
        "--rdzv-id", "bench", "--max-restarts", "1000", *conf])


def _commits(trace: Path, latest: bool = True) -> dict[int, float]:
    """step -> commit time (unix seconds) of every committed step in the trace directory (or
    one rank's file): the latest of its ranks' entries, or (``latest=False``) the earliest."""
    out: dict[int, float] = {}
    pick = max if latest else min
    for path in trace.glob("rank-*.jsonl") if trace.is_dir() else [trace]:
        for line in path.read_text().splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if "time" in entry and "step" in entry:
                step = entry["step"]
                out[step] = pick(out[step], entry["time"]) if step in out else entry["time"]
    return out


def _generations(log: str) -> set[int]:
    """The generations whose recovery committed a step (each rank of a node logs it)."""
    return {int(m[1]) for m in IN_PLACE_DONE.finditer(log)}


def _victim(job: Job) -> tuple[int, int]:
    """The rank and pid of the node's highest-ranked live worker (a replacement's once
    replaced)."""
    replaced = [(int(m[1]), int(m[4])) for m in _REPLACED.finditer(job.output)]
    ranks = {r: p.pid for r, p in job.workers().items() if r >= 0}
    for rank, pid in replaced:
        ranks[rank] = pid
    alive = {r: pid for r, pid in ranks.items() if psutil.pid_exists(pid)}
    return max(alive), alive[max(alive)]


def _halted(pid: int) -> None:
    """Wait (up to 5 s) until the signalled process is stopped or gone: it writes no trace
    entry after this."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() in (psutil.STATUS_STOPPED, psutil.STATUS_ZOMBIE):
                return
        except psutil.NoSuchProcess:
            return
        time.sleep(0.001)
    raise TimeoutError(f"pid {pid} neither stopped nor exited within 5 s of the signal")


def _last_step(trace: Path, rank: int) -> int:
    """The newest step in ``rank``'s trace file (0: none)."""
    return max(_commits(trace / f"rank-{rank}.jsonl"), default=0)


def layout(nodes_count: int, nproc: int, backend: str, faults: int, workdir: Path
           ) -> dict[str, Any]:
    """``faults`` SIGKILLs and ``faults`` SIGSTOPs, alternating, of a worker of the last node."""
    nodes = Nodes(nodes_count)
    etcd = None
    jobs: list[Job] = []
    try:
        if backend == "c10d":
            endpoint = f"{nodes.address(0)}:29400"
        else:
            (workdir / "etcd").mkdir()
            etcd = EtcdServer(workdir / "etcd", host=nodes.host_address)
            etcd.start()
            endpoint = etcd.endpoint
        for i in range(nodes_count):
            log = workdir / f"node{i}.log"
            jobs.append(Job(_argv(nodes, i, workdir, nproc, backend, endpoint), log,
                            env=nodes.env(i)))
        target = jobs[-1]
        results: dict[str, list[tuple[float, int]]] = {"sigkill": [], "sigstop": []}
        for n in range(2 * faults):
            kind = ("sigkill", "sigstop")[n % 2]
            wait_until(lambda n=n: len(_READY.findall(target.output)) > n, 600,
                       f"spare {n + 1} of the last node")
            before = _commits(workdir / "trace")
            last = max(before, default=0)
            done = len(_generations(jobs[0].output))
            rank, pid = _victim(target)
            t_fault = time.time()
            psutil.Process(pid).send_signal(signal.SIGKILL if kind == "sigkill"
                                            else signal.SIGSTOP)
            _halted(pid)
            # the victim may have committed a step between t_fault and the signal's delivery:
            # the recovery's step is the first after the victim's own last one (no rank
            # commits it without the victim's place filled)
            victims_last = _last_step(workdir / "trace", rank)
            wait_until(lambda d=done: len(_generations(jobs[0].output)) > d, 300,
                       f"{kind} {n // 2 + 1}: a committed step")
            # (and not one that some rank committed before the signal: the victim died after
            # its all-reduce, before writing its entry; rank 0 repairs that entry later)
            earliest = _commits(workdir / "trace", latest=False)
            first = min(step for step, t in earliest.items()
                        if step > victims_last and t >= t_fault)
            seconds = _commits(workdir / "trace")[first] - t_fault
            results[kind].append((seconds, max(0, last - first + 1)))
        logs = "".join(j.output for j in jobs)
        out: dict[str, Any] = {
            "layout": f"{nodes_count}x{nproc}", "world_size": nodes_count * nproc,
            "backend": backend, "recoveries_in_logs": len(_generations(jobs[0].output)),
            "restarts": logs.count("resumed from"), "heartbeat_timeout_s": HEARTBEAT_S}
        for kind, values in results.items():
            out[kind] = {"seconds": spread([s for s, _ in values]),
                         "redone_steps": spread([float(r) for _, r in values]),
                         "count": len(values)}
        return out
    finally:
        for job in jobs:
            job.kill_all()
        if etcd is not None:
            etcd.stop()
        nodes.close()


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--faults", type=int, default=5, help="SIGKILLs, and as many SIGSTOPs")
    p.add_argument("--layouts", default="2x1,2x2,4x2", help="nodes x workers per node, ...")
    p.add_argument("--backends", default="c10d,etcd-v2")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    rows = []
    for spec in args.layouts.split(","):
        count, nproc = map(int, spec.split("x"))
        for backend in args.backends.split(","):
            with tempfile.TemporaryDirectory(prefix="bench-nodes-") as tmp:
                row = layout(count, nproc, backend, args.faults, Path(tmp))
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"),
                                        "machine": "2 cores, no GPU (CPU, gloo)",
                                        "rows": rows}, indent=1) + "\n")
    return rows


if __name__ == "__main__":
    main()
