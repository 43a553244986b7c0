"""TrainingSession at world size 1 (no process group, no launcher): the step protocol moves the
cursor and the counters, a non-finite step skips its update, a streak rolls back once and then
fails, preemption commits exactly that step, and a resumed session continues bitwise like an
uninterrupted run (dropout: the per-step RNG streams)."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from elastic_runner.checkpoint import storage as ckpt
from elastic_runner.checkpoint.fencing import Fence
from elastic_runner.data.loader import elastic_dataloader
from elastic_runner.data.sampler import step_seed
from elastic_runner.exit_codes import EXIT_FENCED, EXIT_PREEMPTED
from elastic_runner.observe.reporting import WatchdogHeartbeat
from elastic_runner.own_loop import DEFAULT_EVERY_SECONDS, fault_tolerant
from elastic_runner.preempt import Preempted
from elastic_runner.protocol.env import CHECKPOINT_DIR_FILE_ENV
from elastic_runner.train.consensus import LocalConsensus
from elastic_runner.train.session import RollbackRequested, TrainingFailed
from elastic_runner.train.state import RNGState
from elastic_runner.train.stop import StopReason

from .evidence import assert_same_tensors
from .ft_helpers import (
    StepRecorder,
    build_session,
    regression_data,
    run_step,
    weights,
)

MB = 4  # micro-batch; world size 1, no accumulation: the global batch


@pytest.fixture
def parts(tmp_path):
    """A linear model, SGD and a loader over 32 samples (8 steps per epoch)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = elastic_dataloader(regression_data(32), MB, seed=1)
    return model, opt, loader


@pytest.fixture(autouse=True)
def _no_fault_drills(monkeypatch):
    monkeypatch.delenv("ELASTIC_RUNNER_FAULTS", raising=False)


@pytest.fixture
def restore_signals() -> Iterator[None]:
    """``fault_tolerant()`` installs SIGTERM/SIGINT handlers in the test process: put the
    previous ones back."""
    old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for s, handler in old.items():
        signal.signal(s, handler)


def test_steps_move_the_cursor_and_the_counters(tmp_path, parts):
    model, opt, loader = parts
    rec = StepRecorder()
    session = build_session(tmp_path, model, opt, loader, callbacks=[rec])
    session.start()
    perm0 = loader.elastic_sampler.permutation(0).tolist()
    perm1 = loader.elastic_sampler.permutation(1).tolist()
    for expected in range(1, 10):
        assert run_step(session, model, opt, loader) == expected
    assert (session.state.step, session.state.samples) == (9, 9 * MB)
    assert (session.sampler.epoch, session.sampler.cursor) == (1, MB)
    assert [e.step for e in rec.steps] == list(range(1, 10))
    assert [e.epoch for e in rec.steps] == [0] * 8 + [1]
    assert rec.indices == [perm0[i:i + MB] for i in range(0, 32, MB)] + [perm1[:MB]]
    assert all(e.committed and e.global_samples == MB and e.lr == 0.1 for e in rec.steps)
    # log_every_steps=1: each step's mean loss is reported at the end of the next step
    assert [e.step for e in rec.logs] == list(range(1, 9))
    assert rec.logs[-1].mean_loss == pytest.approx(float(rec.steps[-2].loss))
    assert session.steps_this_attempt == 9
    session.close()
    assert [e.step for e in rec.logs] == list(range(1, 10))  # close() reports the last one


def test_step_indices_read_later_are_those_of_the_step(tmp_path, parts):
    model, opt, loader = parts
    rec = StepRecorder()
    session = build_session(tmp_path, model, opt, loader, callbacks=[rec])
    for _ in range(9):
        run_step(session, model, opt, loader)
    assert rec.steps[0].epoch == 0
    assert rec.steps[0].indices() == loader.elastic_sampler.permutation(0)[:MB].tolist()


