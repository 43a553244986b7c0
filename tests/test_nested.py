"""The one walk over nested state (``elastic_runner/nested.py``) and the one host-buffer pool
(``elastic_runner/host_buffers.py``): their rules, as their users rely on them."""

from __future__ import annotations

from collections import OrderedDict, namedtuple

import pytest
import torch
from torch import nn

from elastic_runner import nested
from elastic_runner.host_buffers import HostBuffers

Pair = namedtuple("Pair", "x y")


def _state():
    return {"model": OrderedDict(w=torch.ones(2)), "opt": [{"m": torch.zeros(3)}, 0.5],
            "pair": Pair(torch.ones(1), "tag"), "n": 7}


def test_leaves_come_with_their_key_paths_in_order():
    assert [p for p, _ in nested.tensors(_state())] == [
        ("model", "w"), ("opt", 0, "m"), ("pair", 0)]
    assert nested.dotted(("opt", 0, "m")) == "opt.0.m"
    assert nested.dotted(("w",), "state") == "state.w"


def test_types_keeps_the_containers_plain_makes_them_loadable():
    kept = nested.map_leaves(lambda p, v: v, _state())
    assert type(kept["model"]) is OrderedDict and type(kept["pair"]) is Pair
    plain = nested.map_leaves(lambda p, v: v, _state(), rebuild=nested.Rebuild.PLAIN)
    assert type(plain["model"]) is dict and type(plain["pair"]) is tuple


def test_in_place_keeps_a_state_dicts_class_and_metadata():
    sd = nn.Linear(2, 2).state_dict()
    out = nested.map_leaves(lambda p, v: v.clone(), sd, rebuild=nested.Rebuild.IN_PLACE)
    assert out is sd and hasattr(out, "_metadata")


def test_enter_sees_each_container_before_its_items_and_may_refuse():
    seen = []
    nested.map_leaves(lambda p, v: v, _state(), enter=lambda p, c: seen.append(p))
    assert seen[:3] == [(), ("model",), ("opt",)]

    def refuse(path, container):
        if path:
            raise ValueError(nested.dotted(path))

    with pytest.raises(ValueError, match="^a$"):
        nested.map_leaves(lambda p, v: v, {"a": {}}, enter=refuse)


def test_each_tensor_bytes_and_holds():
    assert nested.tensor_bytes(_state()) == 2 * 4 + 3 * 4 + 4
    assert nested.holds_tensor(_state()) and not nested.holds_tensor({"a": [1, (2, None)]})
    doubled = nested.each_tensor(lambda t: t * 2, _state())
    assert doubled["pair"].x.item() == 2 and doubled["n"] == 7


def test_alias_key_finds_exact_views_of_one_storage():
    w = torch.ones(4)
    assert nested.alias_key(w) == nested.alias_key(w.view(4))
    assert nested.alias_key(w) != nested.alias_key(w[1:])
    assert nested.alias_key(torch.empty(0)) is None


def test_keyed_buffers_are_reused_until_shape_or_dtype_changes():
    pool = HostBuffers()
    a = pool.at(("w",), (2, 3), torch.float32)
    assert pool.at(("w",), (2, 3), torch.float32) is a and pool.bytes == 24
    b = pool.at(("w",), (4,), torch.float64)
    assert b is not a and pool.bytes == 32 and pool.keyed() == [b]


def test_flat_buffers_given_back_are_taken_again_by_size():
    pool = HostBuffers()
    a, b = pool.take(64), pool.take(128)
    pool.give_back([a, b])
    assert pool.take(128) is b and pool.take(64) is a
    pool.give_back([pool.take(8) for _ in range(4)])
    pool.take(16)  # no spare fits: only the newest two are kept
    assert len(pool._spare) == 2
