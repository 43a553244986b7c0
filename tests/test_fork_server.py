"""The agent's fork server: a child it forks runs as the fresh interpreter ``Popen`` starts would
(argv, environment, directory, session, standard streams, exit status, ``atexit``, its own
random numbers), and a request it cannot serve that way starts with ``Popen``.

The multi-process tests run every job through it (``elastic-runner run`` forks by default);
these check what those would not notice: a child's set-up, one by one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from elastic_runner.agent.fork_server import (
    UNKNOWN_EXIT,
    ForkedProcess,
    ForkServer,
    forkable,
)

CHILD = """\
import atexit, json, os, random, sys
atexit.register(lambda: print("atexit ran", flush=True))
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "rank": os.environ.get("RANK"),
                  "only_here": os.environ.get("ONLY_HERE"), "own_session": os.getsid(0) == os.getpid(),
                  "path0": sys.path[0], "name": __name__, "random": random.random(),
                  "title": open("/proc/self/cmdline").read().split("\\0")[0]}))
code = sys.argv[1]
if code == "raise":
    raise ValueError("raised in the child")
if code in ("kill", "term"):
    os.kill(os.getpid(), 9 if code == "kill" else 15)
sys.exit(int(code))
"""


@pytest.fixture
def server():
    s = ForkServer(preload=["json"])
    yield s
    s.close()


def _start(server: ForkServer, tmp_path: Path, argv: list[str], env: dict[str, str], name: str):
    out = open(tmp_path / f"{name}.out", "w")  # noqa: SIM115 - closed below
    err = open(tmp_path / f"{name}.err", "w")  # noqa: SIM115
    try:
        return server.popen(argv, env, out, err)
    finally:
        out.close()  # the child has its own copies
        err.close()


def test_a_forked_child_runs_as_a_fresh_interpreter_would(server, tmp_path, monkeypatch):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    (tmp_path / "child_mod.py").write_text(CHILD)
    monkeypatch.chdir(tmp_path)
    env = {**os.environ, "RANK": "0"}
    procs = {
        "ok": _start(server, tmp_path, [sys.executable, "-u", str(script), "0"], env, "ok"),
        "three": _start(server, tmp_path, [sys.executable, "-u", str(script), "3"],
                        {**env, "RANK": "1"}, "three"),
        "raise": _start(server, tmp_path, [sys.executable, "-u", str(script), "raise"],
                        {**env, "RANK": "-1"}, "raise"),
        "kill": _start(server, tmp_path, [sys.executable, "-u", str(script), "kill"], env,
                       "kill"),
        "module": _start(server, tmp_path, [sys.executable, "-u", "-m", "child_mod", "0"], env,
                         "module"),
        # another value of a variable read at start-up: not forked
        "popen": _start(server, tmp_path, [sys.executable, "-u", str(script), "0"],
                        {**env, "ONLY_HERE": "1"}, "popen"),
    }
    # a signal to every process of the job (Slurm's scancel) leaves the fork server serving,
    # and its children with the signal's default action
    os.kill(server._proc.pid, signal.SIGTERM)
    procs["term"] = _start(server, tmp_path, [sys.executable, "-u", str(script), "term"], env,
                           "term")
    codes = {name: p.wait(60) for name, p in procs.items()}
    assert codes == {"ok": 0, "three": 3, "raise": 1, "kill": -signal.SIGKILL, "module": 0,
                     "popen": 0, "term": -signal.SIGTERM}
    assert isinstance(procs["popen"], subprocess.Popen)
    assert all(isinstance(p, ForkedProcess) for n, p in procs.items() if n != "popen")
    seen = {name: json.loads((tmp_path / f"{name}.out").read_text().splitlines()[0])
            for name in procs}
    for name in ("ok", "three", "raise", "kill", "term"):
        assert seen[name]["argv"] == [str(script), seen[name]["argv"][1]]
        assert seen[name]["path0"] == str(tmp_path)
    assert seen["module"]["argv"] == [str(tmp_path / "child_mod.py"), "0"]
    assert seen["module"]["path0"] == str(tmp_path)
    assert {s["name"] for s in seen.values()} == {"__main__"}
    assert all(s["cwd"] == str(tmp_path) and s["own_session"] for s in seen.values())
    assert [seen[n]["rank"] for n in ("ok", "three", "raise")] == ["0", "1", "-1"]
    assert seen["popen"]["only_here"] == "1"
    assert seen["three"]["title"].endswith(f"{script} 3 (rank 1)")
    assert seen["raise"]["title"].endswith("(spare)")
    assert len({s["random"] for s in seen.values()}) == len(seen)  # each seeded anew
    # the interpreter's own end: atexit handlers, and an uncaught exception's traceback
    assert "atexit ran" in (tmp_path / "three.out").read_text()
    assert "atexit ran" not in (tmp_path / "kill.out").read_text()
    assert "ValueError: raised in the child" in (tmp_path / "raise.err").read_text()


def test_a_child_that_outlives_the_fork_server_is_still_seen_to_end(server, tmp_path):
    script = tmp_path / "wait.py"
    script.write_text("import sys\nsys.stdin = open(sys.argv[1])\nsys.stdin.read()\n")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    child = server.popen([sys.executable, str(script), str(fifo)], dict(os.environ))
    assert isinstance(child, ForkedProcess)
    server._proc.kill()  # the fork server alone
    server._proc.wait(30)
    assert child.poll() is None
    with open(fifo, "w") as f:  # the child reads this, then ends
        f.write("done")
    assert child.wait(60) == UNKNOWN_EXIT
    # a fork server gone: the next request starts with Popen
    later = server.popen([sys.executable, "-c", "pass"], dict(os.environ))
    assert isinstance(later, subprocess.Popen) and later.wait(60) == 0


def test_what_is_forked_and_what_is_started_with_popen():
    env = {"PATH": "/bin", "OMP_NUM_THREADS": "1", "RANK": "0", "TORCHELASTIC_RESTART_COUNT": "0"}
    worker = {**env, "RANK": "3", "TORCHELASTIC_RESTART_COUNT": "2", "MASTER_PORT": "29500",
              "ELASTIC_RUNNER_SPARE": "0.1"}
    assert forkable([sys.executable, "-u", "-m", "elastic_runner", "train", "c.yaml"], worker, env)
    assert forkable([sys.executable, "script.py", "--lr", "1"], worker, env)
    # a variable read at start-up differs, or is new
    assert not forkable([sys.executable, "script.py"], {**worker, "OMP_NUM_THREADS": "2"}, env)
    assert not forkable([sys.executable, "script.py"], {**worker, "PYTHONHASHSEED": "0"}, env)
    # another program, or other interpreter options
    assert not forkable(["/bin/echo", "x"], worker, env)
    assert not forkable([sys.executable, "-X", "dev", "script.py"], worker, env)
    assert not forkable([sys.executable, "-c", "pass"], worker, env)
