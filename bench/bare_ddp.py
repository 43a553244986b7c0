"""The baseline of ``bench.overhead``: a bare DDP loop, written the way the PyTorch DDP tutorial
writes one (``init_process_group``, ``DistributedSampler``, ``DataLoader``, ``DDP``, a plain
loop; no checkpoints, no metrics, no guards), for any built-in task (``digits``, ``char_lm``:
each dataset item is an ``(inputs, targets)`` pair of tensors and ``bundle.loss_fn`` is the mean
loss of a micro-batch, so one loop serves both).

It trains the same recipe as the runner, so that the benchmark's difference is the runner's
overhead and not a different training choice; everything a config's ``optimizer``,
``schedule`` and ``training`` sections ask for is done here too:

* the same model, data and micro-batch (``batch.micro_batch_size`` per rank; one micro-batch per
  optimizer step: gradient accumulation is refused, ``bench.overhead`` sets it to 1);
* the same optimizer with all its settings (AdamW with ``lr``, ``betas`` and ``weight_decay``,
  or SGD with ``momentum`` and ``weight_decay``), and gradients reset with ``set_to_none``;
* the same gradient clipping (``training.grad_clip_norm``);
* the same learning-rate schedule: the runner steps a ``LambdaLR`` of linear warm-up and cosine
  decay (``schedule``) after every optimizer step, over ``training.max_steps`` steps, which
  ``bench.overhead`` sets to ``--steps``. The LR's *value* does not change the cost of a step,
  but stepping the scheduler does (a few µs of Python per step); it is a training choice of the
  config, not runner overhead, so this loop steps an equal scheduler (over ``--steps``) too.
* fp32 only (the runner's autocast is a training choice this loop does not replicate; other
  precisions are refused).

What it leaves out is what the runner adds: per-step reseeding, the step vote (non-finite loss,
SIGTERM), the hang watchdog, metrics, the straggler exchange, checkpoints, the sample trace.

    torchrun --standalone --nproc-per-node 2 -m bench.bare_ddp CONFIG --steps 300 [overrides]

Rank 0 prints ``HH:MM:SS.mmm step N`` every 10 steps; ``bench.overhead`` reads the rate from
those lines exactly as it reads the runner's log.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from datetime import datetime

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from elastic_runner.config import Config, load_config, task_builder


def lr_lambda(cfg: Config, total_steps: int) -> Callable[[int], float]:
    """The runner's schedule (``schedule``): multiplier of the peak LR before optimizer step
    ``step`` (0-based): linear warm-up over ``warmup_steps``, then (``cosine``) a cosine decay to
    ``min_lr_ratio`` at ``total_steps``, or (``constant``) 1."""
    s = cfg.schedule

    def factor(step: int) -> float:
        if step < s.warmup_steps:
            return (step + 1) / s.warmup_steps
        if s.name != "cosine":
            return 1.0
        progress = min(1.0, (step - s.warmup_steps) / max(1, total_steps - s.warmup_steps))
        return s.min_lr_ratio + (1.0 - s.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps to train")
    args = p.parse_args()
    cfg = load_config(args.config, args.overrides)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if cfg.batch.accumulation_for(dist.get_world_size()) != 1:
        raise SystemExit("bench.bare_ddp: gradient accumulation is not supported; set "
                         "batch.grad_accum_steps=1")
    if cfg.training.precision != "fp32":
        raise SystemExit("bench.bare_ddp: only training.precision=fp32 is supported")
    torch.manual_seed(cfg.seed)
    bundle = task_builder(cfg.task)(cfg)
    model = DDP(bundle.model)
    o = cfg.optimizer
    if o.name == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=o.lr, momentum=o.momentum,
                                    weight_decay=o.weight_decay)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=o.betas,
                                      weight_decay=o.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, args.steps))
    sampler = DistributedSampler(bundle.train, seed=cfg.seed, drop_last=True)
    loader = DataLoader(bundle.train, batch_size=cfg.batch.micro_batch_size, sampler=sampler,
                        drop_last=True)
    step, epoch = 0, 0
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad(set_to_none=True)
            loss = bundle.loss_fn(model(x), y)
            loss.backward()
            if cfg.training.grad_clip_norm:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.training.grad_clip_norm)
            optimizer.step()
            scheduler.step()
            step += 1
            if rank == 0 and step % 10 == 0:
                print(f"{datetime.now().strftime('%H:%M:%S.%f')[:-3]} step {step}", flush=True)
            if step >= args.steps:
                break
        epoch += 1
    dist.barrier()  # no rank tears gloo down while its peer still talks to it
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