def test_step_indices_are_the_fetched_ones_and_an_abandoned_step_forgets_its_own(tmp_path,
                                                                                  parts):
    model, opt, loader = parts
    rec = StepRecorder()
    session = build_session(tmp_path, model, opt, loader, callbacks=[rec])
    batches = iter(loader)
    session.begin_step()
    next(batches)  # fetched by the step in flight, whose collective then failed
    session.abandon_step()
    x, y = next(batches)  # the same pass goes on: the cursor's plan is not what is served
    session.begin_step()
    loss = nn.functional.mse_loss(model(x), y)
    session.backward(loss)
    session.should_commit(nn.utils.get_total_norm([p.grad for p in model.parameters()]))
    session.end_step(loss.detach())
    perm = loader.elastic_sampler.permutation(0).tolist()
    assert rec.steps[0].indices_fetched and rec.indices == [perm[MB:2 * MB]]


def test_begin_step_seeds_the_step_stream(tmp_path, parts):
    model, opt, loader = parts
    session = build_session(tmp_path, model, opt, loader, seed=7)
    run_step(session, model, opt, loader)
    session.begin_step()  # step 2: seeded from (seed, epoch, steps done, rank)
    expected = torch.rand(5, generator=torch.Generator().manual_seed(step_seed(7, 0, 1, 0)))
    assert torch.equal(torch.rand(5), expected)


def test_end_step_without_a_decision_is_an_error(tmp_path, parts):
    model, opt, loader = parts
    session = build_session(tmp_path, model, opt, loader)
    session.begin_step()
    with pytest.raises(RuntimeError, match=r"end_step\(\) without should_commit\(\)"):
        session.end_step(torch.tensor(1.0))


def test_non_finite_loss_skips_the_update(tmp_path, parts):
    model, opt, loader = parts
    rec = StepRecorder()
    session = build_session(tmp_path, model, opt, loader, callbacks=[rec], every_steps=1)
    run_step(session, model, opt, loader)
    before = weights(model)
    assert run_step(session, model, opt, loader, nan=True) == 2
    assert_same_tensors(weights(model), before)
    assert (session.state.bad_steps, session.state.bad_in_row) == (1, 1)
    assert session.sampler.cursor == 2 * MB  # the step is done, its samples are not retried
    assert rec.skipped == [(2, 1, 3)] and [e.committed for e in rec.steps] == [True, False]
    assert not session.checkpoint_due()  # never during a streak, even when due
    assert not any(os.scandir(tmp_path))
    run_step(session, model, opt, loader)
    assert not torch.equal(weights(model)["weight"], before["weight"])
    assert (session.state.bad_steps, session.state.bad_in_row) == (1, 0)
    assert session.checkpoint_due()
    session.checkpoint()
    assert ckpt.latest_valid(tmp_path).step == 3


def test_streak_rolls_back_once_then_fails(tmp_path, parts):
    model, opt, loader = parts
    rec = StepRecorder()
    session = build_session(tmp_path, model, opt, loader, callbacks=[rec], max_bad_steps=3)
    run_step(session, model, opt, loader)
    session.checkpoint()
    at_checkpoint = weights(model)
    run_step(session, model, opt, loader)  # a good step after the checkpoint: lost work
    run_step(session, model, opt, loader, nan=True)
    run_step(session, model, opt, loader, nan=True)
    with pytest.raises(RollbackRequested):
        run_step(session, model, opt, loader, nan=True)
    assert (session.state.step, session.state.bad_in_row) == (5, 3)

    session.rollback()
    assert (session.state.step, session.sampler.cursor) == (1, MB)
    assert (session.state.rollbacks, session.state.bad_in_row, session.state.bad_steps) == (
        1, 0, 0)
    assert_same_tensors(weights(model), at_checkpoint)
    assert rec.rollbacks == [1]

    run_step(session, model, opt, loader, nan=True)
    run_step(session, model, opt, loader, nan=True)
    with pytest.raises(TrainingFailed, match="failed: 3 non-finite steps in a row at step 4, "
                       "again after rolling back"):
        run_step(session, model, opt, loader, nan=True)
    assert session.stop.reason is StopReason.FAILED
    assert rec.finished[-1][0] is StopReason.FAILED
    raw = ckpt.load_state(tmp_path / "step-00000004")  # committed before the raise
    assert raw["stop"]["reason"] == "failed" and raw["train_state"]["rollbacks"] == 1
    session.close()

    # a restart stays failed
    torch.manual_seed(3)
    model2 = nn.Linear(4, 1)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1)
    again = build_session(tmp_path, model2, opt2, elastic_dataloader(regression_data(32), MB,
                                                                      seed=1))
    assert again.resume()
    assert again.stop.reason is StopReason.FAILED and again.state.step == 4
    assert_same_tensors(weights(model2), at_checkpoint)  # skipped updates: the weights of step 1


