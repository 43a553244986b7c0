"""In-place recovery with real processes (``elastic-runner run``, gloo): workers SIGKILLed from
outside, one during a checkpoint write, one during an evaluation, replacements killed while they
join (before their group formed, and after, while they agree on the state); the survivors keep their process, the replacement gets the state from a live peer,
and the run ends bitwise equal to an uninterrupted one with an exact sample audit."""

from __future__ import annotations

import re
import signal

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from elastic_runner.data import audit

from .evidence import (
    DIGITS_GLOBAL_BATCH,
    DIGITS_TRAIN,
    assert_exact_audit,
    assert_same_optimizer,
    assert_same_tensors,
)
from .procs import CONFIGS, Pace, cli, free_port, wait_until
from .test_metrics import get, samples
from .test_train_torchrun import final_state

pytestmark = pytest.mark.slow

DIGITS = str(CONFIGS / "digits.yaml")
STEPS = 240  # the outside kills end near step 90 (rank 0 paced until the last)
COMMON = [DIGITS, "logging.tensorboard_dir=null", "early_stopping.enabled=false",
          f"training.max_steps={STEPS}", "training.max_epochs=1000", "checkpoint.every_steps=40",
          "training.log_every_steps=10", "eval.every_steps=0"]
# digits: 19 steps per epoch at world size 2 (global batch 64), evaluated at each epoch's end
FAULTS = ("faults.inject=[{kind: sigkill, rank: 0, step: 40, during: checkpoint},"
          " {kind: sigkill, rank: 1, step: 76, during: evaluation},"
          " {kind: sigkill, rank: 1, after_steps: 0, attempts: 20, during: joining}]")
OUTSIDE_KILLS = 5  # alternating ranks; the third one's replacement is killed as it joins
_REPLACED = re.compile(r"rank\(s\) \[(\d+)\] exited with code\(s\) \[(-?\d+)\]: replaced in "
                       r"place by (\w+) spare\(s\) pid\(s\) \[(\d+)\] \(generation (\d+)")
_DONE = re.compile(r"in-place recovery (\d+) done: step (\d+) committed ([\d.]+) s")
_WENT_ON = re.compile(r"\[rank0\] INFO elastic_runner\.recovery\.rejoin: rank 0 (?:goes on at|received the "
                      r"state of) step (\d+)")


def replacements(log: str) -> list[tuple[int, int, str, int, int]]:
    """(rank, exit code, warm/cold, new pid, generation) of each replacement in the log."""
    return [(int(m[1]), int(m[2]), m[3], int(m[4]), int(m[5])) for m in _REPLACED.finditer(log)]


def done(log: str) -> dict[int, int]:
    """generation -> the step committed first after that recovery."""
    return {int(m[1]): int(m[2]) for m in _DONE.finditer(log)}


def test_ten_kills_a_checkpoint_write_an_evaluation_and_a_joiner(launch, tmp_path, reference):
    ref_ck = reference(*COMMON, "--nproc-per-node", "2")

    ck, trace, port = tmp_path / "ck", tmp_path / "trace", free_port()
    pace = Pace(tmp_path / "pace", 0.03)  # rank 0 slowed until the last kill
    job = launch(cli("run", *COMMON, FAULTS, *pace.args, f"faults.once_dir={tmp_path / 'once'}",
                     f"checkpoint.dir={ck}", "--trace-samples", str(trace), "--nproc-per-node",
                     "2", "--max-restarts", "20", "--metrics-port", str(port)), name="job")
    # the three injected faults: rank 0 dies while step 40's checkpoint is written (after the
    # snapshot, in the background write), rank 1 as step 76's evaluation begins, and its
    # replacement after its group formed, while it agrees with the survivor on the state
    wait_until(lambda: 3 in done(job.output), 240, "the injected faults' recoveries")
    assert [r[:2] for r in replacements(job.output)] == [(0, -9), (1, -9), (1, -9)]
    assert list(done(job.output)) == [1, 3]  # generation 2 never committed a step
    assert "rank 1 sigkill during the joining of step 0" in job.output
    assert not (ck / "step-00000040").exists() or (ck / "step-00000040" / "manifest.json").exists()
    # one scrape shows the recoveries: the agent's count by mode, the ranks' count and phases
    _, text = get(port)
    assert samples(text, "elastic_runner_restarts_total", reason="in_place") == [3.0]
    assert samples(text, "elastic_runner_restarts_total", reason="failure") == [0.0]
    assert sum(samples(text, "elastic_runner_in_place_recoveries_total")) >= 1
    phases = {s.labels["phase"] for f in text_string_to_metric_families(text)
              for s in f.samples if s.name == "elastic_runner_last_recovery_seconds"}
    assert phases == {"detection", "teardown", "group", "state", "first step"}

    pids = {rank: p.pid for rank, p in job.workers().items() if rank >= 0}
    for rank, _, _, pid, _ in replacements(job.output):  # the spares' RANK is set later
        pids[rank] = pid
    generation = len(replacements(job.output))
    lost = []
    for i in range(OUTSIDE_KILLS):
        rank = i % 2
        before = max(audit.steps_recorded(trace, 0) | audit.steps_recorded(trace, 1))
        psutil.Process(pids[rank]).send_signal(signal.SIGKILL)
        generation += 1
        wait_until(lambda g=generation: len(replacements(job.output)) >= g, 60,
                   f"kill {i + 1}: the agent replacing rank {rank}")
        new = replacements(job.output)[generation - 1]
        assert new[:2] == (rank, -9) and new[4] == generation, new
        pids[rank] = new[3]
        if i == 2:  # the replacement dies while it joins: the group forms with the next one
            psutil.Process(new[3]).send_signal(signal.SIGKILL)
            generation += 1
            wait_until(lambda g=generation: len(replacements(job.output)) >= g, 60,
                       "the agent replacing the joiner")
            pids[rank] = replacements(job.output)[generation - 1][3]
        wait_until(lambda g=generation: g in done(job.output), 120,
                   f"kill {i + 1}: a step committed after generation {generation}")
        resumed = int(_WENT_ON.findall(job.output)[-1])
        lost.append(before - resumed)
    pace.end()
    assert job.wait(timeout=600) == 0, job.output[-4000:]

    log = job.output
    assert "resumed from" not in log  # no checkpoint was read: every state came from a peer
    assert all(n <= 0 for n in lost), lost  # nothing committed was lost
    # the state phase's parts: each survivor's in its report, each joiner's in a line of its own
    part = r"[\d.]+ s"
    assert re.search(rf"done: step \d+ committed .*; the state phase: agree {part}, send "
                     rf"{part}, rewrap {part}, claim {part}$", log, re.M), log[-3000:]
    assert re.search(rf"took the state of step \d+ from rank\(s\) \[\d\]: the state phase: "
                     rf"agree {part}, manifest {part}, tensors {part}, install {part}, rewrap "
                     rf"{part}, claim {part}$", log, re.M), log[-3000:]
    assert len(done(log)) == generation - 2  # the two superseded ones never committed
    # world size 2 throughout (warm spares). Killed after committing steps: the outside
    # kills, rank 0 in step 40's checkpoint and rank 1 in step 76's evaluation; the two
    # joiners never committed one: at most OUTSIDE_KILLS + 2 entries repaired
    assert_exact_audit(trace, steps=STEPS, global_batch=DIGITS_GLOBAL_BATCH,
                       num_samples=DIGITS_TRAIN, repaired_at_most=OUTSIDE_KILLS + 2)
    want, got = final_state(ref_ck), final_state(ck)
    assert_same_tensors(want["model"], got["model"])
    assert_same_optimizer(want["optimizer"], got["optimizer"])


