"""Nodes that leave and join a running job in place: each "node" a network namespace with its
own address (tests/netns.py), one ``elastic-runner run`` per node, c10d or etcd-v2. A preempted
node (SIGTERM to its agent) leaves at the next step boundary; a killed node (agent and workers
SIGKILLed) and a partitioned one (cut off the bridge: no packet in or out) are found by their
silent heartbeat in the recovery store; a node that starts while the job runs joins at a step
boundary. The other nodes' workers keep their process, go on at the new world size with the
global batch unchanged, read no checkpoint, and the sample audit is exact. A partitioned node
that heals commits nothing: its workers are fenced out (exit 3)."""

from __future__ import annotations

import json
import re
import signal
import time

import pytest

from elastic_runner import audit

from .etcd import EtcdServer, etcd_on
from .netns import Nodes
from .procs import Job, cli, wait_until
from .test_inplace import DIGITS

pytestmark = pytest.mark.slow

RDZV_PORT = 29400
GLOBAL_BATCH = 96  # micro-batch 16: world sizes 1, 2, 3 and 6 divide it
_CHANGE = re.compile(r"membership: node\(s\) \[([\d, ]+)\] (preempted|lost|join)\S*[^;]*; "
                     r"generation (\d+) goes on (?:without them )?at world size (\d+)")


def start(launch, nodes: Nodes, tmp_path, steps: int) -> list[Job]:
    """digits on every node, 1 worker each, rank 0 slowed so the faults land mid-run."""
    return [start_one(launch, nodes, tmp_path, i, steps) for i in range(nodes.count)]


def start_one(launch, nodes: Nodes, tmp_path, i: int, steps: int, slow: float = 0.04,
               name: str = "", etcd: EtcdServer | None = None, global_batch: int = GLOBAL_BATCH
               ) -> Job:
    """``elastic-runner run`` of digits on node ``i`` (1 worker; rank 0 slowed by ``slow``
    seconds a step so the faults land mid-run; the rendezvous completes 1 s after it has the
    minimum of nodes): c10d hosted by node 0, or ``etcd``."""
    rdzv = (["--rdzv-backend", "etcd-v2", "--rdzv-endpoint", etcd.endpoint,
             "--rdzv-conf", "last_call_timeout=1"] if etcd is not None else
            ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{nodes.address(0)}:{RDZV_PORT}",
             "--rdzv-conf", f"is_host={'true' if i == 0 else 'false'},last_call_timeout=1"])
    argv = cli("run", DIGITS, "logging.tensorboard_dir=null", "early_stopping.enabled=false",
               f"training.max_steps={steps}", "training.max_epochs=1000",
               "eval.every_steps=0", "checkpoint.every_steps=50",
               "training.log_every_steps=10", f"batch.global_batch_size={global_batch}",
               "faults.inject=[{kind: slow, rank: 0, step: 1, count: 100000, "
               f"seconds: {slow}}}]",
               "recovery.spare=false", "recovery.node_timeout_seconds=3",
               f"checkpoint.dir={tmp_path / 'ck'}", "--trace-samples",
               str(tmp_path / "trace"), "--nnodes", f"1:{nodes.count}",
               "--nproc-per-node", "1", "--rdzv-id", "members", "--max-restarts", "3", *rdzv)
    return launch(nodes.argv(i, argv), name=name or f"node{i}", env=nodes.env(i))


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


def sizes_in_order(trace) -> list[int]:
    """The world sizes of the committed steps in step order, repeats folded."""
    out: list[int] = []
    for _, (sizes, _) in sorted(steps(trace).items()):
        if len(sizes) == 1 and (not out or out[-1] != min(sizes)):
            out.append(min(sizes))
    return out


@pytest.fixture
def three_nodes_and_etcd(tmp_path, netns_nodes, request):
    """Three nodes, and with ``request.param == "etcd-v2"`` an etcd server in the root
    namespace on their bridge (else None: c10d)."""
    nodes = netns_nodes(3)
    if request.param != "etcd-v2":
        yield nodes, None
        return
    with etcd_on(tmp_path / "etcd", nodes.host_address) as server:
        yield nodes, server


