"""The step consensus: two real gloo processes. On the DDP comm hook the gradients are bitwise
those of plain DDP (also when it wraps a user's own hook), and a non-finite loss or a stop
request on one rank gives the same decision on both; the plain all-reduce twin agrees."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from elastic_runner.consensus import (
    AllReduceConsensus,
    CommHookConsensus,
    LocalConsensus,
    StepDecision,
    make_consensus,
)

from .procs import free_port

WORLD_SIZE = 2
NAN = float("nan")


def _model() -> nn.Module:
    torch.manual_seed(0)
    # bucket_cap_mb below makes several buckets: the packed flags go with bucket 0 only
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                         nn.Linear(256, 4))


def _backward(net: DDP, x: torch.Tensor, consensus=None, loss_seen=None, stop=None):
    net.zero_grad(set_to_none=True)
    loss = net(x).square().mean()
    if consensus is not None:
        stop[0] = loss_seen[1]
        consensus.propose(torch.tensor(loss_seen[0]))
    loss.backward()
    return [p.grad.clone() for p in net.module.parameters()]


def _decisions(net: DDP, consensus, x: torch.Tensor, rank: int, stop: list[bool]):
    """Decisions for: nothing raised, rank 0's loss NaN, rank 1 asked to stop."""
    cases = [(0.0, False), (NAN if rank == 0 else 1.0, False), (1.0, rank == 1)]
    out, grads = [], None
    for case in cases:
        grads = _backward(net, x, consensus, case, stop)
        out.append(consensus.decide(None))
    return out, grads


def _worker(rank: int, port: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    try:
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(rank))
        stop = [False]
        plain = _backward(DDP(_model(), bucket_cap_mb=0.1), x)
        hooked = DDP(_model(), bucket_cap_mb=0.1)
        packed, packed_grads = _decisions(
            hooked, CommHookConsensus(hooked, lambda: stop[0]), x, rank, stop)
        user = DDP(_model(), bucket_cap_mb=0.1)
        user.register_comm_hook(None, fp16_compress_hook)
        user_plain = _backward(user, x)
        wrapping = DDP(_model(), bucket_cap_mb=0.1)
        wrapped, wrapped_grads = _decisions(
            wrapping, CommHookConsensus(wrapping, lambda: stop[0], fp16_compress_hook), x,
            rank, stop)
        plain_net = DDP(_model())
        reduced, _ = _decisions(plain_net, AllReduceConsensus(lambda: stop[0]), x, rank, stop)
        errors = _errors(x)
        out[rank] = {
            "packed_same": all(map(torch.equal, plain, packed_grads)),
            "wrapped_same": all(map(torch.equal, user_plain, wrapped_grads)),
            "packed": packed, "wrapped": wrapped, "reduced": reduced, "errors": errors,
            "fallback": type(make_consensus(user)).__name__}
    finally:
        dist.destroy_process_group()


def _errors(x: torch.Tensor) -> list[str]:
    errors = []
    net = DDP(_model())
    consensus = CommHookConsensus(net)
    for call in (lambda: consensus.decide(), lambda: (consensus.propose(torch.tensor(1.0)),
                                                      consensus.decide())):
        try:
            call()
            errors.append("no error")
        except RuntimeError as e:
            errors.append(str(e))
    try:
        CommHookConsensus(net)
        errors.append("no error")
    except RuntimeError as e:
        errors.append(str(e))
    return errors


@pytest.mark.timeout(180)
def test_decisions_reach_every_rank_and_gradients_are_unchanged():
    with mp.Manager() as manager:
        out = manager.dict()
        mp.start_processes(_worker, args=(free_port(), out), nprocs=WORLD_SIZE, join=True,
                           start_method="spawn")
        out = dict(out)
    want = [StepDecision(commit=True, stop=False), StepDecision(commit=False, stop=False),
            StepDecision(commit=True, stop=True)]
    for rank in range(WORLD_SIZE):
        r = out[rank]
        assert r["packed_same"], f"rank {rank}: gradients differ from plain DDP"
        assert r["wrapped_same"], f"rank {rank}: gradients differ from the user's own hook"
        assert r["packed"] == r["wrapped"] == r["reduced"] == want, rank
        assert "without propose()" in r["errors"][0]
        assert "reduced no gradient bucket" in r["errors"][1]
        assert "already registered" in r["errors"][2]
        assert r["fallback"] == "AllReduceConsensus"  # a hook the user registered first


def test_local_consensus_checks_loss_gradient_norm_and_stop():
    stop = [False]
    c = LocalConsensus(lambda: stop[0])
    c.propose(torch.tensor(2.0))
    assert c.decide(torch.tensor(1.0)) == StepDecision(commit=True, stop=False)
    c.propose(torch.tensor(float("inf")))
    assert not c.decide(torch.tensor(1.0)).commit
    stop[0] = True
    c.propose(torch.tensor(2.0))
    assert c.decide(torch.tensor(float("nan"))) == StepDecision(commit=False, stop=True)
    assert isinstance(make_consensus(nn.Linear(2, 2)), LocalConsensus)