def test_rollback_without_a_checkpoint_fails(tmp_path, parts):
    model, opt, loader = parts
    session = build_session(tmp_path, model, opt, loader, max_bad_steps=2)
    run_step(session, model, opt, loader, nan=True)
    with pytest.raises(RollbackRequested):
        run_step(session, model, opt, loader, nan=True)
    with pytest.raises(TrainingFailed, match="no checkpoint to roll back to"):
        session.rollback()


def test_rollback_waits_for_the_in_flight_async_checkpoint(tmp_path, parts, monkeypatch):
    model, opt, loader = parts
    session = build_session(tmp_path, model, opt, loader, async_save=True, max_bad_steps=2)
    run_step(session, model, opt, loader)
    at_checkpoint = weights(model)
    # hold the background write until someone waits for the writer (deterministic: no sleep)
    gate, write = threading.Event(), ckpt.write_checkpoint
    monkeypatch.setattr(ckpt, "write_checkpoint",
                        lambda *a, **k: (gate.wait(timeout=60), write(*a, **k))[1])
    session.checkpoint()  # step 1, in flight
    writer = session.checkpoints._writer
    wait = writer.wait
    monkeypatch.setattr(writer, "wait", lambda: (gate.set(), wait())[1])
    try:
        run_step(session, model, opt, loader, nan=True)
        with pytest.raises(RollbackRequested):
            run_step(session, model, opt, loader, nan=True)
        session.rollback()
        assert session.state.step == 1
        assert_same_tensors(weights(model), at_checkpoint)
    finally:
        gate.set()
        session.close()


@pytest.mark.parametrize("async_save", [False, True])
def test_preemption_discards_the_step_in_flight_and_commits_the_last_one(tmp_path, parts,
                                                                         async_save):
    model, opt, loader = parts
    stop = [False]
    rec = StepRecorder()
    session = build_session(tmp_path, model, opt, loader, stop_requested=lambda: stop[0],
                            async_save=async_save, callbacks=[rec])
    run_step(session, model, opt, loader)
    run_step(session, model, opt, loader)
    before = {k: v.clone() for k, v in weights(model).items()}
    stop[0] = True
    with pytest.raises(Preempted, match="after step 2; checkpoint step-00000002 committed"):
        run_step(session, model, opt, loader)
    # committed when end_step raises, without waiting here
    assert sorted(os.listdir(tmp_path)) == ["fence", "step-00000002"]
    assert ckpt.latest_valid(tmp_path).step == 2
    raw = ckpt.load_state(tmp_path / "step-00000002")
    assert raw["train_state"]["step"] == 2 and raw["sampler"]["cursor"] == 2 * MB
    assert_same_tensors(before, weights(model))  # step 3 was not applied...
    assert_same_tensors(raw["model"], before)  # ...and the checkpoint is step 2's state
    assert [e.step for e in rec.steps] == [1, 2]
    assert rec.finished == [(StopReason.PREEMPTED, "preempted")]
    assert not session.stop.stopped  # a preempted run resumes
    session.close()


