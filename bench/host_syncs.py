"""Host synchronisations per optimizer step of the built-in trainer on CUDA.

The trainer runs in this process at world size 1 (no launcher) on ``cuda:0`` with
``torch.cuda.set_sync_debug_mode("warn")``, which makes torch warn at every operation that
blocks the host on the device: ``cudaStreamSynchronize``/``cudaDeviceSynchronize`` and copies
that wait (``.item()``, ``.tolist()``, a device-to-host copy, a host-to-device copy from pageable
memory). Each warning is counted against the optimizer step in flight (from the step's
``on_step_begin``) and attributed to the innermost frame of ``elastic_runner`` (else of the
caller; and the innermost frame outside torch, a model's forward in transformers say) that
issued it. Steps with other work after them are reported apart: logging steps
(``training.log_every_steps``: the loss is read then, and its collective's result at the next
step's end), and steps followed by an evaluation or a checkpoint.

    python -m bench.host_syncs [CONFIG] [--steps 60] [--json out.json] [overrides ...]

Prints, per kind of step, the syncs per step (median, max) and where they come from; the JSON
holds every step's count. CUDA is required.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import tempfile
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch

from elastic_runner.config import load_config
from elastic_runner.dist import init_distributed
from elastic_runner.train.callbacks import Callback
from elastic_runner.trainer.build import build_trainer

_SYNC_WARNING = "synchronizing CUDA operation"
_TORCH = str(Path(torch.__file__).parent) + "/"  # torch's own frames are not the cause


class _StepClock(Callback):
    """Records the optimizer step in flight, and the steps followed by a checkpoint or an
    evaluation (the trainer's phases)."""

    def __init__(self) -> None:
        self.step = 0
        self.busy: set[int] = set()

    def on_step_begin(self, step: int, steps_this_attempt: int) -> None:
        self.step = step

    def on_phase(self, phase: str, what: str, long: bool) -> None:
        if phase in ("checkpointing", "evaluating"):
            self.busy.add(self.step)


def _where(stack: list[traceback.FrameSummary]) -> str:
    """``file:line function`` of the innermost frame of elastic_runner, followed by
    ``<- file:line function`` of the innermost frame outside torch when that is another
    package's (a model's forward in transformers, say)."""
    def name(f: traceback.FrameSummary) -> str:
        return f"{Path(f.filename).name}:{f.lineno} {f.name}"

    outside = [f for f in stack if not f.filename.startswith(_TORCH)
               and "warnings" not in f.filename and Path(f.filename).name != "host_syncs.py"]
    ours = [f for f in outside if "/elastic_runner/" in f.filename]
    where = name(ours[-1]) if ours else "?"
    if outside and outside[-1] is not (ours[-1] if ours else None):
        where += f" <- {name(outside[-1])}"
    return where


def count(config: str, overrides: list[str], steps: int) -> dict[str, Any]:
    """Train ``steps`` optimizer steps of ``config`` on CUDA; returns per-step sync counts and
    their sources. Raises RuntimeError without CUDA."""
    if not torch.cuda.is_available():
        raise RuntimeError("bench.host_syncs needs CUDA")
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(config, [f"checkpoint.dir={tmp}", f"training.max_steps={steps}",
                                   "training.max_epochs=100000", "logging.tensorboard_dir=null",
                                   "early_stopping.enabled=false", *overrides])
        info = init_distributed(cfg.distributed.backend)
        trainer = build_trainer(cfg, info)
        clock = _StepClock()
        trainer.session.callbacks.append(clock)
        per_step: collections.Counter[int] = collections.Counter()
        sources: dict[int, collections.Counter[str]] = collections.defaultdict(
            collections.Counter)

        def record(message: Any, category: Any, filename: str, lineno: int, file: Any = None,
                   line: Any = None) -> None:
            if _SYNC_WARNING in str(message):
                per_step[clock.step] += 1
                sources[clock.step][_where(traceback.extract_stack()[:-1])] += 1

        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            try:
                trainer.fit()
            finally:
                torch.cuda.set_sync_debug_mode("default")
                trainer.close()
    every_log = cfg.training.log_every_steps
    kinds: dict[str, list[int]] = {"plain": [], "logging": [], "checkpoint/eval": []}
    where: dict[str, collections.Counter[str]] = {k: collections.Counter() for k in kinds}
    for step in range(2, steps):  # step 1: first-step set-up (allocator, cuBLAS handles)
        # a logging step's loss is read at the next step's end (its collective had a step to
        # complete in): both belong to the logging cadence
        kind = ("checkpoint/eval" if step in clock.busy
                else "logging" if step % every_log in (0, 1) else "plain")
        kinds[kind].append(per_step[step])
        where[kind].update(sources[step])
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "config": config, "overrides": overrides, "steps": steps,
            "lagged_vote": trainer.session.consensus.lagged,
            "per_step": {str(s): per_step[s] for s in range(1, steps + 1)},
            "kinds": {k: {"steps": len(v), "median": statistics.median(v) if v else None,
                          "max": max(v) if v else None,
                          "sources": dict(where[k].most_common())}
                      for k, v in kinds.items()}}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config", nargs="?", default="configs/digits.yaml")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--json", default=None)
    args = p.parse_intermixed_args(argv)
    result = count(args.config, args.overrides, args.steps)
    print(f"host syncs per optimizer step ({result['device']}, torch {result['torch']}, "
          f"{args.config} {' '.join(args.overrides)})")
    for kind, r in result["kinds"].items():
        print(f"  {kind:<16} {r['steps']:>4} steps  median {r['median']}  max {r['max']}  "
              f"{r['sources']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
