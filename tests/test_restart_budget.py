"""Restart budget by cause (unit tier): which failed attempts spend torchrun's --max-restarts."""

import os
import re
import signal
import subprocess
import sys

import pytest

from elastic_runner.agent import restart_budget
from elastic_runner.agent.restart_budget import Failure, RestartBudget
from elastic_runner.checkpoint import storage as ckpt
from elastic_runner.checkpoint.storage import newest_checkpoint_step
from elastic_runner.exit_codes import (
    EXIT_BAD_INPUT,
    EXIT_CRASH_LOOP,
    EXIT_FENCED,
    EXIT_PEER_LOST,
    EXIT_PREEMPTED,
)

from .procs import CONFIGS, cli


def spend(budget: RestartBudget, failures: dict[int, Failure], remaining: int) -> int:
    """What torch's _invoke_run leaves after the agent fix judged the attempt: it restarts and
    subtracts one while the judged value is positive."""
    judged = budget.judge(failures, remaining)
    return judged - 1 if judged > 0 else -1  # -1: the job stops


CRASH = {0: Failure(1, "RuntimeError: boom")}


def test_a_crash_spends_one_restart_and_the_budget_runs_out():
    budget, remaining, restarts = RestartBudget(crash_loop=0), 2, 0
    while remaining >= 0:
        remaining = spend(budget, CRASH, remaining)
        restarts += remaining >= 0
    assert restarts == 2


@pytest.mark.parametrize("code", [EXIT_PREEMPTED, EXIT_PEER_LOST])
def test_preemptions_and_lost_peers_spend_nothing_until_their_own_budget(code):
    budget = RestartBudget(preemption=3, peer_lost=3, crash_loop=0)
    failures = {0: Failure(code, ""), 1: Failure(code, "")}
    remaining = 1
    for _ in range(3):
        remaining = spend(budget, failures, remaining)
        assert remaining == 1
    assert spend(budget, failures, remaining) == 0  # its own budget is spent: a crash's rule


def test_a_crash_beside_a_preemption_is_a_crash():
    budget = RestartBudget(crash_loop=0)
    assert spend(budget, {0: Failure(EXIT_PREEMPTED, ""), 1: Failure(-11, "SIGSEGV")}, 2) == 1


def test_the_rank_that_crashed_decides_not_those_that_lost_it_or_were_stopped(caplog):
    """One node: rank 1 raised, rank 0 lost it (exit 4, its message names a random port),
    rank 2 was stopped by the agent (SIGTERM): a crash, and the loop signature is rank 1's."""
    budget = RestartBudget(crash_loop=2, progress=lambda: 10)
    for port in (41000, 42000):
        failures = {0: Failure(EXIT_PEER_LOST, f"Connection closed by peer [127.0.0.1]:{port}"),
                    1: Failure(1, "InjectedFault: rank 1 raises"), 2: Failure(-15, "")}
        remaining = spend(budget, failures, 5)
    assert remaining == -1 and "crash loop: rank 1 failed the same way 2 times" in caplog.text
    lost = {0: Failure(EXIT_PEER_LOST, "x"), 1: Failure(-15, "")}
    assert spend(RestartBudget(), lost, 5) == 5  # a peer on another node: refunded


@pytest.mark.parametrize("code", [EXIT_BAD_INPUT, EXIT_FENCED])
def test_bad_input_and_fenced_out_are_never_restarted(code, caplog):
    budget = RestartBudget()
    assert budget.judge({1: Failure(code, "x"), 0: Failure(EXIT_PEER_LOST, "")}, 5) == 0
    assert f"rank 1 exited with code {code}" in caplog.text


def test_the_same_failure_without_checkpoint_progress_is_a_crash_loop(caplog):
    step = [10]
    budget = RestartBudget(crash_loop=3, progress=lambda: step[0])
    assert spend(budget, CRASH, 9) == 8
    assert spend(budget, CRASH, 8) == 7
    assert not budget.looped
    assert spend(budget, CRASH, 7) == -1  # the third identical failure at step 10 stops
    assert budget.looped  # run exits EXIT_CRASH_LOOP, not 1
    assert "crash loop: rank 0 failed the same way 3 times in a row (exit code 1: " \
           "RuntimeError: boom)" in caplog.text


def test_progress_or_another_failure_breaks_the_loop():
    step = [10]
    budget = RestartBudget(crash_loop=2, progress=lambda: step[0])
    assert spend(budget, CRASH, 9) == 8
    step[0] = 20  # a newer checkpoint was committed in between: not a loop
    assert spend(budget, CRASH, 8) == 7
    assert spend(budget, {0: Failure(-9, "Signal 9 (SIGKILL)")}, 7) == 6  # another failure
    assert spend(budget, {0: Failure(EXIT_PREEMPTED, "")}, 6) == 6  # from outside: resets
    assert spend(budget, {0: Failure(-9, "Signal 9 (SIGKILL)")}, 6) == 5
    assert spend(budget, {0: Failure(-9, "Signal 9 (SIGKILL)")}, 5) == -1


class _Handler:
    """A worker as torch's SubprocessHandler holds it: ``proc``, and ``close`` signalling its
    process group (workers run in their own sessions)."""

    def __init__(self, code: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True,
                                     stdout=subprocess.PIPE, text=True)

    def close(self, death_sig=signal.SIGTERM) -> None:
        os.killpg(self.proc.pid, death_sig)


