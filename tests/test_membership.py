"""Unit tests of the membership protocol's pieces against a real TCPStore (no launcher)."""

from __future__ import annotations

import json
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from elastic_runner.config import BatchConfig, ConfigError, load_config
from elastic_runner.protocol.keys import AttemptKeys
from elastic_runner.recovery.membership import (
    NodeBeat,
    NodeWatch,
    Policy,
    View,
    announce_departure,
    announce_join,
    claim_node_id,
    pending_joins,
    raise_counter,
    read_global_batch,
    read_view,
    record_global_batch,
    register,
    request_join,
)
from elastic_runner.recovery.store import StoreLocation, claim_successor, tell_workers, told


@pytest.fixture
def store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=5))


def key(*parts: object) -> str:
    return "/".join(["job/attempt", *map(str, parts)])


def at(store: dist.Store) -> AttemptKeys:
    """The attempt's keys (:func:`key`) in ``store``."""
    return AttemptKeys(store, key)


def test_without_renumbers_the_remaining_nodes_contiguously() -> None:
    view = View(0, {0: [0, 1], 1: [2, 3], 2: [4, 5]}, store_node=0)
    new, members = view.without([1], 7)
    assert members == [0, 1, 4, 5]
    assert new.nodes == {0: [0, 1], 2: [2, 3]}
    assert (new.generation, new.departed, new.world_size, new.store_node) == (7, (1,), 4, 0)
    again, members = new.without([0], 9)
    assert members == [2, 3] and again.nodes == {2: [0, 1]} and again.departed == (0, 1)
    assert View.from_json(again.to_json()) == again


def test_read_view_assembles_the_registrations(store: dist.TCPStore) -> None:
    register(at(store), 1, [2, 3], hosts_store=False, nnodes=2)
    register(at(store), 0, [0, 1], hosts_store=True, nnodes=2)
    view = read_view(at(store))
    assert view == View(0, {0: [0, 1], 1: [2, 3]}, store_node=0)


def test_departure_is_announced_once_with_the_new_ranks(store: dist.TCPStore) -> None:
    view = View(0, {0: [0, 1], 1: [2, 3], 2: [4, 5]}, store_node=0)
    store.add(key("generations"), 3)  # replacements before
    generation, new, members = announce_departure(at(store), view, [2], "lost")
    assert generation == 4 and members == [0, 1, 2, 3]
    announced = json.loads(store.get(key("gen", 4)))
    assert announced == {"departed": [2], "failed": [4, 5], "members": [0, 1, 2, 3],
                         "world_size": 4, "reason": "lost"}
    assert read_view(at(store)) == new
    # a second agent that saw the same silence claims nothing and announces nothing
    assert announce_departure(at(store), view, [2], "lost") is None
    assert store.add(key("generations"), 0) == 4


def test_the_store_moves_with_its_departing_host_seeded_for_the_survivors(
        store: dist.TCPStore) -> None:
    """etcd: node 0 hosts the store and leaves; the announcement names node 1's store, which
    holds the new view, the departure's claim and the generation counter before the old store
    says anything."""
    successor = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=5))
    endpoints = {0: f"127.0.0.1:{store.port}", 1: f"127.0.0.1:{successor.port}", 2: "x:1"}
    register(at(store), 0, [0, 1], hosts_store=True, nnodes=3, own_store=endpoints[0])
    register(at(store), 1, [2, 3], hosts_store=False, nnodes=3, own_store=endpoints[1])
    register(at(store), 2, [4, 5], hosts_store=False, nnodes=3, own_store=endpoints[2])
    view = read_view(at(store))
    assert view.stores == endpoints and view.store_node == 0
    store.add(key("generations"), 5)
    reached = []

    def connect(endpoint: str) -> dist.Store:
        reached.append(endpoint)
        assert not store.check([key("gen", 6)])  # seeded before the announcement
        return successor

    generation, new, members = announce_departure(at(store), view, [0], "preempted",
                                                  connect)
    assert (generation, members, reached) == (6, [2, 3, 4, 5], [endpoints[1]])
    assert new.store_node == 1 and new.nodes == {1: [0, 1], 2: [2, 3]}
    assert json.loads(store.get(key("gen", 6)))["store"] == endpoints[1]
    assert read_view(at(successor)) == new == read_view(at(store))
    assert successor.add(key("generations"), 1) == 7  # the next announcement there
    assert successor.get(key("departed", 0)) == store.get(key("departed", 0))


