"""Surviving faults on one node: worker exceptions, SIGTERM preemption (worker and agent),
NaN/Inf steps, hangs. Real torchrun process groups, real signals, real stuck processes."""

from __future__ import annotations

import json
import os
import re
import signal

import pytest

from elastic_runner.checkpoint import storage as ckpt
from elastic_runner.data import audit

from .evidence import DIGITS_GLOBAL_BATCH, DIGITS_TRAIN, assert_exact_audit, assert_same_tensors
from .procs import CONFIGS, cli, wait_until
from .test_outside_faults import trainers
from .test_train_torchrun import final_state, rank_summaries

pytestmark = pytest.mark.slow

DIGITS = str(CONFIGS / "digits.yaml")
BASE = [DIGITS, "logging.tensorboard_dir=null", "early_stopping.enabled=false",
        "training.max_steps=12", "checkpoint.every_steps=4"]


# rank 0's log lines of a preemption and of the next attempt's resume (see train/session.py)
_PREEMPTING = re.compile(r"\[rank0\] WARNING elastic_runner\.train\.session: preemption: checkpointing "
                         r"step (\d+), then stopping")
_SAVED = re.compile(r"\[rank0\] INFO elastic_runner\.checkpoint\.manager: checkpoint of step (\d+): ")
_LEFT = re.compile(r"\[rank(\d)\] WARNING elastic_runner\.worker: preempted by signal after step "
                   r"(\d+); checkpoint step-\d{8} committed")
_EXITCODE = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: \d+ \(pid: (\d+)\)")
_RESUMED = re.compile(r"\[rank0\] INFO elastic_runner\.train\.session: resumed from (\S+): step (\d+), "
                      r"epoch (\d+), (\d+) samples into the epoch")


def start(launch, name, *args, restarts=1):
    return launch(cli("run", *BASE, *args, "--max-restarts", str(restarts),
                      "--monitor-interval", "0.2"), name=name)


def faults(spec: str) -> str:
    return f"faults.inject=[{spec}]"


def test_a_raising_worker_is_replaced_in_place(launch, tmp_path):
    """The raising worker is replaced, the other goes on from step 6 without reading a
    checkpoint (the restart path's resume after an exception: the next test)."""
    ck = tmp_path / "ck"
    job = start(launch, "raise", f"checkpoint.dir={ck}", "recovery.mode=in_place",
                faults("{kind: raise, rank: 1, step: 6}"))
    assert job.wait(timeout=240) == 0, job.output[-3000:]
    assert "resumed from" not in job.output
    assert "rank(s) [1] exited with code(s) [1]: replaced in place" in job.output
    assert "in-place recovery 1 done: step 7 committed" in job.output
    assert final_state(ck)["train_state"]["step"] == 12


def test_a_raising_worker_restarts_the_group_then_exhausted_restarts_end_in_one_line(
        launch, tmp_path):
    """The restart path: rank 1 raises at step 6; every worker restarts from the checkpoint of
    step 4, reaches step 6 and rank 1 raises again, with no restart left: the job ends with one
    line naming the root cause."""
    ck = tmp_path / "ck"
    job = start(launch, "raise-always", f"checkpoint.dir={ck}", "recovery.mode=restart",
                faults("{kind: raise, rank: 1, step: 6, attempts: 9}"), restarts=1)
    assert job.wait(timeout=240) == 1
    assert f"resumed from {ck / 'step-00000004'}: step 4" in job.output
    attempts = re.findall(r"fault injection: rank 1 raise after step 6 \(\d+ steps of attempt "
                          r"(\d+)\)", job.output)
    assert attempts == ["0", "1"], job.output[-3000:]
    lines = [ln for ln in job.output.splitlines() if ln.startswith("elastic-runner: job failed")]
    assert lines == ["elastic-runner: job failed: rank 1 (local_rank 1) exited with code 1: "
                     "InjectedFault: fault injection: rank 1 raises after step 6"], lines


