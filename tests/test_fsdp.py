"""FSDP2 with sharded DCP checkpoints under ``elastic-runner run`` (real torchrun, gloo, CPU):
bitwise resume after kill -9, a rank killed while its shards are being saved, resharding
2 -> 3 -> 1 -> 2 (from a DDP checkpoint) with every sample exactly once, and GPT-2 trained
sharded and exported for ``from_pretrained``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from elastic_runner.checkpoint import storage as ckpt
from elastic_runner.data import audit

from .evidence import (
    DIGITS_GLOBAL_BATCH,
    DIGITS_TRAIN,
    assert_exact_audit,
    assert_same_optimizer,
    assert_same_tensors,
)
from .needs import HF_EXTRA, require_modules
from .procs import CONFIGS, Pace, cli, wait_until
from .test_train_torchrun import final_state, results

pytestmark = pytest.mark.slow

DIGITS = str(CONFIGS / "digits.yaml")
FSDP = ["distributed.strategy=fsdp", "logging.tensorboard_dir=null",
        "early_stopping.enabled=false"]


def run_to_end(launch, name, *args, timeout=300):
    job = launch(cli("run", *args, "--monitor-interval", "0.2"), name=name)
    assert job.wait(timeout=timeout) == 0, job.output[-3000:]
    return job


def committed(ck: Path) -> list[int]:
    return sorted(c.step for c in ckpt.list_checkpoints(ck) if c.kind == "step" and c.valid)


# the uninterrupted run of the restart and in-place tests: one reference for both
# (tests/references.py; the checkpoint cadence and the recovery settings are neutral)
FSDP_RUN = [DIGITS, *FSDP, "training.max_steps=35", "checkpoint.at_epoch_end=false"]


def test_fsdp_kill_and_resume_is_bitwise_also_when_a_rank_dies_in_the_save(launch, tmp_path,
                                                                          reference):
    """The restart path (``recovery.mode: restart``), dropout on, 2 ranks, one job: a rank
    SIGKILLed while the checkpoint of step 10 is being written (after its snapshot, with the
    background write of the shards in flight: nothing of step 10 may be published; the restart
    resumes from step 5), then, in the restarted group, a rank SIGKILLed after step 15 (the
    restart resumes from step 10). The run ends bitwise equal to the uninterrupted one,
    weights and AdamW state."""
    ref = reference(*FSDP_RUN, "--monitor-interval", "0.2")
    want = final_state(ref)
    assert (Path(ckpt.latest_valid(ref).path) / "__1_0.distcp").exists()

    ck = tmp_path / "ck"
    # the second fault fires in restart attempt 1 (attempts: 2), once (faults.once_dir)
    faults = ("faults.inject=[{kind: sigkill, rank: 1, step: 10, during: checkpoint},"
              " {kind: sigkill, rank: 1, step: 15, attempts: 2}]")
    job = run_to_end(launch, "kills", *FSDP_RUN, "checkpoint.every_steps=5",
                     "checkpoint.keep_last=10", "recovery.mode=restart", f"checkpoint.dir={ck}",
                     faults, f"faults.once_dir={tmp_path / 'once'}", "--max-restarts", "2")
    out = job.output
    first_attempt, second, third = out.split("resumed from ")  # exactly two restarts
    assert "fault injection: rank 1 sigkill during the checkpoint of step 10" in first_attempt
    # the first attempt published nothing of step 10; the second wrote it again
    assert "committed sharded checkpoint" in first_attempt, out[-3000:]
    assert f"{ck / 'step-00000010'}" not in first_attempt
    assert second.startswith(f"{ck / 'step-00000005'}: step 5,"), out[-3000:]
    assert f"{ck / 'step-00000010'}" in second
    assert "fault injection: rank 1 sigkill after step 15" in second
    assert third.startswith(f"{ck / 'step-00000010'}: step 10,"), out[-3000:]
    got = final_state(ck)
    assert got["train_state"]["step"] == want["train_state"]["step"] == 35
    assert_same_tensors(want["model"], got["model"])
    assert_same_optimizer(want["optimizer"], got["optimizer"])
    assert committed(ck) == list(range(5, 36, 5))
    assert not [p for p in ck.iterdir() if p.name.startswith(".tmp")]


def test_fsdp_in_place_recovery_rolls_back_to_peer_copies_bitwise(launch, tmp_path, reference):
    """``recovery.mode: in_place`` under FSDP2, 2 ranks, peer copies every 5 steps: rank 1
    SIGKILLed after step 23, then rank 0 while the sharded checkpoint of step 30 is being
    written. Each time the survivor keeps its process, the replacement (a warm spare) gets its
    shards from the survivor's copy, both roll back to the copies' step (20, then 25) and redo
    the steps after it; no checkpoint is read. The run ends bitwise equal to the uninterrupted
    one (weights and AdamW moments, dropout on), every sample of every step traced once."""
    want = final_state(reference(*FSDP_RUN, "--monitor-interval", "0.2"))
    common = [*FSDP_RUN, "checkpoint.every_steps=10", "recovery.peer_copy_every_steps=5",
              "recovery.spare_delay_seconds=0"]

    ck, trace = tmp_path / "ck", tmp_path / "trace"
    faults = ("faults.inject=[{kind: sigkill, rank: 1, after_steps: 23},"
              " {kind: sigkill, rank: 0, step: 30, during: checkpoint}]")
    job = run_to_end(launch, "in-place", *common, f"checkpoint.dir={ck}", faults,
                     f"faults.once_dir={tmp_path / 'once'}", "--trace-samples", str(trace))
    out = job.output
    assert "resumed from" not in out  # every state came from memory
    assert out.count("replaced in place by") == 2, out[-3000:]
    # rank 0 logs at INFO: the survivor first, then the replacement
    assert "rank 0 rolled back to step 20 (peer copies; replacements [1])" in out
    assert "rank 0 received the state of step 25 (peer copies; replacements [0])" in out
    assert "the sharded checkpoint in flight was abandoned" in out  # step 30's, on rank 1
    assert "3 committed step(s) redone" in out and "5 committed step(s) redone" in out
    got = final_state(ck)
    assert got["train_state"]["step"] == want["train_state"]["step"] == 35
    assert_same_tensors(want["model"], got["model"])
    assert_same_optimizer(want["optimizer"], got["optimizer"])
    assert committed(ck)[-1] == 35
    # two ranks killed in place, each after committing steps: at most one entry each repaired
    assert_exact_audit(trace, steps=35, global_batch=DIGITS_GLOBAL_BATCH,
                       num_samples=DIGITS_TRAIN, repaired_at_most=2)
    steps = sorted(e["step"] for e in audit.read_entries(trace) if "indices" in e)
    assert steps == sorted(list(range(1, 36)) * 2)

    # a shard that only rank 1 hashes (the ranks share the sha256 check: every 2nd file by
    # name) is corrupt: both ranks skip that checkpoint, resume the one before and end bitwise
    shard = ck / "step-00000035" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    out = run_to_end(launch, "corrupt", *common, f"checkpoint.dir={ck}").output
    assert (f"skipping checkpoint {ck / 'step-00000035'}: __0_0.distcp sha256 mismatch "
            "(corrupt)") in out
    assert f"resumed from {ck / 'step-00000030'}: step 30," in out
    got = final_state(ck)
    assert_same_tensors(want["model"], got["model"])
    assert_same_optimizer(want["optimizer"], got["optimizer"])


def test_fsdp_continue_shrunk_reshards_from_checkpoints_in_place(launch, tmp_path):
    """No spare, ``recovery.continue_shrunk``: rank 1 of 2 SIGKILLed after step 23. Rank 0
    keeps its process and goes on alone at once: the peer copies do not fit one rank's shards,
    so it loads the newest checkpoint (step 20, resharded by DCP). When the replacement is up,
    the group grows back at a step boundary: it commits that step first, and the larger group
    loads it, redoing nothing. Every sample of every epoch once, each step's global batch
    whole."""
    ck, trace = tmp_path / "ck", tmp_path / "trace"
    pace = Pace(tmp_path / "pace", 0.15)  # rank 0 slowed until the group is whole again
    job = launch(cli("run", DIGITS, *FSDP, "training.max_steps=60", "checkpoint.every_steps=10",
                     "recovery.peer_copy_every_steps=5", "recovery.continue_shrunk=true",
                     "recovery.spare=false", "batch.global_batch_size=64",
                     f"checkpoint.dir={ck}", *pace.args,
                     "faults.inject=[{kind: sigkill, rank: 1, after_steps: 23}]",
                     f"faults.once_dir={tmp_path / 'once'}", "--trace-samples", str(trace),
                     "--monitor-interval", "0.2"), name="shrunk")
    wait_until(lambda: "back to world size 2" in job.output, 120, "the group to grow back")
    pace.end()
    assert job.wait(timeout=300) == 0, job.output[-3000:]
    out = job.output
    assert "the copies were taken at another world size than 1; every rank loads the newest " \
           "checkpoint" in out, out[-3000:]
    assert f"resumed from {ck / 'step-00000020'}: step 20," in out
    grown = re.search(r"the replacement is ready: back to world size 2 after step (\d+)", out)
    assert grown, out[-3000:]
    assert f"resumed from {ck / f'step-{int(grown[1]):08d}'}: step {grown[1]}," in out
    assert "Traceback" not in out
    worlds = {e["step"]: e["world_size"] for e in audit.read_entries(trace) if "world_size" in e}
    assert worlds[21] == 1 and worlds[60] == 2 and sorted(worlds) == list(range(1, 61))
    # batch.global_batch_size=64 at world sizes 2 and 1; rank 1 killed in place after step 23
    assert_exact_audit(trace, steps=60, global_batch=64, num_samples=DIGITS_TRAIN,
                       repaired_at_most=1)
    by_step: dict[int, int] = {}
    for e in audit.read_entries(trace):
        if "indices" in e:
            by_step[e["step"]] = by_step.get(e["step"], 0) + len(e["indices"])
    assert set(by_step.values()) == {64}


def test_fsdp_reshards_2_3_1_2_3_from_a_ddp_checkpoint_with_every_sample_once(launch, tmp_path):
    """A DDP run at 2 ranks (rank-0 checkpoint) to step 4, then FSDP2 at 3 (the DDP
    checkpoint resharded, uneven shards), 1 and 2 ranks, then DDP at 3 ranks writing DCP
    checkpoints (the replicated tensors spread over the ranks), each resuming the previous one's
    checkpoint: the audit of the fetched sample ids is exact over both epochs, every step trains
    the global batch of 64 (at 3 ranks, which 3 x 16 does not divide, two micro-batches of 11 or
    10 samples on every rank, each loss weighted by its share), and the loss continues the
    uninterrupted DDP run's."""
    # global batch 64 = 2 x 16 x 2 = 1 x 16 x 4; at 3 ranks 2 x (11 or 10): 19 steps an epoch
    common = [DIGITS, *FSDP[1:], "batch.micro_batch_size=16", "batch.global_batch_size=64",
              "schedule.name=constant", "schedule.warmup_steps=0", "model.dropout=0.0",
              "training.max_epochs=2", "checkpoint.every_steps=4", "checkpoint.keep_last=40"]
    ref_trace = tmp_path / "ref-trace"
    run_to_end(launch, "reference", *common, f"checkpoint.dir={tmp_path / 'ref'}",
               "--trace-samples", str(ref_trace))

    ck, trace = tmp_path / "ck", tmp_path / "trace"
    phases = [("2", "ddp", "auto", 4), ("3", "fsdp", "auto", 14), ("1", "fsdp", "auto", 24),
              ("2", "fsdp", "auto", 30), ("3", "ddp", "dcp", None)]
    resumed = [None, 4, 14, 24, 30]
    for i, (nproc, strategy, layout, limit) in enumerate(phases):
        job = run_to_end(launch, f"phase{i}-{strategy}-{nproc}", *common,
                         f"checkpoint.dir={ck}", f"distributed.strategy={strategy}",
                         f"checkpoint.format={layout}",
                         *([f"training.max_steps={limit}"] if limit else []),
                         "--nproc-per-node", nproc, "--trace-samples", str(trace))
        if i:
            step = resumed[i]
            assert f"resumed from {ck / f'step-{step:08d}'}: step {step}," in job.output
        if strategy == "fsdp":
            assert "FSDP2: 0 unit(s) + root on mesh" in job.output
    assert not ckpt.is_sharded(ck / "step-00000004")  # DDP's: one state.pt
    assert ckpt.is_sharded(ck / "step-00000038")  # DDP through DCP: one file per rank
    assert {p.name for p in (ck / "step-00000038").glob("*.distcp")} == {
        "__0_0.distcp", "__1_0.distcp", "__2_0.distcp"}
    assert ckpt.inspect(ck / "step-00000038").world_size == 3

    # global batch 64 at every world size, 2 epochs of 19 steps; restarts only
    reports = assert_exact_audit(trace, steps=38, global_batch=64, num_samples=DIGITS_TRAIN)
    assert [r.epoch for r in reports] == [0, 1]
    for r in reports:
        assert r.complete and r.seen_once == r.expected == DIGITS_TRAIN - r.dropped, r
    entries = audit.read_entries(trace)
    worlds = {e["step"]: e["world_size"] for e in entries if "world_size" in e}
    assert (worlds[4], worlds[5], worlds[14], worlds[15], worlds[24], worlds[25], worlds[31]) == (
        2, 3, 3, 1, 1, 2, 3)
    assert sorted(len(e["indices"]) for e in entries if e["step"] == 5 and "indices" in e) == [
        21, 21, 22]

    ref, got = audit.loss_curve(ref_trace), audit.loss_curve(trace)
    assert ref.keys() == got.keys() and len(ref) == 38
    assert [got[s] for s in range(1, 5)] == [ref[s] for s in range(1, 5)]  # the DDP phase
    # the same samples in the same steps; sums in another order (the norm over shards, 3 or 1
    # ranks, reduce-scatter instead of all-reduce, 3 ranks' weighted micro-batches of 11 or 10
    # samples): 1.97e-7 measured with an even split (2026-11-27), bound 10x that
    # (docs/guides/ddp-or-fsdp.md)
    drift = max(abs(got[s] - ref[s]) for s in range(5, 39))
    print(f"loss drift after the first change: {drift:.3g}")  # pytest -s shows it
    assert drift < 2e-6, drift


