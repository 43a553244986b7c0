"""A forced split brain with real processes: a group whose workers were frozen (a starved node
declared dead) wakes up beside the group that replaced it, both writing into one
``checkpoint.dir``. The stale group's next commit is refused by the fencing token and it stops
with exit 3 and one line; the new group finishes bitwise equal to an uninterrupted run with an
exact sample audit."""

from __future__ import annotations

import re
import shutil
import signal

import pytest

from elastic_runner.checkpoint import storage as ckpt
from elastic_runner.data import audit
from elastic_runner.exit_codes import EXIT_FENCED

from .procs import CONFIGS, cli, wait_until
from .test_train_torchrun import assert_same_tensors, final_state

pytestmark = pytest.mark.slow

STEPS = 120
COMMON = [str(CONFIGS / "digits.yaml"), "logging.tensorboard_dir=null",
          "early_stopping.enabled=false", f"training.max_steps={STEPS}",
          "training.max_epochs=1000", "checkpoint.every_steps=10", "eval.every_steps=0",
          "recovery.mode=restart", "distributed.timeout_seconds=600", "--nproc-per-node", "2"]
_COMMITTED = re.compile(r"committed checkpoint \S*step-(\d{8})")


def committed(log: str) -> list[int]:
    return [int(s) for s in _COMMITTED.findall(log)]


def test_a_stale_group_cannot_commit_beside_the_group_that_replaced_it(launch, tmp_path):
    ref_ck = tmp_path / "ref"
    ref = launch(cli("run", *COMMON, f"checkpoint.dir={ref_ck}"), name="reference")
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
    assert ref.wait(timeout=400) == 0, ref.output[-3000:]

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

    reports = audit.audit(trace_b)
    assert reports and all(r.ok for r in reports), reports
    steps = sorted({e["step"] for e in audit.read_entries(trace_b) if "indices" in e})
    assert steps == list(range(1, STEPS + 1))
    assert_same_tensors(final_state(ck)["model"], final_state(ref_ck)["model"])
