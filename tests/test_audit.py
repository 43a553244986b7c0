"""Sample trace bookkeeping: rewind to the resumed step, torn lines, per-epoch audit, repaired
entries; and the trace records what the data loader fetched, so a loader that serves other
samples than its sampler's plan fails the audit."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from elastic_runner.cli import main as cli_main
from elastic_runner.data.audit import (
    EpochReport,
    SampleTrace,
    audit,
    loss_curve,
    read_entries,
    rewind,
)
from elastic_runner.data.loader import ElasticDataLoader
from elastic_runner.data.sampler import ElasticSampler
from elastic_runner.observe.reporting import SampleTraceRecorder

from .evidence import assert_exact_audit
from .ft_helpers import build_session, regression_data, run_step


def write_epoch(tmp_path, epoch, steps, world_size=2, per_rank=2, n=None, dropped=()):
    traces = [SampleTrace(tmp_path, r) for r in range(world_size)]
    idx = 0
    for step in steps:
        for t in traces:
            t.record_step(epoch, step, world_size, 0.5, list(range(idx, idx + per_rank)))
            idx += per_rank
    if n is not None:
        traces[0].record_epoch_end(epoch, steps[-1], n, list(dropped))
    for t in traces:
        t.close()


def test_complete_epoch_is_ok_and_counts_tail(tmp_path):
    write_epoch(tmp_path, 0, [1, 2, 3], n=13, dropped=[12])
    (r,) = audit(tmp_path)
    assert r.complete and r.ok and r.steps == 3
    assert (r.expected, r.seen_once, r.dropped) == (12, 12, 1)


def test_an_epoch_cut_short_that_records_its_rest_as_dropped_fails(tmp_path, capsys):
    """The epoch-end record is the sampler's word: 13 samples, 2 steps of 4 trained, 5 recorded
    as dropped. Every index is accounted for, but one global batch of 4 leaves a tail of 1."""
    write_epoch(tmp_path, 0, [1, 2], n=13, dropped=range(8, 13))
    (r,) = audit(tmp_path)
    assert not r.missing and not r.duplicated and not r.unexpected
    assert not r.ok and r.global_batches == [4]
    assert r.wrong_tail == ("5 samples recorded as dropped; one global batch of 4 over 13 "
                            "samples leaves 1")
    assert cli_main(["audit", str(tmp_path)]) == 1
    assert "dropped tail: 5 samples recorded as dropped" in capsys.readouterr().out


def test_a_global_batch_that_changed_leaves_a_tail_shorter_than_the_last_step(tmp_path):
    write_epoch(tmp_path, 0, [1, 2], world_size=2, n=20, dropped=[])  # 2 steps of 4: 0..7
    t = SampleTrace(tmp_path, 0)  # the world size fell to 1 at step 3: steps of 2 samples
    for step, idx in ((3, [8, 9]), (4, [10, 11]), (5, [12, 13]), (6, [14, 15]), (7, [16, 17])):
        t.record_step(0, step, 1, 0.5, idx)
    t.close()
    (r,) = audit(tmp_path)
    assert r.global_batches == [4, 2] and r.missing == [18, 19] and not r.ok
    # the same steps with 18, 19 as the tail: 2 is not shorter than the last global batch
    write_epoch(tmp_path / "b", 0, [1, 2], world_size=2, n=20, dropped=[18, 19])
    t = SampleTrace(tmp_path / "b", 0)
    for step in range(3, 8):
        t.record_step(0, step, 1, 0.5, [2 * step + 2, 2 * step + 3])
    t.close()
    (r,) = audit(tmp_path / "b")
    assert not r.missing and "not fewer than the last step's global batch (2)" in r.wrong_tail
    write_epoch(tmp_path / "c", 0, [1, 2], world_size=2, n=19, dropped=[18])
    t = SampleTrace(tmp_path / "c", 0)
    for step in range(3, 8):
        t.record_step(0, step, 1, 0.5, [2 * step + 2, 2 * step + 3])
    t.close()
    (r,) = audit(tmp_path / "c")
    assert r.ok, r


def test_duplicates_and_missing_are_reported(tmp_path):
    write_epoch(tmp_path, 0, [1, 2], n=10)  # indices 0..7 seen, 8 and 9 missing
    t = SampleTrace(tmp_path, 0)
    t.record_step(0, 3, 2, 0.5, [3])  # 3 seen twice
    t.close()
    (r,) = audit(tmp_path)
    assert not r.ok and r.missing == [8, 9] and r.duplicated == [3]


def test_rewind_drops_lost_steps_and_torn_lines(tmp_path):
    write_epoch(tmp_path, 0, [1, 2, 3, 4])
    with open(tmp_path / "rank-1.jsonl", "a") as f:
        f.write('{"epoch": 0, "step": 5, "ind')  # SIGKILL mid-write
    assert rewind(tmp_path, 2) == 5
    assert sorted({e["step"] for e in read_entries(tmp_path)}) == [1, 2]
    (r,) = audit(tmp_path)
    assert not r.complete and r.seen_once == 8
    assert loss_curve(tmp_path) == {1: 0.5, 2: 0.5}


@pytest.mark.parametrize("hook", ["recovered", "resumed"])
def test_recovery_writes_the_entries_of_ranks_that_died_after_committing(tmp_path, hook):
    """Rank 1 died between step 3's all-reduce and its trace entry. Continue-shrunk (rank 0 now
    alone, twice the accumulation) or a restart that resumes from step 3's checkpoint: rank 0
    writes rank 1's entry of step 3 as the 2-rank group trained it, so the audit covers every
    sample of that step once."""
    from elastic_runner.data.sampler import ElasticSampler
    from elastic_runner.observe.reporting import SampleTraceRecorder

    n = 64
    old = [ElasticSampler(n, 7, 4, 2, r, 2) for r in range(2)]
    trace = SampleTrace(tmp_path, 0)
    for step in (1, 2, 3):
        for r, s in enumerate(old):
            if (step, r) != (3, 1):
                trace.record_step(0, step, 2, 0.5, [i for mb in s.step_indices(s.cursor)
                                                    for i in mb], rank=r)
        for s in old:
            s.advance()
    trace.close()
    new = ElasticSampler(n, 7, 4, 4, 0, 1)
    new.load_state_dict(old[0].state_dict())
    if hook == "recovered":
        recorder = SampleTraceRecorder(str(tmp_path), 0, 1, n)
        recorder.on_recovered(3, False, new.last_step)
    else:
        recorder = SampleTraceRecorder(str(tmp_path), 0, 1, n, new.last_step)
        recorder.on_resumed(3)
    recorder.close()
    step3 = [e for e in read_entries(tmp_path) if e["step"] == 3]
    assert sorted((e["rank"], e["world_size"], e.get("repaired", False)) for e in step3) == [
        (0, 2, False), (1, 2, True)]
    (r,) = audit(tmp_path)
    assert r.ok and r.seen_once == 3 * 16 and r.repaired == 1  # counted, and told apart


def test_repaired_and_planned_entries_are_counted_and_reported(tmp_path, capsys):
    write_epoch(tmp_path, 0, [1, 2], n=9, dropped=[8])  # indices 0..7, 2 ranks x 2 per step
    t = SampleTrace(tmp_path, 0)
    t.record_step(1, 3, 2, None, [0, 1], rank=1, repaired=True)
    t.record_step(1, 3, 2, 0.5, [2, 3], planned=True)
    t.close()
    first, second = audit(tmp_path)
    assert first.ok and (first.repaired, first.planned) == (0, 0)
    assert not second.complete and second.seen_once == 4
    assert (second.repaired, second.planned) == (1, 1)
    assert cli_main(["audit", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[-1] == "repaired"
    assert out.splitlines()[2].split()[-1] == "1"  # epoch 1's row
    assert "repaired: 1 entries written from the sampler" in out
    assert "planned: 1 entries hold the sampler's plan" in out


def test_indices_outside_the_expected_set_fail_the_audit(tmp_path, capsys):
    write_epoch(tmp_path, 0, [1, 2], n=10, dropped=[8, 9])
    t = SampleTrace(tmp_path, 1)
    t.record_step(0, 3, 2, 0.5, [9])  # a sample of the dropped tail
    t.close()
    (r,) = audit(tmp_path)
    assert not r.ok and r.unexpected == [9] and not r.missing and not r.duplicated
    assert cli_main(["audit", str(tmp_path)]) == 1
    assert "unexpected: [9]" in capsys.readouterr().out


# ---------------------------------------------------------------- what the loader fetched

N, MB = 34, 4  # 8 steps of 4 samples at world size 1, a dropped tail of 2


class ForgetfulSampler(ElasticSampler):
    """A buggy loader's batch sampler: each pass starts at the beginning of the epoch, not at
    the cursor. Its bookkeeping (cursor, ``step_indices``, ``last_step``) is right: the sampler
    says step 2 trains ``perm[4:8]`` while the loader serves ``perm[0:4]`` again."""

    def __iter__(self) -> Iterator[list[int]]:
        perm = self.permutation(self.epoch)
        for step in range(self.steps_left_in_epoch()):
            yield from self._split(perm, step * self.global_batch_size)


def traced_epoch(directory: Path, sampler: ElasticSampler, workers: int = 0,
                 record_fetch: bool = True) -> EpochReport:
    """One epoch of the session protocol with the sample trace, audited. Every step iterates
    the loader anew from the cursor (``run_step``), as the trainer does after a restart or an
    in-place recovery. ``record_fetch`` False: the session has no loader record, its entries
    hold the sampler's plan (what the trace held before it recorded the fetch)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = ElasticDataLoader(regression_data(N), sampler, num_workers=workers)
    recorder = SampleTraceRecorder(str(directory / "trace"), 0, 1, N)
    session = build_session(directory / "ck", model, opt, loader, callbacks=[recorder])
    if not record_fetch:
        session.fetched = None
    session.start()
    for _ in range(sampler.steps_per_epoch()):
        run_step(session, model, opt, loader)
    recorder.on_epoch_end(0, session.state.step,
                          lambda: sampler.permutation(0)[sampler.cursor:].tolist())
    session.close()
    (report,) = audit(directory / "trace")
    return report


