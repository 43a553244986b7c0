"""The goodput clock: every second goes to exactly one cause, the causes add up to the job's
wall time (``now - job_start``), and the job's figures survive a restart (through a
checkpoint), a rollback, an in-place join and a regroup."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.common import log_time
from elastic_runner.data import audit
from elastic_runner.observe.goodput import CAUSES, Goodput, process_start_time
from elastic_runner.train.callbacks import StepEnd

from .procs import CONFIGS, cli, wait_until


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


def assert_adds_up(g: Goodput) -> dict[str, float]:
    """The invariant: the causes (each >= 0) sum to the wall time; returns the seconds."""
    s = g.seconds()
    assert sum(s.values()) == pytest.approx(g.clock() - g.job_start, abs=1e-9), s
    assert min(s.values()) >= 0.0, s
    return s


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
    second.on_phase("loading", "checkpoint load", True)  # session.resume
    second.load_state_dict(saved)
    second.on_resumed(1)
    step(second, clock, 3.0)
    s = second.seconds()
    assert s["productive"] == 13.0 and s["redone"] == 7.0 and s["startup"] == 4.0
    assert sum(s.values()) == pytest.approx(clock.t - 1000.0)
    assert second.job_start == 1000.0


@pytest.mark.parametrize("loaded_at_start", [True, False])
def test_rollback_undoes_the_steps_since_the_checkpoint(loaded_at_start):
    """A rollback in an attempt that started from scratch (nothing loaded at its start) used
    to count the time up to the checkpoint twice (its own spans and the checkpoint's)."""
    clock = Clock()
    g = Goodput(process_start=clock.t, clock=clock)
    if loaded_at_start:
        g.on_phase("loading", "checkpoint load", True)
        g.load_state_dict(Goodput(process_start=clock.t, clock=clock).state_dict())
    step(g, clock, 2.0)
    saved = g.state_dict()
    step(g, clock, 3.0, committed=False)
    g.on_phase("loading", "checkpoint load", True)  # session.rollback -> resume
    g.load_state_dict(saved)  # rollback to the checkpoint
    step(g, clock, 1.0)
    s = assert_adds_up(g)
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


def test_a_joiner_counts_the_state_transfer_as_recovery():
    """The time between the survivor's snapshot of its account and the joiner's first step
    (sending, loading, DDP re-wrap) used to be in no one's account: about 0.1-0.5 s per
    in-place recovery, 15 s of 304 s in ``docs/bench/recovery-inplace.json``'s in-place row."""
    clock = Clock()
    survivor = Goodput(process_start=clock.t, clock=clock)
    spare = Goodput(process_start=clock.t + 1.0, clock=clock)
    step(survivor, clock, 20.0)
    survivor.on_step_begin(2, 2)
    clock.tick(0.1)
    survivor.on_phase("recovering", "in-place recovery", True)  # the other rank died
    clock.tick(0.2)
    state = survivor.state_dict()  # sent to the spare
    clock.tick(0.3)  # the transfer, unpacking, loading
    spare.load_state_dict(state)
    clock.tick(0.4)  # DDP re-wrapped
    spare.on_recovered(1, True, lambda: (0, []))
    clock.tick(0.1)
    step(spare, clock, 1.0)
    s = assert_adds_up(spare)
    assert s == pytest.approx({"productive": 21.0, "startup": 0.0, "recovery": 1.0,
                               "redone": 0.1, "checkpoint": 0.0, "evaluation": 0.0,
                               "other": 0.0})
    assert spare.job_start == survivor.job_start
    assert_adds_up(survivor)


@pytest.mark.parametrize("spare_start", [5.0, -5.0])
def test_every_member_a_replacement_resumes_from_the_checkpoint(spare_start):
    """No survivor holds the state (``recovery/rejoin.py``): the spares load the newest checkpoint.
    The spare's own time used to be dropped as if it ran beside the training: 16 and 26 s of
    a 60 s run were in no one's account. ``spare_start``: seconds after the checkpoint."""
    clock = Clock()
    rank0 = Goodput(process_start=clock.t, clock=clock)
    step(rank0, clock, 10.0)
    checkpoint = rank0.state_dict()  # at t+10
    spare = Goodput(process_start=clock.t + spare_start, clock=clock)
    clock.tick(15.0)  # the spare stood by; meanwhile both workers died, one after the other
    spare.on_phase("loading", "checkpoint load", True)  # rejoin -> trainer.resume
    spare.load_state_dict(checkpoint)
    spare.on_recovered(10, True, lambda: (0, []))
    clock.tick(0.5)
    step(spare, clock, 1.0)
    s = assert_adds_up(spare)
    assert s["productive"] == 11.0 and s["recovery"] == 0.5
    if spare_start > 0:  # a restart: the checkpoint -> the spare's start was lost
        assert (s["redone"], s["startup"]) == (5.0, 10.0)
    else:  # everything since the checkpoint was lost; the spare's stand-by overlapped it
        assert (s["redone"], s["startup"]) == (15.0, 0.0)


def test_a_regroup_counts_the_new_group_as_recovery():
    """Continue shrunk: the survivor leaves its trainer and builds one for the new group in the
    same process; the new trainer's account goes on from the old one's, and the time in between
    (new group, new trainer: seconds when it waits for a replacement) is recovery."""
    clock = Clock()
    old = Goodput(process_start=clock.t, clock=clock)
    step(old, clock, 10.0)
    old.on_phase("recovering", "in-place recovery", True)
    clock.tick(0.5)
    old.on_phase("finished", "", False)  # Trainer.fit's finally closes the old session
    state = old.state_dict()
    clock.tick(2.0)  # destroy, the new group, build_trainer
    new = Goodput(process_start=old.process_start, clock=clock)
    new.load_state_dict(state)
    new.on_recovered(10, True, lambda: (0, []))
    clock.tick(0.25)  # rejoin
    step(new, clock, 1.0)
    s = assert_adds_up(new)
    assert (s["productive"], s["recovery"], s["startup"]) == pytest.approx((11.0, 2.75, 0.0))


def test_a_writer_clock_ahead_moves_the_job_start_not_a_cause_below_zero():
    """A checkpoint written on a node whose clock is ahead: the gap to this process's start
    comes out negative; no cause goes below 0 and the wall time takes the skew."""
    clock = Clock()
    writer = Goodput(process_start=clock.t + 5.0, clock=lambda: clock.t + 5.0)  # 5 s ahead
    step(writer, clock, 10.0)
    saved = writer.state_dict()
    clock.tick(1.0)
    g = Goodput(process_start=clock.t, clock=clock)
    clock.tick(2.0)
    g.on_phase("loading", "checkpoint load", True)
    g.load_state_dict(saved)
    step(g, clock, 1.0)
    s = assert_adds_up(g)
    assert s["productive"] == pytest.approx(11.0)
    assert g.job_start == pytest.approx(1005.0 - 2.0)  # back by the snapshot's 2 s "ahead"


def test_the_causes_add_up_through_random_restarts_joins_rollbacks_and_regroups():
    """Two ranks through 400 random events, each ledger checked after every event."""
    rng = random.Random(20261124)
    clock = Clock()
    ranks = [Goodput(process_start=clock.t, clock=clock) for _ in range(2)]
    checkpoint = None
    for _ in range(400):
        clock.tick(rng.uniform(0.0, 0.5))
        event, r = rng.random(), rng.randrange(2)
        g = ranks[r]
        if event < 0.4:
            step(g, clock, rng.uniform(0.01, 1.0), committed=rng.random() < 0.9)
        elif event < 0.55:
            g.on_phase(rng.choice(["evaluating", "checkpointing"]), "", True)
            if rng.random() < 0.5 and r == 0:
                checkpoint = g.state_dict()
        elif event < 0.65 and checkpoint is not None:  # restart: new processes, the checkpoint
            clock.tick(rng.uniform(0.1, 2.0))
            ranks = [Goodput(process_start=clock.t, clock=clock) for _ in range(2)]
            clock.tick(rng.uniform(0.5, 3.0))
            for new in ranks:
                new.on_phase("loading", "checkpoint load", True)
                new.load_state_dict(checkpoint)
        elif event < 0.8:  # rank r dies; a spare that started earlier takes the other's state
            peer = ranks[1 - r]
            peer.on_phase("recovering", "in-place recovery", True)
            spare = Goodput(process_start=clock.t - rng.uniform(0.0, 30.0), clock=clock)
            clock.tick(rng.uniform(0.0, 1.0))
            state = peer.state_dict()
            clock.tick(rng.uniform(0.0, 0.5))
            spare.load_state_dict(state)
            clock.tick(rng.uniform(0.0, 0.5))
            spare.on_recovered(1, True, lambda: (0, []))
            ranks[r] = spare
        elif event < 0.9 and checkpoint is not None:  # rollback on every rank
            for each in ranks:
                each.on_phase("loading", "checkpoint load", True)
                each.load_state_dict(checkpoint)
        else:  # a regroup: a new trainer in the same process, from the old one's state
            g.on_phase("finished", "", False)
            state = g.state_dict()
            clock.tick(rng.uniform(0.0, 3.0))
            ranks[r] = Goodput(process_start=g.process_start, clock=clock)
            ranks[r].load_state_dict(state)
            ranks[r].on_recovered(1, True, lambda: (0, []))
        for each in ranks:
            assert_adds_up(each)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="Linux /proc")
