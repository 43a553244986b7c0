"""The own-loop example (``examples/own_loop.py``, the DDP tutorial's loop plus elastic-runner in
a few lines) under real torchrun process groups: kill -9 and SIGTERM of a worker, a 2 -> 1 -> 2
world-size change with the sample audit, and the diff from the tutorial loop."""

from __future__ import annotations

import difflib
import re
import signal
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
import torch

from elastic_runner.checkpoint import storage as ckpt
from elastic_runner.cli import main as cli_main
from elastic_runner.data import audit

from .evidence import assert_exact_audit, assert_same_optimizer, assert_same_tensors
from .procs import REPO, Job, Pace, cli, free_port, wait_until
from .test_inplace import done, replacements

_READY = re.compile(r"spare \S+ ready")

EXAMPLES = REPO / "examples"
pytestmark = pytest.mark.slow


def code_diff() -> list[str]:
    """Changed lines from the tutorial loop to the fault-tolerant one, module docstrings
    aside."""
    def code(name: str) -> list[str]:
        text = (EXAMPLES / name).read_text()
        return text.split('"""', 2)[2].splitlines()

    return [ln for ln in difflib.unified_diff(code("ddp_tutorial.py"), code("own_loop.py"),
                                              lineterm="", n=0)
            if ln[:1] in "+-" and not ln.startswith(("+++", "---"))]


@pytest.mark.timeout(30)
def test_at_most_20_changed_lines_and_the_readme_and_guide_show_them():
    diff = code_diff()
    added = [ln for ln in diff if ln.startswith("+")]
    assert 0 < len(added) <= 20, "\n".join(diff)
    guide = (REPO / "docs" / "guides" / "own-loop.md").read_text()
    # the guide's diff is made from the two files when the site is built, not pasted
    assert "{er-diff} ../../examples/ddp_tutorial.py ../../examples/own_loop.py" in guide
    removed = [ln for ln in diff if ln.startswith("-")]
    readme = (REPO / "README.md").read_text()
    assert f"({len(added)} added, {len(removed)}\nremoved" in readme
    missing = [ln for ln in diff if ln.strip("+- ") and ln not in readme]
    assert not missing, missing


def test_the_tutorial_loop_runs_under_torchrun(launch):
    job = launch([sys.executable, "-m", "torch.distributed.run", "--standalone",
                  "--nproc-per-node", "2", str(EXAMPLES / "ddp_tutorial.py"), "--steps", "20"],
                 name="tutorial")
    assert job.wait(timeout=240) == 0, job.output[-3000:]
    assert re.search(r"step 20 loss \d", job.output), job.output[-3000:]


def torchrun(*args: str, nproc: int = 2, restarts: int = 2, script: str = "own_loop.py"
             ) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            str(nproc), "--max-restarts", str(restarts), "--monitor-interval", "0.2",
            str(EXAMPLES / script), *args]


