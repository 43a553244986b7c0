"""The checks the fault tests end with, each guarded so that an empty record cannot pass.

A loop of assertions over nothing passes: an empty sample trace audits clean, two empty state
dicts compare equal. Every helper here first asserts that there is something to check, and
what the test expects of it (the number of epochs, the steps traced, the tensors compared).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from elastic_runner.data import audit
from elastic_runner.tasks.digits import split_indices

DIGITS_SAMPLES = 1797  # scikit-learn's digits; configs/digits.yaml splits 70/15/15, seed 1234
DIGITS_TRAIN = len(split_indices(DIGITS_SAMPLES, 0.15, 0.15, 1234)[0])
DIGITS_GLOBAL_BATCH = 64  # configs/digits.yaml at 2 ranks: 2 x micro-batch 16 x accumulation 2


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """``a`` and ``b`` hold the same names and bitwise equal tensors, and are not empty."""
    assert a, "no tensors to compare"
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def assert_same_optimizer(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Two optimizer ``state_dict()``s (their per-parameter ``state``) bitwise equal, and not
    empty (an optimizer before its first step holds no state)."""
    assert a["state"], "no optimizer state to compare"
    assert a["state"].keys() == b["state"].keys()
    for name in a["state"]:
        assert_same_tensors(a["state"][name], b["state"][name])


def assert_exact_audit(trace: str | Path, *, steps: int, global_batch: int | None,
                       num_samples: int | None = None, first_step: int = 1,
                       repaired_at_most: int = 0) -> list[audit.EpochReport]:
    """The sample trace in ``trace`` shows every step from ``first_step`` to ``steps`` traced,
    every epoch the run reached audited clean, nothing from the sampler's plan alone
    (``planned``), and at most ``repaired_at_most`` entries repaired from it (a rank that died
    after committing a step and before tracing it: the ranks lost times the steps in flight).

    ``global_batch``: the run's constant global batch (samples); every complete epoch then
    dropped exactly ``num_samples % global_batch`` (``num_samples``: the training split; None:
    what the epoch-end records say, which must agree). Every epoch, the one in progress too,
    then holds each of its steps' ``global_batch`` samples exactly once; the epoch in progress
    has exactly the steps taken since the last epoch's end. None: the global batch changed, and
    only the audit's own rules hold (no duplicates; a complete epoch's tail). Returns the
    reports.
    """
    reports = audit.audit(trace)
    assert reports, f"no trace entries in {trace}"
    traced = sorted({e["step"] for e in audit.read_entries(trace) if "indices" in e})
    assert traced == list(range(first_step, steps + 1)), (traced[:3], traced[-3:])
    sizes = {r.num_samples for r in reports if r.complete}
    if num_samples is None:
        assert len(sizes) <= 1, sizes
        num_samples = sizes.pop() if sizes else None
    else:
        assert sizes <= {num_samples}, sizes
    bad = [r for r in reports if not r.ok or r.planned]
    assert not bad, bad
    assert sum(r.repaired for r in reports) <= repaired_at_most, reports
    assert sum(r.steps for r in reports) == len(traced), reports  # each step in one epoch
    if global_batch is not None:  # every epoch, the unfinished one too: each step's samples once
        for r in reports:
            assert r.global_batches in ([global_batch], []), r
            assert r.seen_once == r.steps * global_batch, r
    if global_batch is not None and num_samples is None and first_step == 1:
        # no epoch ended: all of them are the first one's
        assert [(r.epoch, r.complete) for r in reports] == [(0, False)], reports
    if global_batch is not None and num_samples is not None and first_step == 1:
        per_epoch = num_samples // global_batch
        complete, partial = divmod(steps, per_epoch)
        # the last epoch is complete when the last step ends it; else it is in progress
        epochs = {complete + 1} if partial else {complete, complete + 1}
        assert len(reports) in epochs, (len(reports), epochs)
        assert [r.epoch for r in reports] == list(range(len(reports)))
        assert all(r.complete for r in reports[:complete]), reports
        for r in reports[:complete]:
            assert r.global_batches == [global_batch], r
            assert r.dropped == num_samples % global_batch, r
        if partial:  # the epoch in progress: the steps taken in it, no more and no fewer
            assert not reports[-1].complete and reports[-1].steps == partial, reports[-1]
    return reports


def world_sizes(trace: str | Path) -> list[int]:
    """World size of each traced step, in step order (the trace is rewound on every resume)."""
    entries = [e for e in audit.read_entries(trace) if "world_size" in e]
    return [ws for _, ws in sorted({(e["step"], e["world_size"]) for e in entries})]
