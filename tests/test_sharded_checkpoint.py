"""Sharded (DCP) checkpoints inside the runner's commit protocol, in one process (unit tier): a
world-size-1 gloo group with a real FSDP2 model and DCP; the multi-rank cases are in
tests/test_fsdp.py. Round trip, manifest and sha256, corrupt and hostile files, fencing, the
format conversions, and the config errors of the parallelism strategies."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from elastic_runner.checkpoint import dcp_format
from elastic_runner.checkpoint import storage as ckpt
from elastic_runner.checkpoint.fencing import Fence, FencedOut
from elastic_runner.checkpoint.layout import is_sharded
from elastic_runner.checkpoint.manager import CheckpointManager
from elastic_runner.config import Config, ConfigError, from_dict
from elastic_runner.parallel.base import total_norm
from elastic_runner.parallel.choose import make_parallelism
from elastic_runner.parallel.config import DDPConfig, FSDPConfig
from elastic_runner.parallel.fsdp import FSDPParallelism, device_mesh, find_blocks
from elastic_runner.trainer.build import checkpoint_layout

from .evidence import assert_same_tensors
from .procs import run_cli

CPU = torch.device("cpu")


class Blocks(nn.Module):
    """An embedding, a list of blocks and a head: FSDP2 shards each block, then the root."""

    def __init__(self, width: int = 6, depth: int = 3, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(4, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for b in self.blocks:
            x = torch.relu(b(x))
        return self.head(x)


class Counter:
    """A minimal Stateful beside the sharded state (goes into state.pt)."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state):
        self.n = state["n"]


@pytest.fixture
def group(tmp_path):
    """A real gloo process group of world size 1 in this process (FSDP2 and DCP need one)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg-store'}", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


def sharded(seed: int = 0, steps: int = 2) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = FSDPParallelism(FSDPConfig(), 1, CPU).wrap(Blocks(seed=seed))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        model(torch.randn(8, 4, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def local(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: getattr(v, "_local_tensor", v).detach().clone() for k, v in
            model.state_dict().items()}


def manager(directory, model, opt, counter=None, **kw) -> CheckpointManager:
    return CheckpointManager(str(directory), {"model": model, "optimizer": opt,
                                              "counter": counter or Counter()},
                             async_save=False, **kw)


def test_a_sharded_round_trip_is_bitwise_and_every_file_is_in_the_manifest(group, tmp_path):
    model, opt = sharded()
    counter = Counter()
    counter.n = 7
    m = manager(tmp_path / "ck", model, opt, counter)
    assert m.sharded and is_sharded(model)
    m.save(4)
    info = ckpt.latest_valid(tmp_path / "ck")
    assert info.step == 4 and info.valid
    manifest = json.loads((Path(info.path) / ckpt.MANIFEST).read_text())
    assert manifest["format_version"] == ckpt.SHARDED_FORMAT_VERSION
    on_disk = sorted(p.name for p in Path(info.path).iterdir() if p.name != ckpt.MANIFEST)
    assert sorted(manifest["files"]) == on_disk == [".metadata", "__0_0.distcp", "state.pt"]
    assert not [p for p in os.listdir(tmp_path / "ck") if p.startswith(".tmp")]

    other, other_opt = sharded(seed=1)
    fresh = Counter()
    manager(tmp_path / "ck", other, other_opt, fresh).load_latest()
    assert fresh.n == 7
    want, got = local(model), local(other)
    assert_same_tensors(want, got)
    for a, b in zip(opt.state_dict()["state"].values(), other_opt.state_dict()["state"].values(),
                    strict=True):
        assert torch.equal(a["exp_avg"].to_local(), b["exp_avg"].to_local())


def test_an_async_sharded_save_holds_the_state_of_its_step_not_a_later_one(group, tmp_path):
    """The snapshot copies each rank's shards; training goes on while the background writes."""
    model, opt = sharded()
    m = CheckpointManager(str(tmp_path / "ck"), {"model": model, "optimizer": opt},
                          async_save=True)
    want = local(model)
    m.save(2)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # the next steps, while the save of step 2 is being written
    m.close()
    got = ckpt.load_state(tmp_path / "ck" / "step-00000002")["model"]
    plain = Blocks()
    plain.load_state_dict(got)
    assert_same_tensors(want, {k: plain.state_dict()[k] for k in want})


