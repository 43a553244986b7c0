"""Nodes that leave a running job in place: each "node" a network namespace with its own address
(tests/netns.py), one ``elastic-runner run`` per node. A preempted node (SIGTERM to its agent)
leaves at the next step boundary, a killed node (agent and workers SIGKILLed) and a partitioned
one (cut off the bridge: no packet in or out) are found by their silent heartbeat in the recovery store;
the other nodes' workers keep their process, go on at the smaller world size with the global
batch unchanged, read no checkpoint, and the sample audit is exact. A partitioned node that
heals commits nothing: its workers are fenced out (exit 3)."""

from __future__ import annotations

import json
import re
import signal
import time

import pytest

from elastic_runner import audit

from .netns import Nodes
from .procs import Job, cli, wait_until
from .test_inplace import DIGITS

pytestmark = pytest.mark.slow

RDZV_PORT = 29400
GLOBAL_BATCH = 96  # micro-batch 16: world sizes 1, 2, 3 and 6 divide it
_CHANGE = re.compile(r"membership: node\(s\) \[([\d, ]+)\] (preempted|lost)\S*[^;]*; "
                     r"generation (\d+) goes on (?:without them )?at world size (\d+)")


def start(launch, nodes: Nodes, tmp_path, steps: int) -> list[Job]:
    """digits on every node, 1 worker each, rank 0 slowed so the faults land mid-run."""
    jobs = []
    for i in range(nodes.count):
        argv = cli("run", DIGITS, "logging.tensorboard_dir=null", "early_stopping.enabled=false",
                   f"training.max_steps={steps}", "training.max_epochs=1000",
                   "eval.every_steps=0", "checkpoint.every_steps=50",
                   "training.log_every_steps=10", f"batch.global_batch_size={GLOBAL_BATCH}",
                   "faults.inject=[{kind: slow, rank: 0, step: 1, count: 100000, "
                   "seconds: 0.04}]",
                   "recovery.spare=false", "recovery.node_timeout_seconds=3",
                   f"checkpoint.dir={tmp_path / 'ck'}", "--trace-samples",
                   str(tmp_path / "trace"), "--nnodes", f"1:{nodes.count}",
                   "--nproc-per-node", "1", "--rdzv-id", "members", "--max-restarts", "3",
                   "--rdzv-backend", "c10d", "--rdzv-endpoint",
                   f"{nodes.address(0)}:{RDZV_PORT}",
                   "--rdzv-conf", f"is_host={'true' if i == 0 else 'false'}")
        jobs.append(launch(nodes.argv(i, argv), name=f"node{i}", env=nodes.env(i)))
    return jobs


def changes(job: Job) -> list[tuple[list[int], str, int, int]]:
    """(nodes, reason, generation, world size) of each membership change in the log (the
    announcing agent and each worker log it; once per generation here)."""
    found = {int(m[3]): ([int(n) for n in m[1].split(",")], m[2], int(m[3]), int(m[4]))
             for m in _CHANGE.finditer(job.output)}
    return [found[g] for g in sorted(found)]


def steps(trace) -> dict[int, tuple[set[int], int]]:
    """step -> (the world sizes that committed it, its samples over all ranks), from the
    sample trace."""
    out: dict[int, tuple[set[int], int]] = {}
    for path in trace.glob("rank-*.jsonl"):
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            if "indices" in entry:
                sizes, samples = out.get(entry["step"], (set(), 0))
                out[entry["step"]] = ({*sizes, entry["world_size"]},
                                      samples + len(entry["indices"]))
    return out


def sizes_seen(tmp_path) -> set[int]:
    return {w for sizes, _ in steps(tmp_path / "trace").values() for w in sizes}


def check_samples(tmp_path) -> None:
    for r in audit.audit(tmp_path / "trace"):
        assert r.ok, r


