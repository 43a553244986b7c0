"""Fast single-process tests of the built-in tasks ``digits`` and ``char_lm``."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from elastic_runner.config import ConfigError, from_dict, load_config
from elastic_runner.task_registry import task_builder
from elastic_runner.tasks import char_lm, digits
from elastic_runner.tasks.base import TaskBundle


def build(raw: dict[str, Any]) -> TaskBundle:
    """Build a task as the runner does: seed the global RNG with cfg.seed, then call build."""
    cfg = from_dict(raw)
    torch.manual_seed(cfg.seed)
    return task_builder(cfg.task)(cfg)


def all_items(ds: Any) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = next(iter(DataLoader(ds, batch_size=len(ds), shuffle=False)))
    return x, y


def assert_same_model(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


# ---------------------------------------------------------------- digits


@pytest.fixture(scope="module")
def digits_bundle() -> TaskBundle:
    return build({"task": "digits"})


def test_digits_splits(digits_bundle: TaskBundle) -> None:
    b = digits_bundle
    sizes = [len(b.train), len(b.val), len(b.test)]
    assert sum(sizes) == 1797
    assert sizes[1] == sizes[2] == round(0.15 * 1797)
    x, y = b.train[0]
    assert x.shape == (1, 8, 8) and x.dtype == torch.float32
    assert y.shape == () and y.dtype == torch.int64
    # disjoint: reconstruct the index split and compare with the datasets' contents
    tr, va, te = digits.split_indices(1797, 0.15, 0.15, 1234)
    assert len(set(tr) | set(va) | set(te)) == 1797
    from sklearn.datasets import load_digits

    raw = load_digits()
    a = b.artifacts
    xt, yt = all_items(b.test)
    expected = (torch.tensor(raw.images[te], dtype=torch.float64) - a["mean"]) / a["std"]
    torch.testing.assert_close(xt[:, 0].double(), expected, atol=1e-5, rtol=0)
    assert torch.equal(yt, torch.tensor(raw.target[te]))
    # train statistics: the normalised train split has mean 0 and std 1
    xtr, _ = all_items(b.train)
    assert abs(xtr.double().mean().item()) < 1e-5
    assert abs(xtr.double().std(unbiased=False).item() - 1) < 1e-5
    assert set(yt.tolist()) <= set(range(10))


def test_the_packaged_digits_are_what_load_digits_gives() -> None:
    """The package's copy of the digits file is the data scikit-learn's loader returns, bit for
    bit (the task reads it without scikit-learn)."""
    from sklearn.datasets import load_digits

    images, labels = digits.load_digits_arrays()
    want = load_digits()
    assert images.shape == (1797, 8, 8) and images.dtype == want.images.dtype
    assert images.tobytes() == want.images.tobytes()
    assert labels.dtype == "int64" and labels.tolist() == want.target.tolist()


def test_digits_artifacts(digits_bundle: TaskBundle) -> None:
    a = digits_bundle.artifacts
    assert a["input_shape"] == [1, 8, 8]
    assert a["classes"] == list(range(10))
    assert a["split_seed"] == 1234
    assert 0 < a["mean"] < 16 and a["std"] > 0
    json.dumps(a)


def test_digits_deterministic(digits_bundle: TaskBundle) -> None:
    again = build({"task": "digits"})
    for name in ("train", "val", "test"):
        xa, ya = all_items(getattr(digits_bundle, name))
        xb, yb = all_items(getattr(again, name))
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert_same_model(digits_bundle.model, again.model)
    other = build({"task": "digits", "seed": 7})
    assert not torch.equal(all_items(other.test)[1], all_items(digits_bundle.test)[1])


def test_digits_metrics_match_loss(digits_bundle: TaskBundle) -> None:
    b = digits_bundle
    x, y = next(iter(DataLoader(b.val, batch_size=50)))
    b.model.eval()
    with torch.no_grad():
        out = b.model(x)
    assert out.shape == (50, 10) and out.dtype == torch.float32
    m = b.metrics_fn(out, y)
    assert set(m) == {"loss", "accuracy"}
    assert all(isinstance(v, float) for pair in m.values() for v in pair)
    loss_sum, n = m["loss"]
    assert n == 50.0
    assert loss_sum / n == pytest.approx(b.loss_fn(out, y).item(), rel=1e-5)
    correct, n_acc = m["accuracy"]
    assert n_acc == 50.0 and correct == (out.argmax(1) == y).sum().item()


def test_digits_model_config() -> None:
    b = build({"task": "digits", "model": {"channels": 4, "hidden": 16, "dropout": 0.0}})
    assert b.model(torch.zeros(3, 1, 8, 8)).shape == (3, 10)
    with pytest.raises(ConfigError, match=r"model\.channel.*did you mean 'model\.channels'"):
        from_dict({"task": "digits", "model": {"channel": 4}})
    with pytest.raises(ConfigError, match=r"data\.val_fraction"):
        build({"task": "digits", "data": {"val_fraction": 1.5}})


def test_digits_cnn_overfits_small_batch(digits_bundle: TaskBundle) -> None:
    torch.manual_seed(0)
    model = digits.DigitsCNN()
    x, y = next(iter(DataLoader(digits_bundle.train, batch_size=64)))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(100):
        opt.zero_grad()
        loss = digits_bundle.loss_fn(model(x), y)
        loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        acc = (model(x).argmax(1) == y).float().mean().item()
    assert acc > 0.9, acc


# ---------------------------------------------------------------- char_lm


@pytest.fixture(scope="module")
def lm_bundle() -> TaskBundle:
    return build({"task": "char_lm"})


def test_char_lm_splits(lm_bundle: TaskBundle) -> None:
    b = lm_bundle
    a = b.artifacts
    bs = a["block_size"]
    assert bs == 128
    lengths = [len(getattr(b, s).data) for s in ("train", "val", "test")]
    assert sum(lengths) == a["corpus_chars"]
    assert lengths[1] == lengths[2] == round(0.05 * a["corpus_chars"])
    for name, n_chars in zip(("train", "val", "test"), lengths, strict=True):
        assert len(getattr(b, name)) == (n_chars - 1) // bs
    # contiguous and disjoint: concatenating the splits gives back the whole corpus
    corpus = char_lm.load_corpus(tuple(a["corpus_modules"]))
    vocab = a["vocab"]
    joined = torch.cat([getattr(b, s).data for s in ("train", "val", "test")])
    assert "".join(vocab[i] for i in joined.tolist()) == corpus
    x, y = b.train[3]
    assert x.shape == y.shape == (bs,) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[1:], y[:-1])
    assert torch.equal(x, b.train.data[3 * bs : 4 * bs])
    x_last, y_last = b.test[len(b.test) - 1]
    assert y_last.shape == (bs,)
    with pytest.raises(IndexError):
        b.test[len(b.test)]


def test_char_lm_vocab_and_artifacts(lm_bundle: TaskBundle) -> None:
    a = lm_bundle.artifacts
    vocab = a["vocab"]
    assert list(vocab) == sorted(set(vocab))
    corpus = char_lm.load_corpus(tuple(a["corpus_modules"]))
    n_val = round(0.05 * len(corpus))
    for text in (corpus[-2 * n_val :], corpus[-n_val:]):  # val + test, test
        assert set(text) <= set(vocab)
    assert 600_000 < a["corpus_chars"] < 2_000_000
    assert len(a["corpus_sha256"]) == 64
    assert a["corpus_modules"] == list(char_lm.DEFAULT_CORPUS_MODULES)
    assert a["python_version"].count(".") == 2
    assert 0 < a["unigram_entropy_nats"] < math.log(len(vocab))
    json.dumps(a)


def test_unigram_entropy() -> None:
    p, q = 2 / 3, 1 / 3
    assert char_lm.unigram_entropy("aab") == pytest.approx(-(p * math.log(p) + q * math.log(q)))
    assert char_lm.unigram_entropy("abcd") == pytest.approx(math.log(4))
    assert char_lm.unigram_entropy("zzz") == 0.0
    assert char_lm.unigram_entropy("") == 0.0


def test_char_lm_deterministic(lm_bundle: TaskBundle) -> None:
    again = build({"task": "char_lm"})
    for name in ("train", "val", "test"):
        assert torch.equal(getattr(lm_bundle, name).data, getattr(again, name).data)
    assert lm_bundle.artifacts == again.artifacts
    assert_same_model(lm_bundle.model, again.model)


def test_char_lm_metrics_match_loss(lm_bundle: TaskBundle) -> None:
    b = lm_bundle
    x, y = next(iter(DataLoader(b.val, batch_size=4)))
    b.model.eval()
    with torch.no_grad():
        out = b.model(x)
    assert out.shape == (4, 128, len(b.artifacts["vocab"])) and out.dtype == torch.float32
    m = b.metrics_fn(out, y)
    assert set(m) == {"loss"}
    loss_sum, n = m["loss"]
    assert isinstance(loss_sum, float) and n == 4.0 * 128
    assert loss_sum / n == pytest.approx(b.loss_fn(out, y).item(), rel=1e-5)
    # an untrained model is close to uniform over the vocabulary
    assert abs(loss_sum / n - math.log(len(b.artifacts["vocab"]))) < 0.5


def test_char_lm_causal(lm_bundle: TaskBundle) -> None:
    model = lm_bundle.model.eval()
    x, _ = lm_bundle.val[0]
    x2 = x.clone()
    x2[64:] = (x2[64:] + 1) % len(lm_bundle.artifacts["vocab"])
    with torch.no_grad():
        a, b = model(x[None]), model(x2[None])
    torch.testing.assert_close(a[:, :64], b[:, :64])
    assert not torch.allclose(a[:, 64:], b[:, 64:])


def test_char_lm_sample(lm_bundle: TaskBundle) -> None:
    b = lm_bundle
    assert b.sample_fn is not None
    b.model.train()
    rng_state = torch.get_rng_state()
    prompt = "def main(argv):\n    "
    out = b.sample_fn(b.model, prompt, 30, 0)
    assert isinstance(out, str) and out.startswith(prompt)
    assert len(out) == len(prompt) + 30
    assert set(out[len(prompt) :]) <= set(b.artifacts["vocab"])
    assert b.sample_fn(b.model, prompt, 30, 0) == out  # same seed, same text
    assert b.sample_fn(b.model, prompt, 30, 1) != out
    assert b.model.training  # mode restored
    assert torch.equal(torch.get_rng_state(), rng_state)  # global RNG untouched
    # unknown characters are dropped from the context; an empty prompt works
    assert b.sample_fn(b.model, "\u2603" + prompt, 5, 0).startswith("\u2603" + prompt)
    assert len(b.sample_fn(b.model, "", 5, 0)) == 5
    # prompts longer than block_size are cropped
    long_prompt = "x = 1\n" * 40
    assert len(b.sample_fn(b.model, long_prompt, 3, 0)) == len(long_prompt) + 3


def test_char_lm_config(tmp_path: Any) -> None:
    with pytest.raises(ConfigError, match=r"model\.n_layers.*did you mean 'model\.n_layer'"):
        from_dict({"task": "char_lm", "model": {"n_layers": 3}})
    path = tmp_path / "lm.yaml"
    path.write_text("task: char_lm\ndata:\n  block_size: 32\nmodel:\n  n_embd: 64\n")
    cfg = load_config(path, ["model.n_head=2", "data.corpus_modules=[textwrap, difflib]"])
    assert isinstance(cfg.data, char_lm.DataConfig) and isinstance(cfg.model, char_lm.ModelConfig)
    assert cfg.data.corpus_modules == ["textwrap", "difflib"]
    torch.manual_seed(cfg.seed)
    b = char_lm.build(cfg)
    x, y = b.train[0]
    assert x.shape == (32,)
    assert b.model(x[None]).shape == (1, 32, len(b.artifacts["vocab"]))
    assert b.artifacts["corpus_modules"] == ["textwrap", "difflib"]
    with pytest.raises(ConfigError, match=r"model\.n_embd.*divisible"):
        char_lm.build(from_dict({"task": "char_lm", "model": {"n_embd": 30, "n_head": 4}}))
    with pytest.raises(ConfigError, match=r"data\.corpus_modules\[1\]"):
        char_lm.build(from_dict({"task": "char_lm", "data": {"corpus_modules": ["ast", "nope_x"]}}))
    with pytest.raises(ConfigError, match=r"data\.corpus_modules\[0\]"):
        char_lm.build(from_dict({"task": "char_lm", "data": {"corpus_modules": ["sys"]}}))
