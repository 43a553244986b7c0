"""The baseline of ``bench.overhead`` and ``bench.gpu``: a bare DDP loop, written the way the
PyTorch DDP tutorial writes one (``init_process_group``, ``DistributedSampler``, ``DataLoader``,
``DDP``, a plain loop; no checkpoints, no metrics, no guards), for any built-in task (``digits``
and ``char_lm`` give ``(inputs, targets)`` pairs and a ``loss_fn``; ``causal_lm`` gives mappings
and its model computes the loss).

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
* the same precision: fp32, or bf16 autocast around the forward and loss (fp16, which needs
  a GradScaler, is refused);
* the same device and backend: ``cuda:<LOCAL_RANK>`` with NCCL on a GPU machine (gloo and the
  CPU otherwise), batches copied with ``non_blocking=True``; the optimizer fused where the
  runner's is (``optimizer.fused``, auto: on CUDA);
* the same batches: a mapping (a transformers task such as ``causal_lm``) is passed as
  ``model(**batch)`` and its loss is ``outputs.loss``, an ``(x, y)`` pair as ``model(x)``.

What it leaves out is what the runner adds: per-step reseeding, the step vote (non-finite loss,
SIGTERM), the hang watchdog, metrics, the straggler exchange, checkpoints, the sample trace. Like
the tutorial's, it never reads the device in the step: on CUDA the host runs ahead of the GPU.

    torchrun --standalone --nproc-per-node 2 -m bench.bare_ddp CONFIG --steps 300 [overrides]
             [--fsdp]

``--fsdp``: the model is sharded with FSDP2 instead (``fully_shard`` on each block the runner
shards, ``elastic_runner.parallel.fsdp.find_blocks``, then the root, on a 1-D mesh), as
torchtitan's ``apply_fsdp`` does; the loop is otherwise the same.

Rank 0 prints ``HH:MM:SS.mmm step N`` every 10 steps; ``bench.overhead`` reads the rate from
those lines exactly as it reads the runner's log.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable, Mapping
from datetime import datetime

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from elastic_runner.config import Config, load_config
from elastic_runner.parallel.fsdp import find_blocks
from elastic_runner.task_registry import task_builder


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
    p.add_argument("--fsdp", action="store_true", help="FSDP2 instead of DDP")
    args = p.parse_args()
    cfg = load_config(args.config, args.overrides)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    if cfg.batch.accumulation_for(dist.get_world_size()) != 1:
        raise SystemExit("bench.bare_ddp: gradient accumulation is not supported; set "
                         "batch.grad_accum_steps=1")
    if cfg.training.precision not in ("fp32", "bf16"):
        raise SystemExit("bench.bare_ddp: training.precision must be fp32 or bf16")
    autocast = torch.autocast(device.type, dtype=torch.bfloat16,
                              enabled=cfg.training.precision == "bf16")
    torch.manual_seed(cfg.seed)
    bundle = task_builder(cfg.task)(cfg)
    if args.fsdp:
        model = bundle.model.to(device)
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        for block in find_blocks(model):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        model = DDP(bundle.model.to(device), device_ids=[device] if cuda else None)
    o = cfg.optimizer
    fused = o.fused_on(device)
    if o.name == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=o.lr, momentum=o.momentum,
                                    weight_decay=o.weight_decay, fused=fused)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=o.betas,
                                      weight_decay=o.weight_decay, fused=fused)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, args.steps))
    sampler = DistributedSampler(bundle.train, seed=cfg.seed, drop_last=True)
    loader = DataLoader(bundle.train, batch_size=cfg.batch.micro_batch_size, sampler=sampler,
                        drop_last=True, collate_fn=bundle.collate_fn)
    step, epoch = 0, 0
    while step < args.steps:
        sampler.set_epoch(epoch)
        for batch in loader:
            optimizer.zero_grad(set_to_none=True)
            with autocast:
                if isinstance(batch, Mapping):  # a transformers model computes its loss
                    loss = model(**{k: v.to(device, non_blocking=True)
                                    for k, v in batch.items()}).loss
                else:
                    x, y = (t.to(device, non_blocking=True) for t in batch)
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
    dist.barrier()  # no rank leaves while its peer still talks to it
    # leave without tearing the group and DDP's reducer down: torch 2.13's gloo group, freed
    # while its worker thread still frees a finished work (which takes the GIL the freeing
    # thread holds), can deadlock (seen in CI under load: the join in ~ProcessGroupGloo); the
    # runner's workers leave the same way (elastic_runner/__main__.py)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
