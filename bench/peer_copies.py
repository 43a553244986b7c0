"""What the peer copies of in-place recovery under FSDP cost per step, against the world size.

Each rank's copy (``recovery.peer_copy_every_steps``, ``elastic_runner/recovery/peer_copies.py``)
is its local shards and the rest of the state, copied into a reusable host buffer and sent to
the next rank in the background. This measures, on the same FSDP2 model (an MLP of ``--blocks``
square ``--width`` layers, AdamW: state bytes = 3 x parameters x 4) in one torchrun job per
world size (gloo, this machine), per repeat and side by side:

* ``--steps`` training steps (forward, backward, AdamW) without copies: the baseline;
* the same steps with copies every K steps (``--every``; ``--steps`` a multiple of K), in
  steady state: a refresh just before the timed steps, whose exchange overlaps them, and the
  last one's exchange waited for after them. The **throughput ratio** is the baseline's time
  over this one's (what the copies cost the training, the background exchange's use of the
  cores included);
* ``stall``: what one refresh holds the step up (``PeerCopies.seconds``: the wait for the
  previous exchange, the copy into host memory, posting the next), the slowest rank;
* ``restore``: loading one's copy into the model (what a recovery does on each rank after the
  hand-over).

Also the committed steps a recovery redoes per cadence (at most K, when the failure comes just
before a refresh, plus the step in flight; (K - 1) / 2 on average for a failure uniform in
time).

    python -m bench.peer_copies [--world-sizes 2 4] [--width 1024] [--blocks 16] [--steps 10]
                                [--repeats 5] [--every 1 10] [--json docs/bench/peer_copies.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .common import run_logged, slowest_over_ranks, spread

RESULT = "peer-copies-result "


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    from elastic_runner.checkpoint.manager import CheckpointManager
    from elastic_runner.dist import release_groups_of
    from elastic_runner.parallel.config import FSDPConfig
    from elastic_runner.parallel.fsdp import FSDPParallelism
    from elastic_runner.recovery.peer_copies import PeerCopies

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    cpu = torch.device("cpu")
    model = FSDPParallelism(FSDPConfig(), world, cpu).wrap(
        nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.blocks)]))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(args.batch, args.width)

    def step() -> None:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def refresh_after(i: int, every: int) -> None:
        if every and i % every == 0:
            copies.refresh(manager.local_copy(), i, rank, world, cpu)
            stalls.append(copies.seconds)  # reduced over the ranks after the timed steps

    step()  # the optimizer holds its moments
    manager = CheckpointManager(args.dir, {"model": model, "optimizer": opt}, async_save=False,
                                fencing=False, layout="dcp")
    copies = PeerCopies(1)
    # DTensor.numel() is the global count: the whole job's state
    out: dict[str, Any] = {"none": [], "stall": [], "restore": [],
                           "state_bytes": 3 * 4 * sum(p.numel() for p in model.parameters())}
    out.update({f"every_{k}": [] for k in args.every})
    stalls: list[float] = []
    for _ in range(args.repeats):
        for every in [0, *args.every]:
            # steady state: an exchange posted before the window overlaps its first steps,
            # and the one posted at its end overlaps what follows (waited for untimed)
            refresh_after(every, every)
            dist.barrier()
            t0 = time.perf_counter()
            for i in range(1, args.steps + 1):
                step()
                refresh_after(i, every)
            out[f"every_{every}" if every else "none"].append(
                slowest_over_ranks(time.perf_counter() - t0) / args.steps)
            copies.settle()
        dist.barrier()
        t0 = time.perf_counter()
        assert copies.own is not None
        manager.load_local_copy(copies.own.state(), "the copy")
        out["restore"].append(slowest_over_ranks(time.perf_counter() - t0))
    out["stall"] = [slowest_over_ranks(s) for s in stalls]
    out["copy_bytes"] = int(copies.own.data.numel()) if copies.own else 0
    if rank == 0:
        print(RESULT + json.dumps(out), flush=True)
    manager.close()
    dist.barrier()
    release_groups_of(model)  # the mesh's group freed here, not while the interpreter exits
    dist.destroy_process_group()


def run_one(world: int, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            str(world), "-m", "bench.peer_copies", "--worker", "--width", str(args.width),
            "--blocks", str(args.blocks), "--batch", str(args.batch), "--repeats",
            str(args.repeats), "--steps", str(args.steps), "--every", *map(str, args.every),
            "--dir", str(tmp / str(world))]
    log = run_logged(argv, f"peer_copies x{world}", timeout=1200)
    line = next(ln for ln in log.splitlines() if RESULT in ln)
    return json.loads(line.split(RESULT, 1)[1])


def summarise(raw: dict[str, Any], every: list[int]) -> dict[str, Any]:
    """Medians and spreads; per cadence the throughput ratio (each repeat's baseline over its
    run with copies) and the steps a recovery redoes."""
    return {"state_bytes": raw["state_bytes"], "copy_bytes_per_rank": raw["copy_bytes"],
            "step_s": spread(raw["none"]), "stall_s": spread(raw["stall"]),
            "restore_s": spread(raw["restore"]),
            "by_cadence": {str(k): {
                "step_s": spread(raw[f"every_{k}"]),
                "throughput_ratio": spread([n / c for n, c in zip(raw["none"], raw[f"every_{k}"],
                                                                  strict=True)]),
                "redone_steps_max": k, "redone_steps_mean": (k - 1) / 2} for k in every},
            "raw": {k: raw[k] for k in ("none", "stall", "restore",
                                        *(f"every_{k}" for k in every))}}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--blocks", type=int, default=16)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=10, help="training steps per run")
    p.add_argument("--every", type=int, nargs="+", default=[1, 10])
    p.add_argument("--json", default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--dir", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        _worker(args)
        gc.collect()  # its FSDP state holds the group: freed while the interpreter runs
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        results = {str(w): summarise(run_one(w, args, Path(tmp)), args.every)
                   for w in args.world_sizes}
    summary = {"date": time.strftime("%Y-%m-%d"), "width": args.width, "blocks": args.blocks,
               "batch": args.batch, "steps": args.steps, "repeats": args.repeats,
               "cores": os.cpu_count(), "torch": _torch_version(), "results": results}
    print_table(summary)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return summary


def _torch_version() -> str:
    import torch

    return torch.__version__


def print_table(summary: dict[str, Any]) -> None:
    def cell(s: dict[str, float], f: str = ".3f") -> str:
        return f"{s['median']:{f}} [{s['min']:{f}}, {s['max']:{f}}]"

    print(f"\nmedian [min, max] of {summary['repeats']} repeats of {summary['steps']} steps; "
          "throughput with copies every K steps / without, in the same repeat")
    for world, r in summary["results"].items():
        print(f"world {world}: state {r['state_bytes'] / 2**20:.0f} MiB, copy "
              f"{r['copy_bytes_per_rank'] / 2**20:.0f} MiB per rank; step "
              f"{cell(r['step_s'])} s, stall {cell(r['stall_s'])} s, restore "
              f"{cell(r['restore_s'])} s")
        print("  " + ", ".join(f"K={k}: {cell(c['throughput_ratio'])} (redo <= "
                               f"{c['redone_steps_max']})" for k, c in r["by_cadence"].items()))


if __name__ == "__main__":
    main()
