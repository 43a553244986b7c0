"""A training loop as the PyTorch DDP tutorial writes one (``init_process_group``,
``DistributedSampler``, ``DataLoader``, ``DDP``, a plain loop), on scikit-learn's digits.
No checkpoints, no resume: a killed worker loses the run. ``own_loop.py`` is this file made
fault-tolerant (docs/guides/own-loop.md shows the diff).

    torchrun --standalone --nproc-per-node 2 examples/ddp_tutorial.py --steps 200
"""

import argparse
from datetime import datetime

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from elastic_runner.tasks.digits import load_digits_arrays


def digits() -> TensorDataset:
    # 1797 8x8 images: the copy of scikit-learn's digits that elastic-runner carries
    images, labels = load_digits_arrays()
    x = torch.tensor(images, dtype=torch.float32).unsqueeze(1) / 16.0
    return TensorDataset(x, torch.tensor(labels))


def build_model() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Flatten(),
                         nn.Dropout(0.1), nn.Linear(16 * 64, 10))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    dataset = digits()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(args.seed)
    model = DDP(build_model())
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    loss_fn = nn.CrossEntropyLoss()
    sampler = DistributedSampler(dataset, seed=args.seed, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    step, epoch = 0, 0
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            step += 1
            if rank == 0 and step % 10 == 0:
                print(f"{datetime.now():%H:%M:%S.%f} step {step} loss {loss.item():.4f}",
                      flush=True)
            if step >= args.steps:
                break
        epoch += 1
    dist.barrier()  # no rank tears gloo down while its peer still talks to it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
