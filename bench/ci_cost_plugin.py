"""A pytest plugin of :mod:`bench.ci_cost`: one JSON line per test (its node id, wall seconds, and the CPU seconds of the pytest process and of the descendants it reaped meanwhile,
from ``getrusage``) in ``$ER_CI_COST_RECORDS/<pid>.jsonl``. Standard library only: it is loaded
into every pytest session of the run, the second environment's too."""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path

import pytest

_out = None


def _cpu() -> float:
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(
        resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def _write(row: dict) -> None:
    global _out
    if _out is None:
        records = os.environ.get("ER_CI_COST_RECORDS")
        if not records:
            return
        _out = open(Path(records) / f"{os.getpid()}.jsonl", "a")  # noqa: SIM115
    _out.write(json.dumps(row) + "\n")
    _out.flush()


def pytest_sessionstart(session) -> None:
    _write({"kind": "session", "python": sys.executable,
            "args": list(session.config.invocation_params.args), "start": time.time()})


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    wall, cpu = time.monotonic(), _cpu()
    try:
        return (yield)
    finally:
        _write({"kind": "test", "id": item.nodeid, "wall_s": round(time.monotonic() - wall, 2),
                "cpu_s": round(_cpu() - cpu, 2)})