def test_full_load_assembles_the_model_outside_any_group(group, tmp_path):
    model, opt = sharded()
    manager(tmp_path / "ck", model, opt).save(2)
    dist.destroy_process_group()
    try:
        full = ckpt.load_state(tmp_path / "ck" / "step-00000002")
    finally:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg2'}", rank=0,
                                world_size=1)
    assert full["counter"] == {"n": 0}
    plain = Blocks()
    plain.load_state_dict(full["model"])  # whole tensors, as a plain module wants them
    assert torch.equal(plain.head.weight, model.head.weight.full_tensor())
    assert set(full["optimizer"]["state"]) == {n for n, _ in plain.named_parameters()}


@pytest.mark.parametrize("damage", ["bitflip", "truncate", "unlisted", "missing"])
def test_a_damaged_sharded_checkpoint_is_skipped_naming_why(group, tmp_path, damage):
    model, opt = sharded()
    m = manager(tmp_path / "ck", model, opt, keep_last=5)
    m.save(1)
    m.save(2)
    newest = tmp_path / "ck" / "step-00000002"
    shard = newest / "__0_0.distcp"
    if damage == "bitflip":
        data = bytearray(shard.read_bytes())
        data[len(data) // 3] ^= 0x10
        shard.write_bytes(bytes(data))
        reason = "__0_0.distcp sha256 mismatch"
    elif damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:100])
        reason = "__0_0.distcp has 100 bytes"
    elif damage == "unlisted":  # DCP would read a file the manifest never vouched for
        shutil.copy(shard, newest / "__1_0.distcp")
        reason = "'__1_0.distcp' is not in the manifest"
    else:
        (newest / ".metadata").unlink()
        reason = ".metadata missing"
    assert reason in ckpt.inspect(newest, verify=True).reason
    assert ckpt.latest_valid(tmp_path / "ck").step == 1
    listing = run_cli("checkpoints", str(tmp_path / "ck"), "--verify").stdout
    assert "INVALID" in listing and reason.split(" ")[0] in listing


def test_hostile_dcp_metadata_is_refused_without_running_it(group, tmp_path):
    model, opt = sharded()
    m = manager(tmp_path / "ck", model, opt)
    m.save(3)
    path = tmp_path / "ck" / "step-00000003"
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (path / ".metadata").write_bytes(pickle.dumps(Payload()))
    # the attacker also rewrites the manifest, so the sha256 check passes
    manifest = json.loads((path / ckpt.MANIFEST).read_text())
    manifest["files"][".metadata"] = ckpt.hash_files(path, [".metadata"])[".metadata"]
    (path / ckpt.MANIFEST).write_text(json.dumps(manifest))
    assert ckpt.inspect(path, verify=True).valid
    with pytest.raises(ckpt.CheckpointError, match=r"cannot read its DCP metadata: \.metadata "
                                                   r"names posix\.system.*\(refused\)"):
        m.load_latest()
    with pytest.raises(ckpt.CheckpointError, match="posix.system"):
        ckpt.load_state(path)
    assert not marker.exists()


@pytest.mark.parametrize("change", ["escape", "foreign", "unverified"])
def test_a_hostile_sharded_manifest_is_invalid(group, tmp_path, change):
    model, opt = sharded()
    manager(tmp_path / "ck", model, opt).save(3)
    path = tmp_path / "ck" / "step-00000003"
    manifest = json.loads((path / ckpt.MANIFEST).read_text())
    entry = manifest["files"].pop("__0_0.distcp")
    if change == "escape":
        manifest["files"]["../__0_0.distcp"] = entry
        want = "a path outside the checkpoint directory"
    elif change == "foreign":
        manifest["files"]["evil.py"] = entry
        want = "not one of this format"
    else:
        manifest["files"]["__0_0.distcp"] = {"bytes": entry["bytes"]}
        want = "lacks an int 'bytes' or a 'sha256'"
    (path / ckpt.MANIFEST).write_text(json.dumps(manifest))
    info = ckpt.inspect(path)
    assert not info.valid and want in info.reason


