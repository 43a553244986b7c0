"""The agent's one line naming the rank that died first when every worker restarts
(``agent/first_death.py``), where torch's poll named a survivor the agent had stopped."""

from __future__ import annotations

import json
import logging
import signal
import time
from types import SimpleNamespace

import pytest
from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from elastic_runner.agent import restart_budget
from elastic_runner.agent.first_death import describe, first_death, log_first_death

from .test_restart_budget import IGNORES_SIGTERM, _Handler


def failure(local_rank: int, exitcode: int, error_file: str = "/nonexistent") -> ProcessFailure:
    return ProcessFailure(local_rank=local_rank, pid=1000 + local_rank, exitcode=exitcode,
                          error_file=error_file)


def test_the_killed_rank_comes_before_the_survivor_the_agent_stopped():
    """The issue's case: rank 1 SIGKILLed, rank 0 stopped by the agent (SIGTERM) in the same
    second: torch's poll named rank 0 (``exitcode: -15 local_rank: 0``)."""
    failures = {0: failure(0, -signal.SIGTERM), 1: failure(1, -signal.SIGKILL)}
    rank, first = first_death(failures, seen={1})
    assert rank == 1
    assert describe(rank, first) == "rank 1 (local_rank 1, pid 1001) was killed by SIGKILL"
    assert first_death(failures)[0] == 1  # without the look before the stop too


def test_a_signal_comes_before_a_survivor_that_raised_about_it(tmp_path):
    """The survivor's gloo traceback (exit 1, an error file written a second earlier than
    the killed rank's failure was seen) does not name it."""
    error_file = tmp_path / "error.json"
    error_file.write_text(json.dumps({"message": {"message": "RuntimeError: gloo: Connection "
                                                  "reset by peer", "extraInfo": {
                                                      "timestamp": int(time.time()) - 1}}}))
    failures = {0: failure(0, 1, str(error_file)), 1: failure(1, -signal.SIGKILL)}
    assert first_death(failures, seen={0, 1})[0] == 1


def test_a_rank_that_exited_before_the_stop_comes_first():
    """Seen before the agent stopped the rest: the one that raised, not those stopped
    (SIGTERM) or that lost it (exit 4); an exit code reads as such."""
    failures = {0: failure(0, 4), 1: failure(1, -signal.SIGTERM), 2: failure(2, 1)}
    rank, first = first_death(failures, seen={0, 2})
    assert describe(rank, first) == "rank 2 (local_rank 2, pid 1002) exited with code 1"


@pytest.mark.parametrize("remaining, says", [
    (3, "was killed by SIGKILL; restarting every worker"),
    (0, "was killed by SIGKILL; not restarting")])
def test_the_agent_names_the_killed_rank_before_torchs_summary(monkeypatch, caplog, remaining,
                                                               says):
    """The agent's monitor (restart_budget's wrapper around torch's) with real processes: local rank 1
    SIGKILLed, local rank 0 running until the wrapper stops it; torch's poll (here: every
    failure stamped in the same second, as torch's whole-second timestamps do) follows."""
    monkeypatch.setattr(restart_budget, "FAILED_STOP_SECONDS", 0.5)
    monkeypatch.setattr(restart_budget, "_BUDGET", [restart_budget.RestartBudget(crash_loop=0)])
    survivor = _Handler(IGNORES_SIGTERM)
    killed = _Handler("import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    killed.proc.wait(timeout=60)
    assert survivor.proc.stdout.readline() == "ready\n"
    handlers = {0: survivor, 1: killed}

    def torch_monitor(agent, worker_group):
        return RunResult(state=WorkerState.FAILED, failures={
            lr: ProcessFailure(lr, h.proc.pid, h.proc.wait(timeout=30), "/nonexistent")
            for lr, h in handlers.items()})

    agent = SimpleNamespace(_pcontext=SimpleNamespace(subprocess_handlers=handlers),
                            _remaining_restarts=remaining)
    group = SimpleNamespace(spec=SimpleNamespace(max_restarts=3))
    try:
        with caplog.at_level(logging.WARNING, logger="elastic_runner.agent.first_death"):
            restart_budget._restart_budget_by_cause(torch_monitor)(agent, group)
    finally:
        for h in handlers.values():
            if h.proc.poll() is None:
                h.close(signal.SIGKILL)
            h.proc.wait(timeout=30)
    lines = [r.getMessage() for r in caplog.records if r.name.endswith("first_death")]
    assert lines == [f"rank 1 (local_rank 1, pid {killed.proc.pid}) {says}"]


def test_nothing_is_said_without_a_failure(caplog):
    log_first_death({}, (), True)
    assert not caplog.records
