"""Plots of the benchmarks' JSON results (matplotlib, PNG) for docs/benchmarks.md.

Reads ``overhead.json``, ``checkpoint_stall.json``, ``recovery.json`` and ``rendezvous.json``
from ``--results`` (each written by its benchmark's ``--json``; missing ones are skipped) and
writes ``bench-<name>.png`` into ``--out``. Error bars are min-max over repeats.

    python -m bench.plot [--results docs/bench] [--out docs]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402


def _bars(ax: Any, labels: list[str], stats: list[dict[str, float]], **kw: Any) -> None:
    """Bars at the medians with min-max error bars."""
    med = [s["median"] for s in stats]
    err = [[m - s["min"] for m, s in zip(med, stats, strict=True)],
           [s["max"] - m for m, s in zip(med, stats, strict=True)]]
    ax.bar(labels, med, yerr=err, capsize=4, **kw)


def plot_overhead(data: dict, ax: Any) -> None:
    variants = [v for v in data["variants"] if v != "bare"]
    _bars(ax, variants, [data["variants"][v]["ratio"] for v in variants], color="tab:blue")
    ax.axhline(1.0, color="black", lw=0.8)
    ax.axhline(0.98, color="tab:red", ls="--", lw=0.8, label="target 0.98")
    ax.set_ylabel("steps/s relative to the bare DDP loop")
    ax.set_title(f"Runner overhead (checkpoint every {data['every']} steps where shown)")
    ax.set_ylim(0, 1.2)
    ax.legend(loc="lower right")


def plot_checkpoint_stall(rows: list[dict], ax: Any) -> None:
    sizes = [f"{r['size_mb']} MB" for r in rows]
    width = 0.27
    series = (("sync save", "sync_s"), ("runner async stall", "async_stall_s"),
              ("DCP async_save stall", "dcp_async_stall_s"))
    for i, (label, key) in enumerate(series):
        xs = [j + (i - 1) * width for j in range(len(rows))]
        ax.bar(xs, [r[key] for r in rows], width, label=label)
    ax.set_xticks(range(len(rows)), sizes)
    ax.set_yscale("log")
    ax.set_ylabel("training loop blocked per save (s, log scale)")
    ax.set_title("Checkpoint stall")
    ax.legend()


def plot_recovery(data: dict, ax: Any) -> None:
    summary = data["summary"]
    cases = list(summary)
    phases = [k for k in next(iter(summary.values())) if k not in ("total", "steps_redone")]
    left = [0.0] * len(cases)
    cmap = plt.get_cmap("tab10")
    for i, phase in enumerate(phases):
        widths = [summary[c][phase]["median"] for c in cases]
        ax.barh(cases, widths, left=left, color=cmap(i), label=phase)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    ax.invert_yaxis()
    ax.set_xlabel("seconds from the fault to the first step after the resume (medians)")
    ax.set_title("Recovery time by phase")
    ax.legend(fontsize="small", ncol=2)


def plot_rendezvous(data: dict, ax: Any) -> None:
    for backend, cells in data["backends"].items():
        agents = sorted(int(n) for n in cells)
        stats = [cells[str(n)]["seconds"] for n in agents]
        med = [s["median"] for s in stats]
        ax.errorbar(agents, med, yerr=[[m - s["min"] for m, s in zip(med, stats, strict=True)],
                                       [s["max"] - m for m, s in zip(med, stats, strict=True)]],
                    marker="o", capsize=4, label=backend)
    ax.set_xlabel("agents (nodes)")
    ax.set_ylabel("rendezvous time (s)")
    ax.set_title("Rendezvous time vs number of agents")
    ax.legend()


PLOTS: dict[str, Callable[[Any, Any], None]] = {
    "overhead": plot_overhead, "checkpoint_stall": plot_checkpoint_stall,
    "recovery": plot_recovery, "rendezvous": plot_rendezvous}


def main(argv: list[str] | None = None) -> list[Path]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", default="docs/bench")
    p.add_argument("--out", default="docs")
    args = p.parse_args(argv)
    written = []
    for name, draw in PLOTS.items():
        src = Path(args.results) / f"{name}.json"
        if not src.is_file():
            print(f"{src}: not found, skipped")
            continue
        fig, ax = plt.subplots(figsize=(9, 4.5))
        draw(json.loads(src.read_text()), ax)
        fig.tight_layout()
        out = Path(args.out) / f"bench-{name.replace('_', '-')}.png"
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=100)
        plt.close(fig)
        written.append(out)
        print(f"wrote {out}")
    return written


if __name__ == "__main__":
    main()
