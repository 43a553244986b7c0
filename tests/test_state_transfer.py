"""The state handed to a replacement (``recovery/state_transfer.py``): the manifest taken apart
and read back, the units split the same way on every rank, a hostile or mismatched manifest
refused; and four real gloo processes: two holders each send a share of a trained model's and
AdamW's state to two receivers at once, the replacement receives it into its own parameters and
into optimizer state it did not have, a survivor behind into new tensors, bitwise."""

from __future__ import annotations

import io
import os
import pickle

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from elastic_runner.checkpoint.storage import CheckpointError, check_compatible
from elastic_runner.recovery import state_transfer as st

from .procs import free_port

_NUMPY_RNG = torch.from_numpy(np.random.RandomState(0).get_state()[1])  # uint32, 624 words


def _trained(seed: int = 0, step: bool = True, width: int = 600):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))
    model.tied = nn.Linear(width, 10, bias=False)
    model.tied.weight = model[2].weight  # tied weights: one tensor under two names
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if step:
        model[2](model[0](torch.randn(4, width))).sum().backward()
        opt.step()
    return model, opt


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    return {"model": model.state_dict(), "optimizer": opt.state_dict(),
            "counters": {"step": 7, "cursor": (3, [1, 2]), "name": "x"},
            "numpy_rng": _NUMPY_RNG.clone()}  # as the sampler keeps it