def test_process_start_is_on_the_wall_clock():
    """psutil's create_time() adds the boot time in whole seconds: 0.14 s early on the 2-core
    development machine, which moved that much of each restart's lost work into its start-up
    (and, with a checkpoint newer than that start, counted it twice)."""
    before = time.time()
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    after = time.time()
    try:
        start = process_start_time(child.pid)
    finally:
        child.communicate(b"", timeout=60)
    tick = 1.0 / os.sysconf("SC_CLK_TCK")  # the kernel keeps the start in clock ticks
    assert before - tick - 1e-3 <= start <= after
    assert abs(process_start_time() - process_start_time(os.getpid())) < 1e-3


# ---------------------------------------------------------------- a real run

_SUMMARY = re.compile(r"^(\d\d:\d\d:\d\d\.\d{3}) \[rank0\] INFO elastic_runner\.train\.loop: goodput: "
                      r"ETTR ([\d.]+) over ([\d.]+) s of job wall time \(productive ([\d.]+) s; "
                      r"badput: (.*)\)$", re.M)
_RECOVERED = {"in_place": re.compile(r"in-place recovery \d+ done: step \d+ committed"),
              "restart": re.compile(r"\[rank0\] INFO elastic_runner\.train\.session: resumed from ")}
REAL_STEPS = 200  # the kill after step 60