def test_raise_counter_only_raises(store: dist.TCPStore) -> None:
    store.add(key("generations"), 4)
    assert raise_counter(store, key("generations"), 2) == 4
    assert raise_counter(store, key("generations"), 9) == 9
    assert store.add(key("generations"), 1) == 10
    assert raise_counter(store, key("fresh"), 3) == 3


def test_agents_that_lost_the_store_agree_on_one_successor(store: dist.TCPStore,
                                                           tmp_path) -> None:
    """The first claim sets the successor; an agent that proposed another (it read an older
    view) moves to the same one; its workers read it from the node's file."""
    first = claim_successor(store, "job/attempt", "10.0.0.2:4000", "10.0.0.3:4001", 1)
    second = claim_successor(store, "job/attempt", "10.0.0.2:4000", "10.0.0.4:4002", 1)
    assert first == second == "10.0.0.3:4001"
    assert claim_successor(store, "job/attempt", "10.0.0.3:4001", "10.0.0.4:4002",
                           1) == "10.0.0.4:4002"  # the next host's failure is its own claim
    assert told(tmp_path) is None
    location = StoreLocation("node0", first, "job/attempt", "job")
    tell_workers(tmp_path, location)
    assert told(tmp_path) == location


def test_a_joining_node_gets_a_fresh_id_and_ranks_after_the_members(store: dist.TCPStore
                                                                     ) -> None:
    # node 1 left earlier: ids 0 and 1 are taken, and so is 2 by another newcomer's claim
    view = View(3, {0: [0, 1]}, departed=(1,), store_node=0)
    store.set(key("view"), view.to_json())
    store.add(key("generations"), 3)
    assert claim_node_id(at(store), view) == 2
    assert claim_node_id(at(store), view) == 3  # 2 is claimed now
    assert pending_joins(at(store), 0) == {}
    assert request_join(at(store), 3, 2) == 1
    assert request_join(at(store), 2, 1) == 2
    assert pending_joins(at(store), 0) == {1: {"node": 3, "nproc": 2, "store": ""},
                                            2: {"node": 2, "nproc": 1, "store": ""}}
    assert pending_joins(at(store), 1) == {2: {"node": 2, "nproc": 1, "store": ""}}
    generation, new = announce_join(at(store), view, {3: 2, 2: 1}, admitted=2)
    assert generation == 4 and new.nodes == {0: [0, 1], 2: [2], 3: [3, 4]}
    assert read_view(at(store)) == new and new.world_size == 5
    assert json.loads(store.get(key("gen", 4))) == {
        "joined": [2, 3], "failed": [], "members": [0, 1], "world_size": 5, "admitted": 2,
        "reason": "joined"}
    assert json.loads(store.get(key("admitted", 3))) == {"generation": 4, "ranks": [3, 4],
                                                         "world_size": 5}
    assert pending_joins(at(store), 2) == {}
    assert int(store.get(key("joins_admitted"))) == 2


def test_policy_refuses_below_min_nodes_the_store_host_and_a_batch_too_small() -> None:
    view = View(0, {0: [0, 1], 1: [2, 3], 2: [4, 5]}, store_node=0)
    batch = BatchConfig(micro_batch_size=4, global_batch_size=32)  # world sizes 1, 2, 4, 8
    policy = Policy.for_batch(1, batch)
    assert policy.refuses(view, [2]) is None  # 6 -> 4 ranks
    assert "hosts the recovery store" in policy.refuses(view, [0])  # c10d: no successor
    standby = View(0, view.nodes, store_node=0, stores={0: "a:1", 1: "b:1", 2: "c:1"})
    assert policy.refuses(standby, [0]) is None  # etcd: the store moves to node 1
    assert standby.successor([0]) == 1 and standby.successor([0, 1]) == 2
    assert "hosts the recovery store" in policy.refuses(standby, [0, 1, 2])
    assert "fewer than --nnodes MIN 3" in Policy.for_batch(3, batch).refuses(view, [2])
    uneven = View(0, {0: [0, 1, 2], 1: [3]}, store_node=0)
    assert policy.refuses(uneven, [1]) is None  # 32 at 3 ranks: split unevenly
    tiny = Policy.for_batch(1, BatchConfig(micro_batch_size=1, global_batch_size=2))
    assert "cannot be split at world size 3" in tiny.refuses(uneven, [1])  # an empty one
    assert Policy.for_batch(1, None).refuses(uneven, [1]) is None  # a script's own batch
    # no global_batch_size: the one the group's rank 0 recorded (the job's first world size's)
    kept = Policy.for_batch(1, BatchConfig(micro_batch_size=1, grad_accum_steps=2))
    assert kept.keeping(None).refuses(uneven, [1]) is None  # not recorded yet: any size
    assert "cannot be split at world size 3" in kept.keeping(2).refuses(uneven, [1])
    assert kept.keeping(6).refuses(uneven, [1]) is None  # 6 = 3 ranks x 2 micro-batches of 1


