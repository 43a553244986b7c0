"""How long does a TorchElastic rendezvous take against the number of agents (c10d, etcd-v2)?

Each trial starts N new agent processes; each builds torch's own handler
(``RendezvousParameters`` + ``registry.get_rendezvous_handler``, i.e. torch's dynamic rendezvous,
``torch/distributed/elastic/rendezvous/dynamic_rendezvous.py``) with min_nodes = max_nodes = N, a
fresh run id and an endpoint on 127.0.0.1; all wait on a common barrier, then each times
``handler.next_rendezvous()`` (``time.perf_counter``, seconds) from the barrier's release. The
trial's figure is the slowest agent's time: the group is formed when the last agent has its rank.
Ranks must be exactly 0..N-1 in a world of size N. c10d: agent 0 hosts the TCPStore
(``is_host``); etcd-v2: one ``etcd --enable-v2`` (3.4, ``tests/etcd.py``) serves the whole run,
skipped with a note when ``etcd`` is not on PATH.

Measured: torch's protocol as a first round runs it: its random 0-0.3 s start-up jitter (round 0
only), the compare-and-set state updates, waiting agents re-reading the state once a second, and
rank 0's bootstrap TCPStore (MASTER_ADDR/PORT) that the other ranks read. The time each agent
spent in the jitter and the number of 1-s polls are recorded too (wrapping torch's ``_delay``; its
behaviour is unchanged). Not measured: process start and imports, building the handler
(connecting to the store or etcd), the launcher's keep-alive heartbeats and monitoring, worker
start, ``shutdown()``. With min_nodes < max_nodes a real job also waits ``last_call_timeout``
(30 s by default) once min_nodes have joined; here min = max, so the last joiner completes it.

The agents are started by multiprocessing's "forkserver" with torch's rendezvous modules
preloaded (each trial's processes are still new ones, forked from a server that has only imported
them), so a trial costs about its rendezvous instead of N torch imports on this small machine;
``--start-method spawn`` starts fresh interpreters instead (about 5 min for the defaults here).

Trials are interleaved (each repeat runs every backend and size once, in rotated order) and every
figure is also given as a same-run ratio: against 1 agent of the same backend, and etcd-v2 against
c10d at the same N (ratios of the medians; "paired" ratios are taken within each repeat).

    python -m bench.rendezvous [--agents 1 2 3 4] [--backends c10d etcd-v2] [--repeats 5]
                               [--timeout 60] [--start-method forkserver] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import queue
import shutil
import statistics
import threading
import time
import traceback
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .common import etcd_server, free_port, spread

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousParameters

BACKENDS = ("c10d", "etcd-v2")
# imported once by the forkserver, so that the agents it forks start at once
PRELOAD = ["torch.distributed.elastic.rendezvous.registry",
           "torch.distributed.elastic.rendezvous.c10d_rendezvous_backend",
           "torch.distributed.elastic.rendezvous.etcd_rendezvous_backend"]


@dataclass(frozen=True)
class Trial:
    """One rendezvous of ``agents`` processes on ``backend`` at ``endpoint`` (HOST:PORT)."""

    backend: str
    agents: int
    endpoint: str
    run_id: str
    timeout: float


def rendezvous_params(trial: Trial, index: int) -> RendezvousParameters:
    """torch's parameters for agent ``index`` of ``trial`` (min = max = ``trial.agents``)."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    conf: dict[str, Any] = {"join_timeout": trial.timeout,
                            "read_timeout": max(1, int(trial.timeout))}
    if trial.backend == "c10d":
        conf["is_host"] = index == 0
    else:
        conf["protocol"] = "http"
    return RendezvousParameters(trial.backend, trial.endpoint, trial.run_id, trial.agents,
                                trial.agents, local_addr="127.0.0.1", **conf)


