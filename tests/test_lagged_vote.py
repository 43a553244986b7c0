"""The lagged step vote (``training.lagged_vote``, :class:`~elastic_runner.train.consensus.LaggedConsensus`):
the update is skipped on the device through a fused optimizer's ``found_inf`` and the host reads
the verdict a step later. It is the CUDA default; on CPU torch's fused AdamW takes the same
``found_inf``, so its semantics are tested here: bitwise the same training as the eager vote
through non-finite steps and a rollback, the skipped steps reported at their own step numbers,
a preemption that applies the step carrying the stop and discards the next, and the errors."""

from __future__ import annotations

import signal

import pytest
import torch

from elastic_runner.config import ConfigError, load_config
from elastic_runner.dist import init_distributed
from elastic_runner.preempt import Preempted
from elastic_runner.train.callbacks import Callback
from elastic_runner.train.consensus import LaggedConsensus, LocalConsensus, skips_on_device
from elastic_runner.trainer.build import build_trainer

from .evidence import assert_same_tensors
from .ft_helpers import weights
from .procs import CONFIGS, cli, wait_until
from .test_train_torchrun import final_state

DIGITS = CONFIGS / "digits.yaml"
BASE = ["logging.tensorboard_dir=null", "logging.progress_bar=false", "optimizer.fused=true",
        "training.max_epochs=100"]
NANS = ("faults.inject=[{kind: nan, rank: 0, step: 7}, {kind: nan, rank: 0, step: 20, count: 2},"
        " {kind: nan, rank: 0, step: 39}]")


def trainer(directory, lagged: bool, *overrides):
    cfg = load_config(DIGITS, [f"checkpoint.dir={directory}", *BASE,
                               f"training.lagged_vote={str(lagged).lower()}", *overrides])
    return build_trainer(cfg, init_distributed(cfg.distributed.backend))


class Record(Callback):
    """Skipped steps as reported, and a stop requested before step ``stop_at`` begins."""

    def __init__(self, t=None, stop_at: int = 0) -> None:
        self.skipped: list[int] = []
        self.t, self.stop_at = t, stop_at

    def on_skipped_step(self, step: int, in_row: int, limit: int) -> None:
        self.skipped.append(step)

    def on_step_begin(self, step: int, steps_this_attempt: int) -> None:
        if step == self.stop_at:  # what the SIGTERM handler records
            self.t.preempt.signum = signal.SIGTERM


def fit(t, record: Record | None = None):
    record = record or Record(t)
    t.session.callbacks.append(record)
    t.fit()
    return record


def test_lagged_equals_eager_bitwise_and_reports_skips_at_their_steps(tmp_path):
    runs = {}
    for lagged in (False, True):
        t = trainer(tmp_path / str(lagged), lagged, "training.max_steps=60",
                    "checkpoint.every_steps=20", NANS)
        assert isinstance(t.session.consensus, LaggedConsensus if lagged else LocalConsensus)
        record = fit(t)
        runs[lagged] = (weights(t.model), record.skipped, t.state.bad_steps, t.state.step)
    assert runs[True][1] == runs[False][1] == [7, 20, 21, 39]
    assert runs[True][2:] == runs[False][2:] == (4, 60)
    assert_same_tensors(runs[True][0], runs[False][0])
    # step 20 was skipped, so neither run checkpointed it (a rollback must not land in a streak)
    assert not (tmp_path / "True" / "step-00000020").exists()
    assert not (tmp_path / "False" / "step-00000020").exists()
    assert (tmp_path / "True" / "step-00000040").exists()


def test_lagged_rollback_after_a_streak_matches_the_eager_one(tmp_path):
    streak = ["faults.inject=[{kind: nan, rank: 0, step: 25, count: 3}]",
              f"faults.once_dir={tmp_path / 'once'}"]
    runs = {}
    for lagged in (False, True):
        streak[1] = f"faults.once_dir={tmp_path / f'once-{lagged}'}"
        t = trainer(tmp_path / str(lagged), lagged, "training.max_steps=50",
                    "checkpoint.every_steps=10", *streak)
        record = fit(t)
        runs[lagged] = (weights(t.model), record.skipped, t.state.rollbacks, t.state.step)
    assert runs[True][1] == runs[False][1] == [25, 26, 27]
    assert runs[True][2:] == runs[False][2:] == (1, 50)
    assert_same_tensors(runs[True][0], runs[False][0])


def test_a_stop_applies_its_step_discards_the_next_and_the_resume_is_exact(tmp_path):
    ref = trainer(tmp_path / "ref", True, "training.max_steps=40")
    fit(ref)
    for lagged, committed in ((True, 25), (False, 24)):
        ck = tmp_path / f"stopped-{lagged}"
        t = trainer(ck, lagged, "training.max_steps=40", "checkpoint.every_steps=100")
        with pytest.raises(Preempted, match=f"after step {committed}; checkpoint "
                                            f"step-{committed:08d} committed"):
            fit(t, Record(t, stop_at=25))
        again = trainer(ck, lagged, "training.max_steps=40")
        assert again.resume() and again.state.step == committed
        fit(again)
        assert again.state.step == 40
        assert_same_tensors(weights(ref.model), weights(again.model))


