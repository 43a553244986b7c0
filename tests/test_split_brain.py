"""A forced split brain with real processes: a group frozen while a newer group took over its
``checkpoint.dir`` wakes up beside it. The stale group never commits again and stops with exit
3 and one line, whichever of its processes wakes first; the new group finishes bitwise equal to
an uninterrupted run with an exact sample audit.

Two ways to be frozen: only the workers (a starved node declared dead; the restart path), and
the whole group with its agent and warm spare (in place, the default). Woken, the agent of the
second finds rank 0 without a heartbeat and replaces it in place, or the workers reach their
next commit first: either way nothing of the stale group may land (seen before the fencing
lineage: the replacement claimed a newer token and committed over the new group's
checkpoints, in 3 of 7 runs)."""

from __future__ import annotations

import contextlib
import re
import shutil
import signal

import psutil
import pytest

from elastic_runner.checkpoint import storage as ckpt
from elastic_runner.exit_codes import EXIT_FENCED

from .evidence import DIGITS_GLOBAL_BATCH, DIGITS_TRAIN, assert_exact_audit, assert_same_tensors
from .procs import CONFIGS, Pace, cli, wait_until
from .test_train_torchrun import final_state

pytestmark = pytest.mark.slow

STEPS = 120
COMMON = [str(CONFIGS / "digits.yaml"), "logging.tensorboard_dir=null",
          "early_stopping.enabled=false", f"training.max_steps={STEPS}",
          "training.max_epochs=1000", "checkpoint.every_steps=10", "eval.every_steps=0",
          "recovery.mode=restart", "distributed.timeout_seconds=600", "--nproc-per-node", "2"]
_COMMITTED = re.compile(r"committed checkpoint \S*step-(\d{8})")


def committed(log: str) -> list[int]:
    return [int(s) for s in _COMMITTED.findall(log)]


def test_a_stale_group_cannot_commit_beside_the_group_that_replaced_it(launch, tmp_path,
                                                                     reference):
    ref_ck = reference(*COMMON)
    ck, trace_a, trace_b = tmp_path / "ck", tmp_path / "trace-a", tmp_path / "trace-b"
    # a straggler keeps group A slow enough to be frozen between two of its checkpoints
    stale = launch(cli("run", *COMMON, f"checkpoint.dir={ck}", "--trace-samples", str(trace_a),
                       "faults.inject=[{kind: slow, rank: 0, step: 1, count: 100000, "
                       "seconds: 0.05}]"), name="stale")
    wait_until(lambda: len(committed(stale.output)) >= 2, 240, "group A's second checkpoint")
    frozen = list(stale.workers().values())
    for p in frozen:  # the starved node: its ranks stop answering, nobody exits
        p.send_signal(signal.SIGSTOP)
    resumed_at = ckpt.latest_valid(ck).step
    token_a = ckpt.latest_valid(ck).fence
    shutil.copytree(trace_a, trace_b)  # the trace as the new group finds it on shared storage

    new = launch(cli("run", *COMMON, f"checkpoint.dir={ck}", "--trace-samples", str(trace_b)),
                 name="new")
    wait_until(lambda: any(s > resumed_at for s in committed(new.output)), 240,
               "group B's first checkpoint")
    for p in frozen:
        p.send_signal(signal.SIGCONT)
    assert stale.wait(timeout=240) == EXIT_FENCED, stale.output[-3000:]
    assert new.wait(timeout=400) == 0, new.output[-3000:]

    assert f"resumed from {ck}/step-{resumed_at:08d}" in new.output
    assert "fenced out: not committing step-" in stale.output
    assert re.search(r"elastic-runner: job failed: rank 0 \(local_rank 0\) exited with code 3: "
                     r"FencedOut: not committing step-\d{8}", stale.output), stale.output[-3000:]
    assert "will restart worker group" not in stale.output  # stopped, not restarted
    # no commit of group A after group B claimed the directory, and B's are all there
    infos = [c for c in ckpt.list_checkpoints(ck) if c.valid]
    assert all(c.step <= resumed_at for c in infos if c.fence == token_a)
    assert {c.fence for c in infos if c.step > resumed_at} == {token_a + 1}
    assert ckpt.latest_valid(ck).step == STEPS

    assert_exact_audit(trace_b, steps=STEPS, global_batch=DIGITS_GLOBAL_BATCH,
                       num_samples=DIGITS_TRAIN)
    assert_same_tensors(final_state(ck)["model"], final_state(ref_ck)["model"])