def commit_times(entries: list[dict], rank: int) -> dict[int, tuple[float, int | None]]:
    """``rank``'s traced steps: step -> (unix time of its entry, pid of the process that
    trained it; None for an entry repaired after a failure, whose time is the repair's)."""
    return {e["step"]: (e["time"], e.get("pid")) for e in entries
            if "indices" in e and e["rank"] == rank}


def step_gaps(times: dict[int, tuple[float, int | None]], fault: float) -> list[float]:
    """Seconds between consecutive commits of one process: a step, and the work after the one
    before it (checkpoint, evaluation, logging). A gap across two processes (a restart, a
    replacement), next to a repaired entry or around the ``fault`` (unix time: a survivor's
    gap holds the recovery) is left out."""
    return [times[s][0] - times[s - 1][0] for s in sorted(times)
            if s - 1 in times and times[s][1] is not None and times[s][1] == times[s - 1][1]
            and not times[s - 1][0] <= fault <= times[s][0]]


STEP_TOL = 2  # steps an outside window may differ by (the step in flight, the first step)
CLOCK_TOL = 0.15  # seconds: trace times are rounded to 1 ms, log lines and polling add the rest


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["in_place", "restart"])
def test_a_killed_worker_and_the_causes_still_add_up_to_the_wall_time(launch, tmp_path, mode):
    """``elastic-runner run``, 2 workers; rank 0 SIGKILLed from outside after step 60 (in
    place: rank 0's account at the end is the one the survivor handed to its replacement,
    started cold; restart: the newest checkpoint's). rank 0's ``goodput:`` line and
    ``results.json``: the causes sum to the wall time (within 1%), and the wall time is the
    job's: from its first worker's start to the end.

    Each cause is also checked against the test's own clock (tolerances :data:`STEP_TOL` steps
    and :data:`CLOCK_TOL` seconds): evaluation and checkpoint against their windows timed from
    the trace and rank 0's log lines; productive against the traced step durations (the gaps
    between one process's consecutive commits less those windows); in place, recovery plus
    the step in flight (redone) against the window from the last commit before the kill to the
    first after it, split where the survivor logged the death; restart, redone against the checkpoint resumed
    from -> the new process's start, and start-up against the two process starts -> their
    first commits."""
    ck, trace = tmp_path / "ck", tmp_path / "trace"
    t_launch = time.time()
    job = launch(cli("run", str(CONFIGS / "digits.yaml"), "logging.tensorboard_dir=null",
                     "early_stopping.enabled=false", f"training.max_steps={REAL_STEPS}",
                     "training.max_epochs=1000", "checkpoint.every_steps=40",
                     # written while training waits: each checkpoint is long enough for the
                     # outside clock to tell it apart from the step after it
                     "checkpoint.async_save=false",
                     "training.log_every_steps=10", "eval.every_steps=0",
                     # in place: a cold replacement (no spare started before the kill), so
                     # the recovery lasts a process start, far more than the clocks' tolerance
                     f"recovery.mode={mode}", "recovery.spare_delay_seconds=600",
                     "faults.inject=[{kind: slow, rank: 0, step: 1, count: 100000, "
                     "seconds: 0.02}]", f"checkpoint.dir={ck}", "--trace-samples", str(trace),
                     "--nproc-per-node", "2", "--max-restarts", "3"), name=mode)
    # after both workers started: rank 0's account at the end may be rank 1's (in place, the
    # survivor's account goes to the replacement), and under load torchrun spawns rank 1
    # noticeably later than rank 0 (seen in CI: the bound below missed by a spawn's delay)
    wait_until(lambda: {0, 1} <= set(job.workers()), 120, "both workers")
    t_first_seen = time.time()
    first_starts = [process_start_time(p.pid) for p in job.workers().values()]
    wait_until(lambda: max(audit.steps_recorded(trace, 0), default=0) >= 60, 240, "60 steps")
    t_kill = time.time()
    job.workers()[0].kill()
    before = commit_times(audit.read_entries(trace), 1)  # the trace as the kill left it
    wait_until(lambda: _RECOVERED[mode].search(job.output) is not None, 240, "the recovery")
    new_start = (min(process_start_time(p.pid) for p in job.workers().values())
                 if mode == "restart" else None)
    assert job.wait(timeout=400) == 0, job.output[-4000:]
    t_exit = time.time()

    m = _SUMMARY.search(job.output)
    assert m is not None, job.output[-4000:]
    line = {"productive": float(m[4]), **{c: float(v) for c, v in
                                          (x.rsplit(" ", 2)[:2] for x in m[5].split(", "))}}
    assert set(line) == set(CAUSES)
    wall, ettr = float(m[3]), float(m[2])
    # the line's figures are rounded to 0.1 s (0.001 for the ETTR)
    assert sum(line.values()) == pytest.approx(wall, rel=0.01, abs=0.05 * len(CAUSES))
    # productive and wall are each rounded by up to 0.05 s: their ratio by up to 0.1 / wall
    # (seen in CI: 10.5 / 19.1 = 0.5497 for an ETTR of 0.552 = 10.53 / 19.09)
    assert ettr == pytest.approx(line["productive"] / wall, abs=0.1 / wall + 1e-3)

    figures = json.loads((ck / "results.json").read_text())["goodput"]
    seconds = figures["seconds"]
    assert set(seconds) == set(CAUSES) and min(seconds.values()) >= 0.0, seconds
    # unrounded, they add up exactly (one kill lost ~0.1 s of 50 s before: within 1%)
    assert sum(seconds.values()) == pytest.approx(figures["wall_seconds"], abs=1e-6)
    assert figures["wall_seconds"] == pytest.approx(wall, abs=0.05)
    assert seconds == pytest.approx(line, abs=0.05)
    # the wall time is the job's: it began with the first workers (after the launch, before
    # the test saw one) and ends at the line
    t_line = log_time(m[1], t_exit)
    assert t_launch - 0.02 <= t_line - wall <= t_first_seen + 0.5, (t_launch, t_first_seen)
    assert t_line <= t_exit
    # the kill cost what its path costs
    if mode == "in_place":
        assert "resumed from" not in job.output
    resumed = [int(s) for s in re.findall(r"resumed from \S+/step-(\d{8})", job.output)]
    check_causes_against_the_outside_clock(seconds, job.output, trace, mode, t_kill, before,
                                           min(first_starts), new_start, resumed,
                                           figures["wall_seconds"])


