"""Metrics overhead: training steps/s with metrics on vs off, paired in one run.

Runs the digits task on 2 CPU workers (c10d, standalone) in pairs, alternating which variant
goes first:

* ``off``: ``metrics.enabled=false`` and ``metrics.straggler_threshold=0`` (nothing recorded,
  no step-time exchange);
* ``on``: every series recorded (multiprocess files), the node endpoint served by the agent,
  the straggler exchange at each log step, and a scraper that GETs ``/metrics`` every
  ``--scrape-interval`` seconds (0.5 s: 30x Prometheus' usual 15 s).

Steps/s is taken from rank 0's log timestamps (ms) between the first and last logged step, so
process start, rendezvous and imports are excluded. Evaluation runs only at the very end
(``eval.every_steps`` beyond the run) and checkpoints only at epoch ends, the same for both.

Digits steps are short (~20 ms), so the end-to-end ratio is dominated by the noise of a shared
2-core machine. The script therefore also measures, in a subprocess in multiprocess mode, what
the recording costs per step (one step's series, µs) and what one scrape of a rank's files costs
(ms), and prints both relative to the measured step time of the ``off`` runs.

    python -m bench.metrics_overhead [--steps 300] [--repeats 6] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import urllib.request
from pathlib import Path

from .common import REPO, digits_run_argv, free_port, run_logged, spread, steps_per_second


def _scrape_until(port: int, interval: float, stop: threading.Event, count: list[int]) -> None:
    while not stop.wait(interval):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                r.read()
            count[0] += 1
        except OSError:
            pass  # not up yet, or already gone


def run_once(variant: str, steps: int, scrape_interval: float, workdir: Path) -> dict:
    port = free_port()
    metrics = ([f"metrics.port={port}"] if variant == "on"
               else ["metrics.enabled=false", "metrics.straggler_threshold=0"])
    argv = digits_run_argv(steps, workdir / variant, "checkpoint.every_steps=0", *metrics)
    stop, scrapes = threading.Event(), [0]
    scraper = threading.Thread(target=_scrape_until, args=(port, scrape_interval, stop, scrapes),
                               daemon=True)
    if variant == "on":
        scraper.start()
    try:
        log = run_logged(argv, variant)
    finally:
        stop.set()
    return {"variant": variant, "steps_per_s": steps_per_second(log), "scrapes": scrapes[0]}


_MICRO = """
import os, tempfile, time, json
os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp()
from prometheus_client import CollectorRegistry, generate_latest
from elastic_runner.observe.node_metrics import LiveWorkersCollector
from elastic_runner.config import MetricsConfig
from elastic_runner.observe.metrics import RankMetrics
m = RankMetrics(MetricsConfig(job="j", node="n"), 0, 0)
n = 20000
t = time.perf_counter()
for i in range(n):
    m.phase("training", 300.0)
    m.step_done(i, 0, 0.02, 0.001, 32, 1.0, 1e-3)
step_us = (time.perf_counter() - t) / n * 1e6
m.window(1.0)
registry = CollectorRegistry()
registry.register(LiveWorkersCollector(os.environ["PROMETHEUS_MULTIPROC_DIR"]))
t = time.perf_counter()
for _ in range(50):
    generate_latest(registry)
print(json.dumps({"record_us_per_step": step_us,
                  "scrape_ms_per_rank": (time.perf_counter() - t) / 50 * 1e3}))
"""


def micro() -> dict:
    """Recording cost per step (µs) and scrape cost per rank (ms), multiprocess mode."""
    out = subprocess.run([sys.executable, "-c", _MICRO], capture_output=True, text=True,
                         timeout=300, cwd=REPO, check=True)
    return json.loads(out.stdout)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--scrape-interval", type=float, default=1.0)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    pairs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            order = ("off", "on") if i % 2 == 0 else ("on", "off")
            runs = {v: run_once(v, args.steps, args.scrape_interval, Path(tmp) / str(i))
                    for v in order}
            pairs.append({"off_steps_per_s": runs["off"]["steps_per_s"],
                          "on_steps_per_s": runs["on"]["steps_per_s"],
                          "ratio": runs["on"]["steps_per_s"] / runs["off"]["steps_per_s"],
                          "scrapes": runs["on"]["scrapes"]})
    ratio = spread([r["ratio"] for r in pairs])
    print(f"{'pair':>4} {'off steps/s':>11} {'on steps/s':>10} {'on/off':>7} {'scrapes':>7}")
    for i, r in enumerate(pairs):
        print(f"{i:>4} {r['off_steps_per_s']:>11.1f} {r['on_steps_per_s']:>10.1f} "
              f"{r['ratio']:>7.3f} {r['scrapes']:>7}")
    summary = {"ratio": ratio, "pairs": pairs, "steps": args.steps,
               "scrape_interval_s": args.scrape_interval}
    print(f"metrics on / off steps/s: median {ratio['median']:.3f} "
          f"(min {ratio['min']:.3f}, max {ratio['max']:.3f}) over {len(pairs)} pairs")
    summary.update(micro())
    step_s = 1 / statistics.median(r["off_steps_per_s"] for r in pairs)
    summary["record_fraction_of_step"] = summary["record_us_per_step"] * 1e-6 / step_s
    summary["scrape_fraction_of_interval"] = (2 * summary["scrape_ms_per_rank"] * 1e-3
                                              / args.scrape_interval)
    print(f"recording: {summary['record_us_per_step']:.1f} us per step = "
          f"{summary['record_fraction_of_step']:.2%} of a {step_s * 1e3:.1f} ms step; "
          f"one scrape: {summary['scrape_ms_per_rank']:.1f} ms per rank = "
          f"{summary['scrape_fraction_of_interval']:.2%} of one core at one scrape every "
          f"{args.scrape_interval:g} s (2 ranks)")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