def count_delays() -> dict[str, float]:
    """Record, in this process, the time torch's rendezvous sleeps in its start-up jitter
    (``_delay((0, 0.3))``) and how many 1-s state polls (``_delay(1)``) it makes."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    stats = {"jitter_s": 0.0, "polls": 0}
    original = dr._delay

    def delay(seconds: float | tuple[float, float]) -> None:
        t0 = time.perf_counter()
        original(seconds)
        if isinstance(seconds, tuple):
            stats["jitter_s"] += time.perf_counter() - t0
        else:
            stats["polls"] += 1

    dr._delay = delay
    return stats


def exit_with_parent() -> None:
    """End this agent process when the benchmark's process ends, also when that was interrupted
    between asking the forkserver for this process and learning its pid (so it cannot kill it)."""
    parent = mp.parent_process()
    if parent is not None:
        threading.Thread(target=lambda: (parent.join(), os._exit(1)), daemon=True).start()


def agent(trial: Trial, index: int, barrier: Any, results: Any) -> None:
    """One agent process: build the handler, wait for all, time ``next_rendezvous()``, report
    {index, rank, world_size, seconds, jitter_s, polls} (or {index, error}) on ``results``."""
    exit_with_parent()
    try:
        from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

        stats = count_delays()
        handler = get_rendezvous_handler(rendezvous_params(trial, index))
        barrier.wait(trial.timeout)
        t0 = time.perf_counter()
        info = handler.next_rendezvous()
        seconds = time.perf_counter() - t0
        results.put({"index": index, "rank": info.rank, "world_size": info.world_size,
                     "seconds": seconds, **stats})
        barrier.wait(trial.timeout)  # c10d: the host keeps the store up until all have a rank
        handler.shutdown()
        barrier.wait(trial.timeout)  # ... and until all have closed the rendezvous
    except BaseException:  # reported to the parent, which raises
        results.put({"index": index, "error": traceback.format_exc()})
        raise SystemExit(1) from None


def collect(results: Any, procs: list[Any], deadline: float) -> list[dict[str, Any]]:
    """The agents' reports, sorted by agent index; RuntimeError on an agent's error, an agent
    that died without reporting, or the deadline."""
    reports: list[dict[str, Any]] = []
    while len(reports) < len(procs):
        try:
            report = results.get(timeout=min(0.5, max(deadline - time.monotonic(), 0.01)))
        except queue.Empty:
            dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"agent(s) {dead} died without reporting") from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"rendezvous not formed in time: {len(reports)} of "
                                   f"{len(procs)} agents reported") from None
            continue
        if "error" in report:
            raise RuntimeError(f"agent {report['index']} failed:\n{report['error']}")
        reports.append(report)
    return sorted(reports, key=lambda r: r["index"])


def check_group(reports: list[dict[str, Any]], n: int) -> None:
    """The ranks are exactly 0..n-1 and every agent sees a world of size n."""
    ranks = sorted(r["rank"] for r in reports)
    sizes = {r["world_size"] for r in reports}
    if ranks != list(range(n)) or sizes != {n}:
        raise RuntimeError(f"bad rendezvous of {n} agents: ranks {ranks}, world sizes {sizes}")


def run_trial(ctx: Any, trial: Trial) -> dict[str, Any]:
    """Run one trial (its processes killed by pid on any failure, timeout or interrupt); its
    figure is the slowest agent's time."""
    barrier, results = ctx.Barrier(trial.agents), ctx.Queue()
    procs = [ctx.Process(target=agent, args=(trial, i, barrier, results), daemon=True)
             for i in range(trial.agents)]
    deadline = time.monotonic() + trial.timeout
    try:
        for p in procs:
            p.start()
        reports = collect(results, procs, deadline)
        for p in procs:
            p.join(max(deadline - time.monotonic(), 0.1))
        if any(p.exitcode != 0 for p in procs):
            raise RuntimeError(f"agent exit codes {[p.exitcode for p in procs]} after the "
                               f"rendezvous of {trial.agents} ({trial.backend})")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        results.close()
    check_group(reports, trial.agents)
    per_agent = [{k: r[k] for k in ("index", "rank", "seconds", "jitter_s", "polls")}
                 for r in reports]
    return {"backend": trial.backend, "agents": trial.agents,
            "seconds": max(r["seconds"] for r in reports), "per_agent": per_agent}


def new_trial(backend: str, n: int, etcd_endpoint: str | None, timeout: float) -> Trial:
    endpoint = f"127.0.0.1:{free_port()}" if backend == "c10d" else etcd_endpoint
    assert endpoint is not None
    return Trial(backend, n, endpoint, f"bench-{uuid.uuid4().hex[:12]}", timeout)


def run_all(args: argparse.Namespace, backends: list[str],
            etcd_endpoint: str | None) -> list[dict[str, Any]]:
    """Every (backend, N) once per repeat, the order rotated from one repeat to the next."""
    ctx = mp.get_context(args.start_method)
    if args.start_method == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)
    cells = [(b, n) for b in backends for n in args.agents]
    trials: list[dict[str, Any]] = []
    if not cells:
        return trials
    for i in range(args.repeats):
        shift = i % len(cells)
        for backend, n in cells[shift:] + cells[:shift]:
            trial = run_trial(ctx, new_trial(backend, n, etcd_endpoint, args.timeout))
            trials.append({"repeat": i, **trial})
    return trials


