"""Recovery time: from a fault to the first completed optimizer step after the group resumed.

Runs the digits task on 2 CPU workers (c10d, standalone) once per scenario, injects the fault
with the runner's fault injection (a real signal / exception at a fixed step), and reads the
times from the sample trace (each committed step's wall-clock ``time``) and the fault's log line:

* ``sigkill``: rank 1 is SIGKILLed after step 30 (checkpoint every 10 steps: 0 steps lost at 30,
  so the redone work is the steps since the step-30 checkpoint, i.e. none; step 35 loses 5);
* ``raise``: rank 1 raises after step 35;
* ``sigterm``: rank 1 receives SIGTERM after step 35 (preemption: checkpoint at the next step
  boundary, exit 143, restart).

    python -m bench.recovery [--repeats 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

from elastic_runner.audit import read_entries

SCENARIOS = {"sigkill": "{kind: sigkill, rank: 1, step: 35}",
             "raise": "{kind: raise, rank: 1, step: 35}",
             "sigterm": "{kind: sigterm, rank: 1, step: 35}"}
_FAULT = re.compile(r"^(\d\d:\d\d:\d\d\.\d\d\d) \[rank1\] WARNING elastic_runner\.faults: fault")
_RESUMED = re.compile(r"^(\d\d:\d\d:\d\d\.\d\d\d) \[rank0\] INFO elastic_runner\.loop: resumed")


def run_once(kind: str, workdir: Path) -> dict[str, float]:
    ck, trace = workdir / f"{kind}-ck", workdir / f"{kind}-trace"
    argv = [sys.executable, "-m", "elastic_runner", "run", "configs/digits.yaml",
            "logging.tensorboard_dir=null", "early_stopping.enabled=false",
            f"checkpoint.dir={ck}", "checkpoint.every_steps=10", "training.max_steps=60",
            f"faults.inject=[{SCENARIOS[kind]}]", "--max-restarts", "1",
            "--monitor-interval", "0.1", "--trace-samples", str(trace)]
    t_start = time.time()
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[1],
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    if out.returncode != 0:
        raise RuntimeError(f"{kind}: run failed:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    lines = (out.stdout + out.stderr).splitlines()
    day = datetime.fromtimestamp(t_start).strftime("%Y-%m-%d")

    def stamp(pattern: re.Pattern[str]) -> float:
        hms = next(m[1] for ln in lines if (m := pattern.match(ln)))
        return datetime.strptime(f"{day} {hms}", "%Y-%m-%d %H:%M:%S.%f").timestamp()

    t_fault, t_resumed = stamp(_FAULT), stamp(_RESUMED)
    steps = sorted((e["time"], e["step"]) for e in read_entries(trace) if "time" in e)
    after = [(t, s) for t, s in steps if t > t_resumed]
    t_first, first_step = after[0]
    lost = 35 - first_step + 1 if kind != "sigterm" else 36 - first_step + 1
    return {"recovery_s": t_first - t_fault, "first_step_after": first_step,
            "steps_redone": max(0, lost)}


def main(argv: list[str] | None = None) -> dict[str, list[dict[str, float]]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    results: dict[str, list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="recovery-bench-") as d:
        for kind in args.scenarios:
            results[kind] = [run_once(kind, Path(d) / str(i)) for i in range(args.repeats)]
    print(f"{'fault':<8} {'recovery s (median)':>20} {'min':>6} {'max':>6} {'steps redone':>13}")
    for kind, runs in results.items():
        rec = [r["recovery_s"] for r in runs]
        print(f"{kind:<8} {statistics.median(rec):>20.2f} {min(rec):>6.2f} {max(rec):>6.2f} "
              f"{runs[0]['steps_redone']:>13}")
    print("(fault -> first committed step after the restarted group resumed; 2 gloo workers on "
          "CPU, c10d standalone, --monitor-interval 0.1)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
