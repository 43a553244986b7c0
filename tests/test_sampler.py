"""Global-cursor sampler: disjoint shards, every index once per epoch, resume at any world size."""

import itertools

import pytest
import torch

from elastic_runner.data.sampler import ElasticSampler, shard_indices


def samplers(n, world_size, b=4, a=2, seed=7):
    return [ElasticSampler(n, seed, b, a, r, world_size) for r in range(world_size)]


def run_steps(ss, steps):
    """Indices each rank trains on in ``steps`` optimizer steps (advancing every sampler)."""
    seen = []
    for _ in range(steps):
        for s in ss:
            seen.extend(itertools.chain.from_iterable(s.step_indices(s.cursor)))
        for s in ss:
            s.advance()
    return seen


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_epoch_covers_each_index_once_except_tail(world_size):
    n = 203
    ss = samplers(n, world_size)
    per_rank = [list(itertools.chain.from_iterable(iter(s))) for s in ss]
    flat = [i for r in per_rank for i in r]
    assert len(flat) == len(set(flat)) == ss[0].steps_per_epoch() * ss[0].global_batch_size
    assert n - len(flat) == n % ss[0].global_batch_size  # drop_last per global batch
    for r1, r2 in itertools.combinations(per_rank, 2):
        assert not set(r1) & set(r2)


def test_iteration_snapshots_cursor_while_loop_advances():
    (s,) = samplers(64, 1, b=4, a=1)
    it = iter(s)
    got = []
    for batch in it:  # the loop advances the cursor after every step, as the trainer does
        got.extend(batch)
        s.advance()
    assert sorted(got) == list(range(64))


def test_permutation_differs_per_epoch_and_is_reproducible():
    (s,) = samplers(100, 1)
    assert (s.permutation(0) != s.permutation(1)).any()
    assert (s.permutation(3) == ElasticSampler(100, 7, 4, 2, 0, 1).permutation(3)).all()


@pytest.mark.parametrize("old_ws, new_ws", [(2, 3), (3, 2), (2, 1), (1, 4)])
def test_resume_at_another_world_size_trains_remaining_indices_exactly_once(old_ws, new_ws):
    n = 500
    before = samplers(n, old_ws, b=5, a=1)
    seen = run_steps(before, 7)
    state = before[0].state_dict()
    after = samplers(n, new_ws, b=5, a=1)
    for s in after:
        s.load_state_dict(state)
    rest = run_steps(after, after[0].steps_left_in_epoch())
    assert len(seen + rest) == len(set(seen + rest))
    assert len(set(range(n)) - set(seen + rest)) < after[0].global_batch_size


def test_state_dict_round_trip_and_mismatch():
    (s,) = samplers(50, 1)
    s.set_epoch(3)
    s.advance()
    (t,) = samplers(50, 1)
    t.load_state_dict(s.state_dict())
    assert (t.epoch, t.cursor) == (3, 8)
    with pytest.raises(ValueError, match="dataset of 50 samples"):
        samplers(60, 1)[0].load_state_dict(s.state_dict())


def test_dataset_smaller_than_global_batch_is_an_error():
    with pytest.raises(ValueError, match="smaller than one global batch"):
        ElasticSampler(10, 0, 8, 1, 0, 2)


def test_eval_shards_partition_without_padding():
    shards = [shard_indices(11, r, 3) for r in range(3)]
    assert sorted(i for s in shards for i in s) == list(range(11))


@pytest.mark.parametrize("steps", [3, 5])  # mid-epoch, and the epoch's last step (cursor wraps)
def test_last_step_names_each_rank_of_the_group_that_committed_it(steps):
    """After a regroup from 2 ranks to 1 (same global batch, twice the accumulation), the step
    that reached the cursor is still split as the 2-rank group trained it."""
    n = 80  # 5 steps of 16
    old = samplers(n, 2, b=4, a=2)
    trained = [[] for _ in old]
    for _ in range(steps):
        for r, s in enumerate(old):
            trained[r] = list(itertools.chain.from_iterable(s.step_indices(s.cursor)))
        for s in old:
            s.advance()
    if steps == 5:
        for s in old:
            s.set_epoch(1)
    (new,) = samplers(n, 1, b=4, a=4)
    new.load_state_dict(old[0].state_dict())
    for r in range(2):
        assert new.last_step(r) == (0, 2, trained[r])
    if steps < 5:  # after a step at the new size: that step's geometry
        mine = list(itertools.chain.from_iterable(new.step_indices(new.cursor)))
        new.advance()
        assert new.last_step() == (0, 1, mine)