def test_a_fenced_writer_cannot_publish_a_sharded_checkpoint(group, tmp_path):
    model, opt = sharded()
    m = manager(tmp_path / "ck", model, opt)
    m.save(1)
    newer = Fence.claim(str(tmp_path / "ck"))  # another group took the directory over
    with pytest.raises(FencedOut, match=f"fencing token {newer.token}"):
        m.save(2)
    assert [c.step for c in ckpt.list_checkpoints(tmp_path / "ck")] == [1]
    assert not [p for p in os.listdir(tmp_path / "ck") if p.startswith(".tmp")]


def test_a_sharded_checkpoint_of_another_model_names_the_tensors(group, tmp_path):
    model, opt = sharded()
    manager(tmp_path / "ck", model, opt).save(1)
    wider = FSDPParallelism(FSDPConfig(), 1, CPU).wrap(Blocks(width=8))
    with pytest.raises(ckpt.CheckpointError, match=r"shape mismatch \(9\): blocks\.0\.bias: "
                                                   r"checkpoint \(6,\) vs model \(8,\)"):
        manager(tmp_path / "ck", wider, torch.optim.AdamW(wider.parameters())).load_latest()


def test_whole_and_sharded_checkpoints_convert_both_ways(group, tmp_path):
    """DDP (rank-0 ``state.pt``) into FSDP2 shards, and FSDP2 (DCP) into a plain module."""
    plain = Blocks(seed=3)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=0.01)
    plain(torch.randn(8, 4)).sum().backward()
    plain_opt.step()
    manager(tmp_path / "whole", plain, plain_opt, layout="rank0").save(5)

    model, opt = sharded(seed=4, steps=0)
    manager(tmp_path / "whole", model, opt).load_latest()
    assert torch.equal(model.head.weight.full_tensor(), plain.head.weight)
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"].full_tensor(),
                       plain_opt.state_dict()["state"][0]["exp_avg"])

    manager(tmp_path / "sharded", model, opt).save(6)
    back = Blocks(seed=5)
    back_opt = torch.optim.AdamW(back.parameters(), lr=0.01)
    manager(tmp_path / "sharded", back, back_opt).load_latest()
    assert torch.equal(back.head.weight, plain.head.weight)
    assert torch.equal(back_opt.state_dict()["state"][0]["exp_avg"],
                       plain_opt.state_dict()["state"][0]["exp_avg"])


def test_the_norm_equals_torch_clip_grad_norm_bitwise():
    torch.manual_seed(0)
    a, b = Blocks(), Blocks()
    b.load_state_dict(a.state_dict())
    x = torch.randn(16, 4)
    for m in (a, b):
        (m(x) * 100).sum().backward()
    want = nn.utils.clip_grad_norm_(list(a.parameters()), 0.5)
    got = total_norm(list(b.parameters()), 0.5)
    assert torch.equal(want, got)
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


def test_find_blocks_takes_the_largest_list_of_one_type():
    model = Blocks(depth=3)
    assert find_blocks(model) == list(model.blocks)
    assert find_blocks(nn.Sequential(nn.Linear(2, 2), nn.ReLU())) == []


def _cfg(**sections) -> Config:
    return from_dict({"task": "digits", **sections})


