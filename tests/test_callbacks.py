"""Callbacks: every event reaches each callback in list order; per-step events reach only the
callbacks that override them; needs_mean_loss aggregates."""

from __future__ import annotations

import inspect

import pytest
import torch

from elastic_runner.checkpoint.events import CheckpointEvent
from elastic_runner.checkpoint.storage import CheckpointInfo
from elastic_runner.recovery.rejoin import RecoveryReport
from elastic_runner.train.callbacks import Callback, Callbacks, LogEvent, StepEnd
from elastic_runner.train.stop import StopReason

EVENT = StepEnd(step=3, epoch=0, seconds=0.1, data_seconds=0.01, samples=4, global_samples=8,
                loss=torch.tensor(0.5), mean_loss=0.5, lr=0.1,
                committed=True, log_due=False, indices=lambda: [1, 2, 3, 4])
LOG = LogEvent(step=3, epoch=0, mean_loss=0.5, straggler_ratio=1.2, lr=0.1,
               samples_per_second=80.0)
INFO = CheckpointInfo("ckpt/step-00000003", "step", 3, 0, 1, 0.0, 10, True)
COMMITTED = CheckpointEvent(["ckpt/step-00000003"], 3, 0.2, 10)

# every event of the Callback interface with arguments to call it with
CALLS = {
    "on_phase": ("checkpointing", "checkpoint", True),
    "on_step_begin": (3, 1),
    "on_step_end": (EVENT,),
    "on_log": (LOG,),
    "on_skipped_step": (3, 1, 3),
    "on_rollback": (2,),
    "on_epoch_end": (0, 3, lambda: [7]),
    "on_eval": (3, {"val_loss": 0.4}),
    "on_early_stopping": ("val_loss", 0.4, 2),
    "on_resumed": (2,),
    "on_finish": (StopReason.MAX_STEPS, "max_steps reached"),
    "on_recovered": (5, True, lambda: (0, [1, 2])),
    "on_recovery_report": (RecoveryReport(1, [1], 5, {"detection": 0.01}),),
    "on_membership_change": ("preempted",),
    "checkpoint_stall": (0.01,),
    "checkpoint_committed": (COMMITTED,),
    "checkpoint_loaded": (INFO,),
    "close": (),
}


def _recording(name: str, log: list) -> type[Callback]:
    def method(event: str):
        def record(self, *args):
            log.append((name, event, args))
        return record

    return type(f"Recording{name}", (Callback,), {e: method(e) for e in CALLS})


def test_the_table_covers_every_event_of_the_interface():
    events = {n for n, f in vars(Callback).items() if inspect.isfunction(f)}
    assert events == set(CALLS)


def test_every_event_is_dispatched_to_each_callback_in_order():
    log: list = []
    a, b, c = (_recording(n, log)() for n in "abc")
    callbacks = Callbacks([a, b, c])
    for event, args in CALLS.items():
        getattr(callbacks, event)(*args)
    assert log == [(n, event, args) for event, args in CALLS.items() for n in "abc"]


class OnlyEnd(Callback):
    def __init__(self) -> None:
        self.ends: list[int] = []

    def on_step_end(self, event: StepEnd) -> None:
        self.ends.append(event.step)


class OnlyBegin(Callback):
    def __init__(self) -> None:
        self.begins: list[tuple[int, int]] = []

    def on_step_begin(self, step: int, steps_this_attempt: int) -> None:
        self.begins.append((step, steps_this_attempt))


def test_per_step_events_go_only_to_callbacks_that_override_them(monkeypatch):
    base_calls: list[tuple[str, object]] = []
    # a dispatch to a callback that does not override the event lands in the base class
    monkeypatch.setattr(Callback, "on_step_begin",
                        lambda self, *a: base_calls.append(("begin", self)))
    monkeypatch.setattr(Callback, "on_step_end", lambda self, *a: base_calls.append(("end", self)))
    end, begin, plain = OnlyEnd(), OnlyBegin(), Callback()
    callbacks = Callbacks([plain, end, begin])
    callbacks.on_step_begin(4, 2)
    callbacks.on_step_end(EVENT)
    assert base_calls == []
    assert end.ends == [3] and begin.begins == [(4, 2)]


def test_appended_callbacks_get_per_step_events():
    end = OnlyEnd()
    callbacks = Callbacks()
    callbacks.on_step_end(EVENT)  # the empty list is a null object
    callbacks.append(end)
    callbacks.on_step_end(EVENT)
    assert end.ends == [3] and callbacks.items == [end]


class WantsMean(Callback):
    needs_mean_loss = True


@pytest.mark.parametrize("items, expected", [
    ([], False),
    ([Callback(), OnlyEnd()], False),
    ([Callback(), WantsMean()], True),
])
def test_needs_mean_loss_aggregates(items, expected):
    assert Callbacks(items).needs_mean_loss is expected


def test_needs_mean_loss_after_append_and_nested():
    callbacks = Callbacks([OnlyEnd()])
    assert not callbacks.needs_mean_loss
    callbacks.append(WantsMean())
    assert callbacks.needs_mean_loss
    assert Callbacks([Callbacks([WantsMean()])]).needs_mean_loss


def test_nested_callbacks_forward_per_step_events():
    end = OnlyEnd()
    outer = Callbacks([Callbacks([end])])
    outer.on_step_end(EVENT)
    assert end.ends == [3]
