"""Sample audit: which dataset indices each committed optimizer step trained on.

Each rank appends one JSON line per optimizer step to ``<trace_dir>/rank-<r>.jsonl``:
``{"epoch", "step", "rank", "world_size", "loss", "time", "indices"}`` (``loss`` is the step's
mean loss over all ranks, ``time`` the commit's unix time in seconds, ``indices`` this rank's
samples). At each epoch end rank 0 adds
``{"epoch_end": e, "step", "num_samples", "dropped"}``, the tail indices that the drop_last rule
left out of that epoch.

On every (re)start rank 0 rewinds the trace to the step of the checkpoint it resumes from
(:func:`rewind`), before any rank appends, so the trace always describes exactly the updates in
the current model. :func:`audit` then checks, per epoch, that every index was trained on once.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO


class SampleTrace:
    """Appends this rank's entries to its JSONL file (flushed per line, so a SIGKILL loses at
    most a partial last line, which readers skip)."""

    def __init__(self, directory: str | Path, rank: int) -> None:
        self.path = Path(directory) / f"rank-{rank}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self._file: TextIO = open(self.path, "a")  # noqa: SIM115 - closed in close()

    def _write(self, entry: dict[str, Any]) -> None:
        self._file.write(json.dumps(entry, separators=(",", ":")) + "\n")
        self._file.flush()

    def record_step(self, epoch: int, step: int, world_size: int, loss: float | None,
                    indices: list[int], skipped: bool = False, rank: int | None = None) -> None:
        """``skipped``: the update of this step was skipped (non-finite loss or gradient); its
        samples were consumed but did not change the model. ``rank``: the rank that trained
        ``indices`` when it is not this one (an entry repaired for a rank that died)."""
        entry = {"epoch": epoch, "step": step, "rank": self.rank if rank is None else rank,
                 "world_size": world_size,
                 "loss": loss, "time": round(time.time(), 3), "indices": indices}
        if skipped:
            entry["skipped"] = True
        self._write(entry)

    def record_epoch_end(self, epoch: int, step: int, num_samples: int, dropped: list[int]
                         ) -> None:
        self._write({"epoch_end": epoch, "step": step, "num_samples": num_samples,
                     "dropped": dropped})

    def close(self) -> None:
        self._file.close()


def steps_recorded(directory: str | Path, rank: int) -> set[int]:
    """The steps of ``rank``'s complete entries."""
    path = Path(directory) / f"rank-{rank}.jsonl"
    if not path.exists():
        return set()
    out = set()
    for line in path.read_text().splitlines():
        try:
            out.add(json.loads(line)["step"])
        except (ValueError, KeyError):
            continue
    return out


def ranks_recorded(directory: str | Path, step: int) -> set[int]:
    """The ranks that have a complete entry of ``step`` (in any rank's file: a survivor writes
    the entries of the ranks that died after committing it)."""
    return {e["rank"] for e in read_entries(directory)
            if "epoch_end" not in e and e.get("step") == step}


def read_entries(directory: str | Path) -> list[dict[str, Any]]:
    """All complete entries of all ranks' files (a torn last line is skipped)."""
    entries = []
    for path in sorted(Path(directory).glob("rank-*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                entries.append(json.loads(line))
            except ValueError:
                continue
    return entries


def rewind(directory: str | Path, step: int) -> int:
    """Drop entries of steps after ``step`` from every rank's file (atomically per file).
    Returns the number of entries dropped."""
    dropped = 0
    for path in Path(directory).glob("rank-*.jsonl"):
        keep, lines = [], path.read_text().splitlines()
        for line in lines:
            try:
                if json.loads(line)["step"] <= step:
                    keep.append(line)
            except (ValueError, KeyError):
                pass
        dropped += len(lines) - len(keep)
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(f"{ln}\n" for ln in keep))
        os.replace(tmp, path)
    return dropped


@dataclass
class EpochReport:
    """Audit of one epoch. ``complete`` epochs have an epoch-end record; only for those are
    ``missing`` and ``expected`` known."""

    epoch: int
    complete: bool
    num_samples: int | None
    steps: int
    seen_once: int
    duplicated: list[int] = field(default_factory=list)
    missing: list[int] = field(default_factory=list)
    dropped: int = 0

    @property
    def expected(self) -> int | None:
        return None if self.num_samples is None else self.num_samples - self.dropped

    @property
    def ok(self) -> bool:
        return not self.duplicated and not self.missing


def audit(directory: str | Path) -> list[EpochReport]:
    """Per epoch: samples expected, seen exactly once, duplicated, and missing."""
    counts: dict[int, Counter[int]] = {}
    steps: dict[int, set[int]] = {}
    ends: dict[int, dict[str, Any]] = {}
    for e in read_entries(directory):
        if "epoch_end" in e:
            ends[e["epoch_end"]] = e
            continue
        counts.setdefault(e["epoch"], Counter()).update(e["indices"])
        steps.setdefault(e["epoch"], set()).add(e["step"])
    reports = []
    for epoch in sorted(set(counts) | set(ends)):
        c = counts.get(epoch, Counter())
        end = ends.get(epoch)
        report = EpochReport(epoch=epoch, complete=end is not None,
                             num_samples=end["num_samples"] if end else None,
                             steps=len(steps.get(epoch, ())),
                             seen_once=sum(1 for n in c.values() if n == 1),
                             duplicated=sorted(i for i, n in c.items() if n > 1))
        if end:
            report.dropped = len(end["dropped"])
            expected = set(range(end["num_samples"])) - set(end["dropped"])
            report.missing = sorted(expected - set(c))
        reports.append(report)
    return reports


def loss_curve(directory: str | Path) -> dict[int, float]:
    """Mean loss (over ranks) of every traced step, by step."""
    return {e["step"]: e["loss"] for e in read_entries(directory) if "loss" in e}
