"""The step vote rides on DDP's gradient all-reduce: two real gloo processes; the gradients are
bitwise those of plain DDP, and a flag raised on one rank reaches both."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from elastic_runner.vote import GradientVote

from .procs import free_port

WORLD_SIZE = 2


def _model() -> nn.Module:
    torch.manual_seed(0)
    # bucket_cap_mb below makes several buckets: the flags go with bucket 0 only
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                         nn.Linear(256, 4))


def _grads(net: DDP, x: torch.Tensor) -> list[torch.Tensor]:
    net.zero_grad(set_to_none=True)
    net(x).square().mean().backward()
    return [p.grad.clone() for p in net.module.parameters()]


def _worker(rank: int, port: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    try:
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(rank))
        plain = _grads(DDP(_model(), bucket_cap_mb=0.1), x)
        hooked = DDP(_model(), bucket_cap_mb=0.1)
        vote = GradientVote(hooked)
        results = []
        for flags in ([0.0, 0.0], [float(rank == 0), 0.0], [0.0, float(rank == 1)]):
            vote.arm(torch.tensor(flags))
            grads = _grads(hooked, x)
            results.append(vote.result().tolist())
        vote.arm(torch.zeros(2))  # no backward since: no result
        try:
            vote.result()
            unreduced = "no error"
        except RuntimeError as e:
            unreduced = str(e)
        out[rank] = {"unreduced": unreduced,"same_grads": all(torch.equal(a, b) for a, b in zip(plain, grads,
                                                                         strict=True)),
                     "flags": results}
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_flags_reach_every_rank_and_gradients_are_unchanged():
    with mp.Manager() as manager:
        out = manager.dict()
        mp.start_processes(_worker, args=(free_port(), out), nprocs=WORLD_SIZE, join=True,
                           start_method="spawn")
        out = dict(out)
    for rank in range(WORLD_SIZE):
        assert out[rank]["same_grads"], f"rank {rank}: gradients differ from plain DDP"
        # mean over ranks: > 0 where any rank raised the flag
        assert out[rank]["flags"] == [[0.0, 0.0], [0.5, 0.0], [0.0, 0.5]]
        assert "reduced no gradient bucket" in out[rank]["unreduced"]

