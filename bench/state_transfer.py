"""How fast an in-place recovery hands the state to a replacement, against the wire it uses.

One gloo job per world size W (``--world-sizes``; processes on this machine): rank 0 is the
replacement (a freshly built model, an optimizer without state), ranks 1..W-1 hold the same
trained state (an MLP of ``--blocks`` square ``--width`` layers after one AdamW step: state
bytes = 3 x parameters x 4). For each state size (``--blocks``), in rotated order per repeat,
from a barrier to rank 0's state loaded into its model and optimizer:

* ``raw``: rank 1 sends one ``uint8`` tensor of the same bytes to rank 0 (``dist.send``/
  ``dist.recv``): the wire's rate, the ceiling. Both buffers are allocated and written once
  per state size and reused by every repeat, after one warm-up send that connects the pair:
  the wire measured warm, as a process that moves the same bytes again sees it;
* ``pickled``: the transfer before ``recovery/state_transfer.py``: rank 1 ``torch.save``s the
  whole state into bytes and sends them, rank 0 copies and ``torch.load``s them
  (``weights_only``) and loads the state;
* ``transfer``: ``state_transfer.send_state`` on every holder (W-1 sources) and
  ``recv_state`` into rank 0's own tensors, then the same load.

Every method is timed the same way: on rank 0, from a barrier to the bytes received (``raw``)
or the state loaded (the others), ``--repeats`` times in rotated order after the warm-up send.
``transfer`` and ``pickled`` receive into a freshly built replacement each time, as in a
recovery: its parameters exist, its optimizer moments are allocated during the receive (their
page faults are part of the transfer's time, not of the raw send's).

Printed and in ``--json``: per world size and state size, the median seconds and spread (min,
max) of each, GB/s, and ``transfer``'s rate as a ratio of ``raw``'s in the same run, of the
medians (``transfer_vs_raw``) and of the best of each (``transfer_vs_raw_best``); at 4 ranks
the sources share the sending. ``transfer_parts``: where the transfer's time goes on the
receiver (medians; recovery/rejoin.py's ``StateParts``): ``manifest``, ``tensors`` (received
into place, the optimizer moments the replacement lacks allocated as they arrive) and
``install`` (loaded into the model and optimizer).

``--load``: also the restart path's load of the same state from a checkpoint file
(``state.pt``, page cache warm), one process, per state size, each way followed by a write to
every optimizer moment (as the first step does: a way that leaves tensors mapped pays for it
there): ``disk`` reads the file's bytes into a preallocated buffer (the ceiling); ``read`` is
the load before (``torch.load`` from an open file object, then ``load_state_dict``);
``mapped`` is :func:`~elastic_runner.checkpoint.storage.load_state` now (``torch.load`` with
``weights_only=True, mmap=True``, then each tensor copied out of the page cache once).

``--recovery N``: also N whole recoveries of each path, side by side, of the ``causal_lm`` task
at GPT-2-small width (:data:`GPT2_SMALL_CPU`: 88 M parameters, about 1.06 GB of state with
AdamW; 2 workers, gloo): rank 1 SIGKILLed after step 18 (:func:`bench.recovery.kill_one`), in
place (once the warm spare is ready) and on the restart path; their phases and totals (the kill
-> the first committed step after the recovery).

``--device cuda``: every rank's model and state live on the one GPU (the ranks share it; the
wire is still gloo through host memory): the replacement's state lands on the device.

    python -m bench.state_transfer [--world-sizes 2 4] [--blocks 8 28 84] [--width 1024]
                                   [--repeats 3] [--recovery 2] [--device cpu]
                                   [--json docs/bench/state_transfer.json]

``--json`` merges into an existing file: the sections a run measured replace the file's, the
others stay, and ``runs`` records each section's date and command.

On this machine the ranks share two CPU cores: the wire is loopback TCP, whose rate the
senders' and the receiver's copies compete for; more sources than cores add no bandwidth.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from bench.common import free_port, spread
from elastic_runner.recovery.rejoin import StateParts
from elastic_runner.recovery.state_transfer import flatten, recv_state, send_state

METHODS = ("raw", "pickled", "transfer")
# the causal_lm task at GPT-2-small width, small enough a step for 2 CPU cores
GPT2_SMALL_CPU = ("model.n_layer=12", "model.n_head=12", "model.n_embd=768",
                  "data.block_size=64", "data.vocab_size=4096", "batch.micro_batch_size=1",
                  "batch.global_batch_size=2", "eval.every_steps=100000")


def _model(width: int, blocks: int, seed: int, device: str = "cpu"
           ) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(*(nn.Linear(width, width) for _ in range(blocks))).to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _trained(width: int, blocks: int, device: str = "cpu") -> dict[str, Any]:
    model, opt = _model(width, blocks, 0, device)
    model(torch.randn(2, width, device=device)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict(),
            "rng": torch.get_rng_state()}


def _send_pickled(state: dict[str, Any], dst: int) -> None:
    """The transfer this replaced: ``torch.save`` into memory, the size, the bytes."""
    buf = io.BytesIO()
    torch.save(state, buf)
    payload = torch.frombuffer(buf.getbuffer(), dtype=torch.uint8)
    dist.send(torch.tensor([payload.numel()], dtype=torch.int64), dst=dst)
    dist.send(payload, dst=dst)


def _recv_pickled(src: int) -> dict[str, Any]:
    """:func:`_send_pickled`'s state: the bytes copied out and loaded (``weights_only``)."""
    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, src=src)
    payload = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.recv(payload, src=src)
    return torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=True)


