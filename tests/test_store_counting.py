"""The recovery store's operations are counted at the client (``protocol/counting.py``, issue
56): each operation exactly once, by kind and key family, against torch's own stores; the
clients the agents and workers make the normal way count; a process group's store does not;
the counts reach the rank's and the agent's Prometheus series."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch.distributed as dist
from prometheus_client import CollectorRegistry

from elastic_runner.agent.store import AgentStore
from elastic_runner.config import MetricsConfig
from elastic_runner.observe.metrics import RankMetrics
from elastic_runner.observe.node_metrics import AgentMonitor
from elastic_runner.protocol import counting
from elastic_runner.protocol.counting import COUNTS, CountingStore, OpCounts, counted, key_family
from elastic_runner.recovery.generation_watch import GenerationWatch
from elastic_runner.recovery.inplace import InPlaceRecovery
from elastic_runner.recovery.store import StoreLocation, connect
from elastic_runner.recovery.store_client import StoreClient

PREFIX = "elastic_runner/run/abc123"


def _server() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=10))


def _delta(before: dict, after: dict) -> dict:
    return {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)}


@pytest.fixture(params=["hash", "tcp"])
def store(request: pytest.FixtureRequest) -> dist.Store:
    return dist.HashStore() if request.param == "hash" else _server()


def test_each_operation_counts_once_by_kind_and_key_family(store):
    counts = OpCounts()
    s = CountingStore(store, counts)
    gen, beat, view = f"{PREFIX}/gen/1", f"{PREFIX}/node/0/beat", "attempt-x/view"
    s.set(gen, "a")
    assert s.get(gen) == b"a"
    assert s.add(beat, 2) == 2 and s.add(beat, 0) == 2
    assert s.compare_set(view, "", "v") == b"v"
    assert s.check([gen, beat]) and not s.check([f"{PREFIX}/restart"])
    s.wait([gen])
    s.wait([gen], timedelta(seconds=1))
    assert s.multi_get([gen, view]) == [b"a", b"v"]
    s.multi_set([f"{PREFIX}/joins_admitted", view], ["1", "w"])
    s.append(f"{PREFIX}/rank0_state", "b")
    assert s.num_keys() >= 4
    assert s.delete_key(view)
    assert counts.snapshot() == {
        ("set", "gen"): 1, ("get", "gen"): 1, ("add", "node"): 2, ("compare_set", "view"): 1,
        ("check", "gen"): 1, ("check", "restart"): 1, ("wait", "gen"): 2,
        ("multi_get", "gen"): 1, ("multi_set", "joins_admitted"): 1,
        ("append", "rank0_state"): 1, ("num_keys", ""): 1, ("delete_key", "view"): 1}
    assert counts.by_op()["add"] == 2 and sum(counts.by_op().values()) == 14
    # what the store is: its timeout and a TCPStore's port are the store's
    s.set_timeout(timedelta(seconds=7))
    assert s.timeout == store.timeout == timedelta(seconds=7)
    if isinstance(store, dist.TCPStore):
        assert s.port == store.port
    assert counted(s, counts) is s and counting.uncounted(s) is store


def test_a_prefix_store_over_it_counts_what_goes_through_it():
    counts = OpCounts()
    s = CountingStore(dist.HashStore(), counts)
    dist.PrefixStore("attempt-x/pg/1", s).set("k", "1")  # torch's C++ calls the counting set
    assert counts.snapshot() == {("set", "pg"): 1}


def test_key_families():
    assert key_family(f"{PREFIX}/spare/0.1/assign") == "spare"
    assert key_family("attempt-9f/restart") == "restart"
    assert key_family("elastic_runner/running/0") == "other"
    assert key_family("x") == "other"


def test_clients_made_the_normal_way_are_counted_and_a_group_store_is_not():
    server = _server()
    location = StoreLocation("c10d", f"127.0.0.1:{server.port}", PREFIX, "run")
    before = COUNTS.snapshot()
    worker = StoreClient(connect(location, 10), PREFIX, location, 10)
    attempt = worker.attempt
    attempt.announce_built()
    assert attempt.built() and not attempt.restart_asked()
    assert attempt.announcement(1) is None  # two checks: gen/1, restart
    assert _delta(before, COUNTS.snapshot()) == {("set", "built"): 1, ("check", "built"): 1,
                                                 ("check", "restart"): 2, ("check", "gen"): 1}
    # a generation's process-group store goes to torch's store: not counted, no Python store
    before = COUNTS.snapshot()
    group = attempt.group_store(1)
    group.set("x", "1")
    assert not isinstance(group, CountingStore)
    assert COUNTS.snapshot() == before
    # a worker's recovery made from a store handed in counts too
    before = COUNTS.snapshot()
    InPlaceRecovery(dist.HashStore(), PREFIX, 0, 1, 1).client.attempt.ask_restart()
    assert _delta(before, COUNTS.snapshot()) == {("set", "restart"): 1}


def test_the_agents_store_counts_as_the_agent(monkeypatch):
    monkeypatch.setattr(COUNTS, "role", "worker")
    agent = AgentStore(None, 10, None)  # one node: the store this agent hosts
    agent.prefix = "attempt-t"
    before = COUNTS.snapshot()
    agent.attempt.spare_ready("0.1")
    assert agent.attempt.is_spare_ready("0.1")
    assert _delta(before, COUNTS.snapshot()) == {("set", "spare"): 1, ("check", "spare"): 1}
    assert COUNTS.role == "agent"


def test_one_look_of_the_generation_watch_is_four_operations():
    """The watch's look every 0.1 s: issue 56 read three operations in the code; the
    restart key is checked twice (``restart_asked``, then ``announcement``'s fallback)."""
    server = _server()
    location = StoreLocation("c10d", f"127.0.0.1:{server.port}", PREFIX, "run")
    recovery = InPlaceRecovery(connect(location, 10), PREFIX, 0, 1, 1, location=location,
                               nnodes=2)
    before = COUNTS.snapshot()
    watch = GenerationWatch(recovery.client, recovery.formation, recovery.nodes,
                            interval_s=0.05)
    try:
        deadline = time.monotonic() + 10
        while COUNTS.snapshot().get(("add", "joins"), 0) - before.get(("add", "joins"), 0) < 3:
            assert time.monotonic() < deadline, "the watch made no look"
            time.sleep(0.01)
    finally:
        watch.close()
    looks = _delta(before, COUNTS.snapshot())
    n = looks[("add", "joins")]
    # each look: restart asked, the next generation announced (or restart), joins posted
    assert looks == {("check", "restart"): 2 * n, ("check", "gen"): n, ("add", "joins"): n}


def test_the_counts_reach_the_rank_and_agent_series():
    registry = CollectorRegistry()
    rank = RankMetrics(MetricsConfig(), 3, 1, registry=registry)

    def rank_value(op: str) -> float:
        return registry.get_sample_value("elastic_runner_store_operations_total",
                                         {"job": "elastic-runner", "node": rank._labels["node"],
                                          "rank": "3", "local_rank": "1", "op": op}) or 0.0

    assert rank_value("check") == 0.0  # the series exist before the first publish
    s = counted(dist.HashStore())
    for _ in range(5):
        s.check(["attempt-x/restart"])
    before = COUNTS.by_op()
    rank.publish()
    assert rank_value("check") == before["check"]
    s.delete_key("attempt-x/restart")
    rank.publish()
    assert rank_value("check") == before["check"]
    assert rank_value("delete_key") == COUNTS.by_op()["delete_key"]
    agent = CollectorRegistry()
    agent.register(AgentMonitor("job", "node", 1))
    s.add("attempt-x/generations", 1)
    assert agent.get_sample_value("elastic_runner_agent_store_operations_total",
                                  {"job": "job", "node": "node", "op": "add"}) == \
        COUNTS.by_op()["add"]