def test_max_steps_limit(tmp_path, parts):
    model, opt, loader = parts
    session = build_session(tmp_path, model, opt, loader, max_steps=2)
    run_step(session, model, opt, loader)
    assert not session.check_limits()
    run_step(session, model, opt, loader)
    assert session.check_limits()
    assert (session.stop.reason, session.stop.message) == (StopReason.MAX_STEPS,
                                                           "max_steps reached")


# ---------------------------------------------------------------- fault_tolerant()


@pytest.mark.usefixtures("restore_signals")
def test_step_done_turns_preemption_into_exit_143(tmp_path, parts):
    model, opt, loader = parts
    ft = fault_tolerant(model, opt, loader, checkpoint_dir=str(tmp_path), async_save=True)
    assert ft.resume() == (0, 0)
    ft.session.consensus = LocalConsensus(lambda: True)  # as after SIGTERM
    x, y = next(iter(loader))
    opt.zero_grad()
    before = {k: v.clone() for k, v in weights(model).items()}
    ft.backward(nn.functional.mse_loss(model(x), y))
    assert not ft.should_commit()  # a stop discards the step in flight
    with pytest.raises(SystemExit) as exit_info:
        ft.step_done()
    assert exit_info.value.code == EXIT_PREEMPTED == 143
    info = ckpt.latest_valid(tmp_path)
    assert info.step == 0 and info.valid
    assert_same_tensors(ckpt.load_state(info.path)["model"], before)
    # the loop closed its reporting on the way out: the watchdog thread is gone
    (heartbeat,) = [c for c in ft.session.callbacks.items if isinstance(c, WatchdogHeartbeat)]
    assert not heartbeat.watchdog._thread.is_alive()


@pytest.mark.usefixtures("restore_signals")
def test_a_loop_fenced_out_at_its_boundary_commit_exits_3(tmp_path, parts, caplog):
    """A newer group claims the directory while this loop trains: the commit at the next
    step's first batch is refused, and the process ends with exit 3 (not a traceback, not 1),
    so the agent does not restart a stale writer; nothing of that step is published."""
    model, opt, loader = parts
    ft = fault_tolerant(model, opt, loader, checkpoint_dir=str(tmp_path), every_steps=1,
                        async_save=False)
    ft.resume()
    batches = iter(loader)
    x, y = next(batches)
    ft.backward(nn.functional.mse_loss(model(x), y))
    assert ft.should_commit()
    opt.step()
    assert ft.step_done() == 1
    newer = Fence.claim(str(tmp_path))
    with pytest.raises(SystemExit) as exit_info:
        next(batches)  # step 2's first batch: step 1's checkpoint is committed here
    assert exit_info.value.code == EXIT_FENCED == 3
    assert f"fencing token {newer.token}" in caplog.text and "fenced out: " in caplog.text
    assert ckpt.list_checkpoints(tmp_path) == []


@pytest.mark.usefixtures("restore_signals")
def test_under_run_script_the_agent_sees_the_loops_checkpoint_progress(tmp_path, parts,
                                                                        monkeypatch):
    """``run script.py`` names a file (``CHECKPOINT_DIR_FILE_ENV``); the loop writes its
    ``checkpoint_dir`` there, absolute, so the agent's crash-loop rule reads the newest
    committed step of it (-1 before the first)."""
    model, opt, loader = parts
    named_in = tmp_path / "agent" / "checkpoint_dir"
    named_in.parent.mkdir()
    progress = ckpt.newest_checkpoint_step_named_in(str(named_in))
    assert progress() == -1  # no loop yet
    monkeypatch.setenv(CHECKPOINT_DIR_FILE_ENV, str(named_in))
    monkeypatch.chdir(tmp_path)
    ft = fault_tolerant(model, opt, loader, checkpoint_dir="ck", every_steps=2, async_save=False)
    assert named_in.read_text() == f"{tmp_path / 'ck'}\n"
    ft.resume()
    assert progress() == -1  # no checkpoint committed yet
    for x, y in loader:
        ft.backward(nn.functional.mse_loss(model(x), y))
        ft.should_commit()
        opt.step()
        if ft.step_done() == 3:
            break
    ft.close()
    assert progress() == 3 == ckpt.latest_valid(tmp_path / "ck").step


