"""Checkpoint commit, verification, fallback on corruption, pruning, model-mismatch errors."""

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch

from elastic_runner.checkpoint import storage as ckpt


def state(v: float) -> dict:
    return {"model": {"w": torch.full((4, 3), v), "b": torch.zeros(3)}, "step": int(v)}


def save(d, step, v=None):
    (path,) = ckpt.write_checkpoint(d, f"step-{step:08d}", state(v if v is not None else step),
                                    {"step": step, "epoch": 0, "world_size": 2})
    return Path(path)


def test_commit_round_trip_and_manifest(tmp_path):
    p = save(tmp_path, 5)
    assert sorted(os.listdir(p)) == ["manifest.json", "state.pt"]
    manifest = json.loads((p / "manifest.json").read_text())
    assert manifest["step"] == 5 and manifest["files"]["state.pt"]["bytes"] > 0
    loaded = ckpt.load_state(p)
    assert torch.equal(loaded["model"]["w"], torch.full((4, 3), 5.0))
    assert not list(tmp_path.glob(".tmp-*"))


def test_truncated_newest_is_skipped_with_reason(tmp_path, caplog):
    save(tmp_path, 1)
    newest = save(tmp_path, 2)
    f = newest / "state.pt"
    f.write_bytes(f.read_bytes()[:50])  # a truncated file, as after a crash of a naive writer
    infos = ckpt.list_checkpoints(tmp_path)
    assert [i.valid for i in infos] == [True, False]
    assert "bytes, manifest says" in infos[1].reason
    with caplog.at_level("WARNING"):
        found = ckpt.latest_valid(tmp_path)
    assert found.step == 1
    assert "skipping checkpoint" in caplog.text and "step-00000002" in caplog.text


def test_same_size_corruption_is_caught_by_sha256(tmp_path):
    save(tmp_path, 1)
    newest = save(tmp_path, 2)
    f = newest / "state.pt"
    data = bytearray(f.read_bytes())
    data[-20] ^= 0xFF
    f.write_bytes(bytes(data))
    assert ckpt.inspect(newest).valid  # size still matches
    assert "sha256 mismatch" in ckpt.inspect(newest, verify=True).reason
    assert ckpt.latest_valid(tmp_path).step == 1


def test_deleted_state_file_is_skipped(tmp_path):
    save(tmp_path, 1)
    (save(tmp_path, 2) / "state.pt").unlink()
    assert ckpt.inspect(tmp_path / "step-00000002").reason == "state.pt missing"
    assert ckpt.latest_valid(tmp_path).step == 1


def test_one_write_commits_step_and_best(tmp_path):
    step, best = map(Path, ckpt.write_checkpoint(
        tmp_path, ["step-00000007", "best-step-00000007"], state(7.0), {"step": 7}))
    assert ckpt.inspect(step, verify=True).valid and ckpt.inspect(best, verify=True).valid
    assert os.stat(step / "state.pt").st_ino == os.stat(best / "state.pt").st_ino  # hard link
    assert [c.kind for c in ckpt.list_checkpoints(tmp_path)] == ["best", "step"]


def test_prune_never_deletes_the_resumed_checkpoint(tmp_path):
    resumed = save(tmp_path, 1)
    for s in range(2, 6):
        save(tmp_path, s)
    ckpt.prune(tmp_path, keep_last=2, protect=resumed)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step-00000001", "step-00000004", "step-00000005"]


def test_uncommitted_directory_is_ignored_and_pruned(tmp_path):
    save(tmp_path, 1)
    partial = tmp_path / "step-00000009"
    partial.mkdir()
    (partial / "state.pt").write_bytes(b"partial")
    stray = tmp_path / ".tmp-step-00000010-999999"
    stray.mkdir()
    assert ckpt.latest_valid(tmp_path).step == 1
    assert "no manifest" in ckpt.inspect(partial).reason
    ckpt.prune(tmp_path, keep_last=5)
    assert not stray.exists()


def test_rewrite_same_step_replaces(tmp_path):
    save(tmp_path, 3, v=1.0)
    save(tmp_path, 3, v=2.0)
    assert torch.equal(ckpt.load_state(tmp_path / "step-00000003")["model"]["w"],
                       torch.full((4, 3), 2.0))