def test_c10d_a_node_preempted_then_a_node_killed(launch, netns_nodes, tmp_path):
    nodes = netns_nodes(3)
    jobs = start(launch, nodes, tmp_path, steps=500)
    wait_until(lambda: all(len(j.workers()) == 1 for j in jobs), 180, "three workers")
    survivor = next(iter(jobs[0].workers().values()))
    wait_until(lambda: len(steps(tmp_path / "trace")) >= 30, 120, "step 30")

    # 1. node 2 preempted: its agent gets SIGTERM, its worker leaves at the step boundary
    jobs[2].proc.send_signal(signal.SIGTERM)
    assert jobs[2].wait(timeout=60) == 143, jobs[2].output[-3000:]
    wait_until(lambda: changes(jobs[0]), 60, "the preemption's membership change")
    assert changes(jobs[0])[0][:2] == ([2], "preempted")
    assert changes(jobs[0])[0][3] == 2

    # 2. node 1 killed: agent and worker SIGKILLed; node 0 finds its heartbeat silent
    wait_until(lambda: 2 in sizes_seen(tmp_path), 60, "a step at world size 2")
    jobs[1].kill_all()
    wait_until(lambda: len(changes(jobs[0])) == 2, 60, "the lost node's membership change")
    assert changes(jobs[0])[1][:2] == ([1], "lost")
    assert changes(jobs[0])[1][3] == 1
    assert survivor.is_running()  # node 0's worker kept its process throughout
    assert jobs[0].wait(timeout=300) == 0, jobs[0].output[-4000:]

    assert "resumed from" not in jobs[0].output  # no checkpoint read
    trace = steps(tmp_path / "trace")
    assert sorted(trace) == list(range(1, 501))
    assert sizes_seen(tmp_path) == {3, 2, 1}
    # the global batch stayed the same at every world size, and every step was committed by
    # one world size only
    assert {samples for _, samples in trace.values()} == {GLOBAL_BATCH}
    assert all(len(sizes) == 1 for sizes, _ in trace.values())
    check_samples(tmp_path)


def test_c10d_a_partitioned_node_is_left_behind_and_fenced_out_when_it_heals(
        launch, netns_nodes, tmp_path):
    nodes = netns_nodes(3)
    jobs = start(launch, nodes, tmp_path, steps=400)
    wait_until(lambda: all(len(j.workers()) == 1 for j in jobs), 180, "three workers")
    kept = [next(iter(j.workers().values())) for j in jobs[:2]]
    wait_until(lambda: len(steps(tmp_path / "trace")) >= 30, 120, "step 30")

    # node 2 cut off: no reset, no error, its peers just wait
    t_cut = time.time()
    nodes.cut(2)
    wait_until(lambda: changes(jobs[0]), 60, "the partitioned node's membership change")
    assert changes(jobs[0])[0][:2] == ([2], "lost") and changes(jobs[0])[0][3] == 2
    wait_until(lambda: 2 in sizes_seen(tmp_path), 60, "a step at world size 2")

    # healed: the stale node learns it was left behind; its worker commits nothing, exit 3
    nodes.heal(2)
    assert jobs[2].wait(timeout=240) == 3, jobs[2].output[-4000:]
    assert "fenced out" in jobs[2].output
    assert all(p.is_running() for p in kept)  # the group went on, undisturbed
    for job in jobs[:2]:
        assert job.wait(timeout=300) == 0, job.output[-4000:]
    assert len(changes(jobs[0])) == 1  # the healed node changed nothing more
    stale = [json.loads(line) for line in
             (tmp_path / "trace" / "rank-2.jsonl").read_text().splitlines()]
    assert max(e["time"] for e in stale if "time" in e) < t_cut + 1  # nothing after the cut
    trace = steps(tmp_path / "trace")
    assert sorted(trace) == list(range(1, 401)) and sizes_seen(tmp_path) == {3, 2}
    assert {samples for _, samples in trace.values()} == {GLOBAL_BATCH}
    assert "resumed from" not in jobs[0].output
    check_samples(tmp_path)