# rank 0's lines that end an evaluation and a checkpoint (millisecond stamps)
_EVAL_END = re.compile(r"^(\d\d:\d\d:\d\d\.\d{3}) \[rank0\] INFO elastic_runner\.train\.loop: "
                       r"eval at step (\d+):", re.M)
_COMMIT_END = re.compile(r"^(\d\d:\d\d:\d\d\.\d{3}) \[rank0\] INFO elastic_runner\.checkpoint\."
                         r"manager: committed checkpoint \S*step-(\d{8})", re.M)
# a survivor's line as its collective fails for the dead peer (the number: its generation)
_NOTICED = re.compile(r"^(\d\d:\d\d:\d\d\.\d{3}) \[rank\d\] WARNING elastic_runner\.recovery\.inplace: "
                      r"in-place recovery: rank\(s\) \[\d+\] died \(.*\); generation (\d+)", re.M)
WINDOW_TOL = 0.003  # seconds per outside window: two millisecond stamps and a log line's write
OTHER_MAX = 0.01  # of the wall time: this run's "other" is bookkeeping (no skipped step)


def stamps(pattern: re.Pattern[str], log: str, near: float) -> dict[int, float]:
    """Step -> unix time of the last line of ``pattern`` for that step (a step redone after a
    restart: the new process's), on the day of the unix time ``near``."""
    return {int(m[2]): log_time(m[1], near) for m in pattern.finditer(log)}