def ratio(a: list[float], b: list[float]) -> dict[str, float]:
    """Median(a) / median(b), and the spread of the per-repeat ratios a[i] / b[i]."""
    paired = spread([x / y for x, y in zip(a, b, strict=True)])
    return {"of_medians": statistics.median(a) / statistics.median(b),
            **{f"paired_{k}": v for k, v in paired.items()}}


def summarize(trials: list[dict[str, Any]], backends: list[str],
              agents: list[int]) -> dict[str, dict[str, dict[str, Any]]]:
    """{backend: {str(N): cell}}: each cell's seconds (spread over repeats) and same-run
    ratios."""
    def times(b: str, n: int) -> list[float]:
        return [t["seconds"] for t in sorted(trials, key=lambda t: t["repeat"])
                if t["backend"] == b and t["agents"] == n]

    def cell(b: str, n: int) -> dict[str, Any]:
        runs = [t for t in trials if t["backend"] == b and t["agents"] == n]
        return {
            "seconds": spread(times(b, n)), "per_repeat_s": times(b, n),
            "vs_1_agent": ratio(times(b, n), times(b, 1)) if 1 in agents else None,
            "vs_c10d": (ratio(times(b, n), times("c10d", n))
                        if b != "c10d" and "c10d" in backends else None),
            "slowest_jitter_s": statistics.median(
                max(a["jitter_s"] for a in t["per_agent"]) for t in runs),
            "most_polls": statistics.median(
                max(a["polls"] for a in t["per_agent"]) for t in runs)}

    return {b: {str(n): cell(b, n) for n in agents} for b in backends}


def print_table(cells: dict[str, dict[str, dict[str, Any]]], repeats: int) -> None:
    print(f"{'backend':<8} {'agents':>6} {'rdzv s':>7} {'min':>6} {'max':>6} {'/1 agent':>8} "
          f"{'/c10d':>6} {'jitter s':>8} {'1s polls':>8}")
    for backend, by_n in cells.items():
        for n, r in by_n.items():
            vs1 = f"{r['vs_1_agent']['of_medians']:.2f}" if r["vs_1_agent"] else "-"
            vsc = f"{r['vs_c10d']['of_medians']:.2f}" if r["vs_c10d"] else "-"
            s = r["seconds"]
            print(f"{backend:<8} {n:>6} {s['median']:>7.3f} {s['min']:>6.3f} {s['max']:>6.3f} "
                  f"{vs1:>8} {vsc:>6} {r['slowest_jitter_s']:>8.3f} {r['most_polls']:>8.1f}")
    print(f"(seconds from the barrier until the last agent has its rank; median, min, max of "
          f"{repeats} repeats; ratios of medians, same run; jitter = torch's random start delay "
          f"of the slowest-jittering agent, polls = most 1-s state polls of one agent)")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--agents", type=int, nargs="+", default=[1, 2, 3, 4])
    p.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--timeout", type=float, default=60.0,
                   help="seconds allowed per trial (process start included); join_timeout")
    p.add_argument("--start-method", default="forkserver", choices=("forkserver", "spawn"),
                   help="how the agent processes start (not timed)")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    if min(args.agents) < 1 or args.repeats < 1:
        p.error("--agents and --repeats must be at least 1")
    args.agents = list(dict.fromkeys(args.agents))
    backends, skipped = list(dict.fromkeys(args.backends)), {}
    if "etcd-v2" in backends and shutil.which("etcd") is None:
        backends.remove("etcd-v2")
        skipped["etcd-v2"] = "etcd not on PATH (Debian: apt-get install etcd-server)"
        print(f"note: etcd-v2 skipped: {skipped['etcd-v2']}")
    with contextlib.ExitStack() as stack:
        endpoint = stack.enter_context(etcd_server()) if "etcd-v2" in backends else None
        trials = run_all(args, backends, endpoint)
    cells = summarize(trials, backends, args.agents)
    print_table(cells, args.repeats)
    result = {"unit": "s", "agents": args.agents, "repeats": args.repeats,
              "start_method": args.start_method, "skipped": skipped, "backends": cells,
              "trials": trials}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
