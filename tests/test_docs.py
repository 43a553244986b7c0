"""The docs are claims: the README's commands are CI's, the docs site builds with warnings as
errors, every code example in the docs is a file under ``examples/`` that a test runs (included
into the pages, never pasted), and the examples run."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest

from .needs import require_modules
from .procs import REPO, cli

README = (REPO / "README.md").read_text()
DOCS = REPO / "docs"
EXAMPLES = REPO / "examples"
TESTS = REPO / "tests"
DOCS_EXTRA = 'pip install -e ".[docs]"'


def bash_blocks(text: str, section: str | None = None) -> list[str]:
    if section is not None:
        text = text.split(f"## {section}", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)\n```", text, flags=re.S)


def pages() -> list:
    return [p for p in DOCS.rglob("*.md") if "_build" not in p.parts]


def test_quick_start_is_two_commands_and_ci_runs_the_test_command():
    main_job, tests = bash_blocks(README, "Quick start")
    assert "\n" not in main_job and "\n" not in tests
    assert "-c constraints/cpu.txt" in main_job and "configs/digits.yaml" in main_job
    ci_lines = (REPO / ".ci" / "run").read_text().splitlines()
    assert tests in ci_lines
    getting_started = bash_blocks((DOCS / "getting-started.md").read_text())
    assert main_job in getting_started and tests in getting_started


def test_no_code_is_pasted_into_the_docs_every_include_exists():
    """Python, YAML and TOML live in files that tests run; the pages include them."""
    pasted = []
    for page in [*pages(), REPO / "README.md"]:
        text = page.read_text()
        pasted += [f"{page.relative_to(REPO)}: {lang}"
                   for lang in re.findall(r"^```(python|py|yaml|yml|toml)\s*$", text, flags=re.M)]
        for target in re.findall(r"```\{literalinclude\}\s+(\S+)", text) + [
                t for pair in re.findall(r"```\{er-diff\}\s+(\S+)\s+(\S+)", text) for t in pair]:
            assert (page.parent / target).resolve().is_file(), f"{page}: {target}"
    assert pasted == []


def test_every_example_is_run_by_a_test():
    """Each file under examples/ (or its directory) is named by a test."""
    sources = "\n".join(p.read_text() for p in TESTS.glob("test_*.py"))
    for example in EXAMPLES.rglob("*"):
        if example.is_file() and "__pycache__" not in example.parts:
            name = example.relative_to(EXAMPLES).parts[0]
            assert f'"{name}"' in sources, f"examples/{name}: no test runs it"


@pytest.mark.slow
def test_the_site_builds_with_warnings_as_errors(tmp_path):
    require_modules("sphinx", "myst_parser", "furo", "sphinxarg", "sphinxcontrib.mermaid",
                    "sphinx_copybutton", install_hint=DOCS_EXTRA)
    done = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b",
                           "html", str(DOCS), str(tmp_path / "html")],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-6000:]
    config = (tmp_path / "html" / "reference" / "config.html").read_text()
    assert "recovery.node_timeout_seconds" in config  # the generated reference is there
    cli_page = (tmp_path / "html" / "reference" / "cli.html").read_text()
    # options are copied from it: two hyphens, never an en dash (smartquotes off)
    assert "--trace-samples" in cli_page and "\u2013trace-samples" not in cli_page
    assert "copybutton" in (tmp_path / "html" / "index.html").read_text()


def copy_example(name: str, to) -> None:
    shutil.copytree(EXAMPLES / name, to, dirs_exist_ok=True)


@pytest.mark.slow
def test_the_iris_task_example_trains(launch, tmp_path):
    copy_example("iris", tmp_path)
    job = launch(cli("run", "iris.yaml"), name="iris", cwd=tmp_path,
                 env={"PYTHONPATH": str(tmp_path)})
    assert job.wait(timeout=300) == 0, job.output[-3000:]
    res = json.loads((tmp_path / "runs/iris/checkpoints/results.json").read_text())
    assert res["test_accuracy"] >= 0.8, res


@pytest.mark.slow
def test_the_fault_drill_recovers_in_place_then_restarts(launch, tmp_path):
    drill = launch(["bash", str(EXAMPLES / "fault_drill.sh"), str(tmp_path / "drill")],
                   name="drill")
    assert drill.wait(timeout=400) == 0, drill.output[-4000:]
    in_place, restart = drill.output.split("--- restart")
    assert re.search(r"rank\(s\) \[\d\] exited with code\(s\) \[-9\]: replaced in place by "
                     r"warm spare", in_place), drill.output
    assert "in-place recovery 1 done" in in_place and "resumed from" not in in_place
    assert "resumed from" in restart and "in-place recovery" not in restart
    steps = [json.loads((tmp_path / "drill" / run / "results.json").read_text())["step"]
             for run in ("in-place", "restart")]
    assert steps[0] == steps[1] > 0
