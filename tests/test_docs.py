"""The docs are claims: the README's commands are CI's, the docs site builds with warnings as
errors, every code example in the docs is a file under ``examples/`` that a test runs (included
into the pages, never pasted), and the examples run."""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from .procs import REPO, cli

README = (REPO / "README.md").read_text()
DOCS = REPO / "docs"
EXAMPLES = REPO / "examples"
TESTS = REPO / "tests"


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
    assert f"{tests} || exit" in ci_lines  # the && list's failure fails CI (tests/test_ci.py)
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


def docs_commands() -> tuple[list[str], list[str]]:
    """The README's two commands that build the site: the pip install, the sphinx build."""
    (block,) = bash_blocks(README, "Documentation")
    install, build = (shlex.split(part) for part in block.split(" && "))
    assert install[:3] == ["python3", "-m", "pip"] and install[-1] == ".[docs]", install
    assert build[:3] == ["python3", "-m", "sphinx"] and "-W" in build, build
    return install, build


def remote_loads(html: str) -> list[str]:
    """The http(s) URLs a page loads a script or a style sheet from: a ``src`` or ``href`` of
    a ``<script>`` or ``<link>`` tag, or a URL inside a script's body (an ES module's
    ``import ... from "https://..."``)."""
    tags = re.findall(r'<(?:script|link)\b[^>]*?(?:src|href)="(https?://[^"]+)"', html)
    bodies = re.findall(r"<script\b[^>]*>(.*?)</script>", html, flags=re.S)
    return tags + [url for body in bodies for url in re.findall(r"https?://[^\s\"'`)]+", body)]


@pytest.mark.slow
def test_the_site_builds_from_the_docs_extra_alone(tmp_path):
    """The README's two commands, in a fresh virtual environment that holds only what the
    ``docs`` extra brings (not CI's union of extras), build the site with warnings as errors.

    About 35 s: the venv's install is mostly torch's wheel unpacked (pip's cache is warm after
    CI's own install)."""
    install, build = docs_commands()
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python3")
    # --no-compile: byte-compiling all of torch took half of the install (45 s -> 23 s); the
    # build compiles what it imports
    done = subprocess.run([python, *install[1:], "-q", "--no-compile"], capture_output=True,
                          text=True, timeout=900, cwd=REPO)
    assert done.returncode == 0, done.stderr[-6000:]
    out = tmp_path / "html"
    done = subprocess.run([python, *build[1:-1], "--keep-going", "-q", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-6000:]
    config = (out / "reference" / "config.html").read_text()
    assert "recovery.node_timeout_seconds" in config  # the generated reference is there
    cli_page = (out / "reference" / "cli.html").read_text()
    # options are copied from it: two hyphens, never an en dash (smartquotes off)
    assert "--trace-samples" in cli_page and "\u2013trace-samples" not in cli_page
    front = (out / "index.html").read_text()
    assert "copybutton" in front
    # the front page's own-loop excerpt and the README's fault table are included
    assert "er.fault_tolerant" in front and "warm spare takes its rank" in front
    # no page loads a script or a style from another host: the site works offline
    remote = [f"{page.relative_to(out)}: {url}" for page in out.rglob("*.html")
              for url in remote_loads(page.read_text())]
    assert remote == []


def test_every_diagram_is_rendered_from_its_source():
    """Each Mermaid source's SVG beside it was rendered from its current text (the stamp
    ``docs/_tools/render_diagrams.py`` writes names the source's sha256), and a page shows it."""
    spec = importlib.util.spec_from_file_location("render_diagrams",
                                                  DOCS / "_tools" / "render_diagrams.py")
    render = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(render)
    sources = render.sources()
    assert sources, "no diagram source under docs/"
    shown = "\n".join(p.read_text() for p in pages())
    for source in sources:
        svg = source.with_suffix(".svg")
        assert svg.is_file(), f"{svg.relative_to(REPO)}: run python3 docs/_tools/render_diagrams.py"
        first = svg.read_text().splitlines(keepends=True)[0]
        assert first == render.stamp(source), (
            f"{source.relative_to(REPO)} changed since its SVG was rendered: "
            "run python3 docs/_tools/render_diagrams.py")
        assert f"]({svg.name})" in shown, f"no page shows {svg.name}"


def run_time(seconds: float) -> str:
    """``seconds`` as the tasks table writes a run's time: ``3 min 17 s``, ``13 s``."""
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest} s" if minutes else f"{rest} s"


def task_figures(task: str, done: dict, base: dict) -> list[str]:
    """What the tasks table says of ``task``'s final figures and baselines."""
    if task == "digits":
        return [f"test accuracy {done['test_accuracy']:.3f}"]
    if task == "char_lm":
        return [f"val {done['val_loss']:.3f} nats per character",
                f"character unigram {base['unigram_entropy_nats']:.3f} nats"]
    if task == "causal_lm":
        return [f"val {done['val_nats_per_byte']:.3f} nats per byte",
                f"(test {done['test_nats_per_byte']:.3f})",
                f"byte unigram {base['byte_unigram_nats_per_byte']:.3f}",
                f"token unigram {base['token_unigram_nats_per_byte']:.3f} nats"]
    return [f"test accuracy {done['test_accuracy']:.3f}",
            f"majority class (`adj.all`) {base['majority_test_accuracy']:.3f}",
            f"logistic regression (scikit-learn) {base['tfidf_logreg_test_accuracy']:.3f}"]


def test_the_built_in_tasks_table_quotes_its_benchmark():
    """The transformers guide's "Built-in tasks" table quotes ``docs/bench/task_quality.json``
    (``python -m bench.task_quality``): each task's run time, steps, final figures and
    baselines, and the runs' date."""
    runs = json.loads((DOCS / "bench" / "task_quality.json").read_text())["tasks"]
    text = (DOCS / "guides" / "transformers.md").read_text()
    rows = {m[1]: m[0] for m in re.finditer(r"^\| `(\w+)`.*$", text, re.MULTILINE)}
    assert set(rows) == set(runs), (set(rows), set(runs))
    assert {run["date"] for run in runs.values()} == {
        re.search(r"Figures of (\S+) on", text)[1]}
    for task, run in runs.items():
        done = run["finished"]
        quoted = [run_time(run["seconds"]), f"{done['step']:,} steps"]
        quoted += task_figures(task, done, run["baselines"])
        for figure in quoted:
            assert figure in rows[task], f"{task}: the table does not say {figure!r}"
    per_byte = runs["causal_lm"]["finished"]["val_nats_per_byte"]
    below = round(100 * (1 - per_byte / runs["char_lm"]["finished"]["val_loss"]))
    assert f"ends {below}% below char_lm's final loss per byte" in text


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
