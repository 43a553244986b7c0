"""Checkpoints on a real S3 API (moto in server mode on loopback, through s3fs): commit by
manifest, sha256 verification, retention, corrupt and partial objects written from outside, a
writer SIGKILLed between its state object and its manifest, and a 2-worker run that is SIGKILLed
and resumes from the bucket with an exact sample audit.

Faults are injected from outside the code under test (another S3 client, another process); the
reader then looks with a new s3fs instance, as a restarted rank 0 does (new process), except in
the test that checks a long-lived reader.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest
import torch

from elastic_runner.checkpoint import storage as ckpt
from elastic_runner.checkpoint.manager import CheckpointManager

from .evidence import DIGITS_GLOBAL_BATCH, DIGITS_TRAIN, assert_exact_audit
from .procs import CONFIGS, cli, wait_until
from .s3 import S3Bucket, clear_s3fs_instances


def state(v: float) -> dict:
    return {"model": {"w": torch.full((4,), float(v))}, "step": int(v)}


def name(step: int) -> str:
    return f"step-{step:08d}"


def new_reader() -> None:
    """Forget this process's s3fs instance and its listings: look as a new process would."""
    clear_s3fs_instances()


def test_commit_verify_retention_and_load(s3_bucket: S3Bucket):
    url, fs = f"{s3_bucket.url}/run", s3_bucket.fs()
    for s in (1, 2, 3, 4):
        paths = ckpt.write_checkpoint(url, name(s), state(s), {"step": s, "epoch": 0})
        assert paths == [f"{url}/{name(s)}"]
    # the manifest's sha256 is that of the object the server holds (read by another client)
    manifest = json.loads(fs.cat_file(s3_bucket.key(f"run/{name(4)}/manifest.json")))
    body = fs.cat_file(s3_bucket.key(f"run/{name(4)}/state.pt"))
    assert manifest["files"]["state.pt"] == {"bytes": len(body),
                                             "sha256": hashlib.sha256(body).hexdigest()}
    new_reader()
    infos = ckpt.list_checkpoints(url)
    assert [(c.name, c.valid, c.step) for c in infos] == [(name(s), True, s) for s in (1, 2, 3, 4)]
    assert ckpt.inspect(infos[-1].path, verify=True).valid

    removed = ckpt.prune(url, keep_last=2, protect=infos[0].path)
    assert removed == [f"{url}/{name(2)}"]
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(s3_bucket.key("run"))) == [
        name(1), name(3), name(4)]

    # a step and a best checkpoint of one step share one upload (server-side copy)
    ckpt.write_checkpoint(url, [name(5), "best-step-00000005"], state(5), {"step": 5})
    new_reader()
    newest, best = ckpt.latest_valid(url), ckpt.latest_valid(url, kind="best")
    assert (newest.path, best.path) == (f"{url}/{name(5)}", f"{url}/best-step-00000005")
    for info in (newest, best):
        loaded = ckpt.load_state(info.path)
        assert torch.equal(loaded["model"]["w"], torch.full((4,), 5.0)) and loaded["step"] == 5


def test_truncated_bit_flipped_and_manifestless_objects_are_skipped(s3_bucket: S3Bucket,
                                                                   caplog):
    url, fs = f"{s3_bucket.url}/run", s3_bucket.fs()
    for s in (1, 2, 3, 4):
        ckpt.write_checkpoint(url, name(s), state(s), {"step": s})
    data = fs.cat_file(s3_bucket.key(f"run/{name(3)}/state.pt"))
    # from another client: step 4 truncated, step 5 a state object whose writer died before
    # the manifest
    fs.pipe_file(s3_bucket.key(f"run/{name(4)}/state.pt"), data[:-7])
    fs.pipe_file(s3_bucket.key(f"run/{name(5)}/state.pt"), data)
    new_reader()
    # retention counts and deletes only valid checkpoints: step 1 goes, 4 and 5 stay
    assert ckpt.prune(url, keep_last=2) == [f"{url}/{name(1)}"]
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(s3_bucket.key("run"))) == [
        name(s) for s in (2, 3, 4, 5)]
    # step 3: one bit flipped, same size
    fs.pipe_file(s3_bucket.key(f"run/{name(3)}/state.pt"), data[:-1] + bytes([data[-1] ^ 1]))
    new_reader()

    truncated = ckpt.inspect(f"{url}/{name(4)}")
    assert not truncated.valid
    assert truncated.reason == f"state.pt has {len(data) - 7} bytes, manifest says {len(data)}"
    assert ckpt.inspect(f"{url}/{name(3)}").valid  # sizes alone cannot see a flipped bit
    flipped = ckpt.inspect(f"{url}/{name(3)}", verify=True)
    assert (flipped.valid, flipped.reason) == (False, "state.pt sha256 mismatch (corrupt)")
    partial = ckpt.inspect(f"{url}/{name(5)}")
    assert (partial.valid, partial.reason) == (False, "no manifest (incomplete write)")
    empty = ckpt.inspect(f"{url}/{name(9)}")  # a prefix with no objects at all
    assert (empty.valid, empty.reason) == (False, "no manifest (incomplete write)")

    with caplog.at_level("WARNING", logger="elastic_runner.checkpoint.storage"):
        chosen = ckpt.latest_valid(url)
    assert chosen.path == f"{url}/{name(2)}"
    assert torch.equal(ckpt.load_state(chosen.path)["model"]["w"], torch.full((4,), 2.0))
    skipped = sorted(r.getMessage() for r in caplog.records)
    assert skipped == [f"skipping checkpoint {url}/{name(3)}: state.pt sha256 mismatch "
                       "(corrupt)",
                       f"skipping checkpoint {url}/{name(4)}: state.pt has {len(data) - 7} "
                       f"bytes, manifest says {len(data)}",
                       f"skipping checkpoint {url}/{name(5)}: no manifest (incomplete write)"]


