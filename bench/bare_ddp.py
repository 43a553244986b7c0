"""The baseline of ``bench.overhead``: a bare DDP loop, written the way the PyTorch DDP tutorial
writes one (``init_process_group``, ``DistributedSampler``, ``DataLoader``, ``DDP``, a plain
loop; no checkpoints, no metrics, no guards), on the same model, data, batch, optimizer and
gradient clipping (``training.grad_clip_norm``: a training choice of the config, not runner
overhead) as the runner.

    torchrun --standalone --nproc-per-node 2 -m bench.bare_ddp CONFIG --steps 300 [overrides]

Rank 0 prints ``HH:MM:SS.mmm step N`` every 10 steps; ``bench.overhead`` reads the rate from
those lines exactly as it reads the runner's log.
"""

from __future__ import annotations

import argparse
import os
from datetime import datetime

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from elastic_runner.config import load_config, task_builder


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--steps", type=int, default=300)
    args = p.parse_args()
    cfg = load_config(args.config, args.overrides)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(cfg.seed)
    bundle = task_builder(cfg.task)(cfg)
    model = DDP(bundle.model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optimizer.lr,
                                  weight_decay=cfg.optimizer.weight_decay)
    sampler = DistributedSampler(bundle.train, seed=cfg.seed, drop_last=True)
    loader = DataLoader(bundle.train, batch_size=cfg.batch.micro_batch_size, sampler=sampler,
                        drop_last=True)
    step, epoch = 0, 0
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            loss = bundle.loss_fn(model(x), y)
            loss.backward()
            if cfg.training.grad_clip_norm:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.training.grad_clip_norm)
            optimizer.step()
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
