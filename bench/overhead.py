"""Runner overhead: training steps/s of the runner against a bare DDP loop, paired in one run.

For each task (``--tasks``: ``digits``, the small CNN of ``configs/digits.yaml``, and
``char_lm``, the character GPT of ``configs/char_lm.yaml``) the bare loop and the runner train
the same recipe: same model, data, micro-batch, optimizer (all its settings), gradient clipping
and LR schedule (see ``bench/bare_ddp.py``), 2 gloo workers on CPU, no gradient accumulation.
Each repeat runs every task's variants once, tasks and variants in rotated order, and each
ratio is taken against the bare loop of the same task in the same repeat (a pair):

* ``bare``: ``bench/bare_ddp.py`` under plain torchrun, the PyTorch DDP tutorial's loop;
* ``runner``: ``elastic-runner run`` with metrics on (the node endpoint served) and no
  checkpoints during the measured steps (``checkpoint.every_steps=0``,
  ``checkpoint.at_epoch_end=false``; evaluation only after the last step): the runner's fixed
  per-step work (bookkeeping, step vote, metrics, watchdog, seeding);
* ``runner+sync``: the same with a synchronous checkpoint every ``--every`` steps;
* ``runner+async``: the same with the runner's asynchronous checkpoint every ``--every`` steps.

Steps/s comes from rank 0's millisecond log timestamps between the first and the last logged
step (every 10 steps), so process start, rendezvous and imports are excluded. Per task and
variant the script prints the median steps/s over repeats, the ratio variant / bare (median,
min, max over pairs) and the per-step overhead in milliseconds, ``1000 * (1/rate_variant -
1/rate_bare)`` of each pair (median, min, max): the time the variant adds to one optimizer step.

    python -m bench.overhead [--tasks digits char_lm] [--steps 300] [--repeats 10] [--every 20]
                             [--variants ...] [--strategy ddp|fsdp] [--json out.json]

``--strategy fsdp``: both sides shard the model with FSDP2 (the bare loop: ``bench/bare_ddp.py
--fsdp``; the runner: ``distributed.strategy=fsdp``, sharded DCP checkpoints).

The JSON holds ``tasks: {task: {repeats, variants}}``; its top-level ``repeats`` and
``variants`` repeat those of the first task (the layout ``bench.plot`` reads).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from .common import TASK_CONFIGS, free_port, run_argv, run_logged, spread, steps_per_second

BARE_STEP = re.compile(r"^(\d\d:\d\d:\d\d\.\d\d\d) step (\d+)$")
VARIANTS = ("bare", "runner", "runner+sync", "runner+async")
TASKS = tuple(TASK_CONFIGS)


def argv_for(variant: str, task: str, steps: int, every: int, workdir: Path,
             strategy: str = "ddp") -> list[str]:
    """Command line of one run of ``variant`` on ``task`` for ``steps`` optimizer steps
    (checkpoints every ``every`` steps where the variant has them) under ``workdir``, with the
    model replicated (``ddp``) or sharded (``fsdp``)."""
    config = TASK_CONFIGS[task]
    if variant == "bare":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "2", "-m", "bench.bare_ddp", config,
                "batch.grad_accum_steps=1", "logging.tensorboard_dir=null", "--steps", str(steps),
                *(["--fsdp"] if strategy == "fsdp" else [])]
    ckpt = {"runner": ["checkpoint.every_steps=0", "checkpoint.at_epoch_end=false"],
            "runner+sync": [f"checkpoint.every_steps={every}", "checkpoint.async_save=false"],
            "runner+async": [f"checkpoint.every_steps={every}", "checkpoint.async_save=true"]}
    return run_argv(config, steps, workdir / variant, "batch.grad_accum_steps=1",
                    f"metrics.port={free_port()}", f"distributed.strategy={strategy}",
                    *ckpt[variant])


def run_once(variant: str, task: str, steps: int, every: int, workdir: Path,
             strategy: str = "ddp") -> float:
    """Steps/s of one run of ``variant`` on ``task``."""
    log = run_logged(argv_for(variant, task, steps, every, workdir, strategy),
                     f"{task}/{variant}/{strategy}")
    return steps_per_second(log, BARE_STEP) if variant == "bare" else steps_per_second(log)


def overhead_ms(rate: float, bare_rate: float) -> float:
    """Milliseconds a run at ``rate`` steps/s adds to each step of one at ``bare_rate``."""
    return 1000.0 * (1.0 / rate - 1.0 / bare_rate)


def summarize(repeats: list[dict[str, float]], variants: list[str]) -> dict[str, Any]:
    """Per variant: median steps/s, and the ratio to bare and the overhead in ms per step of
    each pair (same repeat), as median/min/max."""
    return {v: {"steps_per_s": statistics.median(r[v] for r in repeats),
                "ratio": spread([r[v] / r["bare"] for r in repeats]),
                "overhead_ms": spread([overhead_ms(r[v], r["bare"]) for r in repeats])}
            for v in variants}


def print_task(task: str, steps: int, summary: dict[str, Any]) -> None:
    pairs = len(summary["repeats"])
    print(f"\n{task}: {steps} steps, {pairs} pair{'s' if pairs != 1 else ''}")
    print(f"{'variant':<13} {'steps/s':>8} | {'/ bare: median':>14} {'min':>6} {'max':>6} | "
          f"{'overhead ms/step: median':>24} {'min':>6} {'max':>6}")
    for v, s in summary["variants"].items():
        r, o = s["ratio"], s["overhead_ms"]
        print(f"{v:<13} {s['steps_per_s']:>8.1f} | {r['median']:>14.3f} {r['min']:>6.3f} "
              f"{r['max']:>6.3f} | {o['median']:>24.2f} {o['min']:>6.2f} {o['max']:>6.2f}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    p.add_argument("--steps", type=int, default=300, help="optimizer steps per run")
    p.add_argument("--repeats", type=int, default=10, help="pairs per task")
    p.add_argument("--every", type=int, default=20, help="checkpoint cadence (steps)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--strategy", default="ddp", choices=("ddp", "fsdp"))
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    variants = ["bare", *[v for v in args.variants if v != "bare"]]
    tasks = list(dict.fromkeys(args.tasks))
    repeats: dict[str, list[dict[str, float]]] = {t: [] for t in tasks}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for task in tasks[i % len(tasks):] + tasks[:i % len(tasks)]:
                order = variants[i % len(variants):] + variants[:i % len(variants)]
                repeats[task].append({v: run_once(v, task, args.steps, args.every,
                                                  Path(tmp) / f"{i}-{task}-{v}", args.strategy)
                                      for v in order})
    summary: dict[str, Any] = {"steps": args.steps, "every": args.every,
                               "strategy": args.strategy, "tasks": {}}
    for task in tasks:
        summary["tasks"][task] = {"repeats": repeats[task],
                                  "variants": summarize(repeats[task], variants)}
        print_task(task, args.steps, summary["tasks"][task])
    summary.update(summary["tasks"][tasks[0]])  # top-level repeats/variants: bench.plot's layout
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