def test_a_state_taken_apart_and_read_back_is_the_same_with_tied_tensors_sent_once():
    state = _state(*_trained())
    manifest, tensors = st.flatten(state)
    read = st.Manifest.from_bytes(manifest.to_bytes(), "rank 1")
    assert read == manifest
    paths = [m.path for m in read.metas]
    tied = paths.index(("model", "tied.weight"))
    assert read.metas[tied].alias == paths.index(("model", "2.weight"))
    back = st.rebuild(read, tensors)
    assert back["counters"] == {"step": 7, "cursor": (3, [1, 2]), "name": "x"}
    assert back["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]
    assert all(back["model"][k] is v for k, v in state["model"].items())
    sent = {i for u in st.units(read.metas, 3) for i in u.indices}
    assert sent == {i for i, m in enumerate(read.metas) if m.alias < 0}


def test_a_peer_copy_holds_every_dtype_aligned_its_tied_tensors_once_and_owns_its_bytes():
    """``peer_copies.Copy``: the state's tensors (bf16, int64, bool, an empty one, a tied pair,
    a numpy RNG's uint32 words) copied into one flat buffer, each at an aligned offset, and read
    back equal; a later change of the live tensors or a reuse of the buffer does not reach what
    was read back; a size the manifest does not lay out is refused, naming the peer."""
    from elastic_runner.recovery.peer_copies import ALIGN, Copy, _declared, offsets

    state = _state(*_trained(width=40))
    state["extra"] = {"half": torch.arange(5, dtype=torch.bfloat16), "ids": torch.arange(3),
                      "mask": torch.tensor([True, False, True]), "empty": torch.zeros(0, 4)}
    copy = Copy.of(state, 7, 2)
    starts, size = offsets(copy.manifest.metas)
    assert copy.data.numel() == size and all(o % ALIGN == 0 for o in starts)
    tied = sum(m.alias >= 0 for m in copy.manifest.metas)
    assert tied == 1 and size < sum(m.nbytes for m in copy.manifest.metas) + ALIGN * len(starts)
    back = copy.state()
    with torch.no_grad():
        state["model"]["0.weight"].add_(1.0)  # the live model moves on
    copy.data.zero_()  # the buffer is reused by the next copy
    want = _state(*_trained(width=40))
    for key in want["model"]:
        assert torch.equal(back["model"][key], want["model"][key]), key
    assert back["model"]["tied.weight"] is back["model"]["2.weight"]
    for key, t in state["extra"].items():
        assert back["extra"][key].dtype == t.dtype and torch.equal(back["extra"][key], t), key
    assert torch.equal(back["numpy_rng"], _NUMPY_RNG)
    assert back["counters"] == state["counters"]
    with pytest.raises(CheckpointError, match=f"rank 3's peer copy declares {size + 1} bytes"):
        _declared(copy.manifest, size + 1, 3)


def test_units_are_split_by_bytes_the_same_way_for_every_rank():
    metas = tuple(st.TensorMeta(("t", i), (n,), torch.float32, "cpu")
                  for i, n in enumerate([1 << 20, 10, 3 << 18, 1 << 19, 7, 1 << 20]))
    split = st.units(metas, 2)
    assert split == st.units(metas, 2)
    assert [u.indices for u in split if u.direct] == [(0,), (2,), (3,), (5,)]
    assert [u.indices for u in split if not u.direct] == [(1, 4)]
    load = [sum(u.nbytes for u in split if u.source == s) for s in (0, 1)]
    assert abs(load[0] - load[1]) <= max(u.nbytes for u in split)
    assert {u.source for u in st.units(metas, 1)} == {0}


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo owned",))


def test_a_manifest_that_is_not_one_is_refused_naming_the_peer():
    buf = io.BytesIO()
    pickle.dump({"skeleton": _Evil(), "tensors": []}, buf, protocol=2)
    with pytest.raises(CheckpointError, match="rank 3 sent a state manifest"):
        st.Manifest.from_bytes(buf.getvalue(), "rank 3")
    bad = io.BytesIO()
    torch.save({"skeleton": {}, "tensors": [[["w"], [2], "torch.nn.Module", "cpu", -1]]}, bad)
    with pytest.raises(CheckpointError, match="not allowed"):
        st.Manifest.from_bytes(bad.getvalue(), "rank 1")


def _check(model: nn.Module):
    def check(manifest: st.Manifest) -> None:
        declared = {m.path[1]: torch.empty(m.shape, device="meta") for m in manifest.metas
                    if m.path[0] == "model"}
        check_compatible(model.state_dict(), declared, "rank 1's state")
    return check


def _worker(rank: int, port: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=4)
    try:
        if rank == 3:  # a survivor behind: received into new tensors, at once with rank 0
            raw = st.recv_state(None, [1, 2], torch.device("cpu"))
            want = _state(*_trained())
            out["behind"] = all(torch.equal(raw["model"][k], v) for k, v in want["model"].items()) \
                and all(torch.equal(a[k], b[k]) for a, b in zip(
                    want["optimizer"]["state"].values(), raw["optimizer"]["state"].values(),
                    strict=True) for k in a)
            return
        if rank > 0:  # two holders of the same trained state, two receivers
            cpu = torch.device("cpu")
            st.send_state(st.flatten(_state(*_trained())), [0, 3], [1, 2], rank, cpu)
            if rank == 1:  # a peer whose model has another width: only its manifest goes
                manifest, _ = st.flatten(_state(*_trained(width=500)))
                for work in st.send_manifest(manifest, [0], cpu):
                    work.wait()
            return
        model, opt = _trained(seed=1, step=False)
        params = [p.data_ptr() for p in model.parameters()]
        raw = st.recv_state(_state(model, opt), [1, 2], torch.device("cpu"), _check(model))
        model.load_state_dict(raw["model"])
        opt.load_state_dict(raw["optimizer"])
        want_model, want_opt = _trained()
        out["model"] = all(torch.equal(v, model.state_dict()[k])
                           for k, v in want_model.state_dict().items())
        out["optimizer"] = all(
            torch.equal(a[k], b[k]) for a, b in zip(want_opt.state_dict()["state"].values(),
                                                     opt.state_dict()["state"].values(), strict=True)
            for k in a)
        out["moments"] = len(opt.state_dict()["state"])
        out["in_place"] = params == [p.data_ptr() for p in model.parameters()] and \
            raw["model"]["0.weight"].data_ptr() == params[0]
        out["counters"] = raw["counters"]
        out["numpy_rng"] = bool((raw["numpy_rng"].numpy() == _NUMPY_RNG.numpy()).all())
        try:
            st.recv_state(_state(model, opt), [1], torch.device("cpu"), _check(model))
            out["refused"] = "not refused"
        except CheckpointError as e:
            out["refused"] = str(e)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_holders_send_a_trained_state_to_two_receivers_at_once_bitwise():
    """Rank 0, a replacement, receives into its own tensors; rank 3, a survivor behind, into
    new ones; both from the same two holders' sends."""
    with mp.Manager() as manager:
        out = manager.dict()
        mp.start_processes(_worker, args=(free_port(), out), nprocs=4, join=True,
                           start_method="spawn")
        out = dict(out)
    assert out["model"] and out["optimizer"], out
    assert out["behind"], "the survivor behind did not receive the state bitwise"
    assert out["moments"] == 4  # AdamW's state created on the receiver (it had none)
    assert out["in_place"], "the parameters were replaced, not received into"
    assert out["counters"] == {"step": 7, "cursor": (3, [1, 2]), "name": "x"}
    assert out["numpy_rng"]
    assert "rank 1's state does not match this model" in out["refused"], out["refused"]
    assert "0.weight: checkpoint (500, 500) vs model (600, 600)" in out["refused"]
