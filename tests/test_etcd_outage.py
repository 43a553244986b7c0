"""An etcd outage during training: training goes on (rendezvous is needed only at (re)start);
a restart while etcd is down waits and proceeds once etcd is back. On the restart path
(``recovery.mode=restart``): in place, the worker killed during the outage is replaced without a
rendezvous (the recovery store is in an agent, not in etcd)."""

from __future__ import annotations

import signal

import pytest

from elastic_runner.checkpoint import storage as ckpt
from elastic_runner.data import audit

from .evidence import DIGITS_GLOBAL_BATCH, DIGITS_TRAIN, assert_exact_audit
from .procs import CONFIGS, Pace, cli, wait_until

pytestmark = pytest.mark.slow


def steps(trace) -> int:
    return max((e["step"] for e in audit.read_entries(trace) if "step" in e), default=0)


def test_training_survives_an_etcd_outage_and_restarts_after_it(launch, etcd_server, tmp_path):
    ck, trace = tmp_path / "ck", tmp_path / "trace"
    pace = Pace(tmp_path / "pace", 0.1)  # rank 0 slowed until the kill, so it lands mid-interval
    job = launch(cli(
        "run", str(CONFIGS / "digits.yaml"), "logging.tensorboard_dir=null",
        "early_stopping.enabled=false", f"checkpoint.dir={ck}", "checkpoint.every_steps=10",
        "training.max_epochs=1000", "recovery.mode=restart", "--nnodes", "1:2",
        "--nproc-per-node", "2",
        "--rdzv-backend", "etcd-v2", "--rdzv-endpoint", etcd_server.endpoint,
        "--rdzv-id", "outage", "--rdzv-conf", "join_timeout=120,last_call_timeout=1",
        "--max-restarts", "3", "--monitor-interval", "0.2", "--trace-samples", str(trace), *pace.args),
        name="outage")
    wait_until(lambda: steps(trace) >= 10, 120, "10 steps")

    etcd_server.stop()
    before = steps(trace)
    wait_until(lambda: steps(trace) >= before + 40, 120, "40 more steps while etcd is down")
    wait_until(lambda: "training continues" in job.output, 30, "the agent's outage warning")

    # kill between two checkpoints (every 10 steps, and at each epoch's end, 19 steps): the
    # restart redoes the steps after the last one, and the trace must be rewound to it (checked
    # by the audit at the end). The kill lands within two paced steps of the one seen.
    wait_until(lambda: between_checkpoints(steps(trace)), 30, "a step between two checkpoints")
    job.workers()[1].kill()  # a restart while etcd is down
    pace.end()
    wait_until(lambda: "rendezvous backend unreachable" in job.output
               and "retrying for up to" in job.output, 60, "the rendezvous to wait for etcd")
    assert "resumed from" not in job.output
    etcd_server.start()
    wait_until(lambda: "resumed from" in job.output, 120, "the group to resume after etcd is back")
    resumed = steps(trace)
    wait_until(lambda: steps(trace) >= resumed + 10, 120, "10 steps after the restart")
    job.proc.send_signal(signal.SIGTERM)
    assert job.wait(timeout=60) == 143, job.output[-3000:]
    assert "sample trace: dropped" in job.output  # the killed attempt's lost steps
    assert_trace_exact(trace, ck)


def between_checkpoints(step: int) -> bool:
    """No checkpoint falls on ``step + 1`` or ``step + 2`` (every 10 steps, and each epoch's
    last step; 19 steps an epoch)."""
    return 3 <= step % 10 <= 5 and all((step + k) % 19 for k in (1, 2))


def assert_trace_exact(trace, ck) -> None:
    """Every step from 1 to the last once, from both ranks, 64 samples (the global batch);
    every completed epoch trained on each sample exactly once; the last traced step is the
    one the SIGTERM committed. The restart's rewind must have dropped the steps after the
    checkpoint it resumed from."""
    by_step: dict[int, list[dict]] = {}
    for e in audit.read_entries(trace):
        if "indices" in e:
            by_step.setdefault(e["step"], []).append(e)
    last = max(by_step)
    assert sorted(by_step) == list(range(1, last + 1))
    for step, es in by_step.items():
        assert sorted(e["rank"] for e in es) == [0, 1], (step, es)
        assert sum(len(e["indices"]) for e in es) == 64, step
    assert ckpt.latest_valid(ck).step == last
    # 19 steps of 64 samples per epoch (1257 train samples); the restart path: nothing repaired
    reports = assert_exact_audit(trace, steps=last, global_batch=DIGITS_GLOBAL_BATCH,
                                 num_samples=DIGITS_TRAIN)
    assert len(reports) >= 4, reports
    for r in reports:
        if r.complete:
            assert r.steps == 19 and r.seen_once == r.expected == DIGITS_TRAIN - 41, r
        else:
            assert r.seen_once == r.steps * 64, r
