"""The built-in tasks' results, the table "Built-in tasks" of ``docs/guides/transformers.md``:
each task's shipped config trained as a user would, ``elastic-runner run configs/NAME.yaml``
(2 CPU workers, its own early stopping and budget), then

* ``seconds``: the run's wall time (this machine's; the other figures do not depend on it);
* ``finished``: the metrics of the run's ``finished:`` line (the last evaluation, the test split
  on the best checkpoint's weights, the step it stopped at);
* ``baselines``: the task's own reference points on the same split (from its build's
  artifacts; text_classification's from :func:`elastic_runner.tasks.text_classification.baselines`,
  whose tf-idf one needs scikit-learn, the ``[sklearn]`` extra).

The runs are deterministic (a seeded model, sampler and data order on gloo), so a rerun gives
the same ``finished`` figures on the same torch release; ``tests/test_docs.py`` checks that the
table quotes this file.

    python -m bench.task_quality --json docs/bench/task_quality.json
    python -m bench.task_quality --tasks digits char_lm
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from datetime import date
from pathlib import Path
from typing import Any

from bench.common import REPO, run_logged

TASKS = ("digits", "char_lm", "causal_lm", "text_classification")
_FINISHED = re.compile(r"\[rank0\] INFO elastic_runner\.train\.loop: finished: (.*?) "
                       r"stop_reason=(.*?)(?: ettr=\S+)?$", re.MULTILINE)


def finished_metrics(log: str) -> dict[str, Any]:
    """The ``key=value`` figures of rank 0's ``finished:`` line (numbers as numbers) and its
    ``stop_reason``. Raises ValueError when the log has no such line."""
    match = _FINISHED.search(log)
    if match is None:
        raise ValueError("no 'finished:' line in the run's log")
    out: dict[str, Any] = {}
    for pair in match[1].split():
        key, _, value = pair.partition("=")
        out[key] = int(value) if value.isdigit() else float(value)
    out["stop_reason"] = match[2]
    return out


def baselines(task: str, config: str) -> dict[str, Any]:
    """The task's reference points on the same split (module docstring)."""
    from elastic_runner.config import load_config
    from elastic_runner.task_registry import task_builder

    cfg = load_config(str(REPO / config))
    if task == "text_classification":
        from elastic_runner.tasks.text_classification import baselines as text_baselines

        found = text_baselines(cfg)
        return {"majority_test_accuracy": found["majority"]["test_accuracy"],
                "tfidf_logreg_test_accuracy": found["tfidf_logreg"]["test_accuracy"]}
    artifacts = task_builder(cfg.task)(cfg).artifacts
    keys = {"char_lm": ("unigram_entropy_nats",),
            "causal_lm": ("byte_unigram_nats_per_byte", "token_unigram_nats_per_byte")}
    return {key: artifacts[key] for key in keys.get(task, ())}


def measure(task: str) -> dict[str, Any]:
    """One run of ``configs/TASK.yaml`` and the task's baselines."""
    config = f"configs/{task}.yaml"
    with tempfile.TemporaryDirectory(prefix=f"er-quality-{task}-") as where:
        argv = [sys.executable, "-m", "elastic_runner", "run", config,
                f"checkpoint.dir={Path(where) / 'ck'}"]
        began = time.perf_counter()
        log = run_logged(argv, task, timeout=900)
        seconds = time.perf_counter() - began
    return {"command": f"elastic-runner run {config}", "seconds": round(seconds, 1),
            "finished": finished_metrics(log), "baselines": baselines(task, config)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS))
    parser.add_argument("--json", type=Path, help="write (merge into) this JSON file")
    args = parser.parse_args(argv)
    import torch

    results = json.loads(args.json.read_text()) if args.json and args.json.exists() else {}
    results.setdefault("tasks", {})
    for task in args.tasks:
        results["tasks"][task] = {"date": date.today().isoformat(), "torch": torch.__version__,
                                  **measure(task)}
        print(json.dumps({task: results["tasks"][task]}, indent=1), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
