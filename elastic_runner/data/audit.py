"""Sample audit: which dataset indices each committed optimizer step trained on.

Each rank appends one JSON line per optimizer step to ``<trace_dir>/rank-<r>.jsonl``:
``{"epoch", "step", "rank", "world_size", "loss", "time", "pid", "indices"}`` (``loss`` is the
step's mean loss over all ranks, ``time`` the commit's unix time in seconds, ``pid`` the process
that trained them (a fault drill finds a rank's live process by it: ranks are renumbered and
replacements start as spares), ``indices`` this rank's samples). At each epoch end rank 0 adds
``{"epoch_end": e, "step", "num_samples", "dropped"}``, the tail indices that the drop_last rule
left out of that epoch (the sampler's plan: what the epoch was meant to train is all other
indices).

Where ``indices`` come from: the dataset fetch itself. The data loader reads the dataset through
``data.IndexedDataset``, whose batched fetch returns the indices it read with the samples, in the
process that fetches (the training process, or a DataLoader worker); they travel with the batch
to the training loop, and the step's entry lists those of the micro-batches the loop took for
the step, in order (``data.ElasticDataLoader.take_fetched``). So the audit checks what the model
was fed, not the sampler's bookkeeping. Two kinds of entries hold the sampler's plan instead,
and say so: ``"repaired": true``, an entry rank 0 wrote after a rewind for a rank that died
after committing the step and before writing it (``reporting.SampleTraceRecorder``), and
``"planned": true``, a step of a session that had no loader record. The audit counts their
indices like the others and reports how many there were. ``"skipped": true``: the step's
update was skipped (non-finite loss or gradient).

On every (re)start rank 0 rewinds the trace to the step of the checkpoint it resumes from
(:func:`rewind`), before any rank appends, so the trace always describes exactly the updates in
the current model. :func:`audit` then checks, per epoch, that every expected index was trained
on once and no other index was, and that the dropped tail is what the drop_last rule leaves: the
epoch-end record is the sampler's word, so an epoch cut short that recorded its untrained
samples as dropped must not pass. With one global batch ``G`` over the whole epoch (the steps'
entries add up to ``G`` indices each) the tail is exactly ``num_samples % G``; when the global
batch changed within the epoch (``batch.keep_global_batch: false``), it is shorter than the last
step's global batch.
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
                    indices: list[int], skipped: bool = False, rank: int | None = None,
                    repaired: bool = False, planned: bool = False) -> None:
        """One step's entry; ``indices``: the dataset indices (ints) the rank fetched for it.

        ``skipped``: the update of this step was skipped (non-finite loss or gradient); its
        samples were consumed but did not change the model. ``rank``: the rank that trained
        ``indices`` when it is not this one. ``repaired``: written for a rank that died before
        writing it, from the sampler's plan; ``planned``: the indices are the sampler's plan
        (no record of the fetch)."""
        entry = {"epoch": epoch, "step": step, "rank": self.rank if rank is None else rank,
                 "world_size": world_size, "loss": loss, "time": round(time.time(), 3),
                 "indices": indices}
        if rank is None:  # this process trained them
            entry["pid"] = os.getpid()
        for flag, on in (("skipped", skipped), ("repaired", repaired), ("planned", planned)):
            if on:
                entry[flag] = True
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
    ``missing``, ``unexpected`` and ``expected`` known.

    Attributes:
        steps: steps with an entry in the epoch.
        seen_once: indices trained on exactly once.
        duplicated: indices trained on more than once.
        missing: expected indices never trained on.
        unexpected: indices trained on that the epoch did not expect (its dropped tail, or
            not an index of the dataset).
        dropped: size of the dropped tail.
        repaired: entries written from the sampler's plan for a rank that died before writing
            its own (their indices are counted above).
        planned: entries whose indices are the sampler's plan, not a record of the fetch.
        global_batches: the global batch sizes (samples: the indices of one step's entries
            over all ranks) of the epoch's steps, in step order without repeats.
        wrong_tail: why the dropped tail is not the one the drop_last rule leaves ('' if it is;
            module docstring).
    """

    epoch: int
    complete: bool
    num_samples: int | None
    steps: int
    seen_once: int
    duplicated: list[int] = field(default_factory=list)
    missing: list[int] = field(default_factory=list)
    dropped: int = 0
    unexpected: list[int] = field(default_factory=list)
    repaired: int = 0
    planned: int = 0
    global_batches: list[int] = field(default_factory=list)
    wrong_tail: str = ""

    @property
    def expected(self) -> int | None:
        return None if self.num_samples is None else self.num_samples - self.dropped

    @property
    def ok(self) -> bool:
        return (not self.duplicated and not self.missing and not self.unexpected
                and not self.wrong_tail)