def test_sigterm_to_a_worker_checkpoints_that_step_and_loses_nothing(launch, tmp_path):
    ref = start(launch, "reference", f"checkpoint.dir={tmp_path / 'ref'}")
    assert ref.wait(timeout=240) == 0, ref.output[-3000:]
    ck, trace = tmp_path / "ck", tmp_path / "trace"
    job = start(launch, "sigterm", f"checkpoint.dir={ck}", "checkpoint.every_steps=100",
                faults("{kind: sigterm, rank: 1, step: 7}"), "--trace-samples", str(trace))
    assert job.wait(timeout=240) == 0, job.output[-3000:]
    out = job.output
    # the signal lands after step 7; every rank discards step 8 and saves step 7
    assert "preemption: checkpointing step 7" in out and "exitcode: 143" in out
    assert "step 8 discarded" in out
    assert f"resumed from {ck / 'step-00000007'}: step 7" in out
    assert "sample trace: dropped" not in out  # zero lost steps
    # a preemption: every rank checkpointed step 7 and the restart resumed it; nothing repaired
    (report,) = assert_exact_audit(trace, steps=12, global_batch=DIGITS_GLOBAL_BATCH,
                                   num_samples=DIGITS_TRAIN)
    assert report.seen_once == 12 * 64
    assert_same_tensors(final_state(tmp_path / "ref")["model"], final_state(ck)["model"])


def test_sigterm_to_the_agent_stops_within_grace_with_a_checkpoint(launch, tmp_path):
    ck, trace = tmp_path / "ck", tmp_path / "trace"
    args = [f"checkpoint.dir={ck}", "training.max_steps=100000", "training.max_epochs=1000",
            "checkpoint.every_steps=5", "data.num_workers=2", "--trace-samples", str(trace)]
    job = start(launch, "evicted", *args)
    wait_until(lambda: (ck / "step-00000005").is_dir(), 200, "the step-5 checkpoint")
    job.proc.send_signal(signal.SIGTERM)  # what Kubernetes sends to the pod's main process
    assert job.wait(timeout=30) == 143, job.output[-3000:]
    assert "preemption: checkpointing step" in job.output
    last = max(e["step"] for e in audit.read_entries(trace))
    assert ckpt.latest_valid(ck).step == last  # the very last trained step is committed

    again = start(launch, "resumed", *args[:-2], "training.max_steps=" + str(last + 2),
                  "--trace-samples", str(trace))
    assert again.wait(timeout=240) == 0, again.output[-3000:]
    assert f": step {last}," in again.output and "sample trace: dropped" not in again.output
    assert_exact_audit(trace, steps=last + 2, global_batch=DIGITS_GLOBAL_BATCH,
                       num_samples=DIGITS_TRAIN)


