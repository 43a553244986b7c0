"""Failures close together: warm spares per node (``recovery.spares``) against one.

``examples/own_loop.py`` (digits, a user's DDP loop) under ``elastic-runner run``, one node, 2
workers, c10d. Once the warm spares are ready, rank 1 is SIGKILLed from outside three times,
``--gap`` (4) seconds apart (each time the process that holds rank 1 then). For each
``recovery.spares`` in ``--spares`` (0: ``recovery.spare: false``, every replacement cold; 1;
2), in the same repeat: each recovery's seconds (the survivor's ``in-place recovery N done:
... committed T s after the failure`` line: from its failed collective to the first committed
step after), whether its replacement was warm (the agent's ``replaced in place by warm|cold
spare(s)`` line, which says why a cold one was) and the spares started at a lower priority
(``nice +10``). ``--popen`` starts workers and spares as new interpreters
(``--no-fork-server``): a spare then takes seconds to build, as without the fork server.
A kill that lands on a replacement still joining merges two recoveries into one (that
replacement's recovery has no seconds of its own). Medians and min-max over ``--repeats``.

    python -m bench.spares [--repeats 3] [--spares 0 1 2] [--gap 4] [--popen] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from tests.procs import REPO, Job, cli, wait_until

from .common import free_port, spread

OWN_LOOP = REPO / "examples" / "own_loop.py"
KILLS = 3
TIMEOUT_S = 120
_READY = re.compile(r"spare \S+ ready")
_STEP = re.compile(r"step \d+ loss")
_DONE = re.compile(r"in-place recovery (\d+) done: step \d+ committed ([\d.]+) s")
_REPLACED = re.compile(r"replaced in place by (warm|cold) spare\(s\) pid\(s\) \[(\d+)\] "
                       r"\(generation (\d+)")


def burst(spares: int, gap: float, workdir: Path, popen: bool = False
          ) -> tuple[list[dict[str, Any]], int]:
    """One job, three kills of rank 1 ``gap`` seconds apart: per recovery, its seconds and
    whether its spare was warm; and the spares started at a lower priority."""
    workdir.mkdir(parents=True)
    argv = cli("run", str(OWN_LOOP), "--nproc-per-node", "2", "--max-restarts", "100",
               "--monitor-interval", "0.1", "--metrics-port", str(free_port()),
               *(["--no-fork-server"] if popen else []), "--",
               "--steps", "10000000", "--checkpoint-dir", str(workdir / "ck"))
    recovery = ("{spare: false}" if spares == 0
                else f"{{spare_delay_seconds: 0, spares: {spares}}}")
    job = Job(argv, workdir / "node.log", env={"ELASTIC_RUNNER_RECOVERY": recovery})
    try:
        # the burst begins with every spare standing by (none: once training runs)
        wait_until(lambda: len(_READY.findall(job.output)) >= spares
                   and len(_STEP.findall(job.output)) >= 2, TIMEOUT_S, f"{spares} warm spares")
        victim = job.workers(str(OWN_LOOP))[1]
        for i in range(KILLS):
            t = time.monotonic()
            victim.kill()
            wait_until(lambda n=i + 1: len(_REPLACED.findall(job.output)) >= n, TIMEOUT_S,
                       f"replacement {i + 1}")
            victim = psutil.Process(int(_REPLACED.findall(job.output)[i][1]))  # rank 1 now
            if i < KILLS - 1:
                time.sleep(max(0.0, gap - (time.monotonic() - t)))
        # a kill that lands on a replacement still joining merges two recoveries into one
        last = int(_REPLACED.findall(job.output)[-1][2])
        wait_until(lambda: any(int(m[1]) >= last for m in _DONE.finditer(job.output)),
                   TIMEOUT_S, "the last recovery done")
    finally:
        job.kill_all()
    warm = {int(m[3]): m[1] == "warm" for m in _REPLACED.finditer(job.output)}
    seconds: dict[int, float] = {}
    for m in _DONE.finditer(job.output):  # the survivor's line, once per generation
        seconds.setdefault(int(m[1]), float(m[2]))
    return ([{"generation": g, "seconds": seconds.get(g), "warm": warm[g]} for g in sorted(warm)],
            job.output.count(", nice +"))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--spares", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--gap", type=float, default=4.0)
    p.add_argument("--popen", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    runs: dict[int, list[list[dict[str, Any]]]] = {n: [] for n in args.spares}
    niced: dict[int, list[int]] = {n: [] for n in args.spares}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for n in args.spares:  # the same repeat: drift hits every count alike
                result, lowered = burst(n, args.gap, Path(tmp) / f"r{r}-spares{n}",
                                        args.popen)
                runs[n].append(result)
                niced[n].append(lowered)
    out: dict[str, Any] = {"gap_s": args.gap, "kills": KILLS, "popen": args.popen,
                           "by_spares": {}}
    print(f"{'spares':>7} {'recovery':>9} {'seconds (median, min-max)':>28} {'warm':>8}")
    for n, repeats in runs.items():
        rows = []
        for k in range(KILLS):
            secs = [rep[k]["seconds"] for rep in repeats if rep[k]["seconds"] is not None]
            warm = sum(rep[k]["warm"] for rep in repeats)
            s = spread(secs) if secs else {"median": float("nan"), "min": float("nan"),
                                           "max": float("nan")}
            rows.append({"recovery": k + 1, "seconds": s, "warm": warm,
                         "repeats": len(repeats)})
            print(f"{n:>7} {k + 1:>9} {s['median']:>10.3f} ({s['min']:.3f}-{s['max']:.3f})"
                  f"{'':>6} {warm}/{len(repeats)}")
        out["by_spares"][str(n)] = {"recoveries": rows, "raw": repeats, "niced": niced[n],
                                   "median_s": statistics.median(
                                       r["seconds"] for rep in repeats for r in rep
                                       if r["seconds"] is not None)}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
