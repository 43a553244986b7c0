"""CheckpointManager over Stateful objects (world size 1, no process group): Stateful check,
cadence, bitwise save/load (sync and async), best, retention, fallback past a truncated newest
checkpoint, state and shape mismatches, rollback, listener events and after_load."""

from __future__ import annotations

import os
import time

import pytest
import torch
from torch import nn

from elastic_runner.checkpoint import storage as ckpt
from elastic_runner.checkpoint.events import CheckpointEvent
from elastic_runner.checkpoint.manager import CheckpointManager
from elastic_runner.data.sampler import ElasticSampler
from elastic_runner.dist import DistInfo
from elastic_runner.train.state import TrainState

from .evidence import assert_same_tensors


class Recorder:
    """A CheckpointListener that keeps every event."""

    def __init__(self) -> None:
        self.events: list[tuple[str, object]] = []

    def checkpoint_stall(self, seconds: float) -> None:
        self.events.append(("stall", seconds))

    def checkpoint_committed(self, event: CheckpointEvent) -> None:
        self.events.append(("committed", event))

    def checkpoint_loaded(self, info: ckpt.CheckpointInfo) -> None:
        self.events.append(("loaded", info))


def objects(seed: int = 0, shape: tuple[int, int] = (4, 3)) -> dict:
    """model, optimizer (with momentum buffers after one step), sampler, train state."""
    torch.manual_seed(seed)
    model = nn.Linear(*shape)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train(model, opt)
    sampler = ElasticSampler(40, seed=1, micro_batch_size=4, grad_accum_steps=1, rank=0,
                             world_size=1)
    return {"model": model, "optimizer": opt, "sampler": sampler, "train_state": TrainState()}


def train(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.ones(2, model.in_features)).square().sum().backward()
    opt.step()


def snapshot(state: dict) -> dict:
    return {"model": {k: v.clone() for k, v in state["model"].state_dict().items()},
            "momentum": [state["optimizer"].state[p]["momentum_buffer"].clone()
                         for p in state["model"].parameters()],
            "sampler": state["sampler"].state_dict(),
            "train_state": state["train_state"].state_dict()}


def assert_same(state: dict, snap: dict) -> None:
    now = snapshot(state)
    assert_same_tensors(now["model"], snap["model"])
    for a, b in zip(now["momentum"], snap["momentum"], strict=True):
        assert torch.equal(a, b)
    assert now["sampler"] == snap["sampler"]
    assert now["train_state"] == snap["train_state"]


def advance(state: dict, step: int) -> None:
    """Change every object, as training step ``step`` would."""
    train(state["model"], state["optimizer"])
    state["sampler"].advance()
    state["train_state"].step = step
    state["train_state"].samples += 4


def names(directory) -> list[str]:
    """The checkpoints in ``directory`` (not the fencing tokens' ``fence/``)."""
    return sorted(n for n in os.listdir(directory) if not n.startswith(".") and n != "fence")


def test_non_stateful_value_is_a_type_error_naming_the_key(tmp_path):
    state = objects()
    with pytest.raises(TypeError, match=r"'counter': int does not implement torch's Stateful"):
        CheckpointManager(str(tmp_path), {**state, "counter": 3})


def test_due_by_steps(tmp_path):
    m = CheckpointManager(str(tmp_path), objects(), every_steps=5, async_save=False)
    assert [s for s in range(1, 21) if m.due(s)] == [5, 10, 15, 20]
    never = CheckpointManager(str(tmp_path), objects(), async_save=False)
    assert not any(never.due(s) for s in range(1, 50))


def test_due_by_seconds_resets_at_each_save(tmp_path):
    m = CheckpointManager(str(tmp_path), objects(), every_seconds=60.0, async_save=False)
    assert not m.due(1)
    m._last_save = time.monotonic() - 61.0
    assert m.due(2) and m.due(3)  # any step, not a multiple
    assert m.maybe_save(3)
    assert names(tmp_path) == ["step-00000003"]
    assert not m.due(4) and not m.maybe_save(4)
    assert names(tmp_path) == ["step-00000003"]
    # only rank 0's clock counts, and only rank 0 writes
    other = CheckpointManager(str(tmp_path / "r1"), objects(), every_seconds=60.0, rank=1)
    other._last_save = time.monotonic() - 61.0
    assert not other.due(5)
    other.save(5)
    assert not (tmp_path / "r1").exists()


