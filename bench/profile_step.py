"""Per-step cost of the runner's bookkeeping, from a profile of both loops in one process.

``bench.overhead`` compares whole runs with two worker processes on two cores, where the
machine's noise (a few percent between runs) can hide a cost of 0.1-0.3 ms per step. This
script takes that noise out: in one process (world size 1, no process group) it builds the
built-in trainer for a task and, on the very same model, optimizer, LR schedule and data, a
bare loop in the DDP tutorial's style (``zero_grad``, forward, ``backward``, clipping,
``optimizer.step``, ``scheduler.step``), then times blocks of ``--steps`` steps of each,
alternating, ``--repeats`` times. It prints both loops' time per step and the runner's extra
microseconds per step (median, min and max over the paired blocks), and with ``--profile`` the
functions where the runner's loop spends its own time (cProfile, sorted by own time).

    python -m bench.profile_step [--tasks digits char_lm] [--steps 200] [--repeats 7]
                                 [--profile] [--json out.json]

What it leaves out, by construction: the cost that exists only with several processes (the
vote's rare all-reduce, the logging step's asynchronous all-gather, the agent process). The
same-run figures of ``bench.overhead`` include those.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .common import TASK_CONFIGS

QUIET = ["logging.tensorboard_dir=null", "logging.progress_bar=false",
         "checkpoint.every_steps=0", "checkpoint.at_epoch_end=false",
         "batch.grad_accum_steps=1", "training.max_epochs=100000", "training.max_steps=10000000",
         "eval.every_steps=10000000", "early_stopping.enabled=false", "metrics.enabled=true"]


def build(task: str, workdir: Path) -> tuple[Callable[[int], None], Callable[[int], None], Any]:
    """The runner's and the bare loop's ``run(n_steps)`` on one shared model, and the
    trainer (to close)."""
    from elastic_runner.config import load_config
    from elastic_runner.dist import init_distributed
    from elastic_runner.trainer.build import build_trainer

    cfg = load_config(TASK_CONFIGS[task], [f"checkpoint.dir={workdir}", *QUIET])
    trainer = build_trainer(cfg, init_distributed("gloo"))
    trainer.session.start()

    def runner(n: int) -> None:
        done = 0
        while done < n:
            for micro_batches in trainer._steps():
                trainer.session.end_step(trainer.engine.step(micro_batches, trainer.session))
                trainer._after_step(end_of_epoch=trainer.sampler.steps_left_in_epoch() == 0)
                done += 1
                if done == n:
                    return
            trainer._end_epoch()

    model, optimizer, scheduler = trainer.model, trainer.optimizer, trainer.scheduler
    loader = torch.utils.data.DataLoader(trainer.bundle.train, shuffle=True, drop_last=True,
                                         batch_size=cfg.batch.micro_batch_size)
    clip = cfg.training.grad_clip_norm

    def bare(n: int) -> None:
        done = 0
        while done < n:
            for x, y in loader:
                optimizer.zero_grad(set_to_none=True)
                trainer.bundle.loss_fn(model(x), y).backward()
                if clip:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                optimizer.step()
                scheduler.step()
                done += 1
                if done == n:
                    return

    return runner, bare, trainer


def measure(task: str, steps: int, repeats: int, profile: bool) -> dict[str, Any]:
    """Paired blocks of ``steps`` steps; microseconds per step of each loop and the
    difference."""
    with tempfile.TemporaryDirectory() as tmp:
        runner, bare, trainer = build(task, Path(tmp))
        runner(max(10, steps // 10))  # warm-up: allocator, first-step paths
        bare(max(10, steps // 10))
        per_step: dict[str, list[float]] = {"runner": [], "bare": []}
        for i in range(repeats):
            for name, run in (("runner", runner), ("bare", bare))[::1 if i % 2 else -1]:
                t0 = time.perf_counter()
                run(steps)
                per_step[name].append((time.perf_counter() - t0) / steps * 1e6)
        top = _profile(runner, steps) if profile else ""
        trainer.close()
    extra = [r - b for r, b in zip(per_step["runner"], per_step["bare"], strict=True)]
    return {"steps": steps, "repeats": repeats, "us_per_step": per_step,
            "bare_us": statistics.median(per_step["bare"]),
            "runner_us": statistics.median(per_step["runner"]),
            "extra_us": {"median": statistics.median(extra), "min": min(extra),
                         "max": max(extra)}, "profile": top}


def _profile(run: Callable[[int], None], steps: int) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    run(steps)
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(20)
    return out.getvalue()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", nargs="+", default=list(TASK_CONFIGS), choices=list(TASK_CONFIGS))
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--profile", action="store_true", help="print the runner loop's cProfile")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    results = {t: measure(t, args.steps, args.repeats, args.profile) for t in args.tasks}
    print(f"{'task':<8} {'bare us/step':>12} {'runner us/step':>14} | "
          f"{'runner extra us/step: median':>28} {'min':>7} {'max':>7}")
    for task, r in results.items():
        e = r["extra_us"]
        print(f"{task:<8} {r['bare_us']:>12.0f} {r['runner_us']:>14.0f} | "
              f"{e['median']:>28.0f} {e['min']:>7.0f} {e['max']:>7.0f}")
        if r["profile"]:
            print(r["profile"])
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