def model_state(ck) -> dict[str, torch.Tensor]:
    state = ckpt.load_state(ckpt.latest_valid(ck).path)
    return {**state["model"], "adam_step": state["optimizer"]["state"][0]["step"]}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted 80-step run, shared by the tests that compare weights with it."""
    ck = tmp_path_factory.mktemp("own-loop-ref")

    job = Job(torchrun("--steps", "80", "--checkpoint-dir", str(ck)), ck / "job.log")
    try:
        assert job.wait(timeout=240) == 0, job.output[-3000:]
    finally:
        job.kill_all()
    return model_state(ck)


def test_sigterm_and_kill_9_under_torchrun_resume_bitwise_then_2_1_2_ranks_audit_exact(
        launch, tmp_path, reference, capsys):
    """One job at 2 ranks, 80 steps: rank 1 gets SIGTERM after step 27 (every rank discards
    step 28, checkpoints step 27 and exits 143: nothing lost), then, in the restarted group,
    SIGKILL after step 30 (the restart resumes step 27's checkpoint and redoes the steps after
    it). It ends bitwise equal to the uninterrupted run. Its checkpoint then continues at world
    size 1 and at 2 again: the sample audit is exact over the epochs across the changes."""
    ck, trace = tmp_path / "ck", tmp_path / "trace"
    # the kill fires in restart attempt 1 (attempts: 2); attempt 0 ends at the SIGTERM first
    faults = ("[{kind: sigterm, rank: 1, step: 27},"
              " {kind: sigkill, rank: 1, step: 30, attempts: 2}]")
    job = launch(torchrun("--steps", "80", "--checkpoint-dir", str(ck), "--trace-dir",
                          str(trace)), name="faults", env={"ELASTIC_RUNNER_FAULTS": faults})
    assert job.wait(timeout=240) == 0, job.output[-3000:]
    out = job.output
    first, after_sigterm, after_kill = out.split("resumed from ")  # exactly two restarts
    # the signal lands after step 27; every rank discards step 28 and saves step 27
    assert "preemption: checkpointing step 27" in first and "exitcode: 143" in out, out[-3000:]
    assert after_sigterm.startswith(f"{ck / 'step-00000027'}: step 27"), out[-3000:]
    assert "sample trace: dropped" not in after_sigterm  # zero lost steps
    assert "fault injection: rank 1 sigkill after step 30" in after_sigterm
    assert after_kill.startswith(f"{ck / 'step-00000027'}: step 27"), out[-3000:]
    assert "entries of steps after 27 (lost work)" in after_kill  # the kill's: 28 to 30
    # own_loop.py: all 1797 samples, 16 per rank and step (global batch 32 at 2 ranks); the
    # restarts resumed checkpoints every rank reached: nothing repaired
    epoch0 = assert_exact_audit(trace, steps=80, global_batch=32)[0]
    assert epoch0.complete and epoch0.seen_once == 56 * 32
    assert_same_tensors(reference, model_state(ck))

    for i, (nproc, steps) in enumerate([(1, 150), (2, 170)]):
        job = launch(torchrun("--steps", str(steps), "--checkpoint-dir", str(ck),
                              "--trace-dir", str(trace), nproc=nproc), name=f"world-{nproc}")
        assert job.wait(timeout=240) == 0, job.output[-3000:]
        resumed = (80, 150)[i]
        assert f"resumed from {ck / f'step-{resumed:08d}'}: step {resumed}" in job.output
    worlds = {e["step"]: e["world_size"] for e in audit.read_entries(trace) if "world_size" in e}
    assert (worlds[80], worlds[81], worlds[150], worlds[151]) == (2, 1, 1, 2)
    # the global batch is 16 per rank: 32, 16, then 32 again. Epoch 0: 56 steps of 32 (5 left
    # as the tail); epoch 1: 24 steps of 32, then 64 of 16 at world size 1 (5 left); epoch 2:
    # 6 steps of 16, then 20 of 32
    first, second, third = assert_exact_audit(trace, steps=170, global_batch=None)
    for epoch in (first, second):
        assert epoch.complete and epoch.seen_once == 1797 - 5 and epoch.dropped == 5, epoch
    assert not third.complete and not third.duplicated and third.seen_once == 6 * 16 + 20 * 32
    capsys.readouterr()
    assert cli_main(["audit", str(trace)]) == 0  # the CLI's report, in this process
    assert capsys.readouterr().out.count(" ok ") == 2


def test_a_kept_global_batch_of_64_goes_from_2_ranks_to_3_split_unevenly(launch, tmp_path):
    """``examples/own_loop_trainer.py --global-batch 64`` (micro-batch 16): DDP at 2 ranks (two
    micro-batches of 16 each), then FSDP2 at 3 ranks (the DDP checkpoint resharded), then DDP
    at 3 again, each resuming the one before. 3 x 16 does not divide 64: every rank runs two
    micro-batches of 11 or 10 samples, every step trains 64 samples, and the sample audit is
    exact across the changes. The update at such a split: ``tests/test_sampler.py``."""
    ck, trace = tmp_path / "ck", tmp_path / "trace"
    common = ["--global-batch", "64", "--checkpoint-dir", str(ck), "--trace-dir", str(trace),
              "--eval-every", "1000"]
    for nproc, steps, fsdp in ((2, 6, False), (3, 12, True), (3, 18, False)):
        job = launch(torchrun("--steps", str(steps), *common, *(["--fsdp"] if fsdp else []),
                              nproc=nproc, script="own_loop_trainer.py"), name=f"to-{steps}")
        assert job.wait(timeout=240) == 0, job.output[-3000:]
        assert "global batch changed" not in job.output
        if steps > 6:
            assert f"resumed from {ck / f'step-{steps - 6:08d}'}: step {steps - 6}" in job.output
    entries = [e for e in audit.read_entries(trace) if "indices" in e]
    shares = {s: sorted(len(e["indices"]) for e in entries if e["step"] == s)
              for s in (6, 7, 13)}
    assert shares == {6: [32, 32], 7: [21, 21, 22], 13: [21, 21, 22]}, shares
    assert_exact_audit(trace, steps=18, global_batch=64)


# a forward hook on the user's model, registered before the loop: each forward appends
# "<unix time> <id of the hooked module>" to <ER_TEST_MODEL_PROBE>/<pid>
_PROBE = """