def test_one_move_of_the_place_renumbers_the_info_the_sampler_and_the_checkpoints(tmp_path):
    """A regroup's one assignment (the own loop's): every holder refers to the process's
    Place; the checkpoint writer of rank 1 (which writes nothing) becomes rank 0's, which
    writes, after the save in flight."""
    info = DistInfo(1, 1, 2, 2, 0, 0, torch.device("cpu"), "gloo")
    state = objects()
    sampler = ElasticSampler(40, seed=1, micro_batch_size=4, grad_accum_steps=1, rank=1,
                             world_size=2)
    sampler.follow(info.place)
    m = CheckpointManager(str(tmp_path), {**state, "sampler": sampler}, rank=info.place)
    m.save(3)
    assert not tmp_path.exists() or names(tmp_path) == []
    info.place.move(0, 1)
    assert (info.rank, info.world_size, info.node_rank) == (0, 1, 0)
    assert (sampler.rank, sampler.world_size, m.rank, m.cadence.rank, m.resumer.rank,
            m.commits.rank) == (0, 1, 0, 0, 0, 0)
    m.save(4)
    m.wait()
    assert names(tmp_path) == ["step-00000004"]
    with pytest.raises(ValueError, match=r"rank 0 of 1; the process is Place\(rank=1,"):
        sampler.follow(DistInfo(1, 1, 2, 2, 0, 0, torch.device("cpu"), "gloo").place)


@pytest.mark.parametrize("async_save", [False, True])
def test_save_load_round_trip_is_bitwise(tmp_path, async_save):
    state = objects()
    advance(state, 7)
    m = CheckpointManager(str(tmp_path), state, async_save=async_save)
    snap = snapshot(state)
    m.save(7)
    advance(state, 8)  # while an async write may still be in flight: the snapshot was taken
    m.wait()
    assert names(tmp_path) == ["step-00000007"]
    assert snapshot(state)["train_state"]["step"] == 8
    assert m.load_latest() is not None
    assert_same(state, snap)
    assert m.resumed_from == str(tmp_path / "step-00000007")
    # a fresh process: other objects, same directory
    fresh = objects(seed=5)
    loaded = CheckpointManager(str(tmp_path), fresh, async_save=async_save)
    loaded.load_latest()
    assert_same(fresh, snap)
    m.close()
    loaded.close()


def test_close_commits_the_in_flight_async_save(tmp_path):
    state = objects()
    m = CheckpointManager(str(tmp_path), state, async_save=True)
    m.save(3)
    m.close()
    info = ckpt.latest_valid(tmp_path)
    assert info is not None and info.step == 3


@pytest.mark.parametrize("keep_best, expected", [
    (True, ["best-step-00000004", "step-00000004"]),
    (False, ["step-00000004"]),
])
def test_best_checkpoint_only_with_keep_best(tmp_path, keep_best, expected):
    m = CheckpointManager(str(tmp_path), objects(), keep_best=keep_best, async_save=False)
    m.save(4, best=True)
    assert names(tmp_path) == expected
    if keep_best:
        best = ckpt.latest_valid(tmp_path, kind="best")
        assert best.step == 4 and best.valid


def test_best_without_step_checkpoint(tmp_path):
    m = CheckpointManager(str(tmp_path), objects(), async_save=False)
    m.save(6, best=True, step_checkpoint=False)
    assert names(tmp_path) == ["best-step-00000006"]
    m.save(9, best=True, step_checkpoint=False)
    assert names(tmp_path) == ["best-step-00000009"]  # only the newest best is kept


def test_keep_last(tmp_path):
    m = CheckpointManager(str(tmp_path), objects(), keep_last=2, async_save=True)
    for step in range(1, 6):
        m.save(step)
    m.close()
    assert names(tmp_path) == ["step-00000004", "step-00000005"]


def test_the_checkpoint_resumed_from_is_never_pruned(tmp_path):
    first = CheckpointManager(str(tmp_path), objects(), keep_last=2, async_save=False)
    first.save(1)
    first.save(2)
    m = CheckpointManager(str(tmp_path), objects(seed=3), keep_last=2, async_save=False)
    m.load_latest()
    assert m.resumed_from == str(tmp_path / "step-00000002")
    for step in range(3, 7):
        m.save(step)
    assert names(tmp_path) == ["step-00000002", "step-00000005", "step-00000006"]


