"""Checkpoints on an object store through fsspec (no atomic rename: commit by manifest).

fsspec's in-memory filesystem stands in for s3:// or gs:// (no object store exists here); the
code path is the same as for any non-local fsspec URL.
"""

import fsspec
import pytest
import torch

from elastic_runner.checkpoint import storage as ckpt
from elastic_runner.config import load_config
from elastic_runner.dist import init_distributed
from elastic_runner.trainer.build import build_trainer

from .procs import CONFIGS


@pytest.fixture
def bucket(request):
    url = f"memory://bucket/{request.node.name}"
    yield url
    fs = fsspec.filesystem("memory")
    if fs.exists(url):
        fs.rm(url, recursive=True)


def state(v):
    return {"model": {"w": torch.full((3,), float(v))}}


def test_commit_list_load_and_prune(bucket):
    for s in (1, 2, 3):
        paths = ckpt.write_checkpoint(bucket, f"step-{s:08d}", state(s), {"step": s})
        assert paths == [f"{bucket}/step-{s:08d}".replace("memory://", "memory:///")]
    infos = ckpt.list_checkpoints(bucket)
    assert [(c.name, c.valid) for c in infos] == [(f"step-{s:08d}", True) for s in (1, 2, 3)]
    newest = ckpt.latest_valid(bucket)
    assert newest.step == 3
    assert torch.equal(ckpt.load_state(newest.path)["model"]["w"], torch.full((3,), 3.0))
    ckpt.prune(bucket, keep_last=1, protect=infos[0].path)
    assert [c.step for c in ckpt.list_checkpoints(bucket)] == [1, 3]


def test_partial_and_corrupt_objects_are_not_trusted(bucket, caplog):
    fs = fsspec.filesystem("memory")
    ckpt.write_checkpoint(bucket, "step-00000001", state(1), {"step": 1})
    (newest,) = ckpt.write_checkpoint(bucket, "step-00000002", state(2), {"step": 2})
    data = fs.cat_file(f"{newest}/state.pt")
    fs.pipe_file(f"{newest}/state.pt", data[:-1] + bytes([data[-1] ^ 1]))  # same size, bit flip
    fs.pipe_file(f"{bucket}/step-00000003/state.pt", data)  # crashed writer: no manifest
    with caplog.at_level("WARNING"):
        assert ckpt.latest_valid(bucket).step == 1
    assert "no manifest" in caplog.text and "sha256 mismatch" in caplog.text


def test_training_resumes_from_an_object_store(bucket):
    def trainer(*extra):
        cfg = load_config(CONFIGS / "digits.yaml", [
            f"checkpoint.dir={bucket}", "logging.tensorboard_dir=null",
            "checkpoint.every_steps=2", *extra])
        return build_trainer(cfg, init_distributed(cfg.distributed.backend))

    first = trainer("training.max_steps=4")
    first.fit()
    assert [c.step for c in ckpt.list_checkpoints(bucket) if c.kind == "step"] == [2, 4]
    second = trainer("training.max_steps=6")
    assert second.resume() and second.state.step == 4
    second.fit()
    assert second.state.step == 6
    assert fsspec.filesystem("memory").exists(f"{bucket}/results.json")