@pytest.mark.parametrize("workers", [0, 1])
def test_a_loader_serving_other_samples_than_the_sampler_says_fails_the_audit(tmp_path,
                                                                              workers):
    """The fetch is recorded where it happens (this process, or a loader worker): the
    forgetful loader trains the epoch's first micro-batch 8 times, and the audit says so."""
    sampler = ForgetfulSampler(N, 3, MB, 1, 0, 1)
    report = traced_epoch(tmp_path, sampler, workers)
    first = sampler.permutation(0)[:MB].tolist()
    assert report.complete and not report.ok and report.planned == 0
    assert report.duplicated == sorted(first) and report.seen_once == 0
    assert report.missing == sorted(sampler.permutation(0)[MB:32].tolist())
    fetched = [i for e in read_entries(tmp_path / "trace") if "indices" in e
               for i in e["indices"]]
    assert fetched == first * 8


def test_the_sampler_plan_would_have_passed_the_same_loader(tmp_path):
    """The same bug with steps reporting the sampler's plan (a trace computed from the
    cursor): an exact audit of the bookkeeping, not of the training."""
    report = traced_epoch(tmp_path, ForgetfulSampler(N, 3, MB, 1, 0, 1), record_fetch=False)
    assert report.ok and report.seen_once == 32 and report.planned == 8


