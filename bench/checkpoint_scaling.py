"""Checkpoint save time and training stall against the world size, for the three ways the
runner writes a checkpoint, on the same model, in one run.

Variants (each through the runner's own :class:`~elastic_runner.checkpoint.manager.CheckpointManager`,
commit protocol included: staging, sha256, manifest, fence check, atomic rename):

* ``ddp-rank0``: DDP replicas; rank 0 writes one ``state.pt`` of the whole state;
* ``ddp-dcp``: DDP replicas; every rank writes a part through DCP (``checkpoint.format: dcp``:
  DCP's planner spreads the replicated tensors over the ranks);
* ``fsdp``: FSDP2 shards; every rank writes its own shards through DCP;
* ``fsdp-dcp-async``: FSDP2 shards saved by DCP's own ``async_save`` (thread executor, its own
  CPU staging) on a gloo group, without the runner's commit: its stall is compared with the
  runner's async staging of the same shards (``fsdp``'s stall).

The model is an MLP of ``--blocks`` square ``--width`` layers, trained one AdamW step so the
optimizer holds its two moments (state bytes = 3 x parameters x 4). For each world size
(``--world-sizes``, torchrun on this machine, gloo) and variant, one torchrun job saves
``--repeats`` times synchronously (``save`` seconds: from a barrier to the commit, on rank 0)
and ``--repeats`` times asynchronously (``stall``: how long ``save()`` blocks the caller, the
slowest rank). Variants run in rotated order per world size. Printed and in ``--json``: median
and spread (min, max) per world size and variant, and the state's bytes.

    python -m bench.checkpoint_scaling [--world-sizes 1 2 4] [--width 1024] [--blocks 16]
                                       [--repeats 5] [--json docs/bench/checkpoint_scaling.json]

What grows with the world size N and what does not (docs/benchmarks.md): rank 0's single file
is the whole state whatever N, so ``ddp-rank0``'s save time stays flat; with DCP every rank
writes 1/N of it, so on storage whose bandwidth adds up across writers (a parallel filesystem,
an object store, one disk per node) the save time falls as 1/N. On this one machine the ranks
share two cores and one disk, so the figures here show the overheads (planning, hashing,
the commit), not that scaling.
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

VARIANTS = ("ddp-rank0", "ddp-dcp", "fsdp", "fsdp-dcp-async")
RESULT = "checkpoint-scaling-result "


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch import nn

    from elastic_runner.checkpoint import dcp_format
    from elastic_runner.checkpoint.manager import CheckpointManager
    from elastic_runner.dist import release_groups_of
    from elastic_runner.parallel.config import DDPConfig, FSDPConfig
    from elastic_runner.parallel.ddp import DDPParallelism
    from elastic_runner.parallel.fsdp import FSDPParallelism

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.blocks)])
    cpu = torch.device("cpu")
    fsdp = args.variant.startswith("fsdp")
    net = (FSDPParallelism(FSDPConfig(), world, cpu).wrap(model) if fsdp
           else DDPParallelism(DDPConfig(), cpu).wrap(model))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    net(torch.randn(4, args.width)).sum().backward()
    opt.step()
    # a sharded parameter is a DTensor: its numel() is the whole tensor's
    state_bytes = 3 * sum(p.numel() * 4 for p in model.parameters())
    root = Path(args.dir)
    out: dict[str, Any] = {"save": [], "stall": [], "state_bytes": state_bytes}
    for mode in ("save", "stall"):
        async_save = mode == "stall"
        if args.variant == "fsdp-dcp-async":
            if not async_save:
                continue
            group = dist.new_group(backend="gloo")
            for i in range(args.repeats):
                dist.barrier()
                t0 = time.perf_counter()
                future = dcp.async_save(
                    dcp_format.sharded_state(model, opt), process_group=group,
                    storage_writer=dcp.FileSystemWriter(str(root / f"dcp-async-{i}")))
                stall = time.perf_counter() - t0
                future.result()
                out["stall"].append(slowest_over_ranks(stall))
            dist.destroy_process_group(group)
            continue
        layout = "rank0" if args.variant == "ddp-rank0" else "dcp"
        m = CheckpointManager(str(root / mode), {"model": model, "optimizer": opt},
                              async_save=async_save, keep_last=2, layout=layout)
        for i in range(args.repeats):
            dist.barrier()
            t0 = time.perf_counter()
            m.save(i + 1)
            stall = time.perf_counter() - t0
            m.wait()
            dist.barrier()  # every rank's part and rank 0's commit are done
            total = time.perf_counter() - t0
            out[mode].append(slowest_over_ranks(stall) if async_save else total)
        m.close()
    if rank == 0:
        print(RESULT + json.dumps(out), flush=True)
    dist.barrier()
    release_groups_of(net)  # an FSDP mesh's group freed here, not while the interpreter exits
    dist.destroy_process_group()


def run_one(world: int, variant: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """One torchrun job of ``world`` ranks saving with ``variant``; rank 0's result line."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            str(world), "-m", "bench.checkpoint_scaling", "--worker", "--variant", variant,
            "--width", str(args.width), "--blocks", str(args.blocks), "--repeats",
            str(args.repeats), "--dir", str(tmp / f"{world}-{variant}")]
    log = run_logged(argv, f"checkpoint_scaling {variant} x{world}", timeout=1200)
    line = next(ln for ln in log.splitlines() if RESULT in ln)
    return json.loads(line.split(RESULT, 1)[1])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--blocks", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--json", default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant", default="fsdp", help=argparse.SUPPRESS)
    p.add_argument("--dir", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        _worker(args)
        gc.collect()  # its FSDP state holds the group: freed while the interpreter runs
        return {}
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, world in enumerate(args.world_sizes):
            order = args.variants[i % len(args.variants):] + args.variants[:i % len(args.variants)]
            for variant in order:
                raw = run_one(world, variant, args, Path(tmp))
                results.setdefault(str(world), {})[variant] = {
                    "state_bytes": raw["state_bytes"],
                    "save_s": spread(raw["save"]) if raw["save"] else None,
                    "stall_s": spread(raw["stall"]),
                    "raw": {"save": raw["save"], "stall": raw["stall"]}}
    summary = {"width": args.width, "blocks": args.blocks, "repeats": args.repeats,
               "cores": os.cpu_count(), "results": results}
    print_table(summary)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return summary


def print_table(summary: dict[str, Any]) -> None:
    first = next(iter(summary["results"].values()))
    mib = next(iter(first.values()))["state_bytes"] / 2**20
    print(f"\nstate {mib:.0f} MiB (parameters + AdamW moments); seconds, median [min, max] "
          f"of {summary['repeats']}")
    print(f"{'world':>5} {'variant':<15} {'save (sync)':>26} {'stall (async)':>26}")
    for world, variants in summary["results"].items():
        for variant, r in variants.items():
            def cell(s: dict[str, float] | None) -> str:
                return "-" if s is None else (f"{s['median']:.3f} [{s['min']:.3f}, "
                                              f"{s['max']:.3f}]")
            print(f"{world:>5} {variant:<15} {cell(r['save_s']):>26} {cell(r['stall_s']):>26}")


if __name__ == "__main__":
    main()
