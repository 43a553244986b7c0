"""The recovery protocol's store traffic on 2 nodes x 2 workers: operations per second per rank
and per node in steady state, and the operations one recovery takes (issue 56, item 1).

Each "node" is a network namespace with its own address (``tests/netns.py``; needs root and
iproute2) running its own ``elastic-runner run`` of digits (c10d, the store on node 0,
in-place recovery with a warm spare per node, rank 0 slowed as in ``bench.recovery_nodes``).
Every process counts its operations on the recovery store at the client
(``elastic_runner/protocol/counting.py``) and, with ``ELASTIC_RUNNER_STORE_OPS_DIR`` set, writes
its counts every 0.1 s to a file of that node's directory. Once both nodes train and both
spares are ready, the benchmark reads every process's counts at the start and the end of a
``--window`` (20 s): operations per second by process (agent, each rank, the spare), by
operation and by key family (which polling loop: ``check restart``, ``check gen``, ``add
joins``, ``add node`` (the agents' beats), ``check spare`` ...). Then it SIGKILLs the last
node's highest rank and counts every process's operations from the kill to the line
``in-place recovery N done`` on both nodes (the group re-formed with the replacement and
committed its first step), in all and over what steady state would have made in that time.

Not counted: torch's own traffic to the same store (its rendezvous' keep-alives, a process
group's store operations while it forms: gloo's address exchange).

Run: ``python -m bench.store_traffic [--window 20] [--out docs/bench/store_traffic.json]``
(about 80 s).
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

from bench.common import IN_PLACE_DONE, RANK0_STEP, REPO
from elastic_runner.protocol.env import STORE_OPS_DIR_ENV
from tests.netns import Nodes
from tests.procs import Job, wait_until

NODES, NPROC = 2, 2
START_TIMEOUT_S = 150.0
RECOVERY_TIMEOUT_S = 60.0
_READY = re.compile(r"spare (\S+) ready")
_REPLACED = re.compile(r"replaced in place by \w+ spare\(s\) pid\(s\) \[([\d, ]+)\]")
_DONE_S = re.compile(r"in-place recovery \d+ done: step \d+ committed ([\d.]+) s after")

Counts = dict[int, dict[str, Any]]  # pid -> {role, time, counts{"op/family": n}}


def _argv(nodes: Nodes, i: int, workdir: Path) -> list[str]:
    return nodes.argv(i, [
        sys.executable, "-m", "elastic_runner", "run", str(REPO / "configs" / "digits.yaml"),
        "logging.tensorboard_dir=null", "early_stopping.enabled=false", "eval.every_steps=0",
        "training.max_steps=100000", "training.max_epochs=100000", "checkpoint.every_steps=50",
        f"checkpoint.dir={workdir / 'ck'}", "recovery.spare_delay_seconds=1",
        "faults.inject=[{kind: slow, rank: 0, step: 1, count: 1000000, seconds: 0.05}]",
        "--nnodes", str(nodes.count), "--nproc-per-node", str(NPROC),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{nodes.address(0)}:29400",
        "--rdzv-id", "bench", "--max-restarts", "100",
        "--rdzv-conf", f"is_host={'true' if i == 0 else 'false'}"])


def _read(directory: Path) -> Counts:
    out: Counts = {}
    for path in directory.glob("*.json"):
        try:
            entry = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        out[entry["pid"]] = entry
    return out


def _kinds(job: Job) -> dict[int, str]:
    """pid -> ``rank <r>`` or ``spare`` of the job's live workers (the rest: its agent)."""
    return {p.pid: "spare" if r < 0 else f"rank {r}" for r, p in job.workers().items()}