# The child commits step 1, then step 2 with its manifest's PUT held forever: the SIGKILL lands
# after state.pt is on the server and before the manifest. The hold is in the S3 client call
# (every request passes s3fs's _call_s3), so it does not depend on how checkpoint/storage.py is written.
KILLED_WRITER = """
import asyncio, sys
import s3fs.core, torch
from elastic_runner.checkpoint.manager import CheckpointManager

url = sys.argv[1]
call_s3 = s3fs.core.S3FileSystem._call_s3

async def held(self, method, *args, **kwargs):
    if method == "put_object" and kwargs.get("Key", "").endswith("step-00000002/manifest.json"):
        print("holding the manifest of step 2", flush=True)
        await asyncio.Event().wait()  # until SIGKILL
    return await call_s3(self, method, *args, **kwargs)

s3fs.core.S3FileSystem._call_s3 = held
model = torch.nn.Linear(3, 2)
manager = CheckpointManager(url, {"model": model}, async_save=False, rank=0)
for step in (1, 2):
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(step))
    manager.save(step)
print("not reached", flush=True)
"""


def fill(model: torch.nn.Module, value: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)


def test_writer_killed_between_state_and_manifest_resumes_from_previous(s3_bucket: S3Bucket,
                                                                        launch):
    url, fs = f"{s3_bucket.url}/run", s3_bucket.fs()
    writer = launch([sys.executable, "-c", KILLED_WRITER, url], name="writer",
                    env=s3_bucket.env)
    state_key = s3_bucket.key(f"run/{name(2)}/state.pt")
    wait_until(lambda: fs.exists(state_key) or writer.proc.poll() is not None, 60,
               "the writer's state.pt of step 2 on the server")
    # the object exists once its PUT is complete; the child then holds the manifest's PUT
    wait_until(lambda: "holding the manifest" in writer.output or writer.proc.poll() is not None,
               60, "the writer to hold the manifest of step 2")
    assert writer.proc.poll() is None, writer.output
    writer.proc.kill()  # SIGKILL, by pid
    assert writer.wait(timeout=30) == -9
    assert "not reached" not in writer.output
    assert sorted(fs.ls(s3_bucket.key(f"run/{name(2)}"))) == [state_key]

    new_reader()
    model = torch.nn.Linear(3, 2)
    fill(model, 0.0)
    manager = CheckpointManager(url, {"model": model}, async_save=False, rank=0)
    assert ckpt.inspect(f"{url}/{name(2)}").reason == "no manifest (incomplete write)"
    raw = manager.load_latest()
    assert raw is not None and manager.resumed_from == f"{url}/{name(1)}"
    assert all(torch.equal(p, torch.ones_like(p)) for p in model.parameters())

    # the resumed writer redoes step 2 over the partial prefix, and that one is trusted
    fill(model, 2.0)
    manager.save(2)
    new_reader()
    redone = ckpt.latest_valid(url)
    assert redone.path == f"{url}/{name(2)}"
    assert torch.equal(ckpt.load_state(redone.path)["model"]["bias"], torch.full((2,), 2.0))


WRITE_STEP = """
import sys, torch
from elastic_runner.checkpoint import storage as ckpt
step = int(sys.argv[2])
ckpt.write_checkpoint(sys.argv[1], f"step-{step:08d}", {"w": torch.full((4,), float(step))},
                      {"step": step})
"""


