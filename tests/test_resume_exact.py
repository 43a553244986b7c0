"""Exact resume with real torchrun process groups: the log naming a global batch that follows
the world size, corrupt newest checkpoints, diverged replicas. (Bitwise replay on the restart
path: test_train_torchrun.py's digits, dropout on, an evaluation at the resumed step. World-size changes with a sample audit: test_fsdp.py's DDP -> FSDP at 3, 1, 2 -> DDP chain,
test_own_loop.py's 2 -> 1 -> 2, test_hf_tasks.py's 1 -> 2.)"""

from __future__ import annotations

import pytest

from elastic_runner.checkpoint import storage as ckpt

from .procs import CONFIGS, cli, cli_here
from .test_train_torchrun import final_state

pytestmark = pytest.mark.slow

DIGITS = str(CONFIGS / "digits.yaml")
QUIET = ["logging.tensorboard_dir=null", "early_stopping.enabled=false"]


def run_to_end(launch, name, *args, timeout=300):
    job = launch(cli("run", *args, "--monitor-interval", "0.2"), name=name)
    assert job.wait(timeout=timeout) == 0, job.output[-3000:]
    return job


def test_without_global_batch_the_log_names_the_change(launch, tmp_path):
    ck = tmp_path / "ck"
    # keep_global_batch=false: the global batch follows the world size (by default the job's
    # first is kept, and nothing changes)
    common = [DIGITS, *QUIET, f"checkpoint.dir={ck}", "batch.micro_batch_size=8",
              "batch.grad_accum_steps=1", "batch.keep_global_batch=false"]
    run_to_end(launch, "two", *common, "training.max_steps=4")
    job = launch(cli("train", *common, "training.max_steps=6"), name="one")  # world size 1
    assert job.wait(timeout=300) == 0, job.output[-3000:]
    assert "global batch changed from 16 to 8 samples (world size now 1)" in job.output


def corrupt(path, how: str) -> str:
    f = path / "state.pt"
    if how == "truncate":
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
        return "bytes, manifest says"
    if how == "bitflip":
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0x01
        f.write_bytes(bytes(data))
        return "sha256 mismatch"
    f.unlink()
    return "state.pt missing"


def test_corrupt_newest_checkpoints_fall_back_to_the_newest_valid(launch, tmp_path, capsys):
    ck = tmp_path / "ck"
    common = [DIGITS, *QUIET, f"checkpoint.dir={ck}", "checkpoint.every_steps=1",
              "checkpoint.keep_last=4"]
    # world size 1, no launcher: the fastest way to checkpoints (the resume below is at 2)
    first = launch(cli("train", *common, "training.max_steps=6"), name="first")
    assert first.wait(timeout=300) == 0, first.output[-3000:]
    # the three newest are damaged three ways; the resume must skip each, naming why
    reasons = {step: corrupt(ck / f"step-{step:08d}", how)
               for step, how in ((6, "truncate"), (5, "bitflip"), (4, "delete"))}
    listing = cli_here(capsys, "checkpoints", str(ck), "--verify")[1]
    assert listing.count("INVALID") == 3 and all(r in listing for r in reasons.values())

    job = run_to_end(launch, "again", *common, "training.max_steps=8")
    out = job.output
    for step, reason in reasons.items():
        skipped = [ln for ln in out.splitlines()
                   if f"skipping checkpoint {ck / f'step-{step:08d}'}: " in ln]
        assert skipped and reason in skipped[0], (step, reason, skipped)
    assert f"resumed from {ck / 'step-00000003'}: step 3" in out
    assert final_state(ck)["train_state"]["step"] == 8


def test_diverged_replicas_after_resume_fail_loudly(launch, tmp_path):
    ck = tmp_path / "ck"
    # world size 1, no launcher: the fastest way to a checkpoint
    first = launch(cli("train", DIGITS, *QUIET, f"checkpoint.dir={ck}", "training.max_steps=2"),
                   name="first")
    assert first.wait(timeout=300) == 0, first.output[-3000:]
    job = launch(cli("run", DIGITS, *QUIET, f"checkpoint.dir={ck}", "training.max_steps=4",
                     "faults.perturb_rank=1", "--max-restarts", "0"), name="diverged")
    assert job.wait(timeout=300) == 1
    assert "model parameters loaded from" in job.output and "differs between ranks" in job.output
    assert [c.step for c in ckpt.list_checkpoints(ck) if c.kind == "step"] == [2]