def _er_test_probe(model):
    import os
    import time

    path = os.path.join(os.environ["ER_TEST_MODEL_PROBE"], str(os.getpid()))

    def hook(module, args, output):
        with open(path, "a") as f:
            f.write(f"{time.time():.3f} {id(module)}\\n")

    model.register_forward_hook(hook)

"""


def with_model_probe(script: Path, into: Path) -> Path:
    """A copy of the example ``script`` in ``into`` whose user model carries a forward hook
    (:data:`_PROBE`) from before its loop: the survivor of an in-place recovery must go on
    with that very object, the hook still firing (a new model object would not carry it)."""
    text = script.read_text()
    anchor = re.search(r"^( +)step, epoch = ft\.resume\(\).*$", text, re.M)
    main = 'if __name__ == "__main__":'
    assert anchor and text.count(anchor[0]) == 1 and text.count(main) == 1, script
    text = text.replace(anchor[0], f"{anchor[1]}_er_test_probe(model)\n{anchor[0]}")
    copy = into / script.name
    copy.write_text(text.replace(main, _PROBE.lstrip("\n") + "\n" + main))
    return copy


def newest_trainers(trace: Path) -> dict[int, int]:
    """Rank -> the pid of the process that traced that rank's newest step."""
    newest: dict[int, dict] = {}
    for e in audit.read_entries(trace):
        if "indices" in e and e.get("pid") is not None:
            newest[e["rank"]] = max(newest.get(e["rank"], e), e, key=lambda x: x["step"])
    return {r: e["pid"] for r, e in newest.items()}


def assert_trained_by(trace: Path, pids: dict[int, int]) -> None:
    """Each rank's newest traced step comes to be trained by the process ``pids`` names (after
    a recovery: the survivor's rank by the survivor, the dead one's by its replacement)."""
    wait_until(lambda: newest_trainers(trace) == pids, 60, f"steps trained by {pids}")


def assert_model_kept(probe_dir: Path, survivors: list[tuple[int, float]]) -> None:
    """Each ``(pid, unix time of a fault)``: that process's hooked model is one object for the
    whole run, and its hook fired after the fault."""
    for pid, t_fault in survivors:
        path = probe_dir / str(pid)
        assert path.is_file(), f"the hook on the model never fired in process {pid}"
        lines = [ln.split() for ln in path.read_text().splitlines()]
        assert len({ident for _, ident in lines}) == 1, (pid, lines[:3])
        assert any(float(t) > t_fault for t, _ in lines), (pid, t_fault, lines[-3:])