def test_load_latest_skips_a_truncated_newest_checkpoint(tmp_path):
    state = objects()
    m = CheckpointManager(str(tmp_path), state, async_save=False)
    m.save(1)
    snap = snapshot(state)
    advance(state, 2)
    m.save(2)
    f = tmp_path / "step-00000002" / "state.pt"
    f.write_bytes(f.read_bytes()[:100])
    listener = Recorder()
    fresh = objects(seed=9)
    loader = CheckpointManager(str(tmp_path), fresh, listener=listener, async_save=False)
    raw = loader.load_latest()
    assert raw is not None and raw["train_state"]["step"] == 0
    assert loader.resumed_from == str(tmp_path / "step-00000001")
    assert_same(fresh, snap)
    assert [(kind, info.step) for kind, info in listener.events] == [("loaded", 1)]


def test_load_latest_without_checkpoint_returns_none(tmp_path):
    state = objects()
    snap = snapshot(state)
    m = CheckpointManager(str(tmp_path / "empty"), state, async_save=False)
    assert m.load_latest() is None
    assert m.resumed_from is None
    assert_same(state, snap)


def test_missing_state_key_is_a_checkpoint_error_naming_it(tmp_path):
    state = objects()
    CheckpointManager(str(tmp_path), {"model": state["model"], "optimizer": state["optimizer"]},
                      async_save=False).save(1)
    m = CheckpointManager(str(tmp_path), state, async_save=False)
    with pytest.raises(ckpt.CheckpointError, match=r"has no state for sampler, train_state"):
        m.load_latest()


def test_model_of_another_shape_is_a_checkpoint_error_naming_the_tensors(tmp_path):
    CheckpointManager(str(tmp_path), objects(), async_save=False).save(1)
    other = objects(shape=(5, 3))
    before = {k: v.clone() for k, v in other["model"].state_dict().items()}
    m = CheckpointManager(str(tmp_path), other, async_save=False)
    with pytest.raises(ckpt.CheckpointError) as e:
        m.load_latest()
    msg = str(e.value)
    assert "shape mismatch (1): weight: checkpoint (3, 4) vs model (3, 5)" in msg
    assert "bias" not in msg  # same shape: not named
    assert_same_tensors(other["model"].state_dict(), before)  # nothing was loaded


def test_rollback_reloads_the_newest_checkpoint(tmp_path):
    state = objects()
    m = CheckpointManager(str(tmp_path), state, async_save=True)
    assert not m.rollback()  # nothing to roll back to
    advance(state, 1)
    snap = snapshot(state)
    m.save(1)  # in flight: rollback waits for it
    advance(state, 2)
    advance(state, 3)
    assert m.rollback()
    assert_same(state, snap)
    m.close()


def test_listener_receives_stall_committed_and_loaded(tmp_path):
    listener = Recorder()
    m = CheckpointManager(str(tmp_path), objects(), listener=listener, async_save=True,
                          meta=lambda: {"epoch": 2, "world_size": 1})
    m.save(2)
    m.wait()
    m.load_latest()
    m.close()
    # the stall is reported by the saving thread once the snapshot is handed off, the commit by
    # the writing thread: either may come first (seen in CI: the commit, under load)
    events = dict(listener.events)
    assert sorted(kind for kind, _ in listener.events[:2]) == ["committed", "stall"]
    assert [kind for kind, _ in listener.events[2:]] == ["loaded"]
    stall, committed, loaded = events["stall"], events["committed"], events["loaded"]
    assert isinstance(stall, float) and stall >= 0
    path = tmp_path / "step-00000002"
    assert committed.paths == [str(path)] and committed.step == 2
    assert committed.size_bytes == sum(f.stat().st_size for f in path.iterdir())
    assert (loaded.path, loaded.step, loaded.epoch, loaded.world_size) == (str(path), 2, 2, 1)


def test_after_load_gets_the_raw_state_with_extra(tmp_path):
    state = objects()
    state["train_state"].step = 11
    CheckpointManager(str(tmp_path), state, extra={"config": {"lr": 0.5}},
                      async_save=False).save(11)
    seen = []
    fresh = objects(seed=4)
    m = CheckpointManager(str(tmp_path), fresh, async_save=False,
                          after_load=lambda raw: seen.append((raw, fresh["train_state"].step)))
    raw = m.load_latest()
    assert len(seen) == 1 and seen[0][0] is raw
    assert raw["config"] == {"lr": 0.5} and raw["train_state"]["step"] == 11
    assert seen[0][1] == 11  # called after the objects were loaded
