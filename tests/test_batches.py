"""Batches as users have them (tensor, tuple/list, mapping, nested), the sample check at build
time, the default metrics, parameter groups and the task's optimizer/scheduler factories."""

from __future__ import annotations

from collections import OrderedDict, namedtuple
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from elastic_runner.config import ConfigError, from_dict
from elastic_runner.data.batches import (
    batch_loss,
    batch_size,
    check_samples,
    forward,
    loss_metrics,
    targets,
    to_device,
)
from elastic_runner.tasks.base import TaskBundle, metric_sums, weight_decay_groups
from elastic_runner.trainer.build import build_optimizer, build_scheduler


class Recorder(nn.Module):
    """Returns how it was called, and a loss computed from ``labels`` when given."""

    def forward(self, *args, **kwargs):
        loss = kwargs["labels"].float().mean() if "labels" in kwargs else None
        return SimpleNamespace(args=args, kwargs=kwargs, loss=loss)


def test_calling_convention_per_batch_kind():
    x, y = torch.ones(2, 3), torch.tensor([1, 0])
    net = Recorder()
    assert forward(net, {"input_ids": x, "labels": y}).kwargs.keys() == {"input_ids", "labels"}
    pair = forward(net, (x, y))
    assert len(pair.args) == 1 and pair.args[0] is x and targets((x, y)) is y
    triple = forward(net, [x, y, y])
    assert len(triple.args) == 3 and targets([x, y, y])[2] is y
    assert forward(net, x).args[0] is x and targets(x) is x


def test_loss_from_outputs_or_loss_fn():
    net = Recorder()
    batch = {"input_ids": torch.zeros(4, 2), "labels": torch.tensor([1, 1, 0, 0])}
    assert batch_loss(net, batch, None).item() == pytest.approx(0.5)
    seen = {}

    def loss_fn(out, whole):
        seen["batch"] = whole
        return torch.tensor(3.0)

    assert batch_loss(net, batch, loss_fn).item() == 3.0 and seen["batch"] is batch
    with pytest.raises(ConfigError, match="no loss_fn and the model's output .* has no 'loss'"):
        batch_loss(nn.Linear(2, 1), (torch.zeros(1, 2), torch.zeros(1)), None)
    # a mapping output (a transformers ModelOutput is an OrderedDict too) gives its "loss" key
    dict_net = nn.Module()
    dict_net.forward = lambda **kw: OrderedDict(loss=torch.tensor(7.0))
    assert batch_loss(dict_net, batch, None).item() == 7.0


def test_to_device_keeps_nesting_and_types():
    Pair = namedtuple("Pair", "x y")
    batch = {"a": [torch.ones(1), (torch.zeros(2), Pair(torch.ones(3), 5))], "b": "text"}
    moved = to_device(batch, torch.device("cpu"))
    assert isinstance(moved["a"][1][1], Pair) and moved["a"][1][1].y == 5
    assert moved["b"] == "text" and torch.equal(moved["a"][0], torch.ones(1))

    class Strict(dict):  # a mapping type whose constructor takes other arguments
        def __init__(self, data, extra):
            super().__init__(data)

    assert type(to_device(Strict({"t": torch.ones(1)}, 0), torch.device("cpu"))) is dict


def test_batch_size_is_dim_0_of_the_first_tensor():
    assert batch_size({"meta": [], "input_ids": torch.zeros(5, 7)}) == 5
    assert batch_size((torch.zeros(3), torch.zeros(3))) == 3
    assert batch_size({"x": "no tensors"}) == 0


def test_default_metrics_weight_the_loss_by_samples():
    model = nn.Linear(3, 2)
    data = TensorDataset(torch.randn(10, 3), torch.randint(0, 2, (10,)))
    sums = metric_sums(model, DataLoader(data, batch_size=4), None, torch.device("cpu"),
                       loss_fn=F.cross_entropy)
    x, y = data.tensors
    want = F.cross_entropy(model(x), y).item()
    assert sums["loss"][1] == 10 and sums["loss"][0] / 10 == pytest.approx(want, rel=1e-5)
    one = loss_metrics(model(x[:4]), (x[:4], y[:4]), F.cross_entropy)
    assert one["loss"][1] == 4.0


class Texts(torch.utils.data.Dataset):
    def __init__(self, items):
        self.items = items

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def test_check_samples_names_what_it_got():
    with pytest.raises(ConfigError, match=r"task t: train\[0\] is builtins.str \('a cat'\); a "
                                          r"sample must be a tensor, a tuple/list"):
        check_samples(Texts(["a cat", "a dog"]), "train", None, "t")
    with pytest.raises(ConfigError, match=r"the collated val batch\['text'\]\[0\] is "
                                          r"builtins.str \('a'\), not a tensor"):
        check_samples(Texts([{"x": torch.ones(2), "text": "a"}, {"x": torch.ones(2),
                                                                 "text": "b"}]), "val", None, "t")
    with pytest.raises(ConfigError, match="collating train.* failed .*give the task a "
                                          "collate_fn"):
        check_samples(Texts([{"ids": torch.ones(2)}, {"ids": torch.ones(3)}]), "train", None, "t")
    with pytest.raises(ConfigError, match="the train split is empty"):
        check_samples(Texts([]), "train", None, "t")
    # variable lengths with a padding collate_fn, ints and nested mappings are fine
    pad = lambda items: {"ids": nn.utils.rnn.pad_sequence([i["ids"] for i in items],  # noqa: E731
                                                          batch_first=True)}
    check_samples(Texts([{"ids": torch.ones(2)}, {"ids": torch.ones(3)}]), "train", pad, "t")
    check_samples(Texts([{"x": {"y": torch.ones(2)}, "label": 1}] * 2), "train", None, "t")


def test_weight_decay_groups_follow_the_hf_rule_and_count_tied_weights_once():
    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 4)
            self.proj = nn.Linear(4, 4)
            self.LayerNorm = nn.LayerNorm(4)
            self.final_norm = nn.Module()
            self.final_norm.weight = nn.Parameter(torch.ones(4))
            self.head = nn.Linear(4, 10, bias=False)
            self.head.weight = self.emb.weight  # tied

    model = Tiny()
    decay, keep = weight_decay_groups(model)
    names = {id(p): n for n, p in model.named_parameters()}
    assert sorted(names[id(p)] for p in decay["params"]) == ["emb.weight", "proj.weight"]
    assert sorted(names[id(p)] for p in keep["params"]) == [
        "LayerNorm.bias", "LayerNorm.weight", "final_norm.weight", "proj.bias"]
    assert keep["weight_decay"] == 0.0 and "weight_decay" not in decay


def cfg(**sections):
    return from_dict({"task": "digits", **sections})


def test_optimizer_takes_the_task_groups_and_factories():
    model = nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3))
    c = cfg(optimizer={"name": "adamw", "lr": 0.1, "weight_decay": 0.3})
    bundle = TaskBundle(model=model, train=[], val=[], test=[], param_groups=weight_decay_groups)
    opt = build_optimizer(c, model, bundle)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.3, 0.0]
    assert [len(g["params"]) for g in opt.param_groups] == [1, 3]
    plain = build_optimizer(c, model)
    assert len(plain.param_groups) == 1

    own = torch.optim.SGD(model.parameters(), lr=0.5)
    bundle.optimizer_fn = lambda m: own
    bundle.scheduler_fn = lambda o, total: torch.optim.lr_scheduler.StepLR(o, total // 2)
    assert build_optimizer(c, model, bundle) is own
    sched = build_scheduler(c, own, 10, bundle)
    assert isinstance(sched, torch.optim.lr_scheduler.StepLR) and sched.step_size == 5
