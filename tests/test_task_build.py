"""What keeps a task's build the same on every rank and restart: ``job_artifact`` (made once,
stored beside the checkpoints), ``task_fingerprint`` and the resume check against it."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from elastic_runner.checkpoint.storage import CheckpointError
from elastic_runner.config import build_key, from_dict
from elastic_runner.tasks.base import (
    ARTIFACTS_DIR,
    TaskBundle,
    check_same_build,
    job_artifact,
    task_fingerprint,
)


def cfg(directory, resume=True):
    return from_dict({"task": "digits", "checkpoint": {"dir": str(directory), "resume": resume}})


def test_job_artifact_is_made_once_and_reused(tmp_path):
    calls = []

    def make():
        calls.append(1)
        return f"vocab v{len(calls)}"

    assert job_artifact(cfg(tmp_path), "tok.json", make) == "vocab v1"
    (stored,) = (tmp_path / ARTIFACTS_DIR).glob("*/tok.json")
    assert stored.parent.name == build_key(cfg(tmp_path).to_dict())
    assert stored.read_text() == "vocab v1"
    assert job_artifact(cfg(tmp_path), "tok.json", make) == "vocab v1" and len(calls) == 1
    # --no-resume (checkpoint.resume false): a fresh job makes and stores it again
    assert job_artifact(cfg(tmp_path, resume=False), "tok.json", make) == "vocab v2"
    assert job_artifact(cfg(tmp_path), "tok.json", make) == "vocab v2"
    assert not list((tmp_path / ARTIFACTS_DIR).glob("*/*.tmp-*"))
    # another learning rate or loader setting: the same build, the same artifact
    same = from_dict({"task": "digits", "checkpoint": {"dir": str(tmp_path)},
                      "optimizer": {"lr": 0.5}, "data": {"num_workers": 2}})
    assert job_artifact(same, "tok.json", make) == "vocab v2"
    # other data: a new one
    other = from_dict({"task": "digits", "checkpoint": {"dir": str(tmp_path)},
                       "data": {"val_fraction": 0.2}})
    assert job_artifact(other, "tok.json", make) == "vocab v3"


def test_job_artifact_names_cannot_leave_the_directory(tmp_path):
    for name in ("../escape", "/etc/passwd", "a/b", ""):
        with pytest.raises(ValueError, match="use letters, digits"):
            job_artifact(cfg(tmp_path), name, lambda: "x")


def test_job_artifact_on_an_object_store_url():
    url = "memory://artifacts-test/ck"
    assert job_artifact(cfg(url), "t.json", lambda: "made") == "made"
    assert job_artifact(cfg(url), "t.json", lambda: "other") == "made"


class Vocab:
    def __init__(self, vocab):
        self.vocab = vocab

    def get_vocab(self):
        return dict(self.vocab)


def bundle(x, vocab=None):
    data = TensorDataset(x, torch.zeros(len(x), dtype=torch.long))
    return TaskBundle(model=nn.Linear(2, 2), train=data, val=data, test=data,
                      tokenizer=Vocab(vocab or {"a": 0, "b": 1}))


def test_fingerprint_sees_samples_sizes_and_token_ids():
    x = torch.arange(8.0).reshape(4, 2)
    base = task_fingerprint(bundle(x))
    assert task_fingerprint(bundle(x.clone())) == base
    assert task_fingerprint(bundle(x + 1)) != base  # other first/last samples
    assert task_fingerprint(bundle(x[:3])) != base  # other split sizes
    assert task_fingerprint(bundle(x, {"a": 1, "b": 0})) != base  # same tokens, other ids


def test_a_checkpoint_of_another_build_of_the_same_config_is_refused():
    config = from_dict({"task": "digits", "seed": 1}).to_dict()
    state = {"config": config, "task_fingerprint": "splits 4/4/4, A"}
    check_same_build(state, config, "splits 4/4/4, A", "ck/step-1")
    with pytest.raises(CheckpointError, match="trained on another build of the same task "
                                              "config .*job_artifact"):
        check_same_build(state, config, "splits 4/4/4, B", "ck/step-1")
    new_lr = from_dict({"task": "digits", "seed": 1, "optimizer": {"lr": 0.1}}).to_dict()
    with pytest.raises(CheckpointError):  # the same build config: still compared
        check_same_build(state, new_lr, "splits 4/4/4, B", "ck/step-1")
    other = from_dict({"task": "digits", "seed": 2}).to_dict()  # another build: not compared
    check_same_build(state, other, "splits 4/4/4, B", "ck/step-1")
    check_same_build({"config": config}, config, "B", "old")  # written before the check