def after_step_windows(log: str, times: dict[int, tuple[float, int | None]], rank: int,
                       near: float) -> dict[int, tuple[float, float]]:
    """Step -> (evaluation, checkpoint) seconds after that step on ``rank``, timed from outside:
    the evaluation from the step's trace entry to rank 0's ``eval at step`` line (the ranks'
    all-reduce of the sums ends every rank's evaluation together); the checkpoint (written
    while training waits: ``checkpoint.async_save=false``), on rank 0, from then to its
    ``committed`` line. Another rank's share of a checkpoint is none: rank 0 writes, and the
    others wait in their next step's first collective. ``near``: a unix time of the run's day."""
    evals, commits = stamps(_EVAL_END, log, near), stamps(_COMMIT_END, log, near)
    out = {}
    for step, (t, _) in times.items():
        e = evals[step] - t if step in evals else 0.0
        c = commits[step] - evals.get(step, t) if rank == 0 and step in commits else 0.0
        out[step] = (e, c)
    return out


def check_causes_against_the_outside_clock(seconds: dict[str, float], log: str, trace: Path,
                                           mode: str, t_kill: float,
                                           before: dict[int, tuple[float, int | None]],
                                           first_start: float, new_start: float | None,
                                           resumed: list[int], wall: float) -> None:
    """The attribution of :func:`test_a_killed_worker_and_the_causes_still_add_up_to_the_wall_time`
    checked against what the test measured itself (its docstring): each cause on its own."""
    entries = audit.read_entries(trace)
    ranks = {r: commit_times(entries, r) for r in (0, 1)}
    after = ranks[1]
    assert sorted(after) == list(range(1, REAL_STEPS + 1))
    # the survivor may commit the step in flight after the kill, before its next collective
    # fails (seen under load in CI): its gap holding the recovery is the one that holds the
    # middle of the kill -> the killed rank's first commit from its new process
    killed_pids = {pid for t, pid in ranks[0].values() if t <= t_kill}
    t_back = min(t for t, pid in ranks[0].values()
                 if t > t_kill and pid is not None and pid not in killed_pids)
    t_mid = (t_kill + t_back) / 2
    last_before = max(s for s, (t, pid) in before.items() if t <= t_kill and pid is not None)
    # whose account covers a step: in place, the survivor's (rank 1) up to the kill, then its
    # replacement's (rank 0, handed the survivor's); restart, rank 0's (the checkpoint's)
    holder = (lambda s: 1 if s <= last_before else 0) if mode == "in_place" else (lambda s: 0)
    windows = {r: after_step_windows(log, ranks[r], r, t_kill) for r in (0, 1)}
    # the steps of the final model (a restart's redone steps: the new process's, whose trace
    # entries replaced the old ones and whose log lines come last)
    kept = sorted(after)
    outside_eval = sum(windows[holder(s)][s][0] for s in kept)
    outside_ckpt = sum(windows[holder(s)][s][1] for s in kept)
    n_windows = sum(1 for s in kept if any(windows[holder(s)][s]))
    window_tol = n_windows * WINDOW_TOL + 0.02
    assert abs(seconds["evaluation"] - outside_eval) <= window_tol, (outside_eval, seconds)
    assert abs(seconds["checkpoint"] - outside_ckpt) <= window_tol, (outside_ckpt, seconds)
    assert seconds["other"] <= OTHER_MAX * wall + CLOCK_TOL, seconds

    # productive: each step's span, the gap between one process's consecutive commits less the
    # evaluation and checkpoint after the step before (a gap across processes, next to a
    # repaired entry or around the fault is left out, and so is each process's first step)
    spans = []
    for s in kept:
        times = ranks[holder(s)]
        if s - 1 in times and holder(s - 1) == holder(s) and times[s][1] is not None \
                and times[s][1] == times[s - 1][1] and not times[s - 1][0] <= t_mid <= times[s][0]:
            e, c = windows[holder(s)][s - 1]
            spans.append(times[s][0] - times[s - 1][0] - e - c)
    dt = sorted(spans)[int(0.9 * len(spans))]  # a step
    tol = STEP_TOL * dt + CLOCK_TOL + window_tol
    assert sum(spans) - seconds["other"] - tol <= seconds["productive"] <= sum(spans) + tol, \
        (sum(spans), seconds)
    t_last = before[last_before][0]
    t_next = min(t for t, pid in after.values() if t > t_mid and pid is not None)
    if mode == "in_place":  # nothing redone but the step in flight; the rest was recovery
        window = t_next - t_last
        assert window - tol <= seconds["recovery"] + seconds["redone"] <= window + tol, \
            (window, seconds)
        # the step in flight is lost until the survivor's collective fails and it logs the
        # death (that line's stamp, from outside); from then on it is recovering
        t_noticed = min(stamps(_NOTICED, log, t_kill).values())
        assert t_kill - CLOCK_TOL <= t_noticed <= t_next, (t_kill, t_noticed, t_next)
        assert abs(seconds["recovery"] - (t_next - t_noticed)) <= tol, (t_next - t_noticed, seconds)
        assert abs(seconds["redone"] - (t_noticed - t_last)) <= tol, (t_noticed - t_last, seconds)
        return
    # restart: the newest checkpoint -> the new process, then its start-up
    assert len(resumed) == 1 and resumed[0] in before, resumed
    assert min(s for s, (t, pid) in after.items() if t > t_kill and pid) == resumed[0] + 1
    assert new_start is not None
    redone = new_start - before[resumed[0]][0]
    assert redone - tol <= seconds["redone"] <= redone + tol, (redone, seconds)
    startup = (after[1][0] - first_start) + (t_next - new_start)
    assert startup - tol <= seconds["startup"] <= startup + tol, (startup, seconds)
    assert seconds["recovery"] == 0.0
