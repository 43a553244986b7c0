"""Fencing tokens (unit tier): a stale group's commit never lands, resume prefers the newest
group, claims are unique under concurrency, on a filesystem and on an fsspec object store."""

import os
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from elastic_runner.checkpoint import storage as ckpt
from elastic_runner.checkpoint.fencing import Fence, FencedOut
from elastic_runner.checkpoint.manager import CheckpointManager

from .commit_log import CommitLog
from .procs import wait_until


class Box:
    """A minimal Stateful."""

    def __init__(self, value: float) -> None:
        self.value = torch.tensor([value])

    def state_dict(self):
        return {"value": self.value.clone()}

    def load_state_dict(self, state):
        self.value = state["value"].clone()


# s3 starts a server (taken inside the fixture, so tests/conftest.py cannot see it): slow tier
@pytest.fixture(params=["local", "memory", pytest.param("s3", marks=pytest.mark.slow)])
def directory(request, tmp_path):
    """A checkpoint directory on a filesystem, on fsspec's in-memory store, and on a real S3
    API server (moto; claims are conditional creates there)."""
    if request.param == "local":
        yield str(tmp_path / "ck")
        return
    if request.param == "s3":
        yield request.getfixturevalue("s3_bucket").url + "/ck"
        return
    url = f"memory://fencing-{uuid.uuid4().hex}/ck"
    yield url
    import fsspec
    fsspec.filesystem("memory").rm(url.split("://")[1].split("/")[0], recursive=True)


def test_tokens_grow_and_a_stale_commit_is_refused(directory):
    old = Fence.claim(directory)
    ckpt.write_checkpoint(directory, "step-00000010", {"x": 1}, {"step": 10}, old)
    new = Fence.claim(directory)
    assert new.token == old.token + 1
    with pytest.raises(FencedOut) as e:
        ckpt.write_checkpoint(directory, "step-00000020", {"x": 2}, {"step": 20}, old)
    assert f"fencing token {new.token}" in str(e.value)
    assert f"holds token {old.token}" in str(e.value)
    assert [c.name for c in ckpt.list_checkpoints(directory)] == ["step-00000010"]
    if "://" not in directory:  # nothing staged is left behind either
        assert not [p for p in os.listdir(directory) if p.startswith(".tmp")]
    ckpt.write_checkpoint(directory, "step-00000015", {"x": 3}, {"step": 15}, new)
    assert ckpt.latest_valid(directory).fence == new.token



def test_the_commit_log_sees_every_commit_set_aside_and_claim_as_it_happens(tmp_path):
    """tests/commit_log.py, the record the split-brain tests check: each commit with its step,
    token and writer, also those retention removed since; a set-aside; each claim."""
    directory = tmp_path / "ck"
    with CommitLog(directory) as log:
        old = Fence.claim(str(directory))
        for step in (1, 2, 3):
            ckpt.write_checkpoint(directory, f"step-{step:08d}", {"x": step}, {"step": step},
                                  old)
        # the log reads each manifest once it sees the rename: let it, before retention
        # removes them (under load its thread lagged behind the prune: step 2 unread)
        wait_until(lambda: len(log.snapshot()[0]) == 3, 10, "three commits")
        ckpt.prune(directory, keep_last=1)  # steps 1 and 2 are gone
        new = Fence.claim(str(directory))
        ckpt.write_checkpoint(directory, "step-00000003", {"x": 3}, {"step": 3}, new)
        wait_until(lambda: len(log.snapshot()[0]) == 4 and log.snapshot()[1], 10,
                   "four commits and a set-aside")
    commits, aside, claims = log.snapshot()
    assert [(c.name, c.step, c.fence, c.pid) for c in commits] == [
        (f"step-{s:08d}", s, t, os.getpid()) for s, t in ((1, 1), (2, 1), (3, 1), (3, 2))]
    assert aside == ["step-00000003".join((".superseded-", "-fence-1"))]
    assert [c.token for c in claims] == [1, 2] and claims[0].time <= commits[0].time

def test_a_stale_writer_whose_staging_a_newer_group_pruned_is_fenced_out(tmp_path, monkeypatch):
    """Group A is frozen while it stages step 20; group B claims the directory and its prune
    removes A's staging directory (not B's pid). A, thawed, is fenced out (exit 3), not a
    FileNotFoundError (a crash its agent would restart)."""
    directory = str(tmp_path / "ck")
    old = Fence.claim(directory)
    save = ckpt._save_hashed

    def frozen_while_the_new_group_starts(f, state):
        digest = save(f, state)
        Fence.claim(directory)
        with monkeypatch.context() as m:  # B's prune, in another process: every .tmp-* of A
            other = os.getpid() + 1
            m.setattr(ckpt.os, "getpid", lambda: other)
            assert ckpt.prune(directory, keep_last=3)
        return digest

    monkeypatch.setattr(ckpt, "_save_hashed", frozen_while_the_new_group_starts)
    with pytest.raises(FencedOut, match="not committing step-00000020"):
        ckpt.write_checkpoint(directory, "step-00000020", {"x": 2}, {"step": 20}, old)
    assert ckpt.list_checkpoints(directory) == []


