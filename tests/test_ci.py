"""``.ci/run`` fails whenever one of its steps fails: the install, ``ruff``, the suite, the
Debian packages or the newest torch's tier. Bash's ``set -e`` does not act on a command of an
``&&`` list that fails before the last one, so without the ``|| exit`` after the README's test
command a failed install or a ruff error skipped the suite and CI went on to pass.

Each case runs the real ``.ci/run`` (copied, byte for byte) and real ``ruff`` on a small tree
with the project's ruff settings; only what would take CI's whole hour is stood in for: pip and
pytest (a ``python3`` first on ``PATH`` that records its arguments and exits with the status the
case plants) and the Debian packages' and the newest torch's scripts (each records that it ran
and exits with the planted status)."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from .procs import REPO

# a stand-in records "<name> <args>" in $CALLS and exits with $RC_<NAME> (default 0)
STAND_IN = """#!/usr/bin/env bash
echo "NAME $*" >> "$CALLS"
BODY
"""
PYTHON3 = """case "$1 $2" in
  "-m pip") exit "${RC_PIP:-0}" ;;
  "-m pytest") exit "${RC_PYTEST:-0}" ;;
esac
exec PYTHON "$@"
"""


def _stand_in(path: Path, name: str, body: str) -> None:
    path.write_text(STAND_IN.replace("NAME", name).replace("BODY", body))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


@pytest.fixture
def ci_tree(tmp_path):
    """A tree with the real ``.ci/run``, the project's ``pyproject.toml`` (ruff's settings) and
    one clean Python file; ``bin/`` holds the ``python3`` stand-in."""
    tree = tmp_path / "tree"
    (tree / ".ci").mkdir(parents=True)
    shutil.copy2(REPO / ".ci" / "run", tree / ".ci" / "run")
    shutil.copy2(REPO / "pyproject.toml", tree / "pyproject.toml")
    (tree / "ok.py").write_text('"""Clean."""\n\nVALUE = 1\n')
    _stand_in(tree / ".ci" / "debian_packages", "debian_packages", 'exit "${RC_DEBIAN:-0}"')
    _stand_in(tree / ".ci" / "newest_torch", "newest_torch",
              'case "$1" in runs) exit "${RC_NEWEST_RUNS:-0}" ;; *) exit "${RC_NEWEST:-0}" ;; esac')
    (tmp_path / "bin").mkdir()
    _stand_in(tmp_path / "bin" / "python3", "python3", PYTHON3.replace("PYTHON", sys.executable))
    return tree


def run_ci(tree: Path, **rcs: int) -> tuple[int, list[str]]:
    """``bash .ci/run`` in ``tree`` with the planted exit statuses (``pip=1``: RC_PIP=1);
    its exit status and the stand-ins' calls in order, each as its name and first two
    arguments."""
    calls = tree.parent / "calls"
    calls.write_text("")
    ruff = shutil.which("ruff")
    assert ruff, "ruff is not installed (the test extra)"
    path = os.pathsep.join([str(tree.parent / "bin"), str(Path(ruff).parent),
                            os.environ.get("PATH", "")])
    env = {**os.environ, "PATH": path, "CALLS": str(calls),
           **{f"RC_{k.upper()}": str(v) for k, v in rcs.items()}}
    out = subprocess.run(["bash", str(tree / ".ci" / "run")], env=env, capture_output=True,
                         text=True, timeout=120)
    return out.returncode, [" ".join(c.split()[:3]) for c in calls.read_text().splitlines()]


def test_ci_runs_every_step_and_passes_when_each_passes(ci_tree):
    rc, calls = run_ci(ci_tree)
    assert rc == 0, calls
    main = [c for c in calls if c not in ("newest_torch install", "newest_torch fast")]
    assert main == ["debian_packages", "python3 -m pip", "python3 -m pytest",
                    "newest_torch runs"], calls
    # the second environment's install and fast tier ran beside the suite, in that order
    assert [c for c in calls if c not in main] == ["newest_torch install", "newest_torch fast"]


def test_a_ruff_error_fails_ci_and_the_suite_does_not_run(ci_tree):
    (ci_tree / "bad.py").write_text("import os\n")  # F401: an unused import
    rc, calls = run_ci(ci_tree)
    assert rc != 0, calls
    assert "python3 -m pytest" not in calls and "newest_torch runs" not in calls, calls


@pytest.mark.parametrize("planted", ["pip", "pytest", "debian", "newest", "newest_runs"])
def test_a_failed_step_fails_ci(ci_tree, planted):
    rc, calls = run_ci(ci_tree, **{planted: 3})
    assert rc == (3 if planted in ("pip", "pytest", "debian", "newest_runs") else 1), calls
    if planted in ("pip", "debian"):  # nothing after it ran
        assert "python3 -m pytest" not in calls, calls