@pytest.mark.parametrize("three_nodes_and_etcd", ["c10d", "etcd-v2"], indirect=True)
def test_nodes_join_and_leave_in_place_2_3_2_1_2(launch, three_nodes_and_etcd, tmp_path):
    """Two nodes; a third joins (3), is preempted (2), node 1 is killed (1), a new node joins
    in node 1's place (2): node 0's worker keeps its process throughout, no checkpoint is
    read, the global batch is the same at every step and every sample is trained once."""
    nodes, etcd = three_nodes_and_etcd
    total = 600  # the second join lands near step 260 (CPU, 2 cores)

    def start_node(i: int, name: str = "") -> Job:
        return start_one(launch, nodes, tmp_path, i, total, slow=0.08, name=name, etcd=etcd)

    jobs = [start_node(i) for i in (0, 1)]
    wait_until(lambda: all(len(j.workers()) == 1 for j in jobs), 180, "two workers")
    kept = next(iter(jobs[0].workers().values()))
    wait_until(lambda: len(steps(tmp_path / "trace")) >= 20, 120, "step 20")

    # 1. a third node joins: the running workers go on and take it in at a step boundary
    third = start_node(2)
    wait_until(lambda: 3 in sizes_seen(tmp_path), 180, "a step at world size 3")
    assert changes(jobs[0])[-1][1:] [::2] == ("join", 3), changes(jobs[0])
    assert "joined the running job" in third.output

    # 2. it is preempted (2), 3. node 1 is killed (1)
    third.proc.send_signal(signal.SIGTERM)
    assert third.wait(timeout=60) == 143, third.output[-3000:]
    wait_until(lambda: sizes_in_order(tmp_path / "trace")[-1] == 2, 60, "world size 2 again")
    jobs[1].kill_all()
    wait_until(lambda: sizes_in_order(tmp_path / "trace")[-1] == 1, 60, "world size 1")

    # 4. a new node in node 1's namespace joins (2)
    again = start_node(1, "node1-again")
    wait_until(lambda: sizes_in_order(tmp_path / "trace")[-1] == 2, 180, "world size 2 again")
    assert kept.is_running()  # node 0's worker kept its process throughout
    assert jobs[0].wait(timeout=400) == 0, jobs[0].output[-4000:]
    assert again.wait(timeout=120) == 0, again.output[-4000:]

    assert sizes_in_order(tmp_path / "trace") == [2, 3, 2, 1, 2]
    assert [c[1] for c in changes(jobs[0])] == ["join", "preempted", "lost", "join"]
    assert "resumed from" not in jobs[0].output + again.output  # no checkpoint read
    trace = steps(tmp_path / "trace")
    assert sorted(trace) == list(range(1, total + 1))
    assert {samples for _, samples in trace.values()} == {GLOBAL_BATCH}
    assert all(len(sizes) == 1 for sizes, _ in trace.values())
    check_samples(tmp_path)


