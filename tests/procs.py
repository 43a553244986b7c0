"""Process helpers for tests: start real launcher/agent processes, bound their time, kill all.

torchrun starts workers in their own sessions, so killing the agent's process group does not
reach them: teardown kills every descendant by pid (psutil), then the process itself.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate: Callable[[], bool], timeout: float, what: str,
               poll: float = 0.05) -> None:
    """Poll ``predicate`` until it holds; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(poll)


class Pace:
    """A job's rank slowed by ``seconds`` a step from outside, through the job's trigger file
    (``faults.trigger_file``, a standing ``slow`` request: elastic_runner/train/faults.py), so that
    faults the test injects land mid-run. :meth:`end` lifts it once the test's last fault is
    done: a run of a fixed number of steps then ends at full speed instead of running its
    slowed tail. The slow-down changes no number the run computes, only its timing."""

    def __init__(self, path: Path, seconds: float, rank: int = 0) -> None:
        self.path, self.rank = path, rank
        path.write_text(f"slow rank={rank} seconds={seconds}\n")

    @property
    def args(self) -> list[str]:
        """The config override that makes a job read the trigger file."""
        return [f"faults.trigger_file={self.path}"]

    def end(self) -> None:
        self.set(0.0)

    def ask(self, request: str) -> None:
        """Add a one-off request line (``nan rank=R``, ``pause rank=R at=NAME``: the faults
        module's docstring); the slow-down stays."""
        with open(self.path, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            f.write(f"{request}\n")

    def set(self, seconds: float, rank: int | None = None) -> None:
        """Change the slow-down (0: none) from the next step on, of ``rank`` (None: the same
        rank as before)."""
        self.rank = self.rank if rank is None else rank
        with open(self.path, "r+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)  # the ranks rewrite it under the same lock
            f.truncate()
            if seconds:
                f.write(f"slow rank={self.rank} seconds={seconds}\n")


class Job:
    """A launched command with its combined output in a log file."""

    def __init__(self, argv: list[str], log_path: Path, env: dict[str, str] | None = None,
                 cwd: Path | None = None) -> None:
        self.argv = argv
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in kill_all/wait
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
                    **(env or {})}
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=full_env, cwd=cwd or REPO, start_new_session=True)
        self._known: dict[int, psutil.Process] = {}

    @property
    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            stacks = self.stacks()
            self.kill_all()
            raise AssertionError(
                f"{' '.join(self.argv)} did not finish in {timeout:.0f} s; output tail:\n"
                + self.output[-3000:] + "\nwhere its processes were:\n" + stacks) from None
        finally:
            if not self._log.closed:  # kill_all closed it on a timeout
                self._log.flush()

    def stacks(self) -> str:
        """The Python stacks of each live descendant, then of the job (``py-spy dump``, the test
        extra), for a job that did not finish: which process held it up, and where. Only the
        main thread and the threads not idle are kept: CI keeps a report's tail only."""
        out = []
        for pid in [*(p.pid for p in self.descendants()), self.proc.pid]:
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied, OSError,
                                     subprocess.TimeoutExpired):
                p = psutil.Process(pid)  # gone since: nothing to show
                dump = subprocess.run(["py-spy", "dump", "--pid", str(pid)],
                                      capture_output=True, text=True, timeout=30)
                out.append(f"--- pid {pid} ({p.status()}): {' '.join(p.cmdline())[:160]}\n"
                           + _busy_threads(dump.stdout or dump.stderr)[-2500:])
        return "\n".join(out)

    def descendants(self) -> list[psutil.Process]:
        try:
            found = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            found = []
        for p in found:  # remember them: orphans of a dead agent are no longer its children
            self._known[p.pid] = p
        return list(self._known.values())

    def workers(self, argument: str = "train") -> dict[int, psutil.Process]:
        """Live training workers by global rank (from each worker's RANK variable): the
        processes with ``argument`` on their command line (the worker's ``train``, or a
        script's path)."""
        out = {}
        for p in self.descendants():
            try:
                if p.is_running() and argument in command_words(p):
                    out[start_rank(p)] = p
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        return out

    def kill_all(self) -> None:
        for p in self.descendants():
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, 9)
        self.proc.wait(timeout=30)
        self._log.close()


