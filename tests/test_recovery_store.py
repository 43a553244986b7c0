"""The pieces in-place recovery across nodes is built from, each against the real thing: where
the recovery store lives and how every node agrees on an attempt's keys (real TCPStores), the
restart key that stops in-place replacements, a group's sockets cut so a waiting peer reads
end-of-file, and the heartbeat an agent uses to find a frozen (SIGSTOPped) worker."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from elastic_runner.agent.hang_watch import HangWatch
from elastic_runner.agent.node_attempt import NodeAttempt
from elastic_runner.agent.spares import REFILL_NICE, Spares, WarmSpares
from elastic_runner.agent.store import AgentStore
from elastic_runner.checkpoint.fencing import FencedOut
from elastic_runner.preempt import Preempted
from elastic_runner.protocol.announcement import RESTART, Announcement
from elastic_runner.protocol.env import HEARTBEAT_ENV, MIN_NODES_ENV, SPARE_ENV
from elastic_runner.protocol.env import INPLACE_ENV as ENV
from elastic_runner.protocol.keys import AttemptKeys
from elastic_runner.recovery.group_sockets import GroupSockets, NoSockets
from elastic_runner.recovery.heartbeat import Heartbeat, NoHeartbeat
from elastic_runner.recovery.inplace import GenerationWatch, InPlaceRecovery
from elastic_runner.recovery.membership import (
    Policy,
    announce_departure,
    read_view,
    register,
)
from elastic_runner.recovery.store import Attempt, StoreLocation, agree_attempt, connect

from .procs import wait_until


def test_location_of_each_rendezvous_backend_round_trips_through_json():
    c10d = StoreLocation.for_rendezvous("c10d", "node-0", "job")
    assert (c10d.kind, c10d.endpoint) == ("c10d", "node-0:29400")  # torchrun's default port
    etcd = StoreLocation.for_rendezvous("etcd-v2", "10.0.0.1:2379", "job")
    assert (etcd.kind, etcd.endpoint) == ("node0", "")  # node rank 0 names it each round
    moved = etcd.at("10.0.0.2:4000", "elastic_runner/job/abc")
    assert StoreLocation.from_json(moved.to_json()) == moved
    with pytest.raises(ValueError, match="c10d or etcd"):
        StoreLocation.for_rendezvous("static", "h:1", "job")


def test_every_node_agrees_on_the_attempt_and_store_through_the_round_store():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=10))
    location = StoreLocation("c10d", f"127.0.0.1:{server.port}", run_id="job")
    stores = [connect(location, 10) for _ in range(3)]

    def round_(name: str, running: dict[int, tuple[str, str]]) -> dict[int, Attempt]:
        got: dict[int, Attempt] = {}
        threads = [threading.Thread(target=lambda n=n: got.update({n: agree_attempt(
            dist.PrefixStore(name, stores[n]), n, 3, "job", f"node{n}:1", running.get(n))}))
            for n in (2, 1, 0)]  # the other nodes ask before node rank 0 has drawn it
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=20)
        assert len(set(got.values())) == 1, got
        return got

    first = round_("round-1/", {})[0]
    assert first.prefix.startswith("elastic_runner/job/") and first.endpoint == "node0:1"
    assert not first.running  # node 0's offer, a new attempt
    again = round_("round-2/", {})[0]
    assert again.prefix != first.prefix  # a new rendezvous round, new keys
    # nodes 0 and 2 still run the attempt of round 2, node 1 joins: everyone takes it
    joined = round_("round-3/", {0: (again.prefix, "node1:7"), 2: (again.prefix, "node1:7")})
    assert joined[1] == Attempt(again.prefix, "node1:7", True)


def test_each_etcd_agent_hosts_a_store_and_every_agent_takes_node_rank_0s():
    """etcd: each agent's :class:`AgentStore` hosts a server and offers it; after the round
    every agent uses node rank 0's (a client of it, even node rank 0's own agent), with one
    prefix; a store not yet in use is reached through its own server."""
    round_server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                 timeout=timedelta(seconds=10))
    etcd = StoreLocation.for_rendezvous("etcd-v2", "etcd:2379", "job")
    agents = [AgentStore(etcd, 10, "127.0.0.1") for _ in range(2)]
    assert all(a.hosted is not None and a.own == f"127.0.0.1:{a.hosted.port}" for a in agents)
    clients = [connect(StoreLocation("c10d", f"127.0.0.1:{round_server.port}"), 10)
               for _ in agents]  # one client per agent: a client blocks while it waits
    threads = [threading.Thread(target=lambda n=n: agents[n].agree(
        dist.PrefixStore("round/", clients[n]), n, 2)) for n in (1, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert {a.location.endpoint for a in agents} == {agents[0].own}
    assert agents[0].prefix == agents[1].prefix and agents[0].prefix.startswith(
        "elastic_runner/job/")
    agents[1].store.set(agents[1].key("x"), "1")  # a client of node rank 0's server
    assert agents[0].hosted.get(agents[0].key("x")) == b"1"
    assert agents[1].client(agents[1].own) is agents[1].hosted
    assert agents[1].for_workers() == etcd.at(agents[0].own, agents[0].prefix)


def test_a_leaving_host_waits_for_every_agent_to_follow_its_store():
    """The host's agent waits until each remaining node acknowledged the move, at most its
    timeout; a host whose store did not move returns at once."""
    etcd = StoreLocation.for_rendezvous("etcd", "etcd:2379", "job")
    host, successor = (AgentStore(etcd, 5, "127.0.0.1") for _ in range(2))
    host.use(host.own)
    host.prefix = "job/attempt"
    endpoints = {0: host.own, 1: successor.own, 2: "127.0.0.1:2"}
    for node in (0, 1, 2):
        register(host.keys_in(host.hosted), node, [node], node == 0, 3, endpoints[node])
    t0 = time.monotonic()
    host.wait_for_followers(0, 30)  # still the store's host: nothing to wait for
    assert time.monotonic() - t0 < 5
    announce_departure(host.keys_in(host.hosted), read_view(host.keys_in(host.hosted)), [0],
                       "preempted", host.client)
    assert read_view(host.keys_in(host.hosted)).store_node == 1
    acks = threading.Timer(0.5, lambda: [host.hosted.set(host.key("moved", n), endpoints[1])
                                         for n in (1, 2)])
    acks.start()
    t0 = time.monotonic()
    host.wait_for_followers(0, 30)
    assert 0.4 < time.monotonic() - t0 < 20
    assert host.hosted.check([host.key("moved", 2)])
    acks.join()


def test_a_restart_asked_for_ends_the_wait_for_a_generation():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=10))
    worker = InPlaceRecovery(connect(StoreLocation("tcp", f"127.0.0.1:{server.port}"), 10),
                             "p", 0, detect_timeout_s=0.2, join_timeout_s=5)
    assert worker.formation.wait_generation(1, 0.2) is None  # nothing announced: times out
    server.set("p/gen/1", json.dumps({"failed": [1]}))
    assert worker.formation.wait_generation(1, 5) == Announcement(failed=(1,))
    worker.ask_restart()
    assert worker.formation.wait_generation(2, 5) == RESTART


def test_cut_sockets_make_the_peer_read_end_of_file_and_leave_others_alone():
    listener = socket.create_server(("127.0.0.1", 0))
    kept = socket.create_connection(listener.getsockname())  # opened before: not the group's
    kept_peer, _ = listener.accept()
    group = GroupSockets()
    with group.forming():
        ours = socket.create_connection(listener.getsockname())
    peer, _ = listener.accept()
    assert group.cut() == 1
    peer.settimeout(5)
    assert peer.recv(16) == b""  # end-of-file, as if this process had died
    kept.sendall(b"x")
    assert kept_peer.recv(16) == b"x"
    assert group.cut() == 0 and NoSockets().cut() == 0
    for s in (listener, kept, kept_peer, ours, peer):
        s.close()


@pytest.mark.parametrize("order", ["inside", "overlapping"])
def test_a_socket_another_thread_opens_while_a_group_forms_is_never_cut(order):
    """A store client that a watcher thread opens while the main thread forms a group (both
    orders in which the two blocks can end) stays usable after the group's sockets are cut."""
    listener = socket.create_server(("127.0.0.1", 0))
    group = GroupSockets()
    forming = group.forming()
    forming.__enter__()
    with group.outside():
        watcher = socket.create_connection(listener.getsockname())
        if order == "overlapping":  # the group finishes forming before the thread's block
            forming.__exit__(None, None, None)
    ours = socket.create_connection(listener.getsockname())  # the group's
    if order == "inside":
        forming.__exit__(None, None, None)
    watcher_peer, _ = listener.accept()
    peer, _ = listener.accept()
    assert group.cut() == (1 if order == "inside" else 0)
    watcher.sendall(b"x")
    assert watcher_peer.recv(16) == b"x"
    for s in (listener, watcher, watcher_peer, ours, peer):
        s.close()


