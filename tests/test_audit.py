"""Sample trace bookkeeping: rewind to the resumed step, torn lines, per-epoch audit."""

import pytest

from elastic_runner.audit import SampleTrace, audit, loss_curve, read_entries, rewind


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
    from elastic_runner.reporting import SampleTraceRecorder
    from elastic_runner.sampler import ElasticSampler

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
    assert sorted((e["rank"], e["world_size"]) for e in step3) == [(0, 2), (1, 2)]
    (r,) = audit(tmp_path)
    assert r.ok and r.seen_once == 3 * 16
