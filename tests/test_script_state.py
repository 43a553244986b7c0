"""A script's ``state=`` as rank 0 holds it (``own_loop/script_state.py``), in one process: a
world size 1 gloo group stands for the group after a recovery and a HashStore for the recovery
store. What rank 0's work after a step changed reaches the store with its step; a survivor
that was not rank 0 goes on with rank 0's value of the step it redoes (or of the boundary);
a survivor inside the work after a step keeps its values; values the record cannot hold are
named. The multi-rank path runs in ``test_own_loop.py`` (rank 0 killed in place)."""

from __future__ import annotations

import io
import logging
from typing import Any

import pytest
import torch
import torch.distributed as dist

from elastic_runner.own_loop.script_state import KEPT_VERSIONS, ScriptState
from elastic_runner.protocol.keys import AttemptKeys


class Counter:
    """Bookkeeping only rank 0 updates (an early stopper's count of evaluations)."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.n = state["n"]


@pytest.fixture
def store() -> AttemptKeys:
    return AttemptKeys(dist.HashStore(), lambda *parts: "/".join(map(str, parts)))


@pytest.fixture
def group():
    assert not dist.is_initialized(), "a default process group leaked by an earlier test"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def rank0_windows(store: AttemptKeys, evaluations: list[int], steps: int) -> Counter:
    """Rank 0 runs ``steps`` steps, counting one evaluation after each step in
    ``evaluations``."""
    counter = Counter()
    state = ScriptState({"counter": counter}, 0, store)
    for step in range(1, steps + 1):
        state.committed(step)
        if step in evaluations:
            counter.n += 1
        state.window_done(step)  # the next step's boundary
    return counter


def survivor(store: AttemptKeys, phase: str, step: int) -> int:
    """A rank that was rank 1 (its counter never moved) agrees alone in the new group, rank 0
    gone: returns the counter it goes on with."""
    counter = Counter()
    state = ScriptState({"counter": counter}, 1, store)
    state.committed(step)
    state.agree(0, joining=False, phase=phase, step=step)
    return counter.n


def test_rank0s_windows_reach_the_store_with_their_steps_and_only_when_they_change(store):
    rank0_windows(store, evaluations=[2, 5, 6, 8], steps=9)
    versions = torch.load(io.BytesIO(store.rank0_state()), weights_only=True)
    # the value before each window that changed it, and after: the last few kept
    assert versions == {"counter": [(5, {"n": 2}), (6, {"n": 3}), (8, {"n": 4})][-KEPT_VERSIONS:]}


@pytest.mark.parametrize(("phase", "step", "want"), [
    ("step", 9, 4),      # rank 0 died in step 10: the window of 9 runs again from its start
    ("step", 8, 3),      # ... in step 9: the window of 8 (an evaluation) runs again from 3
    ("boundary", 8, 4),  # ... at step 9's boundary: the window of 8 stands
])
def test_a_survivor_goes_on_with_rank0s_value_of_the_window_it_redoes(group, store, phase, step,
                                                                     want):
    rank0_windows(store, evaluations=[2, 5, 6, 8], steps=step)
    assert survivor(store, phase, step) == want


def test_rank0_surviving_inside_the_window_keeps_its_value_and_restores_it_for_a_redone_step(
        group, store):
    counter = Counter()
    state = ScriptState({"counter": counter}, 0, store)
    state.committed(4)
    counter.n = 7  # the window's work so far, before a collective failed
    assert state.agree(0, joining=False, phase="window", step=4)  # the replacement redoes it
    assert counter.n == 7
    assert state.agree(0, joining=False, phase="step", step=4)  # a death in step 5
    assert counter.n == 0
    assert not state.agree(0, joining=False, phase="boundary", step=4)


def test_values_the_record_cannot_hold_are_left_out_and_named(group, store, caplog):
    class Opaque(Counter):
        def state_dict(self) -> dict[str, Any]:
            return {"n": self.n, "kind": logging.getLogger("x")}  # weights_only refuses it

    kept, tensor, opaque = Counter(), torch.nn.Linear(1, 1), Opaque()
    scaler = torch.amp.GradScaler("cpu")
    state = ScriptState({"kept": kept, "ema": tensor, "opaque": opaque, "scaler": scaler}, 0,
                        store)
    with caplog.at_level(logging.WARNING, "elastic_runner.own_loop"):
        state.committed(1)
        state.committed(2)
    assert [r.getMessage() for r in caplog.records] == [
        "state['opaque'] cannot be loaded with weights_only=True (UnpicklingError): a "
        "replacement of rank 0 takes a survivor's value"]
    kept.n = 5
    state.agree(0, joining=False, phase="step", step=2)
    assert kept.n == 0


# ------------------------------------------------------------ the loop's own collectives

class Recorder:
    """Stands for the loop's in-place recovery: counts the recoveries."""

    def __init__(self) -> None:
        self.recovered = 0

    def collective(self, call, *args) -> bool:
        try:
            call(*args)
        except RuntimeError:
            self.recovered += 1
            return False
        return True

    def recover_in_window(self, error: RuntimeError) -> None:
        self.recovered += 1


def test_a_collective_failed_in_the_window_is_called_again_after_the_earlier_ones():
    """The survivor's side: after the recovery the window's earlier calls are made again with
    the arguments they had (copies: their results are not the survivor's any more), then the
    failed one with its first argument as it was before (a failed all-reduce may leave it
    half-reduced)."""
    from elastic_runner.own_loop.script_collectives import ScriptCollectives

    recovery, calls, failures = Recorder(), [], [1]

    def reduce(t: torch.Tensor) -> None:
        calls.append(t.clone())
        t.add_(10)  # what a peer's part would add
        if len(calls) == 2 and failures:  # the second call fails once, half done
            failures.pop()
            raise RuntimeError("Connection closed by peer")

    collectives = ScriptCollectives(recovery, lambda name, step: None)
    collectives.window(7)
    a, b = torch.ones(2), torch.full((2,), 5.0)
    collectives.call("all_reduce", reduce, (a,), {}, lambda: None)
    collectives.call("all_reduce", reduce, (b,), {}, lambda: None)
    assert recovery.recovered == 1
    # first a, then b (failed), then again a's copy and b as it was before the failure
    assert [c.tolist() for c in calls] == [[1, 1], [5, 5], [1, 1], [5, 5]]
    assert a.tolist() == [11, 11] and b.tolist() == [15, 15]


def test_outside_the_loops_work_or_in_another_thread_a_call_passes_through():
    import threading

    from elastic_runner.own_loop.script_collectives import ScriptCollectives

    recovery = Recorder()
    collectives = ScriptCollectives(recovery, lambda name, step: None)

    def fails() -> None:
        raise RuntimeError("Connection closed by peer")

    with pytest.raises(RuntimeError):  # the runner's own calls: not guarded
        collectives.call("all_reduce", fails, (), {}, lambda: None)
    collectives.after_backward(8)  # between backward and should_commit: the step discarded
    assert collectives.call("clip_grad_norm_", fails, (), {}, lambda: "stand-in") == "stand-in"
    collectives.window(8)
    errors = []

    def other() -> None:
        try:
            collectives.call("all_gather_object", fails, (), {}, lambda: None)
        except RuntimeError as e:
            errors.append(e)

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert len(errors) == 1 and recovery.recovered == 1  # the stand-in's recovery only
