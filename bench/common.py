"""Helpers shared by the benchmarks: the runs they time (a built-in task's config, by default
the digits task), running them, a free loopback port, a training rate read from the millisecond
timestamps of a run's log, the median and spread of repeated figures, and a throw-away etcd
server (``tests/etcd.py``)."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# rank 0's step log line of the runner: "HH:MM:SS.mmm [rank0] INFO elastic_runner.train.loop: epoch E
# step N/T ..."
RUNNER_STEP = re.compile(r"^(\d\d:\d\d:\d\d\.\d\d\d) \[rank0\] INFO elastic_runner\.train\.loop: "
                         r"epoch \d+ step (\d+)/")
RANK0_STEP = re.compile(r"\[rank0\] INFO elastic_runner\.train\.loop: epoch \d+ step (\d+)/")
"""rank 0's step line anywhere in a log (group 1: the step)."""
IN_PLACE_DONE = re.compile(r"in-place recovery (\d+) done: step (\d+) committed")
"""A rank's line that an in-place recovery is done (groups: its number, the step committed)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_time(stamp: str, near: float) -> float:
    """The unix time (seconds) of a log line's ``HH:MM:SS.mmm`` stamp (``elastic_runner/logs.py``'s
    format), on the local day of the unix time ``near``."""
    return datetime.strptime(f"{datetime.fromtimestamp(near):%Y-%m-%d} {stamp}",
                             "%Y-%m-%d %H:%M:%S.%f").timestamp()


def step_stamps(log: str, pattern: re.Pattern[str] = RUNNER_STEP) -> list[tuple[float, int]]:
    """(seconds since the epoch, step) of every logged step line; ``pattern`` captures
    (HH:MM:SS.mmm, step), taken as today's."""
    now = time.time()
    return [(log_time(m[1], now), int(m[2])) for ln in log.splitlines()
            if (m := pattern.match(ln))]


def steps_per_second(log: str, pattern: re.Pattern[str] = RUNNER_STEP) -> float:
    """Optimizer steps per second between the first and the last logged step (so process start,
    rendezvous and imports are excluded); ``pattern`` captures (HH:MM:SS.mmm, step)."""
    points = step_stamps(log, pattern)
    if len(points) < 2:
        raise RuntimeError(f"fewer than two step lines in the log:\n{log[-2000:]}")
    (t0, s0), (t1, s1) = points[0], points[-1]
    return (s1 - s0) / (t1 - t0)


# the built-in tasks the benchmarks can time: name -> config file (relative to REPO)
TASK_CONFIGS: dict[str, str] = {"digits": "configs/digits.yaml",
                                "char_lm": "configs/char_lm.yaml"}


def run_argv(config: str, steps: int, checkpoint_dir: Path, *overrides: str) -> list[str]:
    """``elastic-runner run`` of ``config`` (a path relative to REPO; 2 CPU workers) for
    ``steps`` optimizer steps, logged every 10 steps, evaluated only after the last one, no
    early stopping, no tensorboard and no warm spare (its one-time task build would land in
    the timed window on 2 cores; these benchmarks time the steps), plus ``overrides``."""
    return [sys.executable, "-m", "elastic_runner", "run", config,
            "logging.tensorboard_dir=null", "early_stopping.enabled=false",
            f"checkpoint.dir={checkpoint_dir}", f"training.max_steps={steps}",
            "training.max_epochs=100000", f"eval.every_steps={steps + 1}",
            "training.log_every_steps=10", "recovery.spare=false", *overrides]


def digits_run_argv(steps: int, checkpoint_dir: Path, *overrides: str) -> list[str]:
    """:func:`run_argv` of the digits task."""
    return run_argv(TASK_CONFIGS["digits"], steps, checkpoint_dir, *overrides)


def run_logged(argv: list[str], what: str, timeout: float = 600) -> str:
    """Run ``argv`` from the repository root (one OpenMP thread per process); its combined
    output. Raises RuntimeError naming ``what`` and the output's tail when it fails."""
    out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=REPO,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    if out.returncode != 0:
        raise RuntimeError(f"{what}: run failed:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    return out.stdout + out.stderr


def spread(values: list[float]) -> dict[str, float]:
    """Median, min and max of repeated figures."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def slowest_over_ranks(seconds: float) -> float:
    """The largest ``seconds`` over the ranks of the process group (what the whole step waits
    for); collective."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


@contextlib.contextmanager
def etcd_server() -> Iterator[str]:
    """An ``etcd --enable-v2`` on free loopback ports in a temporary directory; its endpoint."""
    from tests.etcd import EtcdServer

    with tempfile.TemporaryDirectory(prefix="bench-etcd-") as tmp:
        server = EtcdServer(Path(tmp))
        try:
            server.start()
            yield server.endpoint
        finally:
            server.stop()
