"""Uninterrupted reference runs, trained once per test session and shared between the tests
that compare a faulted run with one.

A fault test ends with "bitwise equal to the run without the fault". That run is the same for
every test whose job trains the same thing, so :func:`reference` trains it once per session and
hands every such test its checkpoint directory. The cache key is everything that decides the
weights: the ``elastic-runner run`` arguments with the ones that cannot change them taken out
(where checkpoints, traces, logs and metrics go, the checkpoint cadence and retention, recovery
and fault-pacing settings, the agent's monitor interval and restart budget; each named in
:data:`NEUTRAL`). Checkpoints at another cadence, a recovery path or a paced rank leave every
update as it is: that is the claim the fault tests check, bitwise, against this run.

A reference is trained alone, never beside the job it checks: on two cores the two would slow
each other and change the timing the test depends on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from .procs import Job, cli

NEUTRAL_KEYS = ("checkpoint.dir", "checkpoint.every_steps", "checkpoint.keep_last",
                "checkpoint.keep_best", "checkpoint.async_save", "logging.", "metrics.",
                "recovery.", "faults.trigger_file", "distributed.timeout_seconds",
                "training.log_every_steps", "watchdog.")
"""Config overrides (``key=value``; a prefix ending in a dot names a section) that cannot
change the weights."""
NEUTRAL_FLAGS = {"--trace-samples": 1, "--monitor-interval": 1, "--max-restarts": 1,
                 "--metrics-port": 1}
"""``run`` flags that cannot change the weights, with how many values each takes."""
NEUTRAL = (NEUTRAL_KEYS, NEUTRAL_FLAGS)


def weights_key(args: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """``args`` without the neutral ones (:data:`NEUTRAL`): the cache key. Config overrides
    (``key=value``) count by key, the last one winning as in the config loader, in any order;
    the other arguments (the config file, flags) in order."""
    kept: list[str] = []
    overrides: dict[str, str] = {}
    skip = 0
    for a in args:
        if skip:
            skip -= 1
        elif a in NEUTRAL_FLAGS:
            skip = NEUTRAL_FLAGS[a]
        elif "=" in a and not a.startswith("-"):
            key = a.split("=", 1)[0]
            if not any(key == k or (k.endswith(".") and key.startswith(k))
                       for k in NEUTRAL_KEYS):
                overrides[key] = a
        else:
            kept.append(a)
    return (*kept, *sorted(overrides.values()))


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Path]]:
    """``reference(*run_args, timeout=400)``: the checkpoint directory of an uninterrupted
    ``elastic-runner run *run_args`` (``checkpoint.dir`` is the fixture's), trained on first
    use and shared by every later call with the same weights key (:func:`weights_key`). Call
    it before launching the job it checks. Fails the test when the run does not exit 0."""
    cache: dict[tuple[str, ...], Path] = {}
    jobs: list[Job] = []

    def train(*args: str, timeout: float = 400) -> Path:
        key = weights_key(args)
        if key not in cache:
            where = tmp_path_factory.mktemp("reference")
            # no warm spare and no periodic checkpoint: neither changes a weight, and each
            # costs a reference a process or writes that no test reads (the last step's
            # checkpoint, which the tests read, is written anyway)
            job = Job(cli("run", *args, f"checkpoint.dir={where / 'ck'}", "recovery.spare=false",
                          "checkpoint.every_steps=0"), where / "run.log")
            jobs.append(job)
            code = job.wait(timeout=timeout)
            assert code == 0, f"reference run {key} exited {code}:\n{job.output[-3000:]}"
            cache[key] = where / "ck"
        return cache[key]

    yield train
    for job in jobs:
        job.kill_all()