SHRUNK_STEPS = 200  # the kill after step 40, the group whole again within ~100 paced steps


def test_continue_shrunk_keeps_every_sample_once_and_the_global_batch(launch, tmp_path):
    """No warm spare (``recovery.spare=false``): rank 0 goes on alone at once with twice the
    accumulation, and the group is whole again once the replacement has started. The config
    sets no global batch: the default keeps the first world size's (2 x 16 x 2 = 64)."""
    ck, trace = tmp_path / "ck", tmp_path / "trace"
    # rank 0 slowed until the group is whole again: the replacement's cold start (seconds)
    # falls well inside the run's SHRUNK_STEPS
    pace = Pace(tmp_path / "pace", 0.1)
    job = launch(cli("run", DIGITS, "logging.tensorboard_dir=null", "early_stopping.enabled=false",
                     f"training.max_steps={SHRUNK_STEPS}", "training.max_epochs=1000",
                     "recovery.continue_shrunk=true", "recovery.spare=false", *pace.args,
                     f"checkpoint.dir={ck}", "--trace-samples", str(trace),
                     "--nproc-per-node", "2"), name="shrunk")
    wait_until(lambda: max(audit.steps_recorded(trace, 0), default=0) >= 40, 240, "40 steps")
    job.workers()[1].send_signal(signal.SIGKILL)
    wait_until(lambda: "back to world size 2" in job.output, 240, "the group whole again")
    pace.end()
    assert job.wait(timeout=400) == 0, job.output[-4000:]

    log = job.output
    assert "continuing at world size 1 until the replacement is ready" in log
    assert "the replacement is ready: back to world size 2" in log
    assert "resumed from" not in log
    assert "world size 1; global batch 64 (1 x micro-batch 16 x accumulation 4)" in log
    entries = [e for e in audit.read_entries(trace) if "indices" in e]
    by_step: dict[int, list[dict]] = {}
    for e in entries:
        by_step.setdefault(e["step"], []).append(e)
    assert sorted(by_step) == list(range(1, SHRUNK_STEPS + 1))
    sizes = [by_step[s][0]["world_size"] for s in sorted(by_step)]
    assert 1 in sizes and sizes[0] == sizes[-1] == 2
    first, last = sizes.index(1), len(sizes) - 1 - sizes[::-1].index(1)
    assert set(sizes[first:last + 1]) == {1}  # one shrunk stretch, then whole again
    for step, es in by_step.items():  # every step: one global batch of 64, from each rank
        assert sum(len(e["indices"]) for e in es) == 64, step
        assert len(es) == es[0]["world_size"], step
    # batch.global_batch_size=64 at world sizes 2 and 1; rank 1 killed in place past step 40
    assert_exact_audit(trace, steps=SHRUNK_STEPS, global_batch=64, num_samples=DIGITS_TRAIN,
                       repaired_at_most=1)