def command_words(p: psutil.Process) -> list[str]:
    """``p``'s command line, word by word, also when it is the process title that a worker
    forked by the agent's fork server shows (one string, padded with NULs)."""
    return " ".join(p.cmdline()).split()


def start_rank(p: psutil.Process) -> int:
    """A worker's RANK when it started (-1: a spare): from its environment, or from the title
    of one forked by the agent's fork server (``... (rank R)``, ``... (spare)``), whose
    ``/proc/PID/environ`` is the fork server's."""
    words = command_words(p)
    if words[-2:-1] == ["(rank"]:
        return int(words[-1].rstrip(")"))
    if words[-1:] == ["(spare)"]:
        return -1
    return int(p.environ().get("RANK", "-1"))


def kill_and_reap(proc: subprocess.Popen | None) -> None:
    """SIGKILL ``proc`` by pid (a test server's data is gone with it) and reap it within 30 s;
    a no-op for None or a process that already ended."""
    if proc is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


@pytest.fixture
def launch(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Callable[..., Job]]:
    """``launch(argv, name=..., env=..., cwd=...)`` starts a Job; all are killed at teardown.
    When the test fails, its report ends with each job's last log lines (:func:`log_tails`):
    a failure in CI can be read without the machine."""
    jobs: list[Job] = []
    request.node.launched_jobs = jobs

    def start(argv: list[str], name: str = "job", env: dict[str, str] | None = None,
              cwd: Path | None = None) -> Job:
        job = Job(argv, tmp_path / f"{name}.log", env=env, cwd=cwd)
        jobs.append(job)
        return job

    yield start
    for job in jobs:
        job.kill_all()


def log_tails(jobs: list[Job], lines: int = 30) -> str:
    """The last ``lines`` lines of each job's log, without the per-checkpoint lines."""
    out = []
    for job in jobs:
        kept = [line for line in job.output.splitlines() if "committed checkpoint" not in line]
        out.append(f"--- {job.log_path.name} (exit {job.proc.poll()}) ---")
        out.extend(kept[-lines:])
    return "\n".join(out)


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "elastic_runner", *args]


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run a short CLI command to completion (bounded by ``timeout``)."""
    return subprocess.run(cli(*args), capture_output=True, text=True, timeout=timeout,
                          cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})


def cli_here(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """``elastic-runner *args`` run in this process (the CLI's ``main``): its exit code and
    what it printed. For commands after the test imported what they import: a subprocess
    (:func:`run_cli`) would pay torch's (and transformers') import again, 2-5 s on 2 cores. On
    one torch thread, as run_cli's subprocesses (OMP_NUM_THREADS=1)."""
    import torch

    from elastic_runner.cli import main

    capsys.readouterr()  # what was printed before is not this command's
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        code = main(list(args))
    finally:
        torch.set_num_threads(threads)
    return code, capsys.readouterr().out


@pytest.fixture(scope="session")
def startup_seconds() -> float:
    """Wall seconds of one ``python -c "import torch"`` on this machine, measured once per
    session: about 1.5 s on an idle 2-core machine, 5-10x that under load. Time budgets that
    cover process start-up, or that a stalled healthy process must not exceed, scale with it
    instead of assuming an idle machine."""
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-c", "import torch"], check=True, timeout=300,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    return time.monotonic() - t0


def _busy_threads(dump: str) -> str:
    """``dump`` (py-spy's text) with the idle threads other than the main one cut to their
    header and innermost frame."""
    sections = re.split(r"(?m)^(?=Thread )", dump)
    return "".join(t if not t.startswith("Thread ") or "MainThread" in t.split("\n", 1)[0]
                   or "(idle)" not in t.split("\n", 1)[0] else "".join(t.splitlines(True)[:2])
                   for t in sections)