def test_rank_0_records_the_global_batch_the_agents_and_joiners_read(store: dist.TCPStore
                                                                      ) -> None:
    assert read_global_batch(at(store)) is None
    record_global_batch(at(store), 64)
    assert read_global_batch(at(store)) == 64
    record_global_batch(at(store), None)  # batch.keep_global_batch: false: none is kept
    assert read_global_batch(at(store)) is None


def test_node_watch_counts_silence_on_its_own_clock(store: dist.TCPStore,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr("elastic_runner.recovery.membership.time.monotonic", lambda: now[0])
    me = NodeWatch(at(store), 0, timeout_s=5)
    other = NodeBeat(at(store), 1)
    other.beat()
    assert me.lost([0, 1, 2]) == {}  # first sight: the silence counts from now
    now[0] += 2
    assert me.lost([0, 1, 2]) == {}
    other.beat()
    now[0] += 2
    assert me.lost([0, 1, 2]) == {}
    now[0] += 2  # node 1 beat 2 s ago (seen at 104); node 2 never beat, first seen at 100
    assert me.lost([0, 1, 2]) == {2: 6.0}
    now[0] += 2
    assert me.lost([0, 1, 2]) == {2: 8.0}
    now[0] += 2
    assert me.lost([1, 2]) == {1: 6.0, 2: 10.0}


def test_a_watch_that_did_not_look_counts_every_silence_afresh(
        store: dist.TCPStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """The watching agent's own loop blocked (torch's rendezvous call waiting for a stopped
    etcd): it cannot tell a silent node from its own absence."""
    now = [100.0]
    monkeypatch.setattr("elastic_runner.recovery.membership.time.monotonic", lambda: now[0])
    me = NodeWatch(at(store), 0, timeout_s=5)
    NodeBeat(at(store), 1).beat()
    assert me.lost([1]) == {}
    now[0] += 7  # no look for 7 s, node 1 silent as well
    assert me.lost([1]) == {}
    now[0] += 2
    assert me.lost([1]) == {}
    for _ in range(2):  # looking again: 6 s of silence seen is lost
        now[0] += 2
    assert me.lost([1]) == {}  # the last look was 4 s ago: afresh again
    for _ in range(3):
        now[0] += 2
        found = me.lost([1])
    assert found == {1: 6.0}


def test_the_beat_thread_beats_until_closed(store: dist.TCPStore) -> None:
    beat = NodeBeat(at(store), 3, interval_s=0.01).start()
    counter = key("node", 3, "beat")
    deadline = time.monotonic() + 10
    while store.add(counter, 0) < 5:
        assert time.monotonic() < deadline, "the thread did not beat"
        time.sleep(0.01)
    beat.close()
    beat._thread.join(5)
    assert not beat._thread.is_alive()
    after = store.add(counter, 0)
    assert store.add(counter, 0) == after


def test_node_timeout_must_be_below_the_detect_timeout(tmp_path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("task: digits\n")
    assert load_config(str(cfg), []).recovery.node_timeout_seconds == 5.0
    with pytest.raises(ConfigError, match=r"recovery.node_timeout_seconds.*must be below "
                                          r"recovery.detect_timeout_seconds \(10\)"):
        load_config(str(cfg), ["recovery.node_timeout_seconds=12"])


def test_node_of_names_the_node_of_a_rank_and_refuses_a_rank_of_none() -> None:
    """The leave protocol reads each rank's node from the view, not from the worker's own
    GROUP_RANK (a replacement on a node that joined once carried a stale one)."""
    view = View(3, {0: [0, 1], 2: [2, 3]})
    assert [view.node_of(r) for r in range(4)] == [0, 0, 2, 2]
    with pytest.raises(KeyError, match="no node of view 3 has rank 4"):
        view.node_of(4)
