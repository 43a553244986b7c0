"""The step engine: batches moved to the device with their nesting, the micro-batch loss of the
supported batch and output shapes, gradient accumulation equal to one large micro-batch, a
skipped update for a non-finite loss, gradient clipping."""

from __future__ import annotations

import collections
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from elastic_runner.data.loader import elastic_dataloader
from elastic_runner.trainer.engine import StepEngine, batch_loss, precision_dtype, to_device

from .evidence import assert_same_tensors
from .ft_helpers import CPU, build_session, regression_data, weights

META = torch.device("meta")


def test_to_device_moves_every_tensor_and_keeps_the_nesting():
    batch = {"a": torch.ones(2), "pair": (torch.zeros(1), [torch.ones(3), "label"]), "n": 4}
    moved = to_device(batch, META)
    assert type(moved) is dict and moved.keys() == batch.keys()
    assert moved["a"].device == META and moved["a"].shape == (2,)
    assert type(moved["pair"]) is tuple and type(moved["pair"][1]) is list
    assert moved["pair"][0].device == META and moved["pair"][1][0].device == META
    assert moved["pair"][1][1] == "label" and moved["n"] == 4
    assert to_device(torch.ones(1), META).device == META


Pair = collections.namedtuple("Pair", "x y")


def test_to_device_keeps_namedtuples():
    moved = to_device(Pair(torch.ones(2), torch.zeros(2)), META)
    assert type(moved) is Pair and moved.x.device == META and moved.y.device == META


class Linear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class WithLoss(Linear):
    """A Hugging Face style model: keyword inputs, an output object with ``.loss``."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> SimpleNamespace:
        out = self.lin(x)
        return SimpleNamespace(logits=out, loss=nn.functional.mse_loss(out, y))


class MappingOut(Linear):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict:
        out = self.lin(x)
        return {"logits": out, "loss": nn.functional.l1_loss(out, y)}


X, Y = torch.arange(12.0).reshape(4, 3) / 10, torch.ones(4, 1)


def test_batch_loss_of_an_input_target_pair():
    net = Linear()
    loss = batch_loss(net, (X, Y), nn.functional.mse_loss)
    assert torch.equal(loss, nn.functional.mse_loss(net.lin(X), Y))


def test_batch_loss_of_a_mapping_batch_from_the_output_loss_attribute():
    net = WithLoss()
    loss = batch_loss(net, {"x": X, "y": Y}, None)
    assert torch.equal(loss, nn.functional.mse_loss(net.lin(X), Y))


def test_batch_loss_of_a_mapping_output():
    net = MappingOut()
    loss = batch_loss(net, {"x": X, "y": Y}, None)
    assert torch.equal(loss, nn.functional.l1_loss(net.lin(X), Y))


def test_batch_loss_of_a_mapping_batch_with_a_loss_fn():
    net = WithLoss()
    loss = batch_loss(net, {"x": X, "y": Y},
                      lambda out, batch: (out.logits - batch["y"]).abs().sum())
    assert torch.equal(loss, (net.lin(X) - Y).abs().sum())


def test_precision_dtype():
    assert [precision_dtype(p) for p in ("fp32", "bf16", "fp16")] == [None, torch.bfloat16,
                                                                        torch.float16]


def engine_for(model: nn.Module, lr: float = 0.1, clip: float | None = None):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    return StepEngine(model, model, opt, scheduler, nn.functional.mse_loss, CPU, None, clip,
                      scaler), opt, scheduler


def one_step(tmp_path, name: str, micro_batch: int, accum: int, *, clip: float | None = None,
             lr: float = 0.1, poison: bool = False):
    """One optimizer step of a fresh 4->1 linear model over the first 16 samples of the same
    permutation, with the given micro-batch and accumulation."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    engine, opt, scheduler = engine_for(model, lr=lr, clip=clip)
    loader = elastic_dataloader(regression_data(32), micro_batch, seed=2,
                                grad_accum_steps=accum)
    session = build_session(tmp_path / name, model, opt, loader)
    before = weights(model)
    micro_batches = next(loader.steps())
    if poison:
        micro_batches[-1] = (micro_batches[-1][0] * float("nan"), micro_batches[-1][1])
    session.begin_step()
    loss = engine.step(micro_batches, session)
    step = session.end_step(loss)
    assert step == 1 and session.sampler.cursor == 16
    assert all(p.grad is None for p in model.parameters())  # zeroed for the next step
    assert scheduler.last_epoch == 1  # the schedule moves on skipped steps too
    return before, weights(model), loss, session


def test_accumulation_of_two_micro_batches_equals_one_micro_batch_of_twice_the_size(tmp_path):
    before, accumulated, loss_acc, _ = one_step(tmp_path, "a", micro_batch=8, accum=2)
    _, single, loss_single, _ = one_step(tmp_path, "b", micro_batch=16, accum=1)
    assert not torch.equal(accumulated["weight"], before["weight"])
    for k in single:
        torch.testing.assert_close(accumulated[k], single[k], rtol=0, atol=1e-6)
    torch.testing.assert_close(loss_acc, loss_single, rtol=0, atol=1e-6)


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step:UserWarning")
def test_non_finite_loss_skips_the_update(tmp_path):
    before, after, loss, session = one_step(tmp_path, "nan", micro_batch=8, accum=2,
                                            poison=True)
    assert_same_tensors(after, before)
    assert not torch.isfinite(loss)
    assert (session.state.bad_steps, session.state.bad_in_row) == (1, 1)


def test_gradient_clipping_bounds_the_update(tmp_path):
    before, after, _, _ = one_step(tmp_path, "clip", micro_batch=16, accum=1, clip=1e-3,
                                   lr=1.0)
    delta = torch.cat([(after[k] - before[k]).flatten() for k in before])
    torch.testing.assert_close(delta.norm(), torch.tensor(1e-3), rtol=1e-4, atol=0)