def test_heartbeat_touches_its_file_and_removes_it_when_closed(tmp_path, monkeypatch):
    assert isinstance(Heartbeat.from_env(10), NoHeartbeat)  # no agent's directory
    monkeypatch.setenv(HEARTBEAT_ENV, str(tmp_path))
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert isinstance(Heartbeat.from_env(None), NoHeartbeat)  # the check is off
    beat = Heartbeat.from_env(0.2)
    path = tmp_path / "3"
    first = path.stat().st_mtime_ns
    wait_until(lambda: path.stat().st_mtime_ns > first, 10, "a second beat")
    beat.close()
    assert not path.exists()


def test_the_agent_kills_a_worker_whose_heartbeat_stopped(tmp_path):
    """A real worker-like process beating through :class:`Heartbeat`, then SIGSTOPped."""
    code = ("import os, sys, threading; from pathlib import Path; "
            "from elastic_runner.recovery.heartbeat import Heartbeat; "
            "Heartbeat(Path(sys.argv[1]), 0.05); threading.Event().wait()")
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "0")])
    try:
        wait_until(lambda: (tmp_path / "0").exists(), 60, "the first beat")
        watch = HangWatch(tmp_path, 0.5)  # recovery.heartbeat_timeout_seconds
        pc = SimpleNamespace(subprocess_handlers={0: SimpleNamespace(proc=proc)})
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:  # beating: never killed
            watch.kill_hung(pc)
            assert proc.poll() is None
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGSTOP)
        wait_until(lambda: (watch.kill_hung(pc), proc.poll())[1] is not None,
                   30, "the agent killing the frozen process")
        assert proc.returncode == -signal.SIGKILL and not (tmp_path / "0").exists()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


