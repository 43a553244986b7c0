"""How long does a checkpoint block the training loop?

For each state size, in one run (the machine is shared and noisy, so only same-run ratios mean
anything):

* ``sync``: the runner's synchronous commit (``torch.save`` + fsync + manifest + rename);
* ``async``: the runner's ``AsyncCheckpointer`` (copy into reused staging buffers, write in a
  background thread), stall = time ``save()`` blocks; the first save, which allocates the
  buffers, is reported separately;
* ``dcp_async``: ``torch.distributed.checkpoint.async_save`` (single process), stall = time until
  it returns;
* ``dd``: sequential write speed of the same disk (``dd ... conv=fsync``), for the throughput
  column.

Between saves the "training loop" computes (matrix products) for longer than one synchronous
save, so a background write has finished before the next save starts.

    python -m bench.checkpoint_stall                 # 10 MB, 100 MB, 1 GB; 3 repeats
    python -m bench.checkpoint_stall --sizes-mb 100 --repeats 5 --json out.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import tempfile
import time
import warnings
from pathlib import Path

import torch

from elastic_runner.checkpoint.async_save import AsyncCheckpointer
from elastic_runner.checkpoint.storage import write_checkpoint


def make_state(size_mb: int) -> dict[str, torch.Tensor]:
    """A model-like state of ``size_mb`` MiB of float32 in 4 MiB tensors (plus a remainder)."""
    total = size_mb * 2**20 // 4
    chunk = 2**20
    state = {f"layer{i}.weight": torch.randn(chunk) for i in range(total // chunk)}
    if total % chunk:
        state["tail"] = torch.randn(total % chunk)
    return state


def compute(seconds: float) -> None:
    """Busy work standing in for training steps between two saves."""
    a = torch.randn(256, 256)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a = torch.tanh(a @ a)


def dd_speed_mb_s(directory: Path, size_mb: int) -> float:
    target = directory / "dd.bin"
    t0 = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={target}", "bs=4M",
                    f"count={max(1, size_mb // 4)}", "conv=fsync"],
                   check=True, capture_output=True)
    seconds = time.perf_counter() - t0
    target.unlink()
    return max(1, size_mb // 4) * 4 / seconds


def bench_size(size_mb: int, repeats: int, directory: Path) -> dict[str, object]:
    state = make_state(size_mb)
    meta = {"step": 0}
    sync = []
    for i in range(repeats):
        t0 = time.perf_counter()
        write_checkpoint(directory / "sync", f"step-{i:08d}", state, meta)
        sync.append(time.perf_counter() - t0)
        shutil.rmtree(directory / "sync")
    gap = 1.5 * max(sync)

    saver = AsyncCheckpointer()
    stalls = []
    try:
        for i in range(repeats + 1):
            stall = saver.save(state, lambda s, i=i: write_checkpoint(
                directory / "async", f"step-{i:08d}", s, meta))
            stalls.append(stall)
            compute(gap)
        saver.wait()
    finally:
        saver.close()
    first, async_stalls = stalls[0], stalls[1:]

    import torch.distributed.checkpoint as dcp

    # single-process use of DCP is what is meant here; torch warns about it on every save
    warnings.filterwarnings("ignore", "torch.distributed is disabled")
    dcp_stalls = []
    for i in range(repeats):
        t0 = time.perf_counter()
        future = dcp.async_save(state, checkpoint_id=str(directory / f"dcp{i}"), no_dist=True)
        dcp_stalls.append(time.perf_counter() - t0)
        compute(gap)
        future.result()
        shutil.rmtree(directory / f"dcp{i}")

    med_sync = statistics.median(sync)
    return {
        "size_mb": size_mb,
        "sync_s": med_sync, "sync_spread_s": [min(sync), max(sync)],
        "async_stall_s": statistics.median(async_stalls),
        "async_spread_s": [min(async_stalls), max(async_stalls)],
        "async_first_save_stall_s": first,
        "dcp_async_stall_s": statistics.median(dcp_stalls),
        "dcp_async_spread_s": [min(dcp_stalls), max(dcp_stalls)],
        "async_over_sync": statistics.median(async_stalls) / med_sync,
        "dcp_async_over_sync": statistics.median(dcp_stalls) / med_sync,
        "sync_throughput_mb_s": size_mb / med_sync,
        "dd_mb_s": dd_speed_mb_s(directory, size_mb),
    }


def main(argv: list[str] | None = None) -> list[dict[str, object]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes-mb", type=int, nargs="+", default=[10, 100, 1000])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    base = Path(args.dir or tempfile.mkdtemp(prefix="ckpt-bench-"))
    rows = []
    try:
        for size in args.sizes_mb:
            rows.append(bench_size(size, args.repeats, base))
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    print(f"{'state':>8} {'sync save':>10} {'async stall':>12} {'ratio':>7} {'1st async':>10} "
          f"{'DCP stall':>10} {'ratio':>7} {'sync MB/s':>10} {'dd MB/s':>8}")
    for r in rows:
        print(f"{r['size_mb']:>6}MB {r['sync_s']:>9.3f}s {r['async_stall_s']:>11.3f}s "
              f"{r['async_over_sync']:>7.3f} {r['async_first_save_stall_s']:>9.3f}s "
              f"{r['dcp_async_stall_s']:>9.3f}s {r['dcp_async_over_sync']:>7.3f} "
              f"{r['sync_throughput_mb_s']:>10.0f} {r['dd_mb_s']:>8.0f}")
    print(f"(medians of {args.repeats} saves; ratio = stall / synchronous save time, same run)")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