HF = ["task=causal_lm", "data.block_size=64", "data.vocab_size=512", "model.n_layer=2",
      "model.n_head=4", "model.n_embd=64", "data.corpus_modules=[functools,textwrap]"]


def test_gpt2_trains_sharded_per_block_and_exports_for_from_pretrained(launch, tmp_path):
    require_modules("transformers", "tokenizers", install_hint=HF_EXTRA)
    from elastic_runner.cli import main as cli_main
    from elastic_runner.tasks.export import model_from_checkpoint

    from .hf_helpers import fresh_load, runner_logits

    ck = tmp_path / "ck"
    job = run_to_end(launch, "gpt2-fsdp", str(CONFIGS / "causal_lm.yaml"), *HF, *FSDP,
                     "training.max_steps=24", "eval.every_steps=12", "checkpoint.every_steps=12",
                     f"checkpoint.dir={ck}", timeout=500)
    assert "FSDP2: 2 unit(s) + root on mesh (2,)" in job.output  # GPT-2's transformer.h
    evals = [float(line.split("val_loss=")[1].split()[0]) for line in job.output.splitlines()
             if "eval at step" in line]
    assert len(evals) == 2 and evals[1] < evals[0], evals
    assert results(ck)["step"] == 24

    # the CLI's export in this process (it imports transformers for the runner's model below
    # anyway; a subprocess would pay torch's and transformers' import again): its exit code
    out = tmp_path / "export"
    assert cli_main(["export", str(ck), str(out)]) == 0
    _, _, model, _ = model_from_checkpoint(None, ck)
    loaded = fresh_load(out, "AutoModelForCausalLM", ["def main(argv):\n    return 0\n"])
    assert loaded["model"] == "GPT2LMHeadModel"
    assert torch.allclose(torch.tensor(loaded["logits"]), runner_logits(model, loaded),
                          rtol=0, atol=1e-4)