def scrape(port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            return r.read().decode()
    except OSError:
        return ""


IN_PLACE_STEPS = 240  # the faults end near step 120 (rank 0 paced until the last recovery)
# an evaluation after every step: each fault then lands where the group runs the window of a
# step with collectives again (a survivor after its discarded step, a replacement in its first)
TRAINER = ("--steps", str(IN_PLACE_STEPS), "--eval-every", "1", "--patience", "1000")


def test_three_kills_and_a_stop_under_elastic_runner_run_recover_in_place_bitwise(
        launch, tmp_path):
    """``elastic-runner run examples/own_loop_trainer.py``: a trainer class as users write one
    (a validation all-reduce, early-stopping bookkeeping only rank 0 updates, its decision
    broadcast, an LR scheduler; in ``state=``), in place. Three SIGKILLs (rank 1, rank 0,
    rank 1) and one SIGSTOP (rank 0: the agent finds it silent and kills it), each once a warm
    spare stands by: each time only the dead worker's process is new (the survivor's pid and
    model object are the same before and after), no checkpoint is read, and the run ends
    bitwise equal to the uninterrupted one: weights, AdamW state, the scheduler, and every
    evaluation counted once with the same loss and decision, also after rank 0's
    replacement; an exact sample audit; the node's endpoint serves both ranks' series."""
    ref = tmp_path / "ref"
    job = Job(torchrun(*TRAINER, "--checkpoint-dir", str(ref), script="own_loop_trainer.py"),
              tmp_path / "ref.log")
    assert job.wait(timeout=240) == 0, job.output[-3000:]

    ck, trace, port = tmp_path / "ck", tmp_path / "trace", free_port()
    probe = tmp_path / "probe"
    probe.mkdir()
    script = str(with_model_probe(EXAMPLES / "own_loop_trainer.py", tmp_path))
    # rank 0 paced until the last recovery: a spare is ready 2-4 s after the one before
    pace = Pace(tmp_path / "pace", 0.1)
    job = launch(cli("run", script, "--nproc-per-node", "2",
                     "--max-restarts", "5", "--metrics-port", str(port), "--", *TRAINER,
                     "--checkpoint-dir", str(ck), "--trace-dir", str(trace)), name="run",
                 env={"ELASTIC_RUNNER_FAULTS_TRIGGER": str(pace.path),
                      "ER_TEST_MODEL_PROBE": str(probe),
                      "ELASTIC_RUNNER_RECOVERY": "{spare_delay_seconds: 0, "
                                                 "heartbeat_timeout_seconds: 3}"})
    series = re.compile(r'^elastic_runner_step\{[^}]*rank="(\d)"[^}]*\} (\d+)', re.M)
    wait_until(lambda: {m[1] for m in series.finditer(scrape(port))} == {"0", "1"}, 60,
               "both ranks' step series on the node endpoint")
    pids = {rank: p.pid for rank, p in job.workers(script).items() if rank >= 0}
    # the first two land inside the loop's own collectives after a step: the victim pauses
    # just before its call, so the survivor waits inside it when the victim dies
    faults = [(1, signal.SIGKILL, "all_reduce"), (0, signal.SIGKILL, "broadcast_object_list"),
              (1, signal.SIGKILL, ""), (0, signal.SIGSTOP, "")]
    survivors = []
    for generation, (rank, sig, pause_at) in enumerate(faults, start=1):
        wait_until(lambda g=generation: len(_READY.findall(job.output)) >= g, 60,
                   f"fault {generation}: a warm spare")
        if pause_at:
            pace.ask(f"pause rank={rank} at={pause_at}")
            wait_until(lambda r=rank, c=pause_at: f"rank {r} pauses before its {c}"
                       in job.output, 30, f"fault {generation}: rank {rank} paused")
        survivor = pids[1 - rank]
        survivors.append((survivor, time.time()))
        psutil.Process(pids[rank]).send_signal(sig)
        wait_until(lambda g=generation: g in done(job.output), 60,
                   f"fault {generation}: a step committed after the recovery")
        new = replacements(job.output)[generation - 1]
        assert new[0] == rank and new[4] == generation, new
        pids[rank] = new[3]
        assert_trained_by(trace, {1 - rank: survivor, rank: new[3]})
    pace.end()
    assert job.wait(timeout=240) == 0, job.output[-4000:]

    log = job.output
    assert "resumed from" not in log  # every state came from the survivor
    assert "sent no heartbeat for" in log  # the stopped rank, found silent and killed
    # the evaluation's all_reduce, the decision's broadcast (its DDP forward, without buffers
    # or autograd, has no collective): called again
    for call, earlier in (("all_reduce", 0), ("broadcast_object_list", 1)):
        assert re.search(rf"the loop's own {call} after step \d+ failed with a peer: called "
                         rf"again in the new group, after {earlier} earlier", log), call
    assert [r[1] for r in replacements(log)] == [-9] * 4
    assert_exact_audit(trace, steps=IN_PLACE_STEPS, global_batch=32, repaired_at_most=4)
    assert_model_kept(probe, survivors)
    want, got = (ckpt.load_state(ckpt.latest_valid(d).path) for d in (ref, ck))
    assert_same_tensors(want["model"], got["model"])
    assert_same_optimizer(want["optimizer"], got["optimizer"])
    assert len(want["stopper"]["evaluations"]) == IN_PLACE_STEPS
    assert got["stopper"] == want["stopper"]
    assert got["scheduler"] == want["scheduler"]


def fsdp_loop(*args: str, nproc: int = 2) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            str(nproc), "--max-restarts", "1", "--monitor-interval", "0.2",
            str(EXAMPLES / "own_loop_fsdp.py"), *args]