def _sub(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    keys = set(after) | set(before)
    return {k: after.get(k, 0) - before.get(k, 0) for k in sorted(keys)
            if after.get(k, 0) != before.get(k, 0)}


def _group(counts: dict[str, int], part: int) -> dict[str, int]:
    """``op/family`` counts summed by operation (``part`` 0) or key family (1)."""
    out: dict[str, int] = {}
    for k, n in counts.items():
        name = k.split("/", 1)[part] or "-"
        out[name] = out.get(name, 0) + n
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def _rates(counts: dict[str, int], seconds: float) -> dict[str, float]:
    return {k: round(n / seconds, 2) for k, n in counts.items()}


def steady(dirs: list[Path], jobs: list[Job], window_s: float) -> dict[str, Any]:
    """Every process's operations per second over ``window_s`` seconds."""
    kinds = [_kinds(job) for job in jobs]
    start = [_read(d) for d in dirs]
    time.sleep(window_s)
    end = [_read(d) for d in dirs]
    nodes: list[dict[str, Any]] = []
    per_rank: dict[str, Any] = {}
    rates: list[dict[int, float]] = []
    for i in range(len(dirs)):
        node: dict[str, Any] = {"processes": {}}
        rates.append({})
        total: dict[str, int] = {}
        for pid, last in end[i].items():
            first = start[i].get(pid)
            if first is None:  # started during the window
                continue
            seconds = last["time"] - first["time"]
            delta = _sub(last["counts"], first["counts"])
            if seconds <= 0:
                continue
            kind = "agent" if last["role"] == "agent" else kinds[i].get(pid, f"pid {pid}")
            row = {"ops_per_s": round(sum(delta.values()) / seconds, 2),
                   "by_op": _rates(_group(delta, 0), seconds),
                   "by_op_and_key": _rates(dict(sorted(delta.items(), key=lambda kv: -kv[1])),
                                           seconds)}
            node["processes"][kind] = row
            rates[i][pid] = sum(delta.values()) / seconds
            if kind.startswith("rank"):
                per_rank[kind.split()[1]] = row["ops_per_s"]
            for k, n in delta.items():
                total[k] = total.get(k, 0) + n / seconds
        node["ops_per_s"] = round(sum(total.values()), 2)
        node["by_op"] = {k: round(v, 2) for k, v in _group(total, 0).items()}  # type: ignore
        node["by_op_and_key"] = {k: round(v, 2) for k, v in
                                 sorted(total.items(), key=lambda kv: -kv[1])}
        nodes.append(node)
    ranks = [v for v in per_rank.values()]
    return {"window_s": window_s, "ops_per_s_per_node": [n["ops_per_s"] for n in nodes],
            "ops_per_s_per_rank": dict(sorted(per_rank.items(), key=lambda kv: int(kv[0]))),
            "mean_ops_per_s_per_rank": round(sum(ranks) / len(ranks), 2) if ranks else None,
            "nodes": nodes, "rates": rates}


def recovery(dirs: list[Path], jobs: list[Job], rates: list[dict[int, float]]
             ) -> dict[str, Any]:
    """SIGKILL the last node's highest rank; every process's operations from then until both
    nodes logged the recovery done, in all and over its steady rate (``rates``: pid -> ops
    per second, by node; over each process's own dump times)."""
    target = jobs[-1]
    ranks = {r: p for r, p in target.workers().items() if r >= 0}
    victim = ranks[max(ranks)]
    done = [len(IN_PLACE_DONE.findall(job.output)) for job in jobs]
    kinds = [_kinds(job) for job in jobs]
    before = [_read(d) for d in dirs]
    t0 = time.time()
    victim.send_signal(signal.SIGKILL)
    wait_until(lambda: all(len(IN_PLACE_DONE.findall(j.output)) > n for j, n in zip(jobs, done,
                                                                          strict=True)),
               RECOVERY_TIMEOUT_S, "the recovery done on both nodes", poll=0.01)
    seconds = time.time() - t0
    time.sleep(0.3)  # every process's next dump (0.1 s) is written
    after = [_read(d) for d in dirs]
    kinds = [{**k, **_kinds(job)} for k, job in zip(kinds, jobs, strict=True)]
    replacements = {int(p) for m in _REPLACED.finditer(target.output) for p in m[1].split(",")}
    total: dict[str, int] = {}
    nodes = []
    for i in range(len(dirs)):
        node: dict[str, Any] = {"ops": 0, "ops_over_steady_state": 0.0, "by_process": {}}
        for pid, last in after[i].items():
            first = before[i].get(pid, {"counts": {}, "time": last["time"]})
            delta = _sub(last["counts"], first["counts"])
            n = sum(delta.values())
            if not n:
                continue
            steady_part = rates[i].get(pid, 0.0) * (last["time"] - first["time"])
            kind = "agent" if last["role"] == "agent" else kinds[i].get(pid, f"pid {pid}")
            if pid == victim.pid:
                kind = f"{kind} (killed)"
            elif pid in replacements:
                kind = f"spare -> rank {max(ranks)} (the replacement)"
            elif pid not in before[i]:
                kind = f"{kind} (started after the kill)"
            node["by_process"][kind] = {"ops": n, "over_steady_state": round(n - steady_part),
                                        "by_op_and_key": delta}
            node["ops"] += n
            node["ops_over_steady_state"] += n - steady_part
            for k, m in delta.items():
                total[k] = total.get(k, 0) + m
        node["ops_over_steady_state"] = round(node["ops_over_steady_state"])
        nodes.append(node)
    logged = [float(m[1]) for m in _DONE_S.finditer("".join(j.output for j in jobs))]
    return {"victim_rank": max(ranks), "seconds_to_done_on_both_nodes": round(seconds, 3),
            "ranks_logged_seconds": logged,
            "ops": sum(n["ops"] for n in nodes),
            "ops_over_steady_state": sum(n["ops_over_steady_state"] for n in nodes),
            "by_op": _group(total, 0), "by_key": _group(total, 1),
            "by_op_and_key": dict(sorted(total.items(), key=lambda kv: -kv[1])),
            "nodes": nodes}


def run(window_s: float, workdir: Path) -> dict[str, Any]:
    nodes = Nodes(NODES)
    jobs: list[Job] = []
    dirs = [workdir / "ops" / f"node{i}" for i in range(NODES)]
    try:
        for i, d in enumerate(dirs):
            d.mkdir(parents=True)
            jobs.append(Job(_argv(nodes, i, workdir), workdir / f"node{i}.log",
                            env={**nodes.env(i), STORE_OPS_DIR_ENV: str(d)}))
        deadline = time.monotonic() + START_TIMEOUT_S
        wait_until(lambda: all(_READY.search(j.output) for j in jobs)
                   and len(RANK0_STEP.findall(jobs[0].output)) >= 2, START_TIMEOUT_S,
                   "both nodes training and both spares ready")
        time.sleep(min(3.0, max(0.0, deadline - time.monotonic())))  # past the start's burst
        out: dict[str, Any] = {"layout": f"{NODES}x{NPROC}", "backend": "c10d",
                               "steady": steady(dirs, jobs, window_s)}
        out["recovery"] = recovery(dirs, jobs, out["steady"].pop("rates"))
        out["restarts"] = sum(j.output.count("resumed from") for j in jobs)
        return out
    finally:
        for job in jobs:
            job.kill_all()
        nodes.close()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--window", type=float, default=20.0, help="steady-state window, seconds")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-store-") as tmp:
        result = run(args.window, Path(tmp))
    print(json.dumps(result, indent=1), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"),
                                        "machine": "2 cores, no GPU (CPU, gloo)",
                                        **result}, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