def test_resume_prefers_the_newest_token_over_a_higher_step(directory):
    """An object store cannot close every window: a stale commit of a higher step that slipped
    in loses to the newer group's checkpoint."""
    old, new = Fence.claim(directory), Fence.claim(directory)
    ckpt.write_checkpoint(directory, "step-00000030", {"x": 30}, {"step": 30}, new)
    ckpt.write_checkpoint(directory, "step-00000050", {"x": 50}, {"step": 50})  # token 0
    assert old.token < new.token
    chosen = ckpt.latest_valid(directory)
    assert (chosen.step, chosen.fence) == (30, new.token)
    ckpt.prune(directory, keep_last=1)
    assert [c.step for c in ckpt.list_checkpoints(directory)] == [30]


def test_the_manager_claims_before_it_chooses_and_a_stale_manager_stops(directory):
    first = CheckpointManager(directory, {"box": Box(1.0)}, async_save=False)
    assert first.load_latest() is None
    first.save(5)
    second = CheckpointManager(directory, {"box": Box(0.0)}, async_save=True)
    assert second.load_latest() is not None and second.state["box"].value.item() == 1.0
    assert second.fence.token == first.fence.token + 1
    with pytest.raises(FencedOut):
        first.save(6)
    second.save(6)
    second.close()
    assert [(c.step, c.fence) for c in ckpt.list_checkpoints(directory)] == \
        [(5, first.fence.token), (6, second.fence.token)]


def test_an_async_stale_save_raises_at_the_next_call(tmp_path):
    directory = str(tmp_path / "ck")
    stale = CheckpointManager(directory, {"box": Box(1.0)}, async_save=True)
    stale.save(1)
    stale.wait()
    Fence.claim(directory)
    stale.save(2)  # the refusal happens in the writer thread
    with pytest.raises(FencedOut):
        stale.wait()
    assert [c.step for c in ckpt.list_checkpoints(directory)] == [1]


def test_concurrent_claims_are_unique(tmp_path):
    """Threads, each with its own open file description of the lock: flock excludes them as it
    excludes processes on other hosts of a shared filesystem."""
    directory = str(tmp_path / "ck")
    with ThreadPoolExecutor(4) as pool:
        tokens = list(pool.map(lambda _: Fence.claim(directory).token, range(60)))
    assert sorted(tokens) == list(range(1, 61))


def test_a_job_that_a_newer_job_claimed_past_never_claims_again(directory):
    """Job A claims, job B takes the directory over: whichever process of A claims next (a
    restart, an in-place replacement, a spare) is refused and told why; B and a job that never
    claimed here go on."""
    a = Fence.claim(directory, run_id="job-a")
    again = Fence.claim(directory, run_id="job-a")  # A's own restart: the newest is A's
    b = Fence.claim(directory, run_id="job-b")
    assert (again.token, b.token) == (a.token + 1, a.token + 2)
    with pytest.raises(FencedOut) as e:
        Fence.claim(directory, run_id="job-a")
    assert (f"this job (run id job-a) held fencing token {again.token}, and a newer group "
            f"claimed token {b.token} since (run id job-b") in str(e.value)
    assert Fence(directory, 0).newest() == b.token  # the refused claim took nothing
    assert Fence.claim(directory, run_id="job-b").token == b.token + 1
    assert Fence.claim(directory, run_id="job-c").token == b.token + 2
    assert Fence.claim(directory, run_id="").token == b.token + 3  # no run id: no lineage


def test_a_commit_never_replaces_a_checkpoint_of_another_token(directory):
    """A newer token's commit of a name an older token wrote (a step redone after a restart)
    sets the old one aside, kept; its own token's is replaced; a newer token's stops it."""
    old = Fence.claim(directory, run_id="r")
    ckpt.write_checkpoint(directory, "step-00000010", {"x": 1}, {"step": 10}, old)
    new = Fence.claim(directory, run_id="r")
    ckpt.write_checkpoint(directory, "step-00000010", {"x": 2}, {"step": 10}, new)
    ckpt.write_checkpoint(directory, "step-00000010", {"x": 3}, {"step": 10}, new)  # redone
    (info,) = ckpt.list_checkpoints(directory)
    assert info.fence == new.token and ckpt.load_state(info.path)["x"] == 3
    aside = f"{directory}/.superseded-step-00000010-fence-{old.token}"
    kept = ckpt.inspect(aside, verify=True)
    assert kept.valid and kept.fence == old.token and ckpt.load_state(aside)["x"] == 1
    with pytest.raises(FencedOut, match=f"written under fencing token {new.token}, newer than "
                                        "this group's 0"):
        ckpt.write_checkpoint(directory, "step-00000010", {"x": 4}, {"step": 10})  # unfenced
    assert ckpt.load_state(info.path)["x"] == 3