def test_hsdp_2x2_recovers_from_a_replica_and_resumes_as_plain_fsdp(launch, tmp_path,
                                                                    reference):
    """HSDP: 2 replicas x 2 shards on 4 ranks. A NaN loss on rank 3 skips that step on every
    rank (the vote rides on the gradients: reduce-scatter, all-reduce over replicas, the norm's
    all-reduce). Rank 2 SIGKILLed after step 5 is recovered in place from rank 0, the surviving
    replica of its shard: nothing is redone (no peer copy exists yet, none is needed) and the
    run ends bitwise equal to an uninterrupted one. Its checkpoint resumes at 2 ranks as plain
    FSDP. (Replicas that do not divide the world size: test_config.py, in one process.)"""
    ck = tmp_path / "ck"
    common = [DIGITS, *FSDP, "batch.micro_batch_size=4", "batch.global_batch_size=32",
              "checkpoint.every_steps=3", "checkpoint.at_epoch_end=false",
              f"checkpoint.dir={ck}", "recovery.spare=false"]
    hsdp = [*common, "distributed.fsdp.replicas=2", "training.max_steps=8",
            "faults.inject=[{kind: nan, rank: 3, step: 4}, {kind: sigkill, rank: 2, step: 5}]",
            f"faults.once_dir={tmp_path / 'once'}", "--nproc-per-node", "4"]
    ref = reference(*hsdp[:-4], "faults.inject=[{kind: nan, rank: 3, step: 4}]", *hsdp[-2:],
                    "--monitor-interval", "0.2")
    trace = tmp_path / "trace"
    job = run_to_end(launch, "hsdp", *hsdp, "--trace-samples", str(trace), timeout=400)
    out = job.output
    assert "FSDP2: 0 unit(s) + root on mesh (2, 2)" in out
    assert "step 4: non-finite loss or gradient on at least one rank: update skipped" in out
    assert "rank(s) [2] exited with code(s) [-9]: replaced in place" in out, out[-3000:]
    assert "rank 0 goes on at step 5; replacement(s) [2] received theirs from replica(s) [0]" \
        in out
    assert "resumed from" not in out and "committed step(s) redone" not in out
    want, got = final_state(ref), final_state(ck)
    assert got["train_state"]["bad_steps"] == want["train_state"]["bad_steps"] == 1
    assert_same_tensors(want["model"], got["model"])
    assert_same_optimizer(want["optimizer"], got["optimizer"])
    # global batch 32 (4 ranks x 4 x 2); step 4 skipped (its samples consumed, traced with
    # "skipped"); rank 2 killed in place after step 5: at most its entry of step 5 repaired
    assert_exact_audit(trace, steps=8, global_batch=32, num_samples=DIGITS_TRAIN,
                       repaired_at_most=1)
    skipped = {e["step"] for e in audit.read_entries(trace) if e.get("skipped")}
    assert skipped == {4}
    # every_seconds: rank 0's clock decides a save every rank writes (its answer is broadcast)
    job = run_to_end(launch, "fsdp", *common, "training.max_steps=11",
                     "checkpoint.every_seconds=0.01")
    assert f"resumed from {ck / 'step-00000008'}: step 8" in job.output
    assert set(committed(ck)) >= {9, 10, 11}  # by the clock, at every step
    assert committed(ck)[-1] == 11