def test_launch_collect_and_the_device_verdict():
    vote = LaggedConsensus(torch.device("cpu"))
    nan = vote.propose(torch.tensor(float("nan"), requires_grad=True))
    assert torch.isnan(nan)  # a non-finite loss poisons the gradients of every rank
    found_inf = vote.launch(3, torch.tensor(float("nan")))
    assert found_inf.item() == 1.0 and found_inf.dim() == 0
    with pytest.raises(RuntimeError, match="launch\\(\\) without propose\\(\\)"):
        vote.launch(4, torch.tensor(1.0))
    assert vote.vetoed_pending()
    [v] = vote.collect()
    assert (v.step, v.commit, v.stop, v.nonfinite_loss) == (3, False, False, True)
    assert vote.collect() == []

    stopping = LaggedConsensus(torch.device("cpu"), stop_requested=lambda: True)
    loss = torch.tensor(2.0)
    assert stopping.propose(loss) == loss  # a stop is not poisoned: its step applies
    assert stopping.launch(5, torch.tensor(0.5)).item() == 0.0
    with pytest.raises(RuntimeError, match="not collected"):
        stopping.propose(loss)
        stopping.launch(6, torch.tensor(0.5))
    [v] = stopping.collect()
    assert (v.step, v.commit, v.stop) == (5, True, True)

    overflow = LaggedConsensus(torch.device("cpu"))
    overflow.propose(torch.tensor(1.0))
    overflow.launch(7, torch.tensor(float("inf")), overflow_ok=True)  # fp16: the scaler's call
    [v] = overflow.collect()
    assert v.commit and not v.nonfinite_loss


def test_only_a_fused_optimizer_skips_on_the_device(tmp_path):
    p = [torch.nn.Parameter(torch.ones(2))]
    assert skips_on_device(torch.optim.AdamW(p, fused=True))
    assert not skips_on_device(torch.optim.AdamW(p))
    with pytest.raises(ConfigError, match="training.lagged_vote: true needs an optimizer"):
        trainer(tmp_path, True, "optimizer.fused=false")
    # auto: the eager vote on CPU, whatever the optimizer
    cfg = load_config(DIGITS, [f"checkpoint.dir={tmp_path}", *BASE])
    assert not build_trainer(cfg, init_distributed("gloo")).session.consensus.lagged


def test_lagged_vote_true_with_a_sample_trace_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="training.lagged_vote: cannot be true with "
                                          "audit.trace_dir"):
        load_config(DIGITS, ["training.lagged_vote=true", f"audit.trace_dir={tmp_path}"])


@pytest.mark.slow
def test_two_ranks_lagged_through_nan_and_sigterm_equal_an_uninterrupted_eager_run(launch,
                                                                                   tmp_path,
                                                                                   reference):
    """gloo, 2 ranks: the flags' all-reduce, a NaN on one rank skipped on both, a preemption
    (SIGTERM to the agent: exit 143), the restart resuming; bitwise an uninterrupted run of the
    eager vote."""
    common = [str(DIGITS), *BASE, "training.max_steps=60", "checkpoint.every_steps=40",
              "eval.every_steps=0", "early_stopping.enabled=false", "recovery.spare=false",
              "faults.inject=[{kind: nan, rank: 1, step: 15}]", "--nproc-per-node", "2"]
    ref = reference(*common, "training.lagged_vote=false")  # trained first, alone
    ck = tmp_path / "ck"
    # rank 0 slowed (numerics unchanged): the SIGTERM lands with 39 steps (3 s) still to run
    job = launch(cli("run", *common, "training.lagged_vote=true", f"checkpoint.dir={ck}",
                     "faults.inject=[{kind: nan, rank: 1, step: 15},"
                     " {kind: slow, rank: 0, step: 1, count: 100000, seconds: 0.08}]"),
                 name="job")
    wait_until(lambda: " step 20/60 loss" in job.output, 240, "step 20")
    job.proc.send_signal(signal.SIGTERM)
    assert job.wait(timeout=120) == 143, job.output[-3000:]
    assert "non-finite loss or gradient on at least one rank" in job.output
    stopped = final_state(ck)["train_state"]["step"]
    assert 20 < stopped < 60
    again = launch(cli("run", *common, "training.lagged_vote=true", f"checkpoint.dir={ck}"),
                   name="again")
    assert again.wait(timeout=300) == 0, again.output[-3000:]
    assert f"step {stopped}, epoch" in again.output
    a, b = final_state(ref), final_state(ck)
    assert a["train_state"]["step"] == b["train_state"]["step"] == 60
    assert a["train_state"]["bad_steps"] == b["train_state"]["bad_steps"] == 1
    assert_same_tensors(a["model"], b["model"])
