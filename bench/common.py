"""Helpers shared by the benchmarks: a free loopback port, and a training rate read from the
millisecond timestamps of a run's log."""

from __future__ import annotations

import re
import socket
from datetime import datetime

# rank 0's step log line of the runner: "HH:MM:SS.mmm [rank0] INFO elastic_runner.loop: epoch E
# step N/T ..."
RUNNER_STEP = re.compile(r"^(\d\d:\d\d:\d\d\.\d\d\d) \[rank0\] INFO elastic_runner\.loop: "
                         r"epoch \d+ step (\d+)/")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def steps_per_second(log: str, pattern: re.Pattern[str] = RUNNER_STEP) -> float:
    """Optimizer steps per second between the first and the last logged step (so process start,
    rendezvous and imports are excluded); ``pattern`` captures (HH:MM:SS.mmm, step)."""
    day = datetime.now().strftime("%Y-%m-%d")
    points = [(datetime.strptime(f"{day} {m[1]}", "%Y-%m-%d %H:%M:%S.%f").timestamp(), int(m[2]))
              for ln in log.splitlines() if (m := pattern.match(ln))]
    if len(points) < 2:
        raise RuntimeError(f"fewer than two step lines in the log:\n{log[-2000:]}")
    (t0, s0), (t1, s1) = points[0], points[-1]
    return (s1 - s0) / (t1 - t0)
