"""The step consensus with two real gloo processes: the default gradient signal (no collective
of its own), the comm hook wrapping a user's hook and the plain all-reduce give the same
decisions on both ranks for a non-finite loss on one rank and a stop request on the other; when
nothing is signalled the gradients are bitwise those of plain DDP (or of the user's hook)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from elastic_runner.train.consensus import (
    AllReduceConsensus,
    CommHookConsensus,
    GradientConsensus,
    LocalConsensus,
    StepDecision,
    make_consensus,
)

from .procs import free_port

WORLD_SIZE = 2
NAN = float("nan")
# nothing; rank 0's loss NaN; rank 1 asked to stop (loss values seen by the vote, stop flag)
CASES = [(lambda r: 1.0, lambda r: False), (lambda r: NAN if r == 0 else 1.0, lambda r: False),
         (lambda r: 1.0, lambda r: r == 1)]
WANT = [StepDecision(commit=True, stop=False), StepDecision(commit=False, stop=False),
        StepDecision(commit=False, stop=True)]


def _model() -> nn.Module:
    torch.manual_seed(0)
    # bucket_cap_mb below makes several buckets: the hook's flags go with bucket 0 only
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                         nn.Linear(256, 4))


def _grads(net: DDP) -> list[torch.Tensor]:
    return [p.grad.clone() for p in net.module.parameters()]


def _plain(net: DDP, x: torch.Tensor) -> list[torch.Tensor]:
    net.zero_grad(set_to_none=True)
    net(x).square().mean().backward()
    return _grads(net)


def _decisions(net: DDP, consensus, x: torch.Tensor, rank: int, stop: list[bool]):
    """Each case's decision, and the gradients of the first (nothing signalled)."""
    out, first = [], None
    for seen, stopping in CASES:
        net.zero_grad(set_to_none=True)
        loss = net(x).square().mean()
        stop[0] = stopping(rank)
        consensus.propose(loss, loss.detach() * seen(rank)).backward()
        norm = nn.utils.get_total_norm([p.grad for p in net.parameters()])
        out.append(consensus.decide(norm))
        first = first or _grads(net)
    return out, first


def _worker(rank: int, port: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    try:
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(rank))
        stop = [False]
        plain = _plain(DDP(_model(), bucket_cap_mb=0.1), x)
        net = DDP(_model(), bucket_cap_mb=0.1)
        signal, signal_grads = _decisions(net, make_consensus(net, lambda: stop[0]), x, rank,
                                          stop)
        user = DDP(_model(), bucket_cap_mb=0.1)
        user.register_comm_hook(None, fp16_compress_hook)
        user_plain = _plain(user, x)
        wrapping = DDP(_model(), bucket_cap_mb=0.1)
        hooked, hooked_grads = _decisions(
            wrapping, make_consensus(wrapping, lambda: stop[0], fp16_compress_hook), x, rank,
            stop)
        reduced, _ = _decisions(DDP(_model()), AllReduceConsensus(lambda: stop[0]), x, rank,
                                stop)
        out[rank] = {
            "kinds": [type(make_consensus(DDP(_model()))).__name__,
                      type(make_consensus(nn.Linear(2, 2))).__name__],
            "signal_same": all(map(torch.equal, plain, signal_grads)),
            "hooked_same": all(map(torch.equal, user_plain, hooked_grads)),
            "signal": signal, "hooked": hooked, "reduced": reduced, "errors": _errors(x)}
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
    for rank in range(WORLD_SIZE):
        r = out[rank]
        assert r["kinds"] == ["GradientConsensus", "AllReduceConsensus"]
        assert r["signal_same"], f"rank {rank}: gradients differ from plain DDP"
        assert r["hooked_same"], f"rank {rank}: gradients differ from the user's own hook"
        assert r["signal"] == r["hooked"] == r["reduced"] == WANT, rank
        assert "without propose()" in r["errors"][0]
        assert "reduced no gradient bucket" in r["errors"][1]
        assert "already registered" in r["errors"][2]


def test_local_consensus_checks_loss_gradient_norm_and_stop():
    stop = [False]
    c = LocalConsensus(lambda: stop[0])
    loss = torch.tensor(2.0)
    assert c.propose(loss) is loss
    assert c.decide(torch.tensor(1.0)) == StepDecision(commit=True, stop=False)
    c.propose(torch.tensor(float("inf")))
    assert not c.decide(torch.tensor(1.0)).commit
    c.propose(torch.tensor(2.0))
    assert not c.decide(torch.tensor(float("nan"))).commit
    c.propose(torch.tensor(2.0))  # fp16: an overflow alone is the GradScaler's to skip
    assert c.decide(torch.tensor(float("inf")), overflow_ok=True).commit
    stop[0] = True
    c.propose(torch.tensor(2.0))
    assert c.decide(torch.tensor(1.0)) == StepDecision(commit=False, stop=True)
    assert isinstance(make_consensus(nn.Linear(2, 2)), LocalConsensus)


def test_gradient_signal_is_exact_when_finite_and_nan_otherwise():
    c = GradientConsensus()
    w = torch.tensor(3.0, requires_grad=True)
    c.propose(w * 2.0).backward()
    assert w.grad.item() == 2.0
    w.grad = None
    loss = w * 2.0
    c.propose(loss, loss.detach() * float("inf")).backward()
    assert w.grad.isnan().item()
