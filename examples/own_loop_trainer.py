"""A trainer class of your own, fault-tolerant: ``own_loop.py``'s model and data, with the
pattern trainer classes in this field follow: a validation pass all-reduces the loss sums,
rank 0 alone keeps the early-stopping bookkeeping and broadcasts its decision
(``broadcast_object_list``), and an LR scheduler steps with the optimizer; the bookkeeping and
the scheduler go in ``state=``. Under ``elastic-runner run`` every rank, a replacement of rank
0 too, goes on with rank 0's bookkeeping (docs/guides/own-loop.md, "Your own state").
``--global-batch`` keeps one global batch at every world size (gradient accumulation, each
micro-batch's loss weighted by ``ft.loss_weights()``); ``--fsdp`` shards the model with FSDP2
instead of DDP.

    elastic-runner run examples/own_loop_trainer.py --nproc-per-node 2 -- --steps 240
    torchrun --nproc-per-node 3 examples/own_loop_trainer.py --global-batch 64 --fsdp
"""

import argparse
import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Subset, TensorDataset

import elastic_runner as er
from elastic_runner.tasks.digits import load_digits_arrays


def digits() -> TensorDataset:
    images, labels = load_digits_arrays()  # the copy of scikit-learn's digits the package has
    x = torch.tensor(images, dtype=torch.float32).unsqueeze(1) / 16.0
    return TensorDataset(x, torch.tensor(labels))


class Rank0Stopper:
    """Patience on the validation loss, kept by rank 0 alone; every decision is recorded."""

    def __init__(self, patience: int) -> None:
        self.patience, self.best, self.bad = patience, float("inf"), 0
        self.evaluations: list[list[Any]] = []  # [step, loss, stop] of each evaluation

    def update(self, loss: float, step: int) -> bool:
        if loss < self.best - 1e-4:
            self.best, self.bad = loss, 0
        else:
            self.bad += 1
        stop = self.bad >= self.patience
        self.evaluations.append([step, loss, stop])
        return stop

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "bad": self.bad, "evaluations": self.evaluations}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.bad = state["best"], state["bad"]
        self.evaluations = [list(e) for e in state["evaluations"]]


class Trainer:
    def __init__(self, args: argparse.Namespace, dataset: TensorDataset) -> None:
        torch.manual_seed(args.seed)
        net = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Flatten(),
                            nn.Dropout(0.1), nn.Linear(16 * 64, 10))
        self.model = fully_shard(net) if args.fsdp else DDP(net)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=args.lr)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, 50, gamma=0.7)
        self.loss_fn = nn.CrossEntropyLoss()
        self.loader = er.elastic_dataloader(dataset, args.batch_size, seed=args.seed,
                                            global_batch_size=args.global_batch)
        self.validation = Subset(dataset, range(0, len(dataset), 9))
        self.stopper = Rank0Stopper(args.patience)
        self.ft = er.fault_tolerant(self.model, self.optimizer, self.loader,
                                    checkpoint_dir=args.checkpoint_dir, every_steps=20,
                                    trace_dir=args.trace_dir,
                                    state={"stopper": self.stopper, "scheduler": self.scheduler})
        self.args = args

    def validate(self) -> float:
        """The mean validation loss: each rank scores its share, the sums are all-reduced."""
        share = range(dist.get_rank(), len(self.validation), dist.get_world_size())
        x = torch.stack([self.validation[i][0] for i in share])
        y = torch.stack([self.validation[i][1] for i in share])
        self.model.eval()
        with torch.no_grad():
            loss = self.loss_fn(self.model(x), y).item()
        self.model.train()
        sums = torch.tensor([loss * len(share), len(share)], dtype=torch.float64)
        dist.all_reduce(sums)
        return (sums[0] / sums[1]).item()

    def should_stop(self, step: int) -> bool:
        """Rank 0 decides on the validation loss and broadcasts the decision."""
        loss = self.validate()
        box = [self.stopper.update(loss, step) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return bool(box[0])

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """No gradient reduction in this backward (an accumulated micro-batch)."""
        if isinstance(self.model, DDP):
            with self.model.no_sync():
                yield
            return
        self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)

    def fit(self) -> None:
        model, ft, loader, args = self.model, self.ft, self.loader, self.args
        step, epoch = ft.resume()
        stop = bool(self.stopper.evaluations) and self.stopper.evaluations[-1][2]
        while step < args.steps and not stop:
            loader.elastic_sampler.set_epoch(epoch)
            for micro_batches in loader.steps():  # K of them; K = 1 without --global-batch
                self.optimizer.zero_grad()
                weights = ft.loss_weights()  # 1/K each, or each one's share of the batch
                for (x, y), weight in zip(micro_batches[:-1], weights, strict=False):
                    with self.no_sync():
                        (self.loss_fn(model(x), y) * weight).backward()
                x, y = micro_batches[-1]
                ft.backward(self.loss_fn(model(x), y) * weights[-1])
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                if ft.should_commit(norm):
                    self.optimizer.step()
                    self.scheduler.step()
                step = ft.step_done()
                if step % args.eval_every == 0 and self.should_stop(step):
                    stop = True
                    break
                if step >= args.steps:
                    break
            epoch += 1
        ft.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=240)
    p.add_argument("--batch-size", type=int, default=16)  # the micro-batch
    p.add_argument("--global-batch", type=int, default=None)  # kept at every world size
    p.add_argument("--fsdp", action="store_true")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--patience", type=int, default=8)
    p.add_argument("--checkpoint-dir", default="runs/own_loop_trainer")
    p.add_argument("--trace-dir", default=None)
    args = p.parse_args()
    dataset = digits()
    er.init_distributed()  # under elastic-runner run, a spare waits here to replace a rank
    trainer = Trainer(args, dataset)
    trainer.fit()
    dist.barrier()  # no rank tears gloo down while its peer still talks to it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
