"""The README is executable: its commands match CI and its task example trains."""

from __future__ import annotations

import json
import re

import pytest

from .procs import REPO, cli

README = (REPO / "README.md").read_text()


def bash_blocks(section: str) -> list[str]:
    body = README.split(f"## {section}", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)\n```", body, flags=re.S)


def examples() -> dict[str, str]:
    return dict(re.findall(r"<!-- example: (\S+) -->\n```\w+\n(.*?)```", README, flags=re.S))


def test_quick_start_is_two_commands_and_ci_runs_the_test_command():
    main_job, tests = bash_blocks("Quick start")
    assert "\n" not in main_job and "\n" not in tests
    assert "-c constraints/cpu.txt" in main_job and "configs/digits.yaml" in main_job
    ci_lines = (REPO / ".ci" / "run").read_text().splitlines()
    assert tests in ci_lines


@pytest.mark.slow
def test_readme_user_task_example_trains(launch, tmp_path):
    for rel, text in examples().items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert (tmp_path / "mypkg" / "mytask.py").is_file() and (tmp_path / "iris.yaml").is_file()
    job = launch(cli("run", "iris.yaml"), name="iris", cwd=tmp_path)
    assert job.wait(timeout=300) == 0, job.output[-3000:]
    res = json.loads((tmp_path / "runs/iris/checkpoints/results.json").read_text())
    assert res["test_accuracy"] >= 0.8, res
