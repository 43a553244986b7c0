"""An etcd outage during training: training goes on (rendezvous is needed only at (re)start);
a restart while etcd is down waits and proceeds once etcd is back."""

from __future__ import annotations

import signal

import pytest

from elastic_runner import audit

from .procs import CONFIGS, cli, wait_until

pytestmark = pytest.mark.slow


def steps(trace) -> int:
    return max((e["step"] for e in audit.read_entries(trace) if "step" in e), default=0)


def test_training_survives_an_etcd_outage_and_restarts_after_it(launch, etcd_server, tmp_path):
    ck, trace = tmp_path / "ck", tmp_path / "trace"
    job = launch(cli(
        "run", str(CONFIGS / "digits.yaml"), "logging.tensorboard_dir=null",
        "early_stopping.enabled=false", f"checkpoint.dir={ck}", "checkpoint.every_steps=10",
        "training.max_epochs=1000", "--nnodes", "1:2", "--nproc-per-node", "2",
        "--rdzv-backend", "etcd-v2", "--rdzv-endpoint", etcd_server.endpoint,
        "--rdzv-id", "outage", "--rdzv-conf", "join_timeout=120,last_call_timeout=1",
        "--max-restarts", "3", "--monitor-interval", "0.2", "--trace-samples", str(trace)),
        name="outage")
    wait_until(lambda: steps(trace) >= 10, 120, "10 steps")

    etcd_server.stop()
    before = steps(trace)
    wait_until(lambda: steps(trace) >= before + 40, 120, "40 more steps while etcd is down")
    wait_until(lambda: "training continues" in job.output, 30, "the agent's outage warning")

    job.workers()[1].kill()  # a restart while etcd is down
    wait_until(lambda: "rendezvous backend unreachable" in job.output
               and "retrying for up to" in job.output, 60, "the rendezvous to wait for etcd")
    assert "resumed from" not in job.output
    etcd_server.start()
    wait_until(lambda: "resumed from" in job.output, 120, "the group to resume after etcd is back")
    resumed = steps(trace)
    wait_until(lambda: steps(trace) >= resumed + 10, 120, "10 steps after the restart")
    job.proc.send_signal(signal.SIGTERM)
    assert job.wait(timeout=60) == 143, job.output[-3000:]