def _load(model: nn.Module, opt: torch.optim.Optimizer, raw: dict[str, Any]) -> None:
    model.load_state_dict(raw["model"])
    opt.load_state_dict(raw["optimizer"])


_TRANSFER_PARTS: list[dict[str, float]] = []  # rank 0's parts of each timed transfer


def _once(method: str, rank: int, world: int, state: dict[str, Any] | None,
          buf: torch.Tensor | None, width: int, blocks: int, device: str = "cpu") -> float:
    """One timed transfer (seconds, on rank 0: from a barrier to the bytes received, or the
    state loaded). ``buf``: ranks 0 and 1's buffer of the raw send, the same each time."""
    cpu = torch.device("cpu")
    model, opt = _model(width, blocks, 1, device) if rank == 0 else (None, None)
    dist.barrier()
    t0 = time.perf_counter()
    if method == "raw":
        if rank == 1:
            dist.send(buf, 0)
        elif rank == 0:
            dist.recv(buf, 1)
    elif method == "pickled":
        if rank == 1:
            _send_pickled(state, 0)
        elif rank == 0:
            _load(model, opt, _recv_pickled(1))
    elif rank == 0:  # where the time goes: recovery/rejoin.py's parts of a joiner
        parts = StateParts()
        template = {"model": model.state_dict(), "optimizer": opt.state_dict()}
        raw = recv_state(template, list(range(1, world)), cpu,
                         check=lambda _: parts.mark("manifest"), device=torch.device(device))
        parts.mark("tensors")
        _load(model, opt, raw)
        parts.mark("install")
        _TRANSFER_PARTS.append(parts.parts)
    else:
        send_state(flatten(state), [0], list(range(1, world)), rank, cpu)
    if device != "cpu":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    dist.barrier()
    return seconds


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if args.device != "cpu":
        torch.cuda.set_device(torch.device(args.device).index or 0)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results: dict[str, Any] = {}
        for blocks in args.blocks:
            state = _trained(args.width, blocks, args.device) if rank > 0 else None
            # the parameters and AdamW's two moments (the transfer adds the step counters and
            # the RNG state: a few kB)
            nbytes = 3 * blocks * (args.width ** 2 + args.width) * 4
            # the raw send's buffers are allocated and written once: every repeat sends from
            # and into memory already mapped, as a process that moves the same bytes again
            # does (a fresh buffer a time cost the receiver its page faults: 0.83 s instead
            # of 0.32 s for 1.06 GB here, 2026-12-01)
            buf = torch.ones(nbytes, dtype=torch.uint8) if rank < 2 else None
            _once("raw", rank, world, None, buf, args.width, blocks)  # connects the pair
            times: dict[str, list[float]] = {m: [] for m in METHODS}
            for r in range(args.repeats):
                for m in METHODS[r % 3:] + METHODS[:r % 3]:
                    times[m].append(_once(m, rank, world, state, buf, args.width, blocks,
                                          args.device))
            results[str(blocks)] = {"bytes": nbytes, "seconds": times,
                                    "transfer_parts": list(_TRANSFER_PARTS)}
            _TRANSFER_PARTS.clear()
        if rank == 0:
            out["results"] = results
    finally:
        dist.destroy_process_group()


