"""``ddp_tutorial.py`` made fault-tolerant with elastic-runner (docs/guides/own-loop.md shows
the diff):
every (re)start resumes from the newest valid checkpoint at the exact next step, at any world
size; SIGTERM checkpoints the current step and exits 143; per-rank metrics; a hang watchdog.

    torchrun --nnodes 1:2 --nproc-per-node 2 --max-restarts 3 examples/own_loop.py
    elastic-runner run examples/own_loop.py --nproc-per-node 2 -- --steps 200
"""

import argparse
from datetime import datetime

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import TensorDataset

import elastic_runner as er
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
    p.add_argument("--checkpoint-dir", default="runs/own_loop")
    p.add_argument("--trace-dir", default=None)  # sample audit: elastic-runner audit DIR
    args = p.parse_args()
    dataset = digits()
    er.init_distributed()  # under elastic-runner run, a spare waits here to replace a rank
    rank = dist.get_rank()
    torch.manual_seed(args.seed)
    model = DDP(build_model())
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    loss_fn = nn.CrossEntropyLoss()
    loader = er.elastic_dataloader(dataset, args.batch_size, seed=args.seed)
    sampler = loader.elastic_sampler  # a global cursor instead of per-rank shards
    ft = er.fault_tolerant(model, optimizer, loader, checkpoint_dir=args.checkpoint_dir,
                           every_steps=20, trace_dir=args.trace_dir)
    step, epoch = ft.resume()
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            ft.backward(loss)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if ft.should_commit(norm):  # the same answer on every rank
                optimizer.step()
            step = ft.step_done()  # checkpoints, metrics; SIGTERM: checkpoint, exit 143
            if rank == 0 and step % 10 == 0:
                print(f"{datetime.now():%H:%M:%S.%f} step {step} loss {loss.item():.4f}",
                      flush=True)
            if step >= args.steps:
                break
        epoch += 1
    ft.close()  # the final checkpoint is committed
    dist.barrier()  # no rank tears gloo down while its peer still talks to it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