def test_sigterm_to_a_workers_process_group_with_dataloader_workers(launch, tmp_path):
    """The loader workers get the signal too (as with a group-wide kill); the save still works."""
    ck = tmp_path / "ck"
    job = start(launch, "pg", f"checkpoint.dir={ck}", "data.num_workers=2",
                "training.max_steps=100000", "training.max_epochs=1000",
                "checkpoint.every_steps=5")
    wait_until(lambda: (ck / "step-00000005").is_dir(), 200, "the step-5 checkpoint")
    workers = trainers(job)  # job.workers() may name a DataLoader worker
    pids = {p.pid for p in workers.values()}
    os.killpg(os.getpgid(workers[1].pid), signal.SIGTERM)
    wait_until(lambda: _RESUMED.search(job.output), 120, "the restarted group to resume")
    out = job.output
    assert "DataLoader worker" not in out
    (preempted,) = [int(s) for s in _PREEMPTING.findall(out)]
    # rank 0's first checkpoint after the preemption line is the preemption checkpoint
    saved = int(_SAVED.search(out, out.index("preemption: checkpointing step")).group(1))
    assert saved == preempted > 5
    assert f"committed checkpoint {ck / f'step-{saved:08d}'} " in out
    # every rank leaves with 143 (128 + SIGTERM) after that commit; torchrun logs the first
    assert sorted(_LEFT.findall(out)) == [("0", str(saved)), ("1", str(saved))], _LEFT.findall(out)
    exits = [(int(code), int(pid)) for code, pid in _EXITCODE.findall(out)]
    assert exits and all(code == 143 and pid in pids for code, pid in exits), (exits, pids)
    (resumed,) = _RESUMED.findall(out)
    steps_per_epoch = 19  # digits: 1257 training samples, global batch 64
    assert resumed == (str(ck / f"step-{saved:08d}"), str(saved), str(saved // steps_per_epoch),
                       str(saved % steps_per_epoch * 64)), resumed


def test_a_nan_step_is_skipped_on_all_ranks_and_a_streak_rolls_back_once(launch, tmp_path):
    """One NaN at step 2 (rank 1): every rank skips the update, its samples consumed. A streak
    of 3 from step 6 (rank 0, ``max_bad_steps=3``): every rank rolls back to the checkpoint of
    step 4 once, and the run succeeds; the streak's skipped steps go with the rollback, the
    single one before the checkpoint stays counted."""
    ck, trace = tmp_path / "ck", tmp_path / "trace"
    job = start(launch, "nan", f"checkpoint.dir={ck}", "training.max_bad_steps=3",
                faults("{kind: nan, rank: 1, step: 2}, {kind: nan, rank: 0, step: 6, count: 3}"),
                "--trace-samples", str(trace))
    assert job.wait(timeout=240) == 0, job.output[-3000:]
    assert "step 2: non-finite loss or gradient on at least one rank: update skipped" in job.output
    assert "rolling back to the last valid checkpoint" in job.output
    assert f"resumed from {ck / 'step-00000004'}: step 4" in job.output
    state = final_state(ck)["train_state"]
    assert (state["step"], state["bad_steps"], state["rollbacks"]) == (12, 1, 1)
    skipped = {e["step"] for e in audit.read_entries(trace) if e.get("skipped")}
    assert skipped == {2}
    assert_exact_audit(trace, steps=12, global_batch=DIGITS_GLOBAL_BATCH,
                       num_samples=DIGITS_TRAIN)  # the skipped step's samples were consumed


def test_recurring_nan_after_rollback_stops_with_clear_error(launch, tmp_path):
    ck = tmp_path / "ck"
    args = [f"checkpoint.dir={ck}", "training.max_bad_steps=2",
            faults("{kind: nan, rank: 1, step: 6, count: 2, repeat: true}")]
    job = start(launch, "recurring", *args, restarts=0)
    assert job.wait(timeout=240) == 1
    (line,) = [ln for ln in job.output.splitlines() if ln.startswith("elastic-runner: job failed")]
    assert "TrainingFailed: failed: 2 non-finite steps in a row at step 7, again after rolling " \
           "back" in line
    again = start(launch, "again", *args, restarts=0)  # a restart does not train on
    assert again.wait(timeout=240) == 1 and "TrainingFailed" in again.output
    assert final_state(ck)["train_state"]["step"] == 7


def test_hung_rank_is_detected_dumped_and_restarted(launch, tmp_path, startup_seconds):
    ck = tmp_path / "ck"
    # 3 s and 1 s on an idle machine; under load a healthy step must not exceed the budget, and
    # rank 0's watchdog must fire within the grace of rank 1's (the agent then kills the rest)
    hang, grace = max(3, round(2 * startup_seconds)), max(1.0, round(startup_seconds, 1))
    job = start(launch, "hang", f"checkpoint.dir={ck}", f"watchdog.hang_timeout_seconds={hang}",
                "watchdog.long_op_timeout_seconds=120", f"watchdog.dump_grace_seconds={grace}",
                faults("{kind: hang, rank: 1, step: 6}"))
    assert job.wait(timeout=240) == 0, job.output[-3000:]
    out = job.output
    for rank in (0, 1):
        assert f"rank {rank}: step 6 exceeded its {hang} s budget (hang)" in out
    assert "_hang_forever" in out and "Thread 0x" in out  # rank 1's stack, from faulthandler
    assert f"resumed from {ck / 'step-00000004'}: step 4" in out
    summaries = rank_summaries(ck)
    assert [s["step"] for s in summaries] == [12, 12]
    assert json.loads((ck / "results.json").read_text())["step"] == 12
