"""What the peer copies of in-place recovery under FSDP cost per step, against the world size.

Each rank's copy (``recovery.peer_copy_every_steps``, ``elastic_runner/recovery/peer_copies.py``)
is its local shards and the rest of the state, serialised to host memory and sent to the next
rank. This measures, on the same FSDP2 model (an MLP of ``--blocks`` square ``--width`` layers,
AdamW: state bytes = 3 x parameters x 4) in one torchrun job per world size (gloo, this
machine):

* ``step``: one training step (forward, backward, AdamW), the baseline, in the same job;
* ``refresh``: one refresh of the copies (``CheckpointManager.local_copy`` + ``PeerCopies.refresh``:
  copy, ``torch.save`` into memory, the ring exchange), the slowest rank;
* ``restore``: loading one's copy into the model (what a recovery does on each rank after the
  hand-over).

Derived per cadence K (``--every``): the training throughput with copies relative to without,
``step / (step + refresh / K)``, and the committed steps a recovery redoes (at most K, when the
failure comes just before a refresh, plus the step in flight; (K - 1) / 2 on average for a
failure uniform in time).

    python -m bench.peer_copies [--world-sizes 2 4] [--width 1024] [--blocks 16] [--repeats 5]
                                [--every 1 5 10 50] [--json docs/bench/peer_copies.json]
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
    from elastic_runner.recovery.peer_copies import PeerCopies, unpack

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

    step()  # the optimizer holds its moments
    manager = CheckpointManager(args.dir, {"model": model, "optimizer": opt}, async_save=False,
                                fencing=False, layout="dcp")
    copies = PeerCopies(1)
    # DTensor.numel() is the global count: the whole job's state
    out: dict[str, Any] = {"step": [], "refresh": [], "restore": [],
                           "state_bytes": 3 * 4 * sum(p.numel() for p in model.parameters())}
    for i in range(args.repeats):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        out["step"].append(slowest_over_ranks(time.perf_counter() - t0))
        dist.barrier()
        t0 = time.perf_counter()
        copies.refresh(manager.local_copy(), i + 1, rank, world, cpu)
        out["refresh"].append(slowest_over_ranks(time.perf_counter() - t0))
        dist.barrier()
        t0 = time.perf_counter()
        assert copies.own is not None
        manager.load_local_copy(unpack(copies.own.payload), "the copy")
        out["restore"].append(slowest_over_ranks(time.perf_counter() - t0))
    out["copy_bytes"] = int(copies.own.payload.numel()) if copies.own else 0
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
            str(args.repeats), "--dir", str(tmp / str(world))]
    log = run_logged(argv, f"peer_copies x{world}", timeout=1200)
    line = next(ln for ln in log.splitlines() if RESULT in ln)
    return json.loads(line.split(RESULT, 1)[1])


def summarise(raw: dict[str, Any], every: list[int]) -> dict[str, Any]:
    """Medians and spreads, and the derived throughput ratio and redone steps per cadence."""
    step, refresh = spread(raw["step"]), spread(raw["refresh"])
    return {"state_bytes": raw["state_bytes"], "copy_bytes_per_rank": raw["copy_bytes"],
            "step_s": step, "refresh_s": spread(raw["refresh"]),
            "restore_s": spread(raw["restore"]),
            "by_cadence": {str(k): {
                "throughput_ratio": step["median"] / (step["median"] + refresh["median"] / k),
                "redone_steps_max": k, "redone_steps_mean": (k - 1) / 2} for k in every},
            "raw": {k: raw[k] for k in ("step", "refresh", "restore")}}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--blocks", type=int, default=16)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--every", type=int, nargs="+", default=[1, 5, 10, 50])
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
    summary = {"width": args.width, "blocks": args.blocks, "batch": args.batch,
               "repeats": args.repeats, "cores": os.cpu_count(), "results": results}
    print_table(summary)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return summary


def print_table(summary: dict[str, Any]) -> None:
    def cell(s: dict[str, float]) -> str:
        return f"{s['median']:.3f} [{s['min']:.3f}, {s['max']:.3f}]"

    print(f"\nseconds, median [min, max] of {summary['repeats']}; throughput with copies every "
          "K steps / without")
    for world, r in summary["results"].items():
        print(f"world {world}: state {r['state_bytes'] / 2**20:.0f} MiB, copy "
              f"{r['copy_bytes_per_rank'] / 2**20:.0f} MiB per rank; step {cell(r['step_s'])}, "
              f"refresh {cell(r['refresh_s'])}, restore {cell(r['restore_s'])}")
        print("  " + ", ".join(f"K={k}: {c['throughput_ratio']:.3f} (redo <= {c['redone_steps_max']})"
                               for k, c in r["by_cadence"].items()))


if __name__ == "__main__":
    main()
