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
import re
import statistics
import sys
import tempfile
from pathlib import Path

from .common import digits_run_argv, free_port, run_logged, spread, steps_per_second

_BARE_STEP = re.compile(r"^(\d\d:\d\d:\d\d\.\d\d\d) step (\d+)$")
VARIANTS = ("bare", "runner", "runner+sync", "runner+async")


def argv_for(variant: str, steps: int, every: int, workdir: Path) -> list[str]:
    if variant == "bare":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "2", "-m", "bench.bare_ddp", "configs/digits.yaml",
                "batch.grad_accum_steps=1", "logging.tensorboard_dir=null", "--steps", str(steps)]
    ckpt = {"runner": ["checkpoint.every_steps=0"],
            "runner+sync": [f"checkpoint.every_steps={every}", "checkpoint.async_save=false"],
            "runner+async": [f"checkpoint.every_steps={every}", "checkpoint.async_save=true"]}
    return digits_run_argv(steps, workdir / variant, "batch.grad_accum_steps=1",
                           f"metrics.port={free_port()}", *ckpt[variant])


def run_once(variant: str, steps: int, every: int, workdir: Path) -> float:
    """Steps/s of one run of ``variant``."""
    log = run_logged(argv_for(variant, steps, every, workdir), variant)
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
        rate = statistics.median(r[v] for r in repeats)
        ratio = spread([r[v] / r["bare"] for r in repeats])
        summary["variants"][v] = {"steps_per_s": rate, "ratio": ratio}
        print(f"{v:<13} {rate:>16.1f} {ratio['median']:>15.3f} {ratio['min']:>6.3f} "
              f"{ratio['max']:>6.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