@pytest.mark.parametrize("workers", [0, 1])
def test_a_correct_loader_passes_with_the_fetched_indices(tmp_path, workers):
    sampler = ElasticSampler(N, 3, MB, 1, 0, 1)
    report = traced_epoch(tmp_path, sampler, workers)
    assert report.ok and report.seen_once == 32 and report.dropped == 2
    assert (report.planned, report.repaired) == (0, 0)
    entries = [e for e in read_entries(tmp_path / "trace") if "indices" in e]
    assert [i for e in entries for i in e["indices"]] == sampler.permutation(0)[:32].tolist()


def test_a_step_entry_lost_in_the_epoch_in_progress_fails_the_exact_audit(tmp_path):
    """Rank 1's entry of step 2 is lost in an epoch that has not ended (steps of 4 samples, 2
    ranks). The audit's own rules find nothing wrong: an epoch in progress has no missing
    samples, and nothing is seen twice. The exact audit counts each traced step's global batch
    of that epoch once, and fails (its check of the last epoch looked for duplicates only)."""
    traces = [SampleTrace(tmp_path, r) for r in range(2)]
    for step in (1, 2, 3):
        for r, t in enumerate(traces):
            if (r, step) != (1, 2):
                t.record_step(0, step, 2, 0.5, [4 * (step - 1) + 2 * r, 4 * (step - 1) + 2 * r + 1])
    for t in traces:
        t.close()
    (r,) = audit(tmp_path)
    assert r.ok and not r.complete and not r.duplicated and r.seen_once == 10
    for num_samples in (None, 100):
        with pytest.raises(AssertionError):
            assert_exact_audit(tmp_path, steps=3, global_batch=4, num_samples=num_samples)
