"""The GPU figures, side by side in one run, with the device, date and versions.

The model is a GPT-2-small-sized causal LM (the ``causal_lm`` task with 12 layers, 12 heads,
768 wide, 1024 positions, a byte-level BPE vocabulary of up to 50257 tokens trained on 90
standard-library modules, which gives 34,636 tokens and 112 M parameters on Python 3.11;
:data:`GPT2_SMALL`), trained in bf16 with AdamW (fused on CUDA, as the runner
builds it by default). Sections (``--sections``):

* ``overhead``: steps/s of ``elastic-runner run`` (metrics on, no checkpoints in the timed
  window) against ``bench/bare_ddp.py`` under plain torchrun (the DDP tutorial's loop, same
  recipe), world size 1 with NCCL on the one GPU. First one run each of the bare loop, the
  runner, and the runner with each of :data:`CANDIDATES` switched off alone (what each saves,
  in ms per step); then ``--repeats`` pairs of the bare loop and the runner, the runner with the
  settings of the :data:`FIXES` candidates that saved at least :data:`MIN_GAIN_MS`: the ratio
  and the milliseconds per step the runner adds, median, min and max over pairs (rates from
  rank 0's log stamps, as ``bench.overhead``).
* ``stall``: how long a checkpoint blocks training, for the model and its AdamW state: a
  synchronous ``torch.save`` + fsync of the state; the runner's synchronous save (the same plus
  its sha256 manifest); the runner's asynchronous save (a copy into reused pinned host buffers;
  the write goes on in a thread); ``torch.distributed.checkpoint.async_save`` (DCP's own
  staging), each after the previous write finished, in seconds and as GB/s of state; the
  first asynchronous save, which allocates the pinned buffers, is reported apart.
* ``recovery``: a worker SIGKILLed from outside (``bench.recovery.kill_one``): two ranks on the
  one GPU (gloo with CUDA tensors; NCCL refuses two ranks on one device), the restart path (the
  phases include the new processes' CUDA context creation, ``device``) and in place (the state
  sent from a live peer; its size over the ``state`` phase as GB/s).
* ``syncs``: host synchronisations per optimizer step (``bench.host_syncs``) for the same model
  and for ``digits``, with the runner's own separated from the model's.

    python -m bench.gpu [--sections overhead stall recovery syncs] [--repeats 2]
                        [--steps 150] [--json out.json]

The JSON holds every repeat; the table at the end is what docs/gpu.md quotes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import default_collate

from .common import (
    REPO,
    RUNNER_STEP,
    free_port,
    run_argv,
    run_logged,
    spread,
    step_stamps,
    steps_per_second,
)
from .overhead import BARE_STEP, overhead_ms

CONFIG = "configs/causal_lm.yaml"
# 90 standard-library modules (4.7 M characters): enough text for a 34.6k-token BPE vocabulary
# (the task's default 15 modules stop at 13.6k merges), so the model is GPT-2 small's size
CORPUS = [
    "argparse", "difflib", "inspect", "pathlib", "textwrap", "tarfile", "zipfile", "ssl",
    "socket", "subprocess", "shutil", "tempfile", "typing", "dataclasses", "enum",
    "functools", "collections", "_pydecimal", "fractions", "statistics", "random",
    "calendar", "email.message", "email.feedparser", "email._header_value_parser",
    "http.client", "http.server", "http.cookiejar", "urllib.request", "urllib.parse",
    "xml.dom.minidom", "xml.etree.ElementTree", "configparser", "csv", "pickle",
    "pickletools", "pydoc", "doctest", "unittest.case", "unittest.mock", "logging",
    "logging.handlers", "asyncio.base_events", "asyncio.tasks", "asyncio.streams",
    "multiprocessing.pool", "multiprocessing.managers", "concurrent.futures.process",
    "ftplib", "imaplib", "smtplib", "mailbox", "tokenize", "ast", "dis", "traceback",
    "threading", "queue", "locale", "gettext", "optparse", "string", "ipaddress",
    "turtle", "pdb", "bdb", "cmd", "codecs", "copy", "datetime", "decimal", "heapq",
    "bisect", "json.decoder", "json.encoder", "os", "posixpath", "ntpath", "platform",
    "plistlib", "pprint", "sre_compile", "shlex", "signal", "sysconfig", "timeit",
    "trace", "uuid", "weakref", "zipimport",
]
GPT2_SMALL = (f"data.corpus_modules=[{', '.join(CORPUS)}]",
              "data.vocab_size=50257", "data.block_size=1024", "model.n_layer=12",
              "model.n_head=12", "model.n_embd=768", "training.precision=bf16",
              "batch.micro_batch_size=8", "batch.global_batch_size=null",
              "batch.grad_accum_steps=1")
SECTIONS = ("overhead", "stall", "recovery", "syncs")


def environment() -> dict[str, Any]:
    """Device, driver, torch/CUDA/NCCL/cuDNN versions and the date."""
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                          "--format=csv,noheader"], capture_output=True, text=True)
    import transformers

    return {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
            "nvidia_smi": smi.stdout.strip(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "nccl": ".".join(map(str, torch.cuda.nccl.version())),
            "cudnn": torch.backends.cudnn.version(), "python": sys.version.split()[0],
            "transformers": transformers.__version__, "cpu_cores": os.cpu_count()}


# ------------------------------------------------------------ overhead


# each candidate for what the launched runner adds to a step (docs/gpu.md measured 8.3 ms on an
# H100), switched off alone: name -> overrides
CANDIDATES: dict[str, tuple[str, ...]] = {
    "agent and worker without in-place recovery": ("recovery.mode=restart",),
    "no metrics (files, endpoint)": ("metrics.enabled=false",),
    "NCCL connects at the first collective (no device_id)": ("distributed.eager_init=false",),
    "torch's DDP buckets (a first one of 1 MiB)": ("distributed.ddp.bucket_cap_mb=null",),
}
# the candidates whose setting a default can take (the others switch a feature off)
FIXES = ("NCCL connects at the first collective (no device_id)",
         "torch's DDP buckets (a first one of 1 MiB)")
MIN_GAIN_MS = 0.5  # a candidate that saves less is within the noise of one run


def _overhead_argv(variant: str, steps: int, workdir: Path, overrides: tuple[str, ...] = ()
                   ) -> list[str]:
    if variant == "bare":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "1", "-m", "bench.bare_ddp", CONFIG, *GPT2_SMALL,
                "logging.tensorboard_dir=null", "--steps", str(steps)]
    metrics = () if "metrics.enabled=false" in overrides else (f"metrics.port={free_port()}",)
    return [*run_argv(CONFIG, steps, workdir, *GPT2_SMALL, *metrics,
                      "checkpoint.every_steps=0", "checkpoint.at_epoch_end=false", *overrides),
            "--nproc-per-node", "1"]


def _rate(variant: str, steps: int, workdir: Path, overrides: tuple[str, ...] = ()) -> float:
    t0 = time.perf_counter()
    log = run_logged(_overhead_argv(variant, steps, workdir, overrides), f"overhead/{variant}",
                     timeout=300)
    # where a launch's time goes (the H200's took about 65 s each, 2026-11-28)
    startup = next((ln.split("startup: ", 1)[1] for ln in log.splitlines()
                    if "startup: " in ln), "-")
    pattern = BARE_STEP if variant == "bare" else RUNNER_STEP
    print(f"  {variant} {' '.join(overrides)}: {time.perf_counter() - t0:.1f} s in all; "
          f"ms per step between log lines {_intervals(log, pattern)}; startup: {startup}",
          flush=True)
    return steps_per_second(log, pattern)


def _intervals(log: str, pattern: re.Pattern[str]) -> str:
    """Median and maximum ms per step between consecutive logged steps: a per-step cost moves
    the median, a one-time stall only the maximum."""
    points = step_stamps(log, pattern)
    ms = [1000 * (t1 - t0) / (s1 - s0)
          for (t0, s0), (t1, s1) in zip(points, points[1:], strict=False) if s1 > s0]
    return f"median {statistics.median(ms):.1f}, max {max(ms):.1f}" if ms else "-"


def _candidates(steps: int, workdir: Path) -> dict[str, Any]:
    """One run of the bare loop, the runner and the runner with each of :data:`CANDIDATES`
    switched off; what each saves in ms per step against the runner of the same run."""
    rates = {"bare": _rate("bare", steps, workdir / "c-bare"),
             "runner": _rate("runner", steps, workdir / "c-runner")}
    for k, (name, overrides) in enumerate(CANDIDATES.items()):
        rates[name] = _rate("runner", steps, workdir / f"c-{k}", overrides)
        print(f"overhead candidate {name}: {rates[name]:.3f} steps/s "
              f"(runner {rates['runner']:.3f}, bare {rates['bare']:.3f})", flush=True)
    saved = {name: 1000 / rates["runner"] - 1000 / rates[name] for name in CANDIDATES}
    return {"steps_per_s": rates, "saved_ms_per_step": saved}


def overhead(repeats: int, steps: int, workdir: Path) -> dict[str, Any]:
    """:func:`_candidates`, then ``repeats`` pairs of the bare loop and the runner, with the
    settings of the candidates in :data:`FIXES` that saved at least :data:`MIN_GAIN_MS` each,
    if any: the default the runner takes when the pairs bear it out (without one, the
    candidates' own bare and runner runs are the first pair)."""
    found = _candidates(steps, workdir)
    fixes = [n for n in FIXES if found["saved_ms_per_step"][n] >= MIN_GAIN_MS]
    overrides = tuple(o for n in fixes for o in CANDIDATES[n])
    fix = bool(fixes)
    # without a fix, the candidates' own bare and runner runs are the first pair
    rates = found["steps_per_s"]
    pairs = [] if fix else [{"bare": rates["bare"], "runner": rates["runner"]}]
    for i in range(len(pairs), repeats):
        pair = {}
        for variant in (("bare", "runner") if i % 2 == 0 else ("runner", "bare")):
            pair[variant] = _rate(variant, steps, workdir / f"{i}-{variant}", overrides)
        pairs.append(pair)
        print(f"overhead pair {i}: {pair}", flush=True)
    return {"steps": steps, "candidates": found, "runner_overrides": list(overrides),
            "pairs": pairs,
            "ratio": spread([p["runner"] / p["bare"] for p in pairs]),
            "ms_per_step": {v: spread([1000 / p[v] for p in pairs]) for v in ("bare", "runner")},
            "overhead_ms": spread([overhead_ms(p["runner"], p["bare"]) for p in pairs])}


# ------------------------------------------------------------ checkpoint stall


def _gpt2_small(device: torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The task's model at GPT-2-small size with a few AdamW steps (moments allocated)."""
    from elastic_runner.config import load_config
    from elastic_runner.task_registry import task_builder

    cfg = load_config(CONFIG, [*GPT2_SMALL, "logging.tensorboard_dir=null"])
    bundle = task_builder(cfg.task)(cfg)
    model = bundle.model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    batch = (bundle.collate_fn or default_collate)([bundle.train[i] for i in range(8)])
    for _ in range(3):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(**{k: v.to(device) for k, v in batch.items()}).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return model, opt


def _state_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    tensors = [*model.state_dict().values(),
               *(t for s in opt.state.values() for t in s.values() if torch.is_tensor(t))]
    return sum(t.numel() * t.element_size() for t in tensors)


def stall(repeats: int, workdir: Path) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from elastic_runner.checkpoint.manager import CheckpointManager

    device = torch.device("cuda", 0)
    model, opt = _gpt2_small(device)
    nbytes = _state_bytes(model, opt)
    out: dict[str, Any] = {"state_bytes": nbytes,
                           "parameters": sum(p.numel() for p in model.parameters())}
    times: dict[str, list[float]] = {k: [] for k in
                                     ("torch.save+fsync", "runner sync", "runner async",
                                      "dcp.async_save")}
    extra: dict[str, list[float]] = {"runner async: write": [], "dcp.async_save: write": []}

    def timed(fn: Any) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def plain(path: Path) -> None:
        with open(path, "wb") as f:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())

    for i in range(repeats):
        path = workdir / f"plain-{i}.pt"
        times["torch.save+fsync"].append(timed(lambda p=path: plain(p)))
        path.unlink()
    sync = CheckpointManager(str(workdir / "sync"), {"model": model, "optimizer": opt},
                             async_save=False, keep_last=1)
    for i in range(repeats):
        times["runner sync"].append(timed(lambda i=i: sync.save(i + 1)))
    sync.close()
    runner = CheckpointManager(str(workdir / "async"), {"model": model, "optimizer": opt},
                               async_save=True, keep_last=1)
    out["runner async first save (allocates pinned buffers)"] = timed(lambda: runner.save(1))
    runner.wait()
    for i in range(repeats):
        times["runner async"].append(timed(lambda i=i: runner.save(i + 2)))
        extra["runner async: write"].append(timed(runner.wait))
    runner.close()
    if not dist.is_initialized():  # DCP's async save wants a group with a CPU backend
        dist.init_process_group("cpu:gloo,cuda:nccl", store=dist.HashStore(), rank=0,
                                world_size=1)
    for i in range(repeats + 1):
        state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
        t0 = time.perf_counter()
        response = dcp.async_save(state, checkpoint_id=str(workdir / f"dcp-{i}"))
        staged = getattr(response, "staging_completion", None)
        if staged is not None:  # async staging: state may change only once it is staged
            staged.result()
        blocked = time.perf_counter() - t0
        upload = getattr(response, "upload_completion", response)
        t1 = time.perf_counter()
        upload.result()
        if i == 0:
            out["dcp.async_save first save"] = blocked
            continue
        times["dcp.async_save"].append(blocked)
        extra["dcp.async_save: write"].append(time.perf_counter() - t1)
    out["seconds"] = {k: spread(v) for k, v in {**times, **extra}.items()}
    out["GB_per_s"] = {k: nbytes / 1e9 / statistics.median(v) for k, v in times.items()}
    base = statistics.median(times["torch.save+fsync"])
    out["fraction_of_sync_save"] = {k: statistics.median(v) / base for k, v in times.items()}
    return out


# ------------------------------------------------------------ recovery


def recovery(workdir: Path) -> dict[str, Any]:
    from elastic_runner.checkpoint import storage as ckpt

    from .recovery import kill_one

    overrides = (*GPT2_SMALL, "distributed.backend=gloo", "batch.micro_batch_size=2",
                 "data.block_size=512", "eval.every_steps=100000")
    out: dict[str, Any] = {}
    for path in ("restart", "in_place"):
        phases = kill_one("causal_lm", path, workdir / path, overrides, kill_after=12)
        newest = ckpt.latest_valid(workdir / path / "ck")
        size = newest.size_bytes if newest is not None else 0
        if path == "in_place" and phases.get("state"):
            phases["state_GB_per_s"] = size / 1e9 / phases["state"]
        out[path] = {"phases": phases, "checkpoint_bytes": size}
        print(f"recovery {path}: {phases}", flush=True)
    return out


# ------------------------------------------------------------ syncs


def syncs() -> dict[str, Any]:
    from .host_syncs import count

    return {"causal_lm GPT-2 small bf16": count(CONFIG, [*GPT2_SMALL, "eval.every_steps=25",
                                                          "checkpoint.every_steps=25"], 40),
            "digits bf16": count("configs/digits.yaml",
                                 ["training.precision=bf16", "eval.every_steps=25",
                                  "checkpoint.every_steps=25"], 60)}


# ------------------------------------------------------------ report


def table(result: dict[str, Any]) -> str:
    lines = [f"{result['env']['device']} | torch {result['env']['torch']} CUDA "
             f"{result['env']['cuda']} NCCL {result['env']['nccl']} | {result['env']['date']}"]
    if "overhead" in result:
        o = result["overhead"]
        for name, ms in o["candidates"]["saved_ms_per_step"].items():
            lines.append(f"  off alone: {name}: {ms:+.2f} ms/step")
        lines.append(f"overhead (runner {' '.join(o['runner_overrides']) or 'as default'}): "
                     f"runner/bare steps/s {o['ratio']['median']:.3f} (min "
                     f"{o['ratio']['min']:.3f}, max {o['ratio']['max']:.3f}); ms/step bare "
                     f"{o['ms_per_step']['bare']['median']:.1f}, runner "
                     f"{o['ms_per_step']['runner']['median']:.1f}; +"
                     f"{o['overhead_ms']['median']:.2f} ms/step")
    if "stall" in result:
        s = result["stall"]
        lines.append(f"stall ({s['state_bytes'] / 1e9:.2f} GB state):")
        for k, v in s["seconds"].items():
            frac = s["fraction_of_sync_save"].get(k)
            gbs = s["GB_per_s"].get(k)
            lines.append(f"  {k:<24} {v['median']:.3f} s (min {v['min']:.3f} max {v['max']:.3f})"
                         + (f"  {gbs:.1f} GB/s  {100 * frac:.1f}% of torch.save+fsync"
                            if frac is not None else ""))
    if "recovery" in result:
        for path, r in result["recovery"].items():
            p = r["phases"]
            lines.append(f"recovery {path}: total {p['total']:.2f} s; " + ", ".join(
                f"{k} {v:.2f}" for k, v in p.items() if k != "total"))
    if "syncs" in result:
        for name, r in result["syncs"].items():
            lines.append(f"syncs {name} (lagged vote {r['lagged_vote']}): " + "; ".join(
                f"{k} median {v['median']} max {v['max']} {v['sources']}"
                for k, v in r["kinds"].items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=SECTIONS)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.gpu needs CUDA")
    os.chdir(REPO)
    result: dict[str, Any] = {"env": environment()}

    def save() -> None:  # after every section: a late failure keeps what was measured
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))

    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as tmp:
        for section in args.sections:
            t0 = time.perf_counter()
            work = Path(tmp) / section
            work.mkdir()
            try:
                if section == "overhead":
                    result[section] = overhead(args.repeats, args.steps, work)
                elif section == "stall":
                    result[section] = stall(max(3, args.repeats), work)
                elif section == "recovery":
                    result[section] = recovery(work)
                else:
                    result[section] = syncs()
            except Exception as e:  # noqa: BLE001 - report it and go on with the next section
                result[section + "_error"] = f"{type(e).__name__}: {e}"[-3000:]
                print(f"{section} failed: {result[section + '_error']}", flush=True)
            result.setdefault("section_seconds", {})[section] = time.perf_counter() - t0
            save()
    print(table(result))
    return result


if __name__ == "__main__":
    main()
