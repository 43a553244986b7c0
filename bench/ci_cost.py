"""What CI costs: ``bash .ci/run`` on a clean clone of a commit, its wall time and CPU seconds,
and each test's wall and CPU seconds.

The clone gets ``../shared`` beside it (a link to this checkout's), as CI's does. The whole run
is put in a cgroup-v1 ``cpuacct`` group of its own, so its CPU seconds (user + sys) count every
process it starts, also the ones that leave their parent (torchrun's workers, servers started
as daemons) and the second environment's tier that runs beside the main suite. Each test's own
figures come from a pytest plugin (:mod:`bench.ci_cost_plugin`, copied beside the clone and
loaded through ``PYTHONPATH`` and ``PYTEST_ADDOPTS``, so an older commit is measured too): its wall seconds and the CPU seconds of the pytest process and of every
descendant it reaped during the test (``getrusage`` of self and children), so a session-scoped
fixture's cost lands on the test that started or stopped it.

    python -m bench.ci_cost --out /tmp/ci-cost.json [--ref HEAD] [--keep]

Needs root (the cgroup) and whatever ``.ci/run`` needs. Writes one JSON object: the commit, the
date, ``rc``, ``wall_s``, ``user_s``, ``sys_s``, ``cpu_s`` (user + sys, from ``cpuacct.stat``),
the pytest sessions' own totals, and the 50 slowest tests by wall and by CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CPUACCT = Path("/sys/fs/cgroup/cpuacct")
TICK = os.sysconf("SC_CLK_TCK")


def _cgroup_stat(group: Path) -> dict[str, float]:
    """User and system seconds of every process that was ever in ``group`` (cpuacct.stat is in
    USER_HZ ticks)."""
    fields = dict(line.split() for line in (group / "cpuacct.stat").read_text().splitlines())
    return {"user_s": int(fields["user"]) / TICK, "sys_s": int(fields["system"]) / TICK}


def _clone(ref: str, into: Path) -> str:
    subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(REPO), str(into / "main")],
                   check=True)
    subprocess.run(["git", "-C", str(into / "main"), "checkout", "-q", ref], check=True)
    (into / "shared").symlink_to(REPO.parent / "shared")
    return subprocess.run(["git", "-C", str(into / "main"), "rev-parse", "HEAD"], check=True,
                          capture_output=True, text=True).stdout.strip()


def _tests(records: Path) -> dict:
    """The plugin's per-test records of each pytest session (one file per session)."""
    sessions = []
    for path in sorted(records.glob("*.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line]
        head = next((r for r in rows if r.get("kind") == "session"), {})
        tests = [r for r in rows if r.get("kind") == "test"]
        sessions.append({"python": head.get("python"), "args": head.get("args"),
                         "tests": len(tests),
                         "wall_s": round(sum(t["wall_s"] for t in tests), 1),
                         "cpu_s": round(sum(t["cpu_s"] for t in tests), 1),
                         "slowest_by_wall": sorted(tests, key=lambda t: -t["wall_s"])[:50],
                         "slowest_by_cpu": sorted(tests, key=lambda t: -t["cpu_s"])[:50]})
    return {"sessions": sessions}


def measure(ref: str, keep: bool) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="er-ci-cost-"))
    commit = _clone(ref, tmp)
    records = tmp / "records"
    records.mkdir()
    plugin = tmp / "plugin"
    plugin.mkdir()
    shutil.copy(Path(__file__).with_name("ci_cost_plugin.py"), plugin / "er_ci_cost_plugin.py")
    group = CPUACCT / f"er-ci-cost-{os.getpid()}"
    group.mkdir()
    env = {**os.environ, "ER_CI_COST_RECORDS": str(records),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(plugin), os.environ.get("PYTHONPATH")])),
           "PYTEST_ADDOPTS": "-p er_ci_cost_plugin --durations=50"}
    log = tmp / "ci.log"
    start = time.monotonic()
    try:
        with open(log, "w") as out:
            proc = subprocess.Popen(["bash", ".ci/run"], cwd=tmp / "main", env=env,
                                    stdout=out, stderr=subprocess.STDOUT,
                                    preexec_fn=lambda: (group / "tasks").write_text(
                                        str(os.getpid())))
            rc = proc.wait()
        wall = time.monotonic() - start
        cpu = _cgroup_stat(group)
    finally:
        _empty_and_remove(group)
    result = {"commit": commit, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "command": "bash .ci/run", "rc": rc, "wall_s": round(wall, 1),
              "user_s": round(cpu["user_s"], 1), "sys_s": round(cpu["sys_s"], 1),
              "cpu_s": round(cpu["user_s"] + cpu["sys_s"], 1), "log": str(log),
              **_tests(records)}
    if not keep:
        subprocess.run(["rm", "-rf", str(tmp / "main")], check=False)
    return result


def _empty_and_remove(group: Path) -> None:
    """A process the run left behind goes back to the root group (it is not killed: it is not
    this tool's to kill), so the group can be removed."""
    for pid in (group / "tasks").read_text().split():
        with contextlib.suppress(OSError):  # it ended meanwhile
            (CPUACCT / "tasks").write_text(pid)
    group.rmdir()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--ref", default="HEAD")
    parser.add_argument("--keep", action="store_true", help="keep the clone")
    args = parser.parse_args()
    result = measure(args.ref, args.keep)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("commit", "rc", "wall_s", "user_s", "sys_s",
                                             "cpu_s", "log")}))
    sys.exit(0 if result["rc"] == 0 else 1)


if __name__ == "__main__":
    main()