def test_an_epoch_ended_at_another_world_size_names_its_last_step_after_a_round_trip():
    """An epoch of 70 trained 4 steps of 10 at world size 1, then, regrouped to 2 ranks with a
    global batch of 16, its last step (cursor 40 -> 56). At the next epoch's start the step that
    reached the cursor is that one, also in a sampler fed the state (a peer-fed replacement):
    whole batches of 16 from 0 would say it ended at 64 (seen in an own loop 2-1-2-1)."""
    n = 70
    (one,) = samplers(n, 1, b=5, a=2)
    run_steps([one], 4)
    two = samplers(n, 2, b=4, a=2)
    for s in two:
        s.load_state_dict(one.state_dict())
    last = [list(itertools.chain.from_iterable(s.step_indices(s.cursor))) for s in two]
    run_steps(two, two[0].steps_left_in_epoch())
    for s in two:
        s.set_epoch(1)
    (fed,) = samplers(n, 1, b=4, a=4)
    fed.load_state_dict(two[0].state_dict())
    for s in (*two, fed):
        assert s.previous_epoch_end() == 56
        assert [s.last_step(r) for r in range(2)] == [(0, 2, last[r]) for r in range(2)]


# ------------------------------------------------------------ a kept global batch, split unevenly

def kept(n, world_size, global_batch=64, b=16):
    return [ElasticSampler(n, 7, b, 1, r, world_size, global_batch_size=global_batch)
            for r in range(world_size)]


def test_a_global_batch_the_world_size_does_not_divide_is_split_within_one_sample():
    """64 samples at 3 ranks of micro-batch 16: two micro-batches on every rank (the same
    number of backward passes), of 11 or 10 samples, each step's 64 samples once; at 2 ranks
    the layout is the even split's."""
    ss = kept(1797, 3)
    assert [s.grad_accum_steps for s in ss] == [2, 2, 2]
    steps = [s.step_indices(s.cursor) for s in ss]
    assert [[len(m) for m in rank] for rank in steps] == [[11, 11], [11, 10], [11, 10]]
    flat = [i for rank in steps for m in rank for i in m]
    assert sorted(flat) == sorted(ss[0].permutation(0)[:64].tolist())
    assert [sum(s.loss_weights()) for s in ss] == pytest.approx([66 / 64, 63 / 64, 63 / 64])
    even = kept(1797, 2)
    assert even[0].even and not ss[0].even
    assert [s.step_indices(0) for s in even] == [s.step_indices(0) for s in samplers(1797, 2, 16, 2)]
    assert even[1].loss_weights() == [0.5, 0.5]


def test_a_kept_global_batch_resumed_at_3_ranks_trains_the_rest_once():
    n = 1797
    two = kept(n, 2)
    seen = run_steps(two, 5)
    three = kept(n, 3)
    for s in three:
        s.load_state_dict(two[0].state_dict())
    seen += run_steps(three, 20)
    assert len(seen) == len(set(seen)) == 25 * 64
    assert three[2].last_step()[1:] == (3, three[2].step_indices(three[2].cursor - 64)[0]
                                        + three[2].step_indices(three[2].cursor - 64)[1])


def test_a_global_batch_too_small_for_the_world_size_is_an_error():
    with pytest.raises(ValueError, match="cannot give each of 5 ranks 1 non-empty"):
        ElasticSampler(100, 0, 16, 1, 0, 5, global_batch_size=4)


def test_the_update_of_an_uneven_step_is_the_even_splits_to_float_tolerance():
    """The same 64 samples: 3 ranks' weighted micro-batch losses, their gradients averaged as
    DDP averages them, against 2 ranks' even split and one batch of 64. A mean-over-samples
    loss (MSE)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 1)
    x, y = torch.randn(1797, 5), torch.randn(1797, 1)

    def update(world_size: int) -> torch.Tensor:
        ranks = []
        for s in kept(1797, world_size):
            model.zero_grad()
            for m, w in zip(s.step_indices(0), s.loss_weights(), strict=True):
                (torch.nn.functional.mse_loss(model(x[m]), y[m]) * w).backward()
            ranks.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        return torch.stack(ranks).mean(0)  # DDP's average over ranks

    first = kept(1797, 1)[0].step_indices(0)
    model.zero_grad()
    whole = [i for m in first for i in m]
    torch.nn.functional.mse_loss(model(x[whole]), y[whole]).backward()
    want = torch.cat([p.grad.flatten() for p in model.parameters()])
    torch.testing.assert_close(update(3), want, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(update(2), want, rtol=1e-6, atol=1e-7)