@dataclass
class _Tally:
    """The step entries of one epoch, summed up."""

    counts: Counter[int] = field(default_factory=Counter)  # index -> times trained
    steps: set[int] = field(default_factory=set)
    batch: Counter[int] = field(default_factory=Counter)  # step -> indices over all ranks
    repaired: int = 0
    planned: int = 0

    def add(self, entry: dict[str, Any]) -> None:
        self.counts.update(entry["indices"])
        self.steps.add(entry["step"])
        self.batch[entry["step"]] += len(entry["indices"])
        self.repaired += bool(entry.get("repaired"))
        self.planned += bool(entry.get("planned"))


def audit(directory: str | Path) -> list[EpochReport]:
    """Per epoch: samples expected, seen exactly once, duplicated, missing and unexpected, and
    how many entries were repaired or planned rather than recorded from the fetch."""
    tallies: dict[int, _Tally] = {}
    ends: dict[int, dict[str, Any]] = {}
    for e in read_entries(directory):
        if "epoch_end" in e:
            ends[e["epoch_end"]] = e
        else:
            tallies.setdefault(e["epoch"], _Tally()).add(e)
    return [_report(epoch, tallies.get(epoch, _Tally()), ends.get(epoch))
            for epoch in sorted(set(tallies) | set(ends))]


def _report(epoch: int, tally: _Tally, end: dict[str, Any] | None) -> EpochReport:
    """One epoch's report from its entries and its epoch-end record (None: in progress)."""
    c = tally.counts
    report = EpochReport(epoch=epoch, complete=end is not None,
                         num_samples=end["num_samples"] if end else None,
                         steps=len(tally.steps),
                         seen_once=sum(1 for n in c.values() if n == 1),
                         duplicated=sorted(i for i, n in c.items() if n > 1),
                         repaired=tally.repaired, planned=tally.planned,
                         global_batches=_runs([tally.batch[s] for s in sorted(tally.batch)]))
    if end:
        report.dropped = len(end["dropped"])
        expected = set(range(end["num_samples"])) - set(end["dropped"])
        report.missing = sorted(expected - set(c))
        report.unexpected = sorted(set(c) - expected)
        report.wrong_tail = _wrong_tail(end["num_samples"], report.dropped,
                                        report.global_batches)
    return report


def _runs(values: list[int]) -> list[int]:
    """``values`` without consecutive repeats."""
    return [v for i, v in enumerate(values) if i == 0 or values[i - 1] != v]


def _wrong_tail(num_samples: int, dropped: int, batches: list[int]) -> str:
    """Why a complete epoch's dropped tail of ``dropped`` samples is not what the drop_last
    rule leaves ('' if it is), given its steps' global batches (module docstring)."""
    if not batches:
        return "" if dropped == num_samples else (
            f"no step trained but {dropped} of {num_samples} samples recorded as dropped")
    if len(batches) == 1:
        want = num_samples % batches[0]
        return "" if dropped == want else (
            f"{dropped} samples recorded as dropped; one global batch of {batches[0]} over "
            f"{num_samples} samples leaves {want}")
    return "" if dropped < batches[-1] else (
        f"{dropped} samples recorded as dropped, not fewer than the last step's global batch "
        f"({batches[-1]}): the epoch ended early")


def loss_curve(directory: str | Path) -> dict[int, float]:
    """Mean loss (over ranks) of every traced step, by step."""
    return {e["step"]: e["loss"] for e in read_entries(directory) if "loss" in e}