def test_a_long_lived_reader_sees_commits_of_another_process(s3_bucket: S3Bucket):
    """E.g. an evaluator polling ``latest_valid``, or a rank 0 that has listed the prefix and
    then reads after another process committed."""
    url = f"{s3_bucket.url}/run"
    ckpt.write_checkpoint(url, name(1), {"w": torch.ones(4)}, {"step": 1})
    assert ckpt.latest_valid(url).step == 1  # this process has listed the prefix now
    subprocess.run([sys.executable, "-c", WRITE_STEP, url, "2"], check=True, timeout=120,
                   env={**os.environ, **s3_bucket.env})
    assert ckpt.latest_valid(url).step == 2


DIGITS = str(CONFIGS / "digits.yaml")
STEPS = 24  # digits at world size 2: 19 steps per epoch (global batch 64), 5 into epoch 1


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_run_sigkilled_resumes_from_s3_with_exact_audit(s3_bucket: S3Bucket, launch, tmp_path,
                                                        strategy, capsys):
    """Rank 0's checkpoints (DDP) and sharded ones (FSDP2: every rank writes its DCP files to
    the checkpoint's prefix, rank 0 the manifest last) on S3: a worker SIGKILLed from outside,
    the restart resumes from the bucket, every sample once."""
    url, fs, trace = f"{s3_bucket.url}/run", s3_bucket.fs(), tmp_path / "trace"
    job = launch(cli("run", DIGITS, "logging.tensorboard_dir=null",
                     f"distributed.strategy={strategy}",
                     "early_stopping.enabled=false", f"training.max_steps={STEPS}",
                     "training.max_epochs=1000", "checkpoint.every_steps=5",
                     "recovery.mode=restart", f"checkpoint.dir={url}",
                     # rank 0 is slowed so the kill lands mid-run, well before the end
                     "faults.inject=[{kind: slow, rank: 0, step: 1, count: 100000, "
                     "seconds: 0.1}]",
                     "--trace-samples", str(trace), "--nproc-per-node", "2",
                     "--max-restarts", "2", "--monitor-interval", "0.2"),
                 name="s3-run", env=s3_bucket.env)
    first = s3_bucket.key(f"run/{name(5)}/manifest.json")
    wait_until(lambda: fs.exists(first) or job.proc.poll() is not None, 240,
               "the step-5 checkpoint's manifest on S3")
    workers = job.workers()
    assert set(workers) == {0, 1}, job.output[-3000:]
    workers[1].kill()  # SIGKILL from outside
    assert job.wait(timeout=300) == 0, job.output[-4000:]

    out = job.output
    resumed = int(out.split(f"resumed from {url}/step-", 1)[1].split(":", 1)[0])
    assert 5 <= resumed < STEPS, out[-3000:]
    # every sample of epoch 0 once (its drop_last tail aside), the first 5 steps of epoch 1;
    # the restart path: nothing repaired
    reports = assert_exact_audit(trace, steps=STEPS, global_batch=DIGITS_GLOBAL_BATCH,
                                 num_samples=DIGITS_TRAIN)
    assert [(r.epoch, r.complete, r.steps, r.seen_once, r.duplicated, r.missing)
            for r in reports] == [(0, True, 19, 19 * 64, [], []),
                                  (1, False, STEPS - 19, (STEPS - 19) * 64, [], [])], reports
    assert reports[0].expected == 19 * 64

    new_reader()
    steps = [c.step for c in ckpt.list_checkpoints(url) if c.kind == "step" and c.valid]
    # keep_last 3 (19: the epoch's end) and never the one this run resumed from
    assert steps == sorted({resumed, 19, 20, STEPS})
    final = ckpt.load_state(ckpt.latest_valid(url).path)
    assert final["train_state"]["step"] == STEPS
    assert json.loads(fs.cat_file(s3_bucket.key("run/results.json")))["step"] == STEPS
    # the CLI, in this process (s3_bucket set the server's env here; a new s3fs instance, as a
    # new process has): it finds the server by the env
    from elastic_runner.cli import main as cli_main

    new_reader()
    capsys.readouterr()
    assert cli_main(["checkpoints", url, "--verify"]) == 0
    listing = capsys.readouterr().out
    rows = [ln.split() for ln in listing.splitlines()[1:]]
    assert [r[0] for r in rows if r[0].startswith("step-")] == [name(s) for s in steps]
    assert all(r[-1] == "valid" for r in rows), listing
    if strategy == "fsdp":  # both ranks' shards, listed and hashed in the manifest
        manifest = json.loads(fs.cat_file(s3_bucket.key(f"run/{name(STEPS)}/manifest.json")))
        assert sorted(manifest["files"]) == [".metadata", "__0_0.distcp", "__1_0.distcp",
                                             "state.pt"]
