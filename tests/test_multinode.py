"""Several torchrun agents ("nodes") on this machine around a real etcd: a node is lost
(SIGKILL of its agent and workers), another joins (in place), one is evicted (SIGTERM: in
place, or all ranks checkpoint that step and the other node goes on alone from it); the group
re-forms at each world size and the sample audit stays exact."""

from __future__ import annotations

import re
import signal

import pytest

from elastic_runner.checkpoint import storage as ckpt
from elastic_runner.data import audit

from .procs import CONFIGS, cli, free_port, wait_until
from .test_metrics import get, samples

pytestmark = pytest.mark.slow

# a lost node is declared dead after 1 s x 8 missed heartbeats; shorter budgets let a busy
# 2-core machine starve a live agent's heartbeat thread, and a node declared dead by mistake
# forms a second group of its own (split brain)
RDZV_CONF = ("last_call_timeout=4,join_timeout=120,keep_alive_interval=1,"
             "keep_alive_max_attempt=8")


def node(launch, etcd, name, ck, trace, *extra):
    return launch(cli(
        "run", str(CONFIGS / "digits.yaml"), "logging.tensorboard_dir=null",
        "early_stopping.enabled=false", f"checkpoint.dir={ck}", "checkpoint.every_steps=10",
        "batch.micro_batch_size=4", "batch.global_batch_size=16", "training.max_epochs=1000", *extra,
        "--nnodes", "1:3", "--nproc-per-node", "1", "--rdzv-backend", "etcd-v2",
        "--rdzv-endpoint", etcd.endpoint, "--rdzv-id", "multinode", "--rdzv-conf", RDZV_CONF,
        "--max-restarts", "5", "--monitor-interval", "0.2", "--trace-samples", str(trace)),
        name=name)


def world_sizes(trace) -> list[int]:
    """World size of each traced step, in step order (the trace is rewound on every resume)."""
    entries = [e for e in audit.read_entries(trace) if "world_size" in e]
    return [ws for _, ws in sorted({(e["step"], e["world_size"]) for e in entries})]


def test_node_loss_and_join_keep_every_sample_exactly_once(launch, etcd_server, tmp_path):
    ck, trace = tmp_path / "ck", tmp_path / "trace"
    port = free_port()
    a = node(launch, etcd_server, "node-a", ck, trace, f"metrics.port={port}")
    b = node(launch, etcd_server, "node-b", ck, trace)
    wait_until(lambda: world_sizes(trace).count(2) >= 20, 120, "20 steps at world size 2")

    b.kill_all()  # node B is lost: SIGKILL of its agent and worker, no goodbye
    wait_until(lambda: world_sizes(trace)[-1:] == [1] and world_sizes(trace).count(1) >= 20,
               120, "20 steps at world size 1 after node B was lost")

    c = node(launch, etcd_server, "node-c", ck, trace)
    wait_until(lambda: world_sizes(trace)[-20:] == [2] * 20, 120,
               "20 steps at world size 2 after node C joined")
    sizes = world_sizes(trace)
    assert sizes[0] == 2 and 1 in sizes and sizes[-1] == 2
    # C joined in place: A's worker took it in at a step boundary, no restart, one more
    # round; B's loss took no round when A's worker went on without it in place (B was not
    # node rank 0, whose agent hosts the recovery store), else one
    _, text = get(port)
    assert re.search(r"membership: node\(s\) \[\d+\] join after step", a.output), a.output[-3000:]
    assert sum(samples(text, "elastic_runner_membership_changes_total", reason="joined")) == 1
    in_place = "membership: node(s) [1] lost" in a.output
    assert in_place or "resumed from" in a.output
    assert samples(text, "elastic_runner_rendezvous_total")[0] >= (2 if in_place else 3)
    assert samples(text, "elastic_runner_world_size", job="multinode") == [2]

    c.proc.send_signal(signal.SIGTERM)  # node C is evicted
    assert c.wait(timeout=60) == 143, c.output[-3000:]

    def went_on() -> bool:
        """In place (C was node rank 1: A's worker goes on without it), or every rank
        checkpointed that step and node A resumed alone from it (C hosted the store)."""
        if re.search(r"membership: node\(s\) \[\d+\] preempted", a.output):
            return True
        evicted_at = ckpt.latest_valid(ck).step
        return f"step-{evicted_at:08d}: step {evicted_at}," in a.output

    wait_until(went_on, 120, "node A to go on alone (in place, or from the eviction checkpoint)")
    wait_until(lambda: world_sizes(trace)[-10:] == [1] * 10, 120, "10 more steps on node A")

    a.proc.send_signal(signal.SIGTERM)  # the last node is evicted too
    assert a.wait(timeout=60) == 143, a.output[-3000:]
    last = max(e["step"] for e in audit.read_entries(trace))
    assert ckpt.latest_valid(ck).step == last

    reports = audit.audit(trace)
    complete = [r for r in reports if r.complete]
    assert complete, "no epoch completed"
    for r in reports:
        assert not r.duplicated, r
        if r.complete:
            assert r.ok and r.seen_once == r.expected, r
    out = "".join(n.output for n in (a, c))
    assert "global batch changed" not in out  # constant global batch across 2 -> 1 -> 2
