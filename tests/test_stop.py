"""StopPolicy: limits, the early-stopping decision after an evaluation, reopening a finished run
whose limits were raised, its state, and the reasons of messages of older releases."""

from __future__ import annotations

import pytest

from elastic_runner.config import EarlyStoppingConfig
from elastic_runner.train.early_stop import EarlyStopping
from elastic_runner.train.stop import StopPolicy, StopReason


def policy(max_steps: int | None = 10, max_epochs: int = 3, **early) -> StopPolicy:
    return StopPolicy(max_steps, max_epochs, EarlyStopping(EarlyStoppingConfig(**early)))


@pytest.mark.parametrize("max_steps, step, epochs_done, expected", [
    (10, 9, 0, None),
    (10, 10, 0, StopReason.MAX_STEPS),
    (10, 12, 5, StopReason.MAX_STEPS),  # steps are checked first
    (10, 5, 2, None),
    (10, 5, 3, StopReason.MAX_EPOCHS),
    (None, 10**6, 2, None),  # no step limit
    (0, 10**6, 2, None),  # 0: no step limit either
])
def test_limit_reached(max_steps, step, epochs_done, expected):
    reached = policy(max_steps, 3).limit_reached(step, epochs_done)
    if expected is None:
        assert reached is None
    else:
        assert reached == (expected, f"{expected.value} reached")


def test_after_eval_stops_after_patience_evaluations_without_improvement():
    p = policy(enabled=True, metric="val_loss", mode="min", patience=2)
    out = [p.after_eval(v, step, rank=0) for v, step in
           [(1.0, 10), (0.5, 20), (0.6, 30), (0.7, 40)]]
    assert [d.improved for d, _ in out] == [True, True, False, False]
    assert [d.stop for d, _ in out] == [False, False, False, True]
    assert out[-1][1] == ("early stopping: no improvement of val_loss in 2 evaluations; best "
                          "0.5 at step 20")
    assert p.early_stopping.best == 0.5 and p.early_stopping.best_step == 20
    assert not p.stopped  # the decision is the caller's to apply


def test_after_eval_with_early_stopping_disabled_only_tracks_the_best():
    p = policy(enabled=False, patience=1)
    decisions = [p.after_eval(v, i, rank=0)[0] for i, v in enumerate([3.0, 4.0, 5.0, 2.0])]
    assert [d.stop for d in decisions] == [False] * 4
    assert [d.improved for d in decisions] == [True, False, False, True]
    assert (p.early_stopping.best, p.early_stopping.best_step) == (2.0, 3)


def stopped(reason: StopReason, max_steps: int | None = 10, max_epochs: int = 3) -> StopPolicy:
    p = policy(max_steps, max_epochs)
    p.stop(reason, f"{reason.value}: test", step=10)
    return p


def test_reopen_when_max_steps_was_raised():
    p = stopped(StopReason.MAX_STEPS)
    assert not p.reopen(step=10, epoch=1)  # unchanged limit: stays stopped
    assert p.reason is StopReason.MAX_STEPS
    p.max_steps = 20
    assert p.reopen(step=10, epoch=1)
    assert (p.reason, p.message, p.stopped) == (None, "", False)


def test_reopen_when_max_epochs_was_raised():
    p = stopped(StopReason.MAX_EPOCHS, max_steps=None, max_epochs=2)
    assert not p.reopen(step=50, epoch=2)
    p.max_epochs = 3
    assert p.reopen(step=50, epoch=2)
    assert not p.stopped


def test_reopen_needs_every_limit_to_allow_it():
    p = stopped(StopReason.MAX_EPOCHS, max_steps=10, max_epochs=2)
    p.max_epochs = 5
    assert not p.reopen(step=10, epoch=2)  # max_steps is reached now
    assert p.reason is StopReason.MAX_EPOCHS


@pytest.mark.parametrize("reason", [StopReason.EARLY_STOPPING, StopReason.FAILED])
def test_early_stopped_and_failed_runs_stay_stopped(reason):
    p = stopped(reason, max_steps=10)
    p.max_steps, p.max_epochs = 1000, 1000
    assert not p.reopen(step=10, epoch=0)
    assert p.reason is reason and p.message == f"{reason.value}: test"


def test_a_running_policy_does_not_reopen():
    assert not policy().reopen(step=1, epoch=0)


def test_state_dict_round_trip():
    p = policy(enabled=True, patience=3)
    p.after_eval(0.9, 5, rank=0)
    p.after_eval(1.2, 10, rank=0)
    p.stop(StopReason.EARLY_STOPPING, "early stopping: test", step=10)
    state = p.state_dict()
    assert state["reason"] == "early_stopping"  # a plain string, loadable with weights_only
    q = policy(enabled=True, patience=3)
    q.load_state_dict(state)
    assert q.reason is StopReason.EARLY_STOPPING and q.message == "early stopping: test"
    assert q.early_stopping.state_dict() == {"best": 0.9, "best_step": 5, "bad_evals": 1,
                                             "stopped": False}
    running = policy()
    running.load_state_dict(policy().state_dict())
    assert running.reason is None and running.message == "" and not running.stopped


@pytest.mark.parametrize("message, reason", [
    ("max_steps reached", StopReason.MAX_STEPS),
    ("max_epochs reached", StopReason.MAX_EPOCHS),
    ("early stopping: no improvement of val_loss in 3 evaluations", StopReason.EARLY_STOPPING),
    ("failed: 3 non-finite steps in a row at step 7", StopReason.FAILED),
    ("preempted by signal after step 4", StopReason.PREEMPTED),
    ("", None),
    ("stopped by the operator", None),
])
def test_reason_from_message(message, reason):
    assert StopReason.from_message(message) is reason


def test_only_preemption_is_not_final():
    assert [r for r in StopReason if not r.final] == [StopReason.PREEMPTED]
