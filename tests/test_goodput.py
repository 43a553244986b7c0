"""The goodput clock: every second goes to exactly one cause, and the job's figures survive a
restart (through a checkpoint), a rollback and an in-place join."""

from __future__ import annotations

import pytest

from elastic_runner.callbacks import StepEnd
from elastic_runner.goodput import CAUSES, Goodput


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def tick(self, seconds: float) -> None:
        self.t += seconds


def step(g: Goodput, clock: Clock, seconds: float, committed: bool = True, n: int = 1) -> None:
    g.on_step_begin(n, n)
    clock.tick(seconds)
    g.on_step_end(StepEnd(step=n, epoch=0, seconds=seconds, data_seconds=0.0, samples=1,
                          global_samples=2, loss=None, mean_loss=None, lr=0.0,
                          committed=committed, log_due=False, indices=list))


def test_every_second_has_one_cause():
    clock = Clock()
    g = Goodput(process_start=clock.t - 3.0, clock=clock)  # 3 s of interpreter and imports
    g.on_phase("loading", "checkpoint load", True)
    clock.tick(1.0)
    step(g, clock, 2.0)
    step(g, clock, 0.5, committed=False)  # a skipped non-finite step
    g.on_phase("evaluating", "evaluation", True)
    clock.tick(1.5)
    g.on_phase("checkpointing", "checkpoint", True)
    clock.tick(0.25)
    step(g, clock, 2.0)
    s = g.seconds()
    assert s == {"productive": 4.0, "startup": 4.0, "recovery": 0.0, "redone": 0.0,
                 "checkpoint": 0.25, "evaluation": 1.5, "other": 0.5}
    assert sum(s.values()) == pytest.approx(clock.t - g.job_start)
    assert g.ettr() == pytest.approx(4.0 / 10.25)
    assert g.summary().startswith("goodput: ETTR 0.390 over 10.2 s")


def test_a_step_left_by_a_failure_is_lost_work_then_recovery():
    clock = Clock()
    g = Goodput(process_start=clock.t, clock=clock)
    step(g, clock, 1.0)
    g.on_step_begin(2, 2)
    clock.tick(0.3)
    g.on_phase("recovering", "in-place recovery", True)  # the peer died mid-step
    clock.tick(0.7)
    step(g, clock, 1.0, n=2)
    s = g.seconds()
    assert (s["productive"], s["redone"], s["recovery"]) == pytest.approx((2.0, 0.3, 0.7))


def test_restart_counts_the_gap_since_the_checkpoint_as_redone():
    clock = Clock()
    first = Goodput(process_start=clock.t, clock=clock)
    step(first, clock, 10.0)
    saved = first.state_dict()  # the checkpoint, at t+10
    step(first, clock, 5.0)  # lost: after the checkpoint
    clock.tick(2.0)  # detection, the agent stops the workers
    second = Goodput(process_start=clock.t, clock=clock)
    clock.tick(4.0)  # start-up of the new process
    second.load_state_dict(saved)
    second.on_resumed(1)
    step(second, clock, 3.0)
    s = second.seconds()
    assert s["productive"] == 13.0 and s["redone"] == 7.0 and s["startup"] == 4.0
    assert sum(s.values()) == pytest.approx(clock.t - 1000.0)
    assert second.job_start == 1000.0


def test_rollback_undoes_the_steps_since_the_checkpoint():
    clock = Clock()
    g = Goodput(process_start=clock.t, clock=clock)
    g.load_state_dict(Goodput(process_start=clock.t, clock=clock).state_dict())
    step(g, clock, 2.0)
    saved = g.state_dict()
    step(g, clock, 3.0, committed=False)
    g.load_state_dict(saved)  # rollback to the checkpoint
    step(g, clock, 1.0)
    s = g.seconds()
    assert s["productive"] == 3.0 and s["redone"] == 3.0
    assert sum(s.values()) == pytest.approx(6.0)


def test_a_joining_spare_does_not_count_its_own_start_up():
    clock = Clock()
    peer = Goodput(process_start=clock.t, clock=clock)
    spare = Goodput(process_start=clock.t + 1.0, clock=clock)
    step(peer, clock, 20.0)  # meanwhile the spare built the task and waited
    spare.load_state_dict(peer.state_dict())
    spare.on_recovered(1, True, lambda: (0, []))
    clock.tick(0.5)
    step(spare, clock, 1.0)
    s = spare.seconds()
    assert s["productive"] == 21.0 and s["recovery"] == 0.5 and s["startup"] == 0.0
    assert set(s) == set(CAUSES)