def test_an_fsdp2_loop_resumes_bitwise_after_kill_9(launch, tmp_path):
    """``examples/own_loop_fsdp.py``: a kill -9 mid-run resumes from the sharded checkpoint
    bitwise equal to an uninterrupted run. (A sharded checkpoint resumed at another world size:
    test_fsdp.py's 2-3-1-2 chain, through the same ``TrainingSession.resume``; an own loop
    at another world size: the 2-1-2 test above.)"""
    ref, ck = tmp_path / "ref", tmp_path / "ck"
    job = launch(fsdp_loop("--steps", "40", "--checkpoint-dir", str(ref)), name="reference")
    assert job.wait(timeout=240) == 0, job.output[-3000:]
    job = launch(fsdp_loop("--steps", "40", "--checkpoint-dir", str(ck)), name="kill",
                 env={"ELASTIC_RUNNER_FAULTS": "[{kind: sigkill, rank: 1, step: 30}]"})
    assert job.wait(timeout=240) == 0, job.output[-3000:]
    assert f"resumed from {ck / 'step-00000020'}: step 20" in job.output
    assert ckpt.is_sharded(ckpt.latest_valid(ck).path)
    want = ckpt.load_state(ckpt.latest_valid(ref).path)
    got = ckpt.load_state(ckpt.latest_valid(ck).path)
    assert_same_tensors(want["model"], got["model"])
    assert_same_optimizer(want["optimizer"], got["optimizer"])


FSDP_IN_PLACE_STEPS = 110  # the faults end near step 70 (rank 0 paced until the last one)