def test_strategy_errors_name_the_key_and_what_to_do(group):
    with pytest.raises(ConfigError, match="'fsdp' needs a process group"):
        make_parallelism("fsdp", DDPConfig(), FSDPConfig(), False, 1, CPU)
    with pytest.raises(ConfigError, match=r"distributed\.fsdp\.units: 'blocks' but Sequential "
                                          "has no block list"):
        FSDPParallelism(FSDPConfig(units="blocks"), 1, CPU).wrap(nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(ConfigError, match=r"distributed\.fsdp\.replicas: 2 does not divide the "
                                          "world size 3"):
        device_mesh(3, 2, CPU)
    with pytest.raises(ConfigError, match="checkpoint.format: 'rank0' with distributed"):
        checkpoint_layout(_cfg(distributed={"strategy": "fsdp"},
                               checkpoint={"format": "rank0"}))
    assert checkpoint_layout(_cfg(distributed={"strategy": "fsdp"},
                                  checkpoint={"dir": "s3://bucket/run"})) == "dcp"
    assert checkpoint_layout(_cfg()) == "rank0"
    assert checkpoint_layout(_cfg(distributed={"strategy": "fsdp"})) == "dcp"
    assert checkpoint_layout(_cfg(checkpoint={"format": "dcp"})) == "dcp"


def test_fsdp_options_keep_old_checkpoints_fingerprints():
    from elastic_runner.config import fingerprint
    base = _cfg().to_dict()
    old = {**base, "distributed": {k: v for k, v in base["distributed"].items()
                                   if k not in ("strategy", "fsdp")}}
    assert fingerprint(base) == fingerprint(old)
    assert fingerprint(_cfg(distributed={"strategy": "fsdp"}).to_dict()) != fingerprint(base)


def test_dcp_helpers_name_only_dcp_files():
    assert dcp_format.SHARD_FILE.match("__12_0.distcp")
    assert not dcp_format.SHARD_FILE.match("__1_0.distcp.py")
    assert not dcp_format.SHARD_FILE.match("../__1_0.distcp")


def test_ranks_share_the_sha256_check_each_reading_its_part(group, tmp_path):
    model, opt = sharded()
    manager(tmp_path / "ck", model, opt).save(1)
    path = tmp_path / "ck" / "step-00000001"
    names = sorted(json.loads((path / ckpt.MANIFEST).read_text())["files"])
    assert names == [".metadata", "__0_0.distcp", "state.pt"]
    data = bytearray((path / "__0_0.distcp").read_bytes())
    data[-1] ^= 0x01
    (path / "__0_0.distcp").write_bytes(bytes(data))
    assert ckpt.verify_files(path, 0, 2) == ""  # .metadata and state.pt
    assert ckpt.verify_files(path, 1, 2) == "__0_0.distcp sha256 mismatch (corrupt)"
    assert ckpt.verify_files(path) == "__0_0.distcp sha256 mismatch (corrupt)"


# ------------------------------------------------------------ peer copies (in-place recovery)


def test_a_local_copy_loads_into_the_module_rebuilt_on_a_new_group_bitwise(tmp_path):
    local_copy_round_trip(tmp_path, CPU, "gloo")


def local_copy_round_trip(tmp_path: Path, device: torch.device, backend: str,
                          param_dtype: torch.dtype | None = None) -> None:
    """What an in-place recovery under FSDP does on one rank: copy the local shards and the
    rest (``local_copy``, through the wire format), destroy the group, form a new one, shard a
    module of the same structure (``module_for_new_group``: parameter-less until loaded) and
    load the copy: weights, AdamW moments and the rest equal the copy; the next step equals the
    one the old model takes. On ``device`` (a GPU: the shards are copied into pinned host memory
    and loaded back onto the device), with ``backend`` and FSDP's ``param_dtype``."""
    from elastic_runner.recovery.peer_copies import Copy
    from elastic_runner.recovery.state_transfer import Manifest

    def init(name):
        dist.init_process_group(backend, init_method=f"file://{tmp_path / name}", rank=0,
                                world_size=1)

    def batch(g):
        return torch.randn(8, 4, generator=g).to(device)

    init("pg-1")
    try:
        strategy = FSDPParallelism(FSDPConfig(), 1, device, param_dtype)
        model = strategy.wrap(Blocks(seed=3).to(device))
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        counter = Counter()
        counter.n = 7
        g = torch.Generator().manual_seed(3)
        for _ in range(2):
            model(batch(g)).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
        shards = manager(tmp_path / "a", model, opt, counter).local_copy(to_cpu=False)
        taken = Copy.of(shards, 2, 1)
        assert taken.data.is_pinned() == (device.type == "cuda")
        # as a peer receives it: the manifest's bytes read back, the data in another buffer
        copy = Copy(2, 1, Manifest.from_bytes(taken.manifest.to_bytes(), "the peer"),
                    taken.data.clone()).state()
        x = batch(g)
        model(x).float().square().mean().backward()
        opt.step()
        want, want_opt = local(model), opt.state_dict()
        fresh = strategy.module_for_new_group(model)
        assert not is_sharded(fresh) and fresh.blocks[0].weight.shape == (6, 6)
    finally:
        dist.destroy_process_group()
    init("pg-2")
    try:
        rebuilt = FSDPParallelism(FSDPConfig(), 1, device, param_dtype).wrap(fresh)
        opt2 = torch.optim.AdamW(rebuilt.parameters(), lr=0.01)
        counter2 = Counter()
        manager(tmp_path / "b", rebuilt, opt2, counter2).load_local_copy(copy, "the copy")
        assert counter2.n == 7
        rebuilt(x).float().square().mean().backward()
        opt2.step()
        got = local(rebuilt)
        assert want.keys() == got.keys()
        for k in want:
            assert got[k].device.type == device.type and torch.equal(want[k], got[k]), k
        a, b = want_opt["state"], opt2.state_dict()["state"]
        for i in a:
            for k in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(a[i][k].to_local(), b[i][k].to_local()), (i, k)
        other = FSDPParallelism(FSDPConfig(), 1, device, param_dtype).wrap(
            Blocks(width=5).to(device))
        with pytest.raises(ckpt.CheckpointError, match=r"the copy: shards.model.inp.weight: local shard \(6, 4\) does not fit"):
            manager(tmp_path / "c", other, torch.optim.AdamW(other.parameters()),
                    Counter()).load_local_copy(copy, "the copy")
    finally:
        dist.destroy_process_group()


def test_the_plan_of_a_recovery_from_peer_copies():
    """Rank r's copy is on rank r + 1 (mod the world size): a replacement gets it from there;
    two neighbours lost, copies of different steps (a failure during the exchange) or of
    another world size fall back to the checkpoint (a reason is returned)."""
    from elastic_runner.recovery.peer_copies import plan

    def member(own, held, joining=False, world=4):
        return {"own": own, "held": held, "world_size": world, "joining": joining}

    survivors = [member(20, 20) for _ in range(4)]
    assert plan(survivors) == (20, {})
    one = [*survivors[:1], member(None, None, True, 0), *survivors[2:]]
    assert plan(one) == (20, {1: 2})
    last = [*survivors[:3], member(None, None, True, 0)]
    assert plan(last) == (20, {3: 0})
    assert plan([*survivors[:1], member(None, None, True, 0), member(None, None, True, 0),
                 survivors[3]]) == "rank 1's copy was on rank 2, which lost it too"
    assert "different steps" in plan([member(20, 20), member(24, 24), *one[1:3]])
    assert "another world size" in plan([member(20, 20, world=2), *one[1:]])
    assert plan([member(None, None, True, 0)] * 2) == "no survivor holds a copy"
    assert plan([member(None, None, world=0), member(None, None, True, 0)]) == (
        "no peer copy was taken yet (recovery.peer_copy_every_steps; 0: none)")
    # copies dropped for a newer checkpoint (commit_before_regroup) say why
    dropped = {**member(None, None, world=0), "dropped": "the peer copies predate step 21"}
    assert plan([dropped, member(None, None, True, 0)]) == "the peer copies predate step 21"


def test_the_plan_of_an_hsdp_recovery_from_replicas():
    """2 replicas x 2 shards (rank = replica x 2 + shard): a replacement gets the live state of
    the surviving replica of its shard; none when both replicas of a shard died, the survivors'
    live states differ, or the world size is not the one they were taken at."""
    from elastic_runner.recovery.peer_copies import plan_replicas

    def member(joining=False, live=(12, 12, 4)):
        return {"joining": joining, "live": None if joining else list(live)}

    gone = member(joining=True)
    assert plan_replicas([member(), member(), member(), gone], 2) == (12, 12, {3: 1})
    assert plan_replicas([gone, member(), member(), member()], 2) == (12, 12, {0: 2})
    assert plan_replicas([member(), gone, member(), gone], 2) is None  # shard 1 lost twice
    assert plan_replicas([member(), member(live=(11, 11, 4)), member(), gone], 2) is None
    assert plan_replicas([member(live=(12, 12, 2))] * 3 + [gone], 2) is None
    assert plan_replicas([member(), member(), member(), gone], 1) is None  # plain FSDP


# ------------------------------------------------------------ object stores (compat fix 12)


def test_sharded_checkpoints_on_an_object_store_commit_by_manifest_last(group, s3_bucket,
                                                                        tmp_path):
    """A real S3 API (moto): the DCP files go straight to the checkpoint's prefix and the
    manifest last; the round trip is bitwise (weights, AdamW moments, the rest); a prefix without
    a manifest (a writer that died before it) and a shard corrupted from outside are skipped;
    a hostile ``.metadata`` with a matching sha256 is refused, nothing run; the whole model loads
    in one process (export)."""
    from .s3 import clear_s3fs_instances

    url, fs = f"{s3_bucket.url}/run", s3_bucket.fs()
    model, opt = sharded()
    counter = Counter()
    counter.n = 5
    m = manager(url, model, opt, counter, keep_last=5)
    m.save(2)
    m.save(4)
    keys = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(s3_bucket.key("run/step-00000004")))
    assert keys == [".metadata", "__0_0.distcp", "manifest.json", "state.pt"]
    m.save(6)
    fs.rm(s3_bucket.key("run/step-00000006/manifest.json"))  # as if its writer died before it
    clear_s3fs_instances()

    other, other_opt = sharded(seed=1)
    fresh = Counter()
    loader = manager(url, other, other_opt, fresh)
    loader.load_latest()
    assert loader.resumed_from == f"{url}/step-00000004" and fresh.n == 5
    want, got = local(model), local(other)
    assert_same_tensors(want, got)
    for a, b in zip(opt.state_dict()["state"].values(), other_opt.state_dict()["state"].values(),
                    strict=True):
        assert torch.equal(a["exp_avg_sq"].to_local(), b["exp_avg_sq"].to_local())
    whole = ckpt.load_state(f"{url}/step-00000004")["model"]
    plain = Blocks()
    plain.load_state_dict(whole)  # every tensor whole, by FQN
    assert torch.equal(plain.head.weight, want["head.weight"])

    shard = s3_bucket.key("run/step-00000004/__0_0.distcp")
    data = bytearray(fs.cat_file(shard))
    data[len(data) // 2] ^= 0xFF
    fs.pipe_file(shard, bytes(data))
    clear_s3fs_instances()
    again = manager(url, *sharded(seed=2))
    again.load_latest()
    assert again.resumed_from == f"{url}/step-00000002"

    hostile = pickle.dumps(os.system)  # a global DCP's metadata never names
    path = s3_bucket.key("run/step-00000002")
    manifest = json.loads(fs.cat_file(f"{path}/manifest.json"))
    manifest["files"][".metadata"] = {"bytes": len(hostile),
                                      "sha256": __import__("hashlib").sha256(hostile).hexdigest()}
    fs.pipe_file(f"{path}/.metadata", hostile)
    fs.pipe_file(f"{path}/manifest.json", json.dumps(manifest).encode())
    clear_s3fs_instances()
    with pytest.raises(ckpt.CheckpointError, match=r"never holds \(refused\)"):
        manager(url, *sharded(seed=3)).load_latest()
