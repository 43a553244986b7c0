"""Several torchrun agents ("nodes") on this machine around a real etcd: a node is lost
(SIGKILL of its agent and workers), another joins, one is evicted (SIGTERM), each in place: the
remaining node's worker goes on at the new world size without a restart (with etcd the recovery
store moves to a remaining node when the one hosting it leaves); the sample audit stays exact."""

from __future__ import annotations

import re
import signal

import pytest

from elastic_runner.checkpoint import storage as ckpt
from elastic_runner.data import audit

from .evidence import DIGITS_TRAIN, assert_exact_audit
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
    # B's loss in place: A's worker went on without it (if B's agent hosted the recovery
    # store, A's agent moved it to itself), no round; C joined in place: A's worker took it in
    # at a step boundary, no restart, one more round
    # in place even when B or C hosts the recovery store (whichever agent became node rank
    # 0): on etcd-v2 a remaining node's agent takes the store over (agent/store_failover.py
    # StoreFailover.fail_over; test_membership_nodes.py loses and preempts the store's host)
    _, text = get(port)
    assert re.search(r"membership: node\(s\) \[\d+\] lost", a.output), a.output[-3000:]
    assert re.search(r"membership: node\(s\) \[\d+\] join after step", a.output), a.output[-3000:]
    assert "resumed from" not in a.output + c.output, a.output[-3000:]
    assert sum(samples(text, "elastic_runner_membership_changes_total", reason="joined")) == 1
    assert samples(text, "elastic_runner_rendezvous_total")[0] >= 2
    assert samples(text, "elastic_runner_world_size", job="multinode") == [2]

    c.proc.send_signal(signal.SIGTERM)  # node C is evicted
    assert c.wait(timeout=60) == 143, c.output[-3000:]

    # in place: A's worker goes on without C (the store moves to A's agent if C hosted it)
    preempted = re.compile(r"membership: node\(s\) \[\d+\] preempted")
    wait_until(lambda: preempted.search(a.output), 120, "node A to go on alone in place")
    wait_until(lambda: world_sizes(trace)[-10:] == [1] * 10, 120, "10 more steps on node A")
    assert "resumed from" not in a.output, a.output[-3000:]

    a.proc.send_signal(signal.SIGTERM)  # the last node is evicted too
    assert a.wait(timeout=60) == 143, a.output[-3000:]
    last = max(e["step"] for e in audit.read_entries(trace))
    assert ckpt.latest_valid(ck).step == last

    # batch.global_batch_size=16 at world sizes 2 and 1 (78 steps an epoch); B's worker killed
    # in place after committing steps: at most its entry of the step in flight repaired (C left
    # at a step boundary)
    reports = assert_exact_audit(trace, steps=last, global_batch=16, num_samples=DIGITS_TRAIN,
                                 repaired_at_most=1)
    complete = [r for r in reports if r.complete]
    assert complete, "no epoch completed"
    assert all(r.seen_once == r.expected for r in complete), complete
    out = "".join(n.output for n in (a, c))
    assert "global batch changed" not in out  # constant global batch across 2 -> 1 -> 2