def test_a_spare_reads_what_the_workers_read_from_its_agent(tmp_path):
    """A spare (a real process started by the agent's ``Spares.start``) gets the recovery
    store, the heartbeat directory and ``--nnodes`` MIN as the workers do: without MIN a
    replacement that was then preempted took its node out of a ``--nnodes 2:2`` job (the soak:
    it left in place instead of taking the restart path)."""
    location = StoreLocation("tcp", "127.0.0.1:1", "attempt/1")
    attempt = NodeAttempt(SimpleNamespace(for_workers=lambda: location),  # type: ignore[arg-type]
                          tmp_path / "beats", Policy(min_nodes=2), node=1)
    out = tmp_path / "env.json"
    code = "import json, os, sys; json.dump(dict(os.environ), open(sys.argv[1], 'w'))"
    pc = SimpleNamespace(entrypoint=sys.executable, args={0: ("-c", code, str(out))},
                         envs={0: {"LOCAL_RANK": "0", "RANK": "3", "GROUP_RANK": "1"}})
    spare = Spares(attempt).start(pc)
    assert spare.proc.wait(timeout=60) == 0
    env = json.loads(out.read_text())
    assert env[MIN_NODES_ENV] == "2" and env[HEARTBEAT_ENV] == str(tmp_path / "beats")
    assert StoreLocation.from_json(env[ENV]) == location
    assert env[SPARE_ENV] == "1.0" and env["RANK"] == "-1"