def test_an_fsdp2_loop_recovers_in_place_from_peer_copies_bitwise(launch, tmp_path):
    """``elastic-runner run examples/own_loop_fsdp.py``, the loop as written: rank 1, then
    rank 0 SIGKILLed once a warm spare stands by. Each time the survivor keeps its process and
    its model object (its FSDP2 modules re-attached to the new group), every rank rolls back
    to the peer copies (no checkpoint is read), and the run ends bitwise equal to the
    uninterrupted one (weights and AdamW state) with an exact sample audit. The first kill
    lands inside the survivor's own ``clip_grad_norm_`` (its all-reduce of the norm), the
    second inside its model's forward."""
    ref, ck, trace = tmp_path / "ref", tmp_path / "ck", tmp_path / "trace"
    job = launch(fsdp_loop("--steps", str(FSDP_IN_PLACE_STEPS), "--checkpoint-dir", str(ref)),
                 name="reference")
    assert job.wait(timeout=240) == 0, job.output[-3000:]

    probe = tmp_path / "probe"
    probe.mkdir()
    script = str(with_model_probe(EXAMPLES / "own_loop_fsdp.py", tmp_path))
    pace = Pace(tmp_path / "pace", 0.1)
    job = launch(cli("run", script, "--nproc-per-node", "2", "--max-restarts", "3", "--",
                     "--steps", str(FSDP_IN_PLACE_STEPS), "--checkpoint-dir", str(ck),
                     "--trace-dir", str(trace)), name="run",
                 env={"ELASTIC_RUNNER_FAULTS_TRIGGER": str(pace.path),
                      "ER_TEST_MODEL_PROBE": str(probe),
                      "ELASTIC_RUNNER_RECOVERY": "{spare_delay_seconds: 0, "
                                                 "peer_copy_every_steps: 5}"})
    wait_until(lambda: len([r for r in job.workers(script) if r >= 0]) == 2, 60, "two ranks")
    pids = {rank: p.pid for rank, p in job.workers(script).items() if rank >= 0}
    survivors = []
    # the first peer copies (of step 5) exchanged: a forked spare is ready before (about 0.5 s)
    wait_until(lambda: max(audit.steps_recorded(trace, 0), default=0) >= 7, 60, "7 steps")
    for generation, rank in enumerate([1, 0], start=1):
        wait_until(lambda g=generation: len(_READY.findall(job.output)) >= g, 60,
                   f"fault {generation}: a warm spare")
        if generation == 1:  # the survivor waits inside its clip_grad_norm_'s all-reduce
            pace.ask(f"pause rank={rank} at=clip_grad_norm_")
            wait_until(lambda r=rank: f"rank {r} pauses before its clip_grad_norm_"
                       in job.output, 30, "fault 1: the victim paused")
        else:  # ... inside its forward's all-gather: the kill lands while it sleeps before
            pace.set(0.6, rank=1 - rank)  # a step
            wait_until(lambda r=1 - rank: f"rank {r} sleeps 0.6 s" in job.output, 30,
                       f"fault {generation}: the survivor asleep")
        survivor = pids[1 - rank]
        survivors.append((survivor, time.time()))
        psutil.Process(pids[rank]).kill()
        wait_until(lambda g=generation: g in done(job.output), 60,
                   f"fault {generation}: a step committed after the recovery")
        new = replacements(job.output)[generation - 1]
        assert new[0] == rank and new[4] == generation, new
        pids[rank] = new[3]
        assert_trained_by(trace, {1 - rank: survivor, rank: new[3]})
    pace.end()
    assert job.wait(timeout=240) == 0, job.output[-4000:]

    log = job.output
    assert "resumed from" not in log  # every state came from the peer copies
    assert re.search(r"rank0\] WARNING \S+ the loop's own clip_grad_norm_ in step \d+ failed "
                     "with a peer: the step is discarded on every rank", log), log[-4000:]
    assert log.count("(peer copies; replacements") >= 2, log[-4000:]  # rank 0's, each time
    assert_exact_audit(trace, steps=FSDP_IN_PLACE_STEPS, global_batch=32, repaired_at_most=2)
    assert_model_kept(probe, survivors)
    want, got = (ckpt.load_state(ckpt.latest_valid(d).path) for d in (ref, ck))
    assert_same_tensors(want["model"], got["model"])
    assert_same_optimizer(want["optimizer"], got["optimizer"])