def test_close_after_the_preemption_exit_is_harmless(tmp_path, parts):
    model, opt, loader = parts
    ft = fault_tolerant(model, opt, loader, checkpoint_dir=str(tmp_path), async_save=True)
    ft.resume()
    ft.session.consensus = LocalConsensus(lambda: True)
    x, y = next(iter(loader))
    ft.backward(nn.functional.mse_loss(model(x), y))
    ft.should_commit()
    with pytest.raises(SystemExit):
        try:
            ft.step_done()
        finally:
            ft.close()


class DropoutNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def train(directory, until: int, init_seed: int) -> tuple[int, int, dict, dict]:
    """The own-loop pattern (examples/own_loop.py) up to step ``until``; returns the step it
    resumed at, the step it stopped at, the weights and the loader state."""
    torch.manual_seed(init_seed)
    model = DropoutNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = elastic_dataloader(regression_data(20), MB, seed=5)  # 5 steps per epoch
    ft = fault_tolerant(model, opt, loader, checkpoint_dir=str(directory), every_steps=4,
                        async_save=True)
    try:
        step, epoch = ft.resume()
        first = step
        while step < until:
            loader.elastic_sampler.set_epoch(epoch)
            for x, y in loader:
                opt.zero_grad()
                ft.backward(nn.functional.mse_loss(model(x), y))
                if ft.should_commit():
                    opt.step()
                step = ft.step_done()
                if step >= until:
                    break
            epoch += 1
    finally:
        ft.close()
    return first, step, weights(model), loader.state_dict()


@pytest.mark.usefixtures("restore_signals")
@pytest.mark.parametrize("restore_rng", [True, False])
def test_resumed_session_continues_bitwise_like_an_uninterrupted_run(tmp_path, monkeypatch,
                                                                     restore_rng):
    first, last, reference, ref_loader = train(tmp_path / "a", until=8, init_seed=0)
    assert (first, last) == (0, 8)
    assert train(tmp_path / "b", until=6, init_seed=0)[:2] == (0, 6)
    if not restore_rng:
        # as on a rank that loads another rank's RNG state (a world-size change): the
        # per-step reseeding alone must give the same dropout masks
        monkeypatch.setattr(RNGState, "load_state_dict", lambda self, state: None)
    first, last, resumed, res_loader = train(tmp_path / "b", until=8, init_seed=1)
    assert (first, last) == (6, 8)
    assert res_loader == ref_loader and (res_loader["epoch"], res_loader["cursor"]) == (1, 12)
    assert_same_tensors(resumed, reference)


class Evaluations:
    """A loop's own state after the step (``state=``): how many evaluations it ran."""

    def __init__(self) -> None:
        self.count = 0

    def state_dict(self) -> dict[str, int]:
        return {"count": self.count}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.count = state["count"]


def train_evaluating(directory, until: int, crash_at: int | None = None) -> tuple[int, int]:
    """The own-loop pattern with an evaluation after every 5th ``step_done()`` kept in
    ``state=``; ``crash_at``: stop right after that step's evaluation without ``close()`` (as a
    SIGKILL would, reporting closed so no thread outlives the test). Returns (the step it
    resumed at, the evaluations counted)."""
    torch.manual_seed(0)
    model = DropoutNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = elastic_dataloader(regression_data(20), MB, seed=5)  # 5 steps per epoch
    evaluations = Evaluations()
    ft = fault_tolerant(model, opt, loader, checkpoint_dir=str(directory), every_steps=5,
                        async_save=False, state={"evaluations": evaluations})
    step, epoch = ft.resume()
    first = step
    while step < until:
        loader.elastic_sampler.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            ft.backward(nn.functional.mse_loss(model(x), y))
            if ft.should_commit():
                opt.step()
            step = ft.step_done()
            if step % 5 == 0:
                evaluations.count += 1  # the loop's own work after the step
            if step == crash_at:
                ft.session.close()
                return first, evaluations.count
            if step >= until:
                break
        epoch += 1
    ft.close()
    return first, evaluations.count