def test_after_a_replacement_the_next_spare_starts_lowered_or_once_the_recovery_committed(
        tmp_path):
    """The next warm spare (a real process) starts when rank 0 announces the recovery's first
    committed step, not at the replacement: its build would take the CPU from the recovery (on
    2 cores the recovery was about 1 s slower at GPT-2-small width). An agent that may give a
    spare its priority back (root) starts it at once instead, at nice +10."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=5))
    keys = AttemptKeys(store, lambda *parts: "/".join(["attempt", *map(str, parts)]))
    location = StoreLocation("tcp", "127.0.0.1:1", "attempt")
    rs = SimpleNamespace(attempt=keys, for_workers=lambda: location)
    attempt = NodeAttempt(rs, tmp_path / "beats", Policy(), node=0)  # type: ignore[arg-type]
    pc = SimpleNamespace(entrypoint=sys.executable, args={0: ("-c", "import time; time.sleep(60)")},
                         envs={0: {"LOCAL_RANK": "0", "RANK": "0", "GROUP_RANK": "0"}})
    spares = WarmSpares(attempt, delay_s=0)
    spares._nice = 0  # an agent that may not give a spare its priority back: the refill waits
    keys.announce_built()
    spares.keep(pc)
    taken = spares._kept[0]  # the first one: as soon as the task is built
    attempt.generation = 3
    assert spares.take(pc) is taken  # a worker died: it takes the place
    lowered = None
    try:
        spares.keep(pc)
        assert not spares._kept  # the recovery of generation 3 has not committed a step
        keys.announce_recovered(2)
        spares.keep(pc)
        assert not spares._kept  # another generation's
        keys.announce_recovered(3)
        spares.keep(pc)
        assert spares._kept and spares._kept[0].proc.poll() is None
        # an agent that may (root): the next refill starts at once, at a lower priority
        spares._nice = REFILL_NICE
        attempt.generation = 4
        lowered = spares.take(pc)
        spares.keep(pc)
        assert spares._kept and spares._kept[0] is not lowered
        pid = spares._kept[0].proc.pid
        assert os.getpriority(os.PRIO_PROCESS, pid) == \
            min(19, os.getpriority(os.PRIO_PROCESS, 0) + REFILL_NICE)  # 19: the lowest
    finally:
        spares.drop()
        for proc in [taken.proc] + ([lowered.proc] if lowered else []):
            proc.kill()
            proc.wait()


@pytest.mark.parametrize(("reason", "raised", "says"), [
    ("preempted", Preempted, "node 1 preempted: it left the job after step 7; the others go on "
                             "at world size 2 (generation 5)"),
    ("lost", FencedOut, "node 1 was declared lost in generation 5")])
def test_a_rank_of_a_departed_node_leaves_as_its_node_did(reason, raised, says):
    """A rank whose collective was cut short by its node's departure (its generation watch saw
    the announcement while it was still in the departure's broadcast) leaves as preempted when
    its node was preempted (exit 143, as its node's other ranks), fenced out when it was lost
    (the membership soak: it was fenced out, exit 3, and its agent ended with 3)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=5))
    recovery = InPlaceRecovery(store, "attempt", 4, detect_timeout_s=1, join_timeout_s=5,
                               location=StoreLocation("node0", "127.0.0.1:1", "attempt"),
                               node=1, nnodes=2)
    announced = Announcement(departed=(1,), reason=reason, world_size=2, failed=(2, 3),
                             members=(0, 1))
    loop = SimpleNamespace(session=SimpleNamespace(state=SimpleNamespace(step=7)))
    with pytest.raises(raised, match=re.escape(says)):
        recovery.nodes.follow_departure(announced, loop, time.perf_counter())


def test_the_generation_watch_cuts_a_collective_only_when_a_peer_cannot_finish_it():
    """A replacement's generation, a lost node and the restart path cut the waiting collective;
    a departure at a step boundary and a join do not: their announcer wrote them while every rank
    was in the same collective with it (cut short, a rank hung in that broadcast: the membership
    soak's fault 92)."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=5))
    location = StoreLocation("node0", f"127.0.0.1:{server.port}", "attempt")
    recovery = InPlaceRecovery(server, "attempt", 4, detect_timeout_s=1, join_timeout_s=5,
                               location=location, node=0, nnodes=2)
    watch = GenerationWatch(recovery.client, recovery.formation, recovery.nodes,
                            interval_s=60)  # looked at here, not by its thread
    try:
        assert not watch._must_leave_collective(5)  # nothing announced
        for announced, cut in [({"departed": [1], "reason": "preempted"}, False),
                               ({"joined": [2], "reason": "joined"}, False),
                               ({"departed": [1], "reason": "lost"}, True),
                               ({"failed": [3], "members": [0, 1, 2, 3]}, True)]:
            server.set("attempt/gen/5", json.dumps(announced))
            assert watch._must_leave_collective(5) is cut, announced
        server.delete_key("attempt/gen/5")
        server.set("attempt/restart", "1")
        assert watch._must_leave_collective(5)
    finally:
        watch.close()


def test_a_replacement_ready_after_the_last_step_leaves_at_once():
    """The job's training ended (rank 0 announced it) while a replacement waits for the others
    to join its generation: it leaves with :class:`JobFinished` (exit 0) at once, not after
    ``join_timeout_s`` with a TimeoutError (which took a restart of the finished job)."""
    from elastic_runner.recovery.inplace import JobFinished

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=5))
    replacement = InPlaceRecovery(store, "attempt", 2, detect_timeout_s=1, join_timeout_s=60)
    InPlaceRecovery(store, "attempt", 1, detect_timeout_s=1,
                    join_timeout_s=60).announce_finished(rank=0)
    started = time.monotonic()
    with pytest.raises(JobFinished, match="waited to join generation 2: nothing to do"):
        replacement.group_store(rank=1, world_size=2)
    assert time.monotonic() - started < 30
    with pytest.raises(TimeoutError):  # without the announcement: the join timeout
        InPlaceRecovery(store, "other", 2, detect_timeout_s=1,
                        join_timeout_s=0.2).group_store(rank=1, world_size=2)
