"""Runner overhead: training steps/s of the runner against a bare DDP loop, paired in one run.

Same model, data, micro-batch and world size (the digits task, 2 gloo workers on CPU, micro-batch
16, no gradient accumulation). Each repeat runs every variant once, in rotated order, and each
ratio is taken against the bare loop of the same repeat:

* ``bare``: ``bench/bare_ddp.py`` under plain torchrun, the PyTorch DDP tutorial's loop;
* ``runner``: ``elastic-runner run`` with metrics on (the node endpoint served) and no
  checkpoints during the measured steps (evaluation only after the last step; the runner still
  commits one asynchronous checkpoint at each epoch end, about every 39 steps here);
* ``runner+sync``: the same with a synchronous checkpoint every ``--every`` steps;
* ``runner+async``: the same with the runner's asynchronous checkpoint every ``--every`` steps.

Steps/s comes from rank 0's millisecond log timestamps between the first and the last logged
step, so process start, rendezvous and imports are excluded.

    python -m bench.overhead [--steps 300] [--repeats 5] [--every 20] [--json out.json]
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
from pathlib import Path

from .common import free_port, steps_per_second

REPO = Path(__file__).resolve().parents[1]
_BARE_STEP = re.compile(r"^(\d\d:\d\d:\d\d\.\d\d\d) step (\d+)$")
VARIANTS = ("bare", "runner", "runner+sync", "runner+async")


def argv_for(variant: str, steps: int, every: int, workdir: Path) -> list[str]:
    common = ["configs/digits.yaml", "batch.grad_accum_steps=1", "logging.tensorboard_dir=null"]
    if variant == "bare":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "2", "-m", "bench.bare_ddp", *common, "--steps", str(steps)]
    ckpt = {"runner": ["checkpoint.every_steps=0"],
            "runner+sync": [f"checkpoint.every_steps={every}", "checkpoint.async_save=false"],
            "runner+async": [f"checkpoint.every_steps={every}", "checkpoint.async_save=true"]}
    return [sys.executable, "-m", "elastic_runner", "run", *common,
            "early_stopping.enabled=false", f"checkpoint.dir={workdir / variant}",
            f"training.max_steps={steps}", "training.max_epochs=100000",
            f"eval.every_steps={steps + 1}", "training.log_every_steps=10",
            f"metrics.port={free_port()}", *ckpt[variant]]


def run_once(variant: str, steps: int, every: int, workdir: Path) -> float:
    """Steps/s of one run of ``variant``."""
    out = subprocess.run(argv_for(variant, steps, every, workdir), capture_output=True,
                         text=True, timeout=600, cwd=REPO,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    if out.returncode != 0:
        raise RuntimeError(f"{variant}: run failed:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    log = out.stdout + out.stderr
    return steps_per_second(log, _BARE_STEP) if variant == "bare" else steps_per_second(log)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--every", type=int, default=20, help="checkpoint cadence (steps)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    variants = ["bare", *[v for v in args.variants if v != "bare"]]
    repeats: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            order = variants[i % len(variants):] + variants[:i % len(variants)]
            repeats.append({v: run_once(v, args.steps, args.every, Path(tmp) / f"{i}-{v}")
                            for v in order})
    print(f"{'variant':<13} {'steps/s (median)':>16} {'/ bare (median)':>15} {'min':>6} "
          f"{'max':>6}")
    summary: dict = {"steps": args.steps, "every": args.every, "repeats": repeats,
                     "variants": {}}
    for v in variants:
        rates = [r[v] for r in repeats]
        ratios = [r[v] / r["bare"] for r in repeats]
        summary["variants"][v] = {"steps_per_s": statistics.median(rates),
                                  "ratio": statistics.median(ratios),
                                  "ratio_min": min(ratios), "ratio_max": max(ratios)}
        print(f"{v:<13} {statistics.median(rates):>16.1f} {statistics.median(ratios):>15.3f} "
              f"{min(ratios):>6.3f} {max(ratios):>6.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