def run(world: int, args: argparse.Namespace) -> dict[str, Any]:
    with mp.Manager() as manager:
        out = manager.dict()
        mp.start_processes(_worker, args=(world, free_port(), args, out), nprocs=world,
                           join=True, start_method="spawn")
        return dict(out)["results"]


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    rows = {}
    for blocks, r in results.items():
        gb = r["bytes"] / 1e9
        row: dict[str, Any] = {"bytes": r["bytes"]}
        for m in METHODS:
            med = statistics.median(r["seconds"][m])
            row[m] = {"seconds": med, **spread(r["seconds"][m]), "gb_per_s": gb / med}
        row["transfer_vs_raw"] = row["raw"]["seconds"] / row["transfer"]["seconds"]
        row["transfer_vs_raw_best"] = row["raw"]["min"] / row["transfer"]["min"]
        row["pickled_vs_raw"] = row["raw"]["seconds"] / row["pickled"]["seconds"]
        # the transfer's seconds by part, on the receiver (median of the repeats): the manifest,
        # the tensors into place (fresh moments allocated as they arrive), the load
        row["transfer_parts"] = {k: statistics.median(p[k] for p in r["transfer_parts"])
                                 for k in r["transfer_parts"][0]}
        rows[blocks] = row
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-sizes", nargs="*", type=int, default=[2, 4])
    p.add_argument("--blocks", nargs="+", type=int, default=[8, 28, 84])
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--device", default="cpu",
                   help="where every rank's model and state live (cuda: all on one GPU, the "
                        "wire still gloo through host memory)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--load", action="store_true", help="also the checkpoint load (one process)")
    p.add_argument("--recovery", type=int, default=0,
                   help="whole recoveries of each path at GPT-2-small width (0: none)")
    p.add_argument("--dir", default=None, help="keep the recoveries' logs here")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    summary = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
               "cpus": os.cpu_count(), "width": args.width, "repeats": args.repeats,
               "device": args.device if args.device == "cpu" else
               f"{args.device} ({torch.cuda.get_device_name(torch.device(args.device).index or 0)})",
               "world_sizes": {str(w): summarize(run(w, args)) for w in args.world_sizes}}
    print_table(summary)
    if summary["world_sizes"]:
        print_parts(summary)
    if args.load:
        summary["load"] = {str(b): checkpoint_load(args.width, b, args.repeats)
                           for b in args.blocks}
        print_load(summary["load"])
    if args.recovery:
        summary["recovery"] = recoveries(args.recovery, args.dir)
        print_recoveries(summary["recovery"])
    if args.json:
        write_json(Path(args.json), summary, sys.argv[1:] if argv is None else argv)
    return summary


SECTIONS = ("world_sizes", "load", "recovery")


def write_json(path: Path, summary: dict[str, Any], argv: list[str]) -> None:
    """Write ``summary`` into ``path``, merged: the sections this run measured
    (:data:`SECTIONS`; ``--world-sizes`` with no value measures none) replace the file's, the
    others are kept, and ``runs`` names the date and the command of each section's run."""
    old = json.loads(path.read_text()) if path.is_file() else {}
    measured = [k for k in SECTIONS if summary.get(k)]
    command = " ".join(["python -m bench.state_transfer", *argv])
    merged = {**old, **{k: v for k, v in summary.items() if k not in SECTIONS or k in measured}}
    merged["runs"] = {**old.get("runs", {}),
                      **{k: {"date": summary["date"], "command": command} for k in measured}}
    path.write_text(json.dumps(merged, indent=1) + "\n")


def print_parts(summary: dict[str, Any]) -> None:
    print("the transfer on the receiver, by part (s, median):")
    for world, rows in summary["world_sizes"].items():
        for row in rows.values():
            print(f"{world:>5} {row['bytes'] / 1e9:6.3f} " + ", ".join(
                f"{k} {v:.3f}" for k, v in row["transfer_parts"].items()))


def print_table(summary: dict[str, Any]) -> None:
    print(f"{'world':>5} {'GB':>6} " + " ".join(f"{m + ' s':>12}" for m in METHODS)
          + f" {'raw GB/s':>9} {'xfer GB/s':>9} {'xfer/raw':>8} {'best/best':>9}"
          f" {'pickled/raw':>11}")
    for world, rows in summary["world_sizes"].items():
        for row in rows.values():
            print(f"{world:>5} {row['bytes'] / 1e9:6.3f} "
                  + " ".join(f"{row[m]['seconds']:12.3f}" for m in METHODS)
                  + f" {row['raw']['gb_per_s']:9.2f} {row['transfer']['gb_per_s']:9.2f}"
                  f" {row['transfer_vs_raw']:8.2f} {row['transfer_vs_raw_best']:9.2f}"
                  f" {row['pickled_vs_raw']:11.2f}")