@pytest.mark.usefixtures("restore_signals")
def test_the_checkpoint_of_a_step_holds_the_loops_work_after_step_done(tmp_path):
    """Issue 25 item 6: a loop that evaluates right after ``step_done()`` and counts it in
    ``state=``, stopped at step 12 and resumed from the checkpoint of step 10, counts the
    evaluations an uninterrupted run counts (the snapshot was taken inside ``step_done()``
    before, so the resumed run counted one evaluation fewer)."""
    assert train_evaluating(tmp_path / "a", until=20) == (0, 4)
    assert train_evaluating(tmp_path / "b", until=20, crash_at=12) == (0, 2)
    assert ckpt.latest_valid(tmp_path / "b").step == 10
    assert train_evaluating(tmp_path / "b", until=20) == (10, 4)


@pytest.mark.usefixtures("restore_signals")
def test_own_loop_with_a_grad_scaler_skips_an_overflow_without_counting_it(tmp_path):
    """fp16's pattern in your own loop: ``ft.backward(loss, scaler=...)``, unscale, the norm,
    ``should_commit(norm, overflow_ok=True)``, ``scaler.step``, ``scaler.update``. A scale so
    large that the gradients overflow: the scaler skips the update, the vote does not count a
    non-finite step, and the scale comes down until updates apply."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = elastic_dataloader(regression_data(20), MB, seed=5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 120, growth_interval=1000)
    ft = fault_tolerant(model, opt, loader, checkpoint_dir=str(tmp_path), every_steps=100,
                        state={"scaler": scaler})
    step, epoch = ft.resume()
    before = weights(model)
    updated = []
    while step < 30 and not any(updated):
        loader.elastic_sampler.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            # x 1e4: the scaled gradients overflow float32 until the scale came down
            ft.backward(1e4 * nn.functional.mse_loss(model(x), y), scaler=scaler)
            scaler.unscale_(opt)
            norm = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if ft.should_commit(norm, overflow_ok=True):
                scaler.step(opt)
            scaler.update()
            step = ft.step_done()
            updated.append(not torch.equal(weights(model)["weight"], before["weight"]))
            before = weights(model)
        epoch += 1
    ft.close()
    assert updated[0] is False and updated[-1] is True  # the overflow skipped, later steps apply
    assert ft.session.state.bad_steps == 0 and scaler.get_scale() < 2.0 ** 200


@pytest.mark.usefixtures("restore_signals")
def test_without_a_cadence_fault_tolerant_checkpoints_on_the_clock(tmp_path, parts, caplog):
    """``every_steps=0`` and no ``every_seconds`` (the defaults) took no periodic checkpoint, so
    a crash after hours resumed from step 0; now a checkpoint every 300 s, logged once."""
    model, opt, loader = parts
    with caplog.at_level("INFO", logger="elastic_runner.own_loop"):
        ft = fault_tolerant(model, opt, loader, checkpoint_dir=str(tmp_path))
    try:
        assert ft.session.checkpoints.every_seconds == DEFAULT_EVERY_SECONDS == 300.0
        assert "no checkpoint cadence given" in caplog.text
        given = fault_tolerant(model, opt, loader, checkpoint_dir=str(tmp_path / "b"),
                               every_steps=10)
        assert given.session.checkpoints.every_seconds is None
        given.close()
    finally:
        ft.close()