def test_prune_keeps_last_k_and_newest_best(tmp_path):
    for s in range(1, 6):
        save(tmp_path, s)
    for s in (2, 4):
        ckpt.write_checkpoint(tmp_path, f"best-step-{s:08d}", state(s), {"step": s})
    ckpt.prune(tmp_path, keep_last=2)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["best-step-00000004", "step-00000004", "step-00000005"]


def test_background_prune_renames_at_once_and_deletes_later(tmp_path):
    import threading

    for s in range(1, 4):
        save(tmp_path, s)
    removals = ckpt.BackgroundRemovals(min_bytes=0)  # every checkpoint counts as large
    gate = threading.Event()
    removals._pool.submit(gate.wait)  # the remover thread is busy until the gate opens
    removed = ckpt.prune(tmp_path, keep_last=1, removals=removals)
    assert sorted(removed) == [str(tmp_path / "step-00000001"), str(tmp_path / "step-00000002")]
    assert [c.step for c in ckpt.list_checkpoints(tmp_path)] == [3]
    pending = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".pruned-"))
    assert [n.split("-")[1:3] for n in pending] == [["step", "00000001"], ["step", "00000002"]]
    gate.set()
    removals.finish()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000003"]


def test_a_dead_writers_pruned_leftovers_are_removed(tmp_path):
    save(tmp_path, 1)
    stray = tmp_path / ".pruned-step-00000000-0-999999"
    stray.mkdir()
    (stray / "state.pt").write_bytes(b"x")
    assert str(stray) in ckpt.prune(tmp_path, keep_last=1)
    assert not stray.exists()


@pytest.mark.parametrize("mode", ["wb+", "wb"])
def test_the_manifest_sha256_is_that_of_the_bytes_written(tmp_path, monkeypatch, mode):
    """Read back in a thread (``wb+``) or hashed in line, over chunk boundaries and many small
    writes, the digest is the file's."""
    monkeypatch.setattr(ckpt, "_HASH_CHUNK", 1000)
    big = {"a": torch.randn(100_000), "small": [torch.randn(7) for _ in range(300)], "n": 3}
    for obj in ({"x": 1}, big):
        with open(tmp_path / "s.pt", mode) as f:
            got = ckpt._save_hashed(f, obj)
        data = (tmp_path / "s.pt").read_bytes()
        assert got == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


class _TouchOnUnpickle:
    """Unpickling this runs code: ``pathlib.Path.touch(marker)``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_load_refuses_a_pickle_that_runs_code(tmp_path):
    """A committed checkpoint whose state.pt (manifest matching) holds an object whose
    unpickling would create a file: load_state refuses it and nothing runs."""
    p = save(tmp_path / "ck", 1)
    marker = tmp_path / "pwned"
    with open(p / "state.pt", "wb") as f:
        torch.save({**state(1.0), "x": _TouchOnUnpickle(marker)}, f)
    data = (p / "state.pt").read_bytes()
    manifest = json.loads((p / "manifest.json").read_text())
    manifest["files"]["state.pt"] = {"bytes": len(data),
                                     "sha256": hashlib.sha256(data).hexdigest()}
    (p / "manifest.json").write_text(json.dumps(manifest))
    assert ckpt.latest_valid(tmp_path / "ck").path == str(p)  # it verifies: a resume loads it
    try:
        ckpt.load_state(p)
        error = ""
    except ckpt.CheckpointError as e:
        error = str(e)
    assert not marker.exists(), "unpickling the checkpoint ran code"
    # torch's weights_only unpickler names the global it refused
    assert "cannot load state.pt: Weights only load failed" in error, error
    assert "Unsupported global" in error, error


def test_mismatch_names_tensors():
    model = {"conv.weight": torch.zeros(8, 1, 3, 3), "fc.weight": torch.zeros(10, 4),
             "fc.bias": torch.zeros(10)}
    other = {"conv.weight": torch.zeros(4, 1, 3, 3), "fc.weight": torch.zeros(10, 4),
             "head.bias": torch.zeros(10)}
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.check_compatible(model, other, "ck")
    msg = str(e.value)
    assert "missing in checkpoint (1): fc.bias" in msg
    assert "unexpected in checkpoint (1): head.bias" in msg
    assert "conv.weight: checkpoint (4, 1, 3, 3) vs model (8, 1, 3, 3)" in msg