def test_etcd_the_store_host_leaves_and_then_dies_and_the_group_goes_on_in_place(
        launch, netns_nodes, tmp_path):
    """etcd-v2, three nodes; the node whose agent hosts the recovery store is preempted (3 ->
    2: the store moves with the departure's announcement to the lowest remaining node id),
    then the node that took it over is
    killed (2 -> 1: the survivor's agent finds the store dead, claims the successor in etcd
    and moves it to itself), then a new node joins (1 -> 2). The last node's worker keeps its
    process throughout, no checkpoint is read, every sample is trained once."""
    nodes = netns_nodes(3)
    total = 500
    with etcd_on(tmp_path / "etcd", nodes.host_address) as etcd:
        def start_node(i: int, name: str = "") -> Job:
            return start_one(launch, nodes, tmp_path, i, total, slow=0.08, name=name,
                             etcd=etcd)

        jobs = [start_node(i) for i in range(3)]
        wait_until(lambda: 3 in sizes_seen(tmp_path), 180, "a step at world size 3")
        # node ids: the first round's node ranks, or claimed on joining if a node was late
        registered = re.compile(r"membership: node (\d+) registered")
        by_id = {int(registered.search(j.output)[1]): j for j in jobs}
        host = next(j for j in jobs if "hosts the recovery store" in j.output)
        successor, last = [by_id[n] for n in sorted(by_id) if by_id[n] is not host]
        kept = next(iter(last.workers().values()))
        wait_until(lambda: len(steps(tmp_path / "trace")) >= 20, 120, "step 20")

        # 1. the store's host is preempted: it leaves in place, the store moves to the next node
        host.proc.send_signal(signal.SIGTERM)
        assert host.wait(timeout=60) == 143, host.output[-3000:]
        wait_until(lambda: sizes_in_order(tmp_path / "trace")[-1] == 2, 60, "world size 2")
        assert "every agent followed" in host.output, host.output[-3000:]
        moved = re.compile(r"the recovery store moved from .* to node (\d+)'s agent")
        ids = {j: n for n, j in by_id.items()}
        assert [int(m[1]) for m in moved.finditer(last.output)] == [ids[successor]]

        # 2. the node that hosts it now is killed: the last node moves it to itself
        successor.kill_all()
        wait_until(lambda: sizes_in_order(tmp_path / "trace")[-1] == 1, 90, "world size 1")
        assert [int(m[1]) for m in moved.finditer(last.output)] == [ids[successor], ids[last]]
        assert "does not answer" in last.output

        # 3. a new node joins the job whose store lives on node 2 now
        again = start_node(0, "node0-again")
        wait_until(lambda: sizes_in_order(tmp_path / "trace")[-1] == 2, 180,
                   "world size 2 again")
        assert kept.is_running()  # the last node's worker kept its process throughout
        assert last.wait(timeout=400) == 0, last.output[-4000:]
        assert again.wait(timeout=120) == 0, again.output[-4000:]

    # the last node's worker, rank 2 at the start, became rank 0 and logs as rank 0 does
    assert "[rank0] INFO elastic_runner.checkpointing: committed checkpoint" in last.output
    assert sizes_in_order(tmp_path / "trace")[-4:] == [3, 2, 1, 2]
    assert [c[1] for c in changes(last)][-3:] == ["preempted", "lost", "join"]
    assert "resumed from" not in last.output + again.output  # no checkpoint read
    trace = steps(tmp_path / "trace")
    assert sorted(trace) == list(range(1, total + 1))
    assert {samples for _, samples in trace.values()} == {GLOBAL_BATCH}
    check_samples(tmp_path)


def test_c10d_a_node_the_global_batch_cannot_take_is_refused_and_the_group_goes_on(
        launch, netns_nodes, tmp_path):
    """Global batch 64 at world size 2; a third node would make 3, which does not divide it:
    rank 0 refuses the join, the step the ranks stopped at is redone in the same group, the
    new node's agent ends with an error, and the job completes at world size 2."""
    nodes = netns_nodes(3)
    jobs = [start_one(launch, nodes, tmp_path, i, 300, global_batch=64) for i in (0, 1)]
    wait_until(lambda: len(steps(tmp_path / "trace")) >= 20, 180, "step 20")
    third = start_one(launch, nodes, tmp_path, 2, 300, global_batch=64)
    assert third.wait(timeout=180) != 0, third.output[-3000:]
    assert "did not take this node in: batch.global_batch_size is not divisible at world " \
           "size 3" in third.output
    for job in jobs:
        assert job.wait(timeout=300) == 0, job.output[-4000:]
    assert "they stay out" in jobs[0].output
    trace = steps(tmp_path / "trace")
    assert sorted(trace) == list(range(1, 301)) and sizes_seen(tmp_path) == {2}
    assert {samples for _, samples in trace.values()} == {64}
    assert "resumed from" not in jobs[0].output
    check_samples(tmp_path)