@pytest.mark.parametrize("wake", ["together", "agent_first"])
def test_a_whole_group_frozen_with_its_agent_wakes_fenced_out(launch, tmp_path, reference,
                                                              wake):
    """Group A (in place, a warm spare) is SIGSTOPped whole: agent, workers, spare. Group B
    resumes from A's newest checkpoint and commits. A is SIGCONTed: ``together`` (agent, then
    the others at once: the race of a real wake-up) or ``agent_first`` (the workers still
    frozen until the agent has replaced them: the in-place and spare path every time). A exits
    3 with nothing committed, B finishes, every checkpoint in the directory verifies."""
    ck, trace_a, trace_b = tmp_path / "ck", tmp_path / "trace-a", tmp_path / "trace-b"
    common = [c for c in COMMON if c != "recovery.mode=restart"]
    want = final_state(reference(*common))["model"]
    pace = Pace(tmp_path / "pace", 0.05)
    stale = launch(cli("run", *common, f"checkpoint.dir={ck}", "--trace-samples", str(trace_a),
                       "recovery.spare_delay_seconds=0", *pace.args), name="stale")
    wait_until(lambda: len(committed(stale.output)) >= 2 and "ready (task built)" in
               stale.output, 240, "group A's second checkpoint and its warm spare")
    agent = psutil.Process(stale.proc.pid)
    agent.send_signal(signal.SIGSTOP)  # first: it starts no process while the others stop
    frozen = stale.descendants()
    for p in frozen:
        p.send_signal(signal.SIGSTOP)
    assert len(frozen) >= 3, frozen  # two workers and the spare
    resumed_at, token_a = ckpt.latest_valid(ck).step, ckpt.latest_valid(ck).fence
    shutil.copytree(trace_a, trace_b)

    # B still trains when A wakes, and until A ends: A's agent waits out its heartbeat limit
    # (10 s) first; at 0.05 s a step B had finished before it (1 of 4 runs)
    pace_b = Pace(tmp_path / "pace-b", 0.4)
    new = launch(cli("run", *common, f"checkpoint.dir={ck}", "--trace-samples", str(trace_b),
                     *pace_b.args), name="new")
    wait_until(lambda: any(s > resumed_at for s in committed(new.output)), 240,
               "group B's first checkpoint")
    agent.send_signal(signal.SIGCONT)
    if wake == "agent_first":  # heartbeats silent for longer than the agent allows
        wait_until(lambda: "sent no heartbeat for" in stale.output, 120,
                   "group A's agent acting on its frozen workers")
    for p in frozen:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(signal.SIGCONT)
    assert stale.wait(timeout=240) == EXIT_FENCED, stale.output[-3000:]
    assert new.proc.poll() is None, new.output[-3000:]  # A's end did not end B
    pace_b.end()
    assert new.wait(timeout=400) == 0, new.output[-3000:]

    assert f"resumed from {ck}/step-{resumed_at:08d}" in new.output
    assert re.search(r"fenced out: not (committing step-|claiming )", stale.output), \
        stale.output[-3000:]
    infos = ckpt.list_checkpoints(ck)
    assert infos and all(ckpt.inspect(c.path, verify=True).valid for c in infos), infos
    assert all(c.step <= resumed_at for c in infos if c.fence == token_a)
    assert {c.fence for c in infos if c.step > resumed_at} == {token_a + 1}
    assert not list(ck.glob(".superseded-*"))  # nothing of B's was in A's way
    assert ckpt.latest_valid(ck).step == STEPS
    assert_exact_audit(trace_b, steps=STEPS, global_batch=DIGITS_GLOBAL_BATCH,
                       num_samples=DIGITS_TRAIN)
    assert_same_tensors(final_state(ck)["model"], want)