def checkpoint_load(width: int, blocks: int, repeats: int) -> dict[str, Any]:
    """The restart path's load of one trained state (module docstring, ``--load``)."""
    from elastic_runner.checkpoint.storage import load_state

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "state.pt"
        torch.save(_trained(width, blocks), path)
        size = path.stat().st_size
        buf = bytearray(size)
        model, opt = _model(width, blocks, 1)

        def disk() -> None:
            with open(path, "rb", buffering=0) as f:
                f.readinto(buf)

        def touch() -> None:  # the first step's write to each moment
            for t in (t for s in opt.state.values() for t in s.values() if t.dim()):
                t.mul_(1.0)

        def read() -> None:
            with open(path, "rb") as f:
                _load(model, opt, torch.load(f, weights_only=True))
            touch()

        def mapped() -> None:
            _load(model, opt, load_state(path))
            touch()

        ways = {"disk": disk, "read": read, "mapped": mapped}
        times: dict[str, list[float]] = {k: [] for k in ways}
        disk()  # the page cache warm for every way alike
        for r in range(repeats):
            for k in list(ways)[r % 3:] + list(ways)[:r % 3]:
                t0 = time.perf_counter()
                ways[k]()
                times[k].append(time.perf_counter() - t0)
    out: dict[str, Any] = {"bytes": size, **{k: spread(v) for k, v in times.items()}}
    out["mapped_vs_read"] = out["read"]["median"] / out["mapped"]["median"]
    out["mapped_vs_disk"] = out["disk"]["median"] / out["mapped"]["median"]
    return out


def print_load(load: dict[str, Any]) -> None:
    print(f"{'GB':>6} {'disk s':>8} {'read s':>8} {'mapped s':>9} {'mapped/read':>11} "
          f"{'mapped/disk':>11}")
    for row in load.values():
        print(f"{row['bytes'] / 1e9:6.3f} {row['disk']['median']:8.3f} "
              f"{row['read']['median']:8.3f} {row['mapped']['median']:9.3f} "
              f"{row['mapped_vs_read']:11.2f} {row['mapped_vs_disk']:11.2f}")


def recoveries(repeats: int, keep: str | None) -> dict[str, Any]:
    """``repeats`` whole recoveries of each path (module docstring), alternating; medians and
    spreads of each phase, and the checkpoint's bytes."""
    from elastic_runner.checkpoint import storage as ckpt

    from .recovery import kill_one

    runs: dict[str, list[dict[str, float]]] = {"in_place": [], "restart": []}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(keep or tmp)
        size = 0
        for r in range(repeats):
            for path in runs:
                work = root / f"{path}-{r}"
                # after the step-10 checkpoint is committed (written in about 6 s, async)
                runs[path].append(kill_one("causal_lm", path, work, GPT2_SMALL_CPU,
                                           kill_after=18, parts=True))
                newest = ckpt.latest_valid(work / "ck")
                size = newest.size_bytes if newest is not None else size
                print(f"recovery {path} {r}: {runs[path][-1]}", flush=True)
    out: dict[str, Any] = {"checkpoint_bytes": size}
    for path, rows in runs.items():
        keys = list(dict.fromkeys(k for row in rows for k in row))
        out[path] = {k: spread([row[k] for row in rows if k in row]) for k in keys}
    out["in_place_vs_restart"] = out["in_place"]["total"]["median"] / \
        out["restart"]["total"]["median"]
    return out


def print_recoveries(rec: dict[str, Any]) -> None:
    print(f"whole recovery, causal_lm at GPT-2-small width ({rec['checkpoint_bytes'] / 1e9:.2f} "
          "GB checkpoint), seconds (median):")
    for path in ("in_place", "restart"):
        print(f"  {path:<9}" + ", ".join(f"{k} {v['median']:.2f}"
                                          for k, v in rec[path].items()))
    print(f"  in place / restart: {rec['in_place_vs_restart']:.3f}")


if __name__ == "__main__":
    main()
