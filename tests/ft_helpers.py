"""World-size-1 building blocks for the component tests: a hand-built TrainingSession (no process
group, no launcher, no watchdog thread, no signal handler), one step of the session protocol
and a recording callback."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.utils.data import TensorDataset

from elastic_runner.checkpoint.manager import CheckpointManager
from elastic_runner.config import EarlyStoppingConfig
from elastic_runner.data.loader import ElasticDataLoader
from elastic_runner.train.callbacks import Callback, Callbacks, LogEvent, StepEnd
from elastic_runner.train.consensus import LocalConsensus
from elastic_runner.train.early_stop import EarlyStopping
from elastic_runner.train.session import SessionOptions, TrainingSession
from elastic_runner.train.state import TrainState
from elastic_runner.train.stop import StopPolicy, StopReason
from elastic_runner.train.straggler import StragglerMonitor

CPU = torch.device("cpu")


def regression_data(n: int = 32, features: int = 4, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True) + 0.1 * torch.randn(n, 1, generator=g))


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class StepRecorder(Callback):
    """Keeps the step, skipped-step, rollback and finish events."""

    def __init__(self) -> None:
        self.steps: list[StepEnd] = []
        self.indices: list[list[int]] = []  # read during the event
        self.skipped: list[tuple[int, int, int]] = []
        self.rollbacks: list[int] = []
        self.finished: list[tuple[StopReason | None, str]] = []
        self.logs: list[LogEvent] = []

    def on_log(self, event: LogEvent) -> None:
        self.logs.append(event)

    def on_step_end(self, event: StepEnd) -> None:
        self.steps.append(event)
        self.indices.append(event.indices())

    def on_skipped_step(self, step: int, in_row: int, limit: int) -> None:
        self.skipped.append((step, in_row, limit))

    def on_rollback(self, step: int) -> None:
        self.rollbacks.append(step)

    def on_finish(self, reason: StopReason | None, message: str) -> None:
        self.finished.append((reason, message))


def build_session(directory: str, model: nn.Module, optimizer: torch.optim.Optimizer,
                  loader: ElasticDataLoader, *, stop_requested: Callable[[], bool] = lambda: False,
                  max_bad_steps: int = 3, async_save: bool = False, every_steps: int = 0,
                  max_steps: int | None = None, callbacks: Sequence[Callback] = (),
                  seed: int = 0) -> TrainingSession:
    """A TrainingSession for world size 1, its parts as
    :func:`~elastic_runner.rank_session.assemble_session` makes them (but LocalConsensus, no
    reporting threads, no RNG state)."""
    state, sampler = TrainState(), loader.elastic_sampler
    stop = StopPolicy(max_steps, 10**9, EarlyStopping(EarlyStoppingConfig()))
    reporting = Callbacks(callbacks)
    checkpoints = CheckpointManager(
        str(directory), {"model": model, "optimizer": optimizer, "sampler": sampler,
                         "train_state": state, "stop": stop},
        every_steps=every_steps, async_save=async_save, keep_best=False, listener=reporting,
        rank=0)
    return TrainingSession(
        state=state, sampler=sampler, checkpoints=checkpoints,
        consensus=LocalConsensus(stop_requested), stop=stop, callbacks=reporting,
        straggler=StragglerMonitor(0.0, 0, 1, CPU), device=CPU,
        options=SessionOptions(seed=seed, log_every_steps=1, max_bad_steps=max_bad_steps),
        lr=lambda: optimizer.param_groups[0]["lr"], fetched=loader.take_fetched)


def run_step(session: TrainingSession, model: nn.Module, optimizer: torch.optim.Optimizer,
             loader: ElasticDataLoader, *, nan: bool = False) -> int:
    """One optimizer step of the session protocol on the loader's next micro-batch (a new
    epoch when the current one is used up); ``nan`` makes the loss non-finite."""
    sampler = loader.elastic_sampler
    if sampler.steps_left_in_epoch() == 0:
        sampler.set_epoch(sampler.epoch + 1)
    session.begin_step()
    x, y = next(iter(loader))
    session.data_ready()
    optimizer.zero_grad(set_to_none=True)
    loss = nn.functional.mse_loss(model(x), y)
    if nan:
        loss = loss * float("nan")
    session.backward(loss)
    norm = nn.utils.get_total_norm([p.grad for p in model.parameters()])
    if session.should_commit(norm):
        optimizer.step()
    return session.end_step(loss.detach())
