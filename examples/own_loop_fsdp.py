"""``own_loop.py`` with the model sharded by FSDP2 (``fully_shard``) instead of replicated by
DDP: the same few elastic-runner lines. Checkpoints are sharded (DCP: every rank writes its own
part) and a resume at another world size reshards them (docs/guides/ddp-or-fsdp.md).

    torchrun --nproc-per-node 2 --max-restarts 3 examples/own_loop_fsdp.py
    elastic-runner run examples/own_loop_fsdp.py --nproc-per-node 2 -- --steps 200
"""

import argparse
from datetime import datetime

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import TensorDataset

import elastic_runner as er
from elastic_runner.tasks.digits import load_digits_arrays


def digits() -> TensorDataset:
    # 1797 8x8 images: the copy of scikit-learn's digits that elastic-runner carries
    images, labels = load_digits_arrays()
    x = torch.tensor(images, dtype=torch.float32).flatten(1) / 16.0
    return TensorDataset(x, torch.tensor(labels))


def build_model() -> nn.Module:
    """An MLP of three blocks: FSDP2 shards each block, then the rest with the root."""
    blocks = [nn.Sequential(nn.Linear(64 if i == 0 else 128, 128), nn.ReLU()) for i in range(3)]
    return nn.Sequential(*blocks, nn.Dropout(0.1), nn.Linear(128, 10))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-dir", default="runs/own_loop_fsdp")
    p.add_argument("--trace-dir", default=None)  # sample audit: elastic-runner audit DIR
    args = p.parse_args()
    er.init_distributed()  # a fresh store namespace per restart attempt
    rank = dist.get_rank()
    torch.manual_seed(args.seed)
    dataset = digits()
    model = build_model()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in list(model)[:3]:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)  # over the shards
    loss_fn = nn.CrossEntropyLoss()
    loader = er.elastic_dataloader(dataset, args.batch_size, seed=args.seed)
    sampler = loader.elastic_sampler  # a global cursor instead of per-rank shards
    ft = er.fault_tolerant(model, optimizer, loader, checkpoint_dir=args.checkpoint_dir,
                           every_steps=20, trace_dir=args.trace_dir)
    step, epoch = ft.resume()  # reshards a checkpoint of another world size
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            ft.backward(loss)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # a DTensor
            if ft.should_commit(norm):  # the same answer on every rank
                optimizer.step()
            step = ft.step_done()  # checkpoints (every rank writes its shard), metrics
            if rank == 0 and step % 10 == 0:
                print(f"{datetime.now():%H:%M:%S.%f} step {step} loss {loss.item():.4f}",
                      flush=True)
            if step >= args.steps:
                break
        epoch += 1
    ft.close()  # the final checkpoint is committed
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