IGNORES_SIGTERM = ("import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                   "print('ready', flush=True); time.sleep(120)")


@pytest.mark.parametrize("exit_code, stopped", [
    (1, True), (EXIT_PEER_LOST, True), (124, True), (-9, True),  # failed for good
    (EXIT_PREEMPTED, False),  # rank 0 may still be committing: torch's own 30 s apply
    (0, False),  # a rank that finished first: the others are finishing too
])
def test_the_rest_of_a_failed_group_is_stopped_without_torchs_30_s(monkeypatch, exit_code,
                                                                    stopped):
    """A rank that ignores SIGTERM (stopped, or blocked in a collective) is SIGKILLed
    FAILED_STOP_SECONDS after the SIGTERM once a local peer failed (here 0.5 s)."""
    monkeypatch.setattr(restart_budget, "FAILED_STOP_SECONDS", 0.5)
    code = f"import os, signal; os.kill(os.getpid(), {-exit_code})" if exit_code < 0 else \
        f"raise SystemExit({exit_code})"
    done, running = _Handler(code), _Handler(IGNORES_SIGTERM)
    done.proc.wait(timeout=60)
    assert running.proc.stdout.readline() == "ready\n"  # its SIGTERM handler is in place
    try:
        restart_budget._stop_failed_group({0: done, 1: running})
        assert (running.proc.poll() == -signal.SIGKILL) == stopped
    finally:
        if running.proc.poll() is None:
            running.close(signal.SIGKILL)
        running.proc.wait(timeout=30)


def test_progress_reads_the_newest_complete_checkpoint(tmp_path):
    from elastic_runner.checkpoint.storage import write_checkpoint

    progress = newest_checkpoint_step(str(tmp_path / "none"))
    assert progress() == -1
    for step in (3, 7):
        write_checkpoint(tmp_path, f"step-{step:08d}", {"x": step}, {"step": step})
    (tmp_path / "step-00000009").mkdir()  # no manifest: an incomplete write is no progress
    assert newest_checkpoint_step(str(tmp_path))() == 7


def test_run_script_judges_a_crash_loop_by_the_loops_checkpoints(tmp_path, monkeypatch):
    """``run script.py``: the agent puts a file in its workers' environment, the script's loop
    names its checkpoint directory there (own_loop's side: test_session.py), and the restart
    budget reads that directory's newest checkpoint; the variable is gone after the run. The
    launch is a stand-in that does what a worker would."""
    from elastic_runner.agent import launch as agent_launch
    from elastic_runner.checkpoint.storage import write_checkpoint
    from elastic_runner.cli import main
    from elastic_runner.protocol.env import CHECKPOINT_DIR_FILE_ENV

    script, ck = tmp_path / "train.py", tmp_path / "ck"
    script.write_text("")
    seen = []

    def launch(args) -> int:
        named_in = os.environ[CHECKPOINT_DIR_FILE_ENV]
        seen.append(args.restarts.progress())  # the loop has not named it yet
        with open(named_in, "w") as f:
            f.write(f"{ck}\n")
        seen.append(args.restarts.progress())  # named, empty
        write_checkpoint(ck, "step-00000005", {"x": 5}, {"step": 5})
        seen.append(args.restarts.progress())
        return 0

    monkeypatch.setattr(agent_launch, "launch", launch)
    assert main(["run", str(script)]) == 0
    assert seen == [-1, -1, 5]
    assert CHECKPOINT_DIR_FILE_ENV not in os.environ


# ---- end to end: elastic-runner run's agent applies the rules (restart path, real workers)

DIGITS = [str(CONFIGS / "digits.yaml"), "logging.tensorboard_dir=null",
          "early_stopping.enabled=false", "training.max_epochs=1000", "eval.every_steps=0",
          "checkpoint.every_steps=10", "recovery.mode=restart", "--nproc-per-node", "2"]


@pytest.mark.slow
def test_preemptions_do_not_spend_max_restarts_and_a_crash_loop_stops_early(launch, tmp_path):
    """--max-restarts 0 survives two preemptions (exit 143, refunded); --max-restarts 9 with
    the same exception at step 15 in every attempt stops after 3 identical failures."""
    preempted = launch(cli("run", *DIGITS, "training.max_steps=40",
                           f"checkpoint.dir={tmp_path / 'p'}", "--max-restarts", "0",
                           "faults.inject=[{kind: sigterm, rank: 1, step: 12},"
                           " {kind: sigterm, rank: 0, step: 25, attempts: 2}]"), name="preempted")
    looping = launch(cli("run", *DIGITS, "training.max_steps=40",
                         f"checkpoint.dir={tmp_path / 'l'}", "--max-restarts", "9",
                         "faults.inject=[{kind: raise, rank: 1, step: 15, attempts: 100}]"),
                     name="looping")
    assert preempted.wait(timeout=400) == 0, preempted.output[-3000:]
    log = preempted.output
    assert log.count("restart after preempted (exit code 143): not counted against "
                     "--max-restarts") == 2, log[-3000:]
    assert ckpt.latest_valid(tmp_path / "p").step == 40

    assert looping.wait(timeout=400) == EXIT_CRASH_LOOP, looping.output[-3000:]
    log = looping.output
    assert re.search(r"crash loop: rank 1 failed the same way 3 times in a row \(exit code 1: "
                     r"InjectedFault", log), log[-3000:]
    assert log.count("resumed from") == 2  # 3 attempts, not 10
    assert ckpt.latest_valid(tmp_path / "l").step == 10
