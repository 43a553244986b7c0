"""The protocol package's pieces (``elastic_runner/protocol/``): the announcement's encoding,
torchrun's environment read once, the environment set for a block and restored, the keys'
names."""

from __future__ import annotations

import json
import os

import pytest
import torch.distributed as dist

from elastic_runner.protocol.announcement import RESTART, Announcement
from elastic_runner.protocol.env import SPARE_ENV, generation_of, min_nodes
from elastic_runner.protocol.keys import AttemptKeys, HandshakeKeys, RoundKeys
from elastic_runner.protocol.scoped_env import environment
from elastic_runner.protocol.torchrun_env import PetEnv, TorchrunEnv, assignment, pet_name


def test_an_announcement_writes_only_what_its_writer_set_and_reads_back() -> None:
    news = Announcement(failed=(1,), exitcodes=(-9,))
    assert json.loads(news.encode()) == {"failed": [1], "exitcodes": [-9]}
    assert Announcement.decode(news.encode()) == news
    joined = Announcement(joined=(2,), failed=(), members=(0, 1), world_size=3, admitted=1,
                          reason="joined")
    assert json.loads(joined.encode())["failed"] == []  # said: nobody failed
    assert Announcement.decode(joined.encode()) == joined and joined.is_join
    assert not joined.cuts_collectives and Announcement(reason="lost").cuts_collectives
    assert Announcement.decode('{"restart": true}') == RESTART
    assert json.loads(Announcement(grow=True).encode()) == {"grow": True}
    with pytest.raises(TypeError):
        Announcement.decode('{"unknown": 1}')


def test_the_attempts_keys_carry_the_announcement_through_a_store() -> None:
    keys = AttemptKeys(dist.HashStore(), lambda *parts: "/".join(["p", *map(str, parts)]))
    assert keys.announcement(1) is None
    keys.announce(1, Announcement(failed=(3,)))
    assert keys.announced(1) and keys.announcement(1) == Announcement(failed=(3,))
    assert keys.store.get("p/gen/1") == b'{"failed": [3]}'
    keys.ask_restart()
    assert keys.announcement(2) == RESTART
    assert keys.raise_generations(5) == 5 and keys.draw_generations() == 6


def test_torchrun_env_is_read_once_with_world_size_1_defaults() -> None:
    alone = TorchrunEnv.read({})
    assert not alone.launched and (alone.rank, alone.world_size, alone.restart_count) == (0, 1, 0)
    env = TorchrunEnv.read({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4",
                            "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2",
                            "MASTER_PORT": "29500", "TORCHELASTIC_RESTART_COUNT": "2",
                            "TORCHELASTIC_RUN_ID": "job"})
    assert env.launched and (env.rank, env.local_rank, env.node_rank, env.nnodes) == (3, 1, 1, 2)
    assert (env.master_port, env.restart_count, env.restart_count_text, env.run_id) == (
        29500, 2, "2", "job")
    with pytest.raises(ValueError):
        TorchrunEnv.read({"RANK": "x"})


def test_a_spares_assignment_and_the_pet_variables() -> None:
    assert assignment({"LOCAL_RANK": "0"}, 4, rank=2, node_rank=1) == {
        "LOCAL_RANK": "0", "RANK": "2", "GROUP_RANK": "1", "ELASTIC_RUNNER_GENERATION": "4"}
    assert generation_of(assignment({}, 7)) == 7
    assert pet_name("--nproc-per-node") == "PET_NPROC_PER_NODE"
    pet = PetEnv.read({"PET_RDZV_ENDPOINT": "h:1", "PET_MASTER_ADDR": "node-0"})
    assert pet.sets("--rdzv-endpoint") and not pet.sets("--nnodes")
    assert pet.master_addr == "node-0" and pet.rdzv_backend is None
    assert min_nodes({}) == 1 and min_nodes({"ELASTIC_RUNNER_MIN_NODES": "2"}) == 2


def test_environment_sets_for_the_block_and_restores_also_on_error(monkeypatch) -> None:
    monkeypatch.setenv("ER_TEST_KEPT", "old")
    monkeypatch.delenv("ER_TEST_NEW", raising=False)
    with pytest.raises(RuntimeError), environment({"ER_TEST_KEPT": None}, ER_TEST_NEW="1"):
        assert "ER_TEST_KEPT" not in os.environ and os.environ["ER_TEST_NEW"] == "1"
        raise RuntimeError
    assert os.environ["ER_TEST_KEPT"] == "old" and "ER_TEST_NEW" not in os.environ


def test_the_keys_of_the_round_and_the_handshake() -> None:
    store = dist.HashStore()
    RoundKeys(store).say_running(1, None)
    assert store.get("elastic_runner/running/1") == b"null"
    assert RoundKeys(store).claim_successor("p", "h:1")
    assert not RoundKeys(store).claim_successor("p", "h:1")
    assert HandshakeKeys.ack(2, 7) == "elastic_runner/attempt/ack/2/7"
    assert HandshakeKeys.group_prefix("ns") == "elastic_runner/pg/ns/"
    assert SPARE_ENV == "ELASTIC_RUNNER_SPARE"
