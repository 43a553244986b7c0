"""The runner's synchronous save against ``torch.save`` + fsync of the same state.

A model of ``--params-m`` million parameters (square 4096-wide Linear layers) and its AdamW
state after one step (about 1.4 GB at the default 117 M), on ``--device``. Alternating, after one
untimed save of each: (a) ``torch.save`` of the model's and the optimizer's state dicts to a
file, flush and fsync; (b) ``CheckpointManager(async_save=False, keep_last=1).save(step)``
(``torch.save`` through the sha256 hashing, fsync, manifest, atomic rename, retention). Between
saves, untimed: the background deletions finish, ``os.sync()``, ``--settle`` seconds of sleep.
Prints each repeat, the medians and their ratio (the goal: (b) within 1.1x of (a)).

``--before`` re-creates the code before the save was sped up (sha256 in the writing thread;
the previous checkpoint deleted inside the save), for a before/after in the same place;
``--breakdown`` times the save's parts; ``--profile`` profiles one more save.

    python -m bench.sync_save [--repeats 3] [--device cuda] [--dir DIR] [--before]
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from elastic_runner.checkpoint import storage as st
from elastic_runner.checkpoint.manager import CheckpointManager


def restore_original() -> None:
    """HEAD's behaviour: sha256 in line in the writing thread, prune deleting synchronously."""
    import hashlib

    class _HashingWriter:
        def __init__(self, f):
            self.f, self.sha, self.size = f, hashlib.sha256(), 0

        def write(self, data):
            self.sha.update(data)
            self.size += len(data)
            return self.f.write(data)

        def flush(self):
            self.f.flush()

    def _save_hashed(f, state):
        w = _HashingWriter(f)
        torch.save(state, w)
        w.flush()
        os.fsync(f.fileno())  # HEAD's callers fsynced right after _save_hashed
        return {"bytes": w.size, "sha256": w.sha.hexdigest()}

    prune = st.prune
    st._save_hashed = _save_hashed
    st.prune = lambda *a, removals=None, **k: prune(*a, **k)


def build(params_m: int, device: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    n = 4096 * 4096  # 16.8M per layer
    layers = max(1, round(params_m * 1e6 / n))
    model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096, bias=True)
                                  for _ in range(layers)]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--params-m", type=int, default=117)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--breakdown", action="store_true")
    ap.add_argument("--settle", type=float, default=1.0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--before", action="store_true",
                    help="run HEAD's hashing writer and synchronous prune (monkeypatched)")
    args = ap.parse_args()
    if args.before:
        restore_original()
    model, opt = build(args.params_m, args.device)
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    nbytes += sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                  if torch.is_tensor(t))
    print(f"device {args.device}, torch {torch.__version__}, dir {args.dir}")
    print(f"params {sum(p.numel() for p in model.parameters())/1e6:.1f} M, state {nbytes/1e9:.3f} GB")
    work = Path(tempfile.mkdtemp(prefix="syncsave-", dir=args.dir))
    try:
        mgr = CheckpointManager(str(work / "ckpt"), {"model": model, "optimizer": opt},
                                async_save=False, keep_last=1)

        parts: dict[str, list[float]] = {}

        def plain(i: int) -> None:
            path = work / f"plain-{i}.pt"
            with open(path, "wb") as f:
                t0 = time.perf_counter()
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, f)
                f.flush()
                t1 = time.perf_counter()
                os.fsync(f.fileno())
                t2 = time.perf_counter()
            parts.setdefault("(a) torch.save", []).append(t1 - t0)
            parts.setdefault("(a) fsync", []).append(t2 - t1)

        def settle() -> None:
            """Untimed: let deletions (ext4 here is mounted with discard) and writeback end."""
            mgr._removals.finish()
            os.sync()
            time.sleep(args.settle)

        def timed(fn) -> float:
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0

        def wrap(mod, name, label):
            fn = getattr(mod, name)

            def timed_fn(*a, **k):
                t0 = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    parts.setdefault(label, []).append(time.perf_counter() - t0)
            setattr(mod, name, timed_fn)

        if args.breakdown:
            wrap(mgr, "state_dict", "(b) manager.state_dict")
            wrap(st, "_save_hashed", "(b) torch.save through hashing writer")
            wrap(st, "_publish_local", "(b) publish (rename, dir fsync)")
            wrap(st, "_manifest", "(b) manifest json")
            wrap(st, "_fsync_dir", "(b) dir fsyncs")
            wrap(st, "prune", "(b) prune (keep_last)")
            wrap(st, "inspect", "(b) inspect calls")
            wrap(st.os, "fsync", "(a+b) os.fsync calls")
        a, b = [], []
        # warm-up (first write of each kind allocates the file system's extents, etc.)
        plain(-1)
        mgr.save(0)
        settle()
        parts.clear()
        for i in range(args.repeats):
            a.append(timed(lambda i=i: plain(i)))
            (work / f"plain-{i}.pt").unlink()
            settle()
            b.append(timed(lambda i=i: mgr.save(i + 1)))
            settle()
            print(f"  repeat {i}: torch.save+fsync {a[-1]:.3f} s   runner sync {b[-1]:.3f} s",
                  flush=True)
        ma, mb = statistics.median(a), statistics.median(b)
        print(f"median torch.save+fsync {ma:.3f} s  runner sync {mb:.3f} s  ratio {mb/ma:.3f}")
        for k, v in sorted(parts.items()):
            n = len(v)
            print(f"  {k:45s} calls {n:3d}  total/save {sum(v)/args.repeats:.3f} s")
        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
            mgr.save(1000)
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(18)
            pstats.Stats(prof).sort_stats("cumtime").print_stats(30)
        mgr.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
