"""Fast single-process tests of the built-in task ``causal_lm`` (GPT-2 over byte-level BPE)."""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from .needs import HF_EXTRA, require_modules

require_modules("transformers", "tokenizers", install_hint=HF_EXTRA)

import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from elastic_runner.config import ConfigError, from_dict, load_config  # noqa: E402
from elastic_runner.tasks import causal_lm, char_lm  # noqa: E402
from elastic_runner.tasks.base import TaskBundle  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TASK = "elastic_runner.tasks.causal_lm:build"  # the module path works with or without the short name
# functools has a non-ASCII character in train, zipfile box-drawing characters in test
SMALL = {
    "task": TASK,
    "data": {"corpus_modules": ["functools", "textwrap", "zipfile"], "block_size": 64,
             "vocab_size": 512},
    "model": {"n_layer": 2, "n_head": 4, "n_embd": 64},
}
SPLITS = ("train", "val", "test")


def build(raw: dict[str, Any]) -> TaskBundle:
    """Build the task as the runner does: seed the global RNG with cfg.seed, then call build."""
    cfg = from_dict(raw)
    torch.manual_seed(cfg.seed)
    return causal_lm.build(cfg)


def split_texts(raw: dict[str, Any]) -> dict[str, str]:
    """The split texts char_lm's build makes of the same data section, decoded from its data."""
    data = {k: v for k, v in raw["data"].items() if k != "vocab_size"}  # char_lm has none
    cfg = from_dict({"task": "char_lm", "data": data})
    torch.manual_seed(cfg.seed)
    b = char_lm.build(cfg)
    vocab = b.artifacts["vocab"]
    return {s: "".join(vocab[i] for i in getattr(b, s).data.tolist()) for s in SPLITS}


@pytest.fixture(scope="module")
def bundle() -> TaskBundle:
    return build(SMALL)


@pytest.fixture(scope="module")
def texts() -> dict[str, str]:
    return split_texts(SMALL)


def test_defaults_match_char_lm() -> None:
    ours, theirs = causal_lm.DataConfig(), char_lm.DataConfig()
    assert ours.corpus_modules == theirs.corpus_modules
    assert (ours.val_fraction, ours.test_fraction) == (theirs.val_fraction, theirs.test_fraction)
    assert causal_lm.ModelConfig().dropout > 0  # dropout on by default: resume must be exact


def test_split_is_char_lm_split(bundle: TaskBundle, texts: dict[str, str]) -> None:
    tok = bundle.tokenizer
    a = bundle.artifacts
    corpus = char_lm.load_corpus(tuple(SMALL["data"]["corpus_modules"]))
    assert "".join(texts[s] for s in SPLITS) == corpus  # char_lm's splits tile the corpus
    for s in SPLITS:
        ids = getattr(bundle, s).ids
        assert ids.dtype == torch.int64 and len(ids) == a["split_tokens"][s]
        # the whole encoded split decodes to exactly char_lm's split: same boundaries, and the
        # tokenizer round-trips (non-ASCII text included)
        assert tok.decode(ids.tolist()) == texts[s]
        assert a["split_chars"][s] == len(texts[s])
    assert a["corpus_chars"] == len(corpus)
    assert a["corpus_bytes"] == len(corpus.encode("utf-8")) > len(corpus)


def test_windows(bundle: TaskBundle) -> None:
    bs = bundle.artifacts["block_size"]
    for s in SPLITS:
        ds = getattr(bundle, s)
        n = len(ds)
        assert n == len(ds.ids) // bs > 0
        items = [ds[i] for i in range(n)]
        for item in items:
            assert set(item) == {"input_ids", "labels"}
            assert item["input_ids"].shape == (bs,) and item["input_ids"].dtype == torch.int64
            assert torch.equal(item["input_ids"], item["labels"])
        # consecutive, non-overlapping, only the tail short of a window dropped
        joined = torch.cat([item["input_ids"] for item in items])
        assert torch.equal(joined, ds.ids[: n * bs])
        assert torch.equal(ds[-1]["input_ids"], items[-1]["input_ids"])
        with pytest.raises(IndexError):
            ds[n]
    item = bundle.train[0]
    item["labels"][0] = -100  # a collator masking labels in place leaves inputs and data alone
    assert item["input_ids"][0] != -100 and bundle.train[0]["labels"][0] != -100
    batch = next(iter(DataLoader(bundle.val, batch_size=3)))
    assert batch["input_ids"].shape == batch["labels"].shape == (3, bs)


def test_tokenizer_round_trip_and_save(bundle: TaskBundle, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tok = bundle.tokenizer
    a = bundle.artifacts
    text = ("def f(x):\n\treturn x  # caf\u00e9 \u2192 \U0001f600\r\n"
            "    \n  <|endoftext|>  leading and trailing spaces , . ")
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text
    assert a["eot_token_id"] in ids  # the special token's text is the special token
    assert tok.eos_token == tok.bos_token == tok.pad_token == causal_lm.EOT
    assert tok.eos_token_id == a["eot_token_id"] and len(tok) == a["vocab_size"] == 512
    assert tok.model_max_length == a["block_size"]
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again(text)["input_ids"] == ids and again.decode(ids) == text
    assert again.eos_token_id == tok.eos_token_id and again.pad_token == causal_lm.EOT


def test_tokenizer_trained_on_train_only(texts: dict[str, str]) -> None:
    small = {**SMALL, "data": {**SMALL["data"], "vocab_size": 300}}
    a = build(small).artifacts
    # the sha covers the vocabulary: a tokenizer trained on train + val differs from it
    assert a["tokenizer_sha256"] == causal_lm.tokenizer_sha256(
        causal_lm.train_tokenizer(texts["train"], 300))
    assert a["tokenizer_sha256"] != causal_lm.tokenizer_sha256(
        causal_lm.train_tokenizer(texts["train"] + texts["val"], 300))


FINGERPRINT = """
import hashlib, json, torch
from elastic_runner.config import from_dict
from elastic_runner.tasks import causal_lm

def fingerprint(raw):
    cfg = from_dict(raw); torch.manual_seed(cfg.seed)
    b = causal_lm.build(cfg)
    h = hashlib.sha256()
    for s in ('train', 'val', 'test'): h.update(getattr(b, s).ids.numpy().tobytes())
    for v in b.model.state_dict().values(): h.update(v.numpy().tobytes())
    return json.loads(json.dumps({'artifacts': b.artifacts, 'data_and_weights': h.hexdigest()}))
"""
"""Defines ``fingerprint(raw)``: what a build of the task from the config dict ``raw`` must
not vary in (its artifacts, a sha256 of its data and initial weights)."""


def test_build_is_deterministic_across_processes() -> None:
    """Every rank and every restart builds in its own process: thread count and hash seed
    must not change the tokenizer, the data or the initial weights. A fresh interpreter whose
    Rust thread count and hash seed differ from this process's builds the SMALL task, and so
    does this process: the same fingerprint."""
    threads = os.environ.get("RAYON_NUM_THREADS") or str(os.cpu_count())
    seed = os.environ.get("PYTHONHASHSEED", "random")
    env = {"RAYON_NUM_THREADS": "2" if threads == "1" else "1",
           "PYTHONHASHSEED": "2" if seed == "1" else "1"}
    code = FINGERPRINT + "import sys\nprint(json.dumps(fingerprint(json.loads(sys.argv[1]))))\n"
    proc = subprocess.Popen([sys.executable, "-c", code, json.dumps(SMALL)], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT), **env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    here: dict[str, Any] = {}
    exec(FINGERPRINT, here)  # while the other process builds
    mine = here["fingerprint"](SMALL)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    assert json.loads(stdout.strip().splitlines()[-1]) == mine


def test_byte_lengths_sum_to_utf8_bytes(bundle: TaskBundle, texts: dict[str, str]) -> None:
    table = causal_lm.token_byte_lengths(bundle.tokenizer.backend_tokenizer)
    assert table.shape == (len(bundle.tokenizer),) and table.dtype == torch.int64
    for s in SPLITS:
        ids = getattr(bundle, s).ids
        assert int(table[ids].sum()) == len(texts[s].encode("utf-8"))
    # characters of 2 to 4 bytes, which a tokenizer this small splits across byte tokens
    text = "\u0141\u00df \u251c\u2500\u2500 \U0001f600 x"
    ids = torch.tensor(bundle.tokenizer(text)["input_ids"])
    assert int(table[ids].sum()) == len(text.encode("utf-8"))
    assert len(ids) > len(text)  # some characters did span several tokens


def test_baselines() -> None:
    p, q = 2 / 3, 1 / 3
    h = -(p * math.log(p) + q * math.log(q))
    assert causal_lm.byte_unigram_entropy(b"aab") == pytest.approx(h)
    assert causal_lm.byte_unigram_entropy(bytes(range(256))) == pytest.approx(math.log(256))
    assert causal_lm.byte_unigram_entropy(b"") == 0.0
    # 3 tokens of entropy h per token, spelling 6 bytes: h * 3 / 6 nats per byte
    assert causal_lm.token_unigram_nats_per_byte(torch.tensor([7, 7, 9]), 6) == pytest.approx(h / 2)


def test_artifacts(bundle: TaskBundle, texts: dict[str, str]) -> None:
    a = bundle.artifacts
    json.dumps(a)
    train = texts["train"].encode("utf-8")
    counts = Counter(bundle.train.ids.tolist())
    n = len(bundle.train.ids)
    token_entropy = -sum(c / n * math.log(c / n) for c in counts.values())
    assert a["token_unigram_nats_per_byte"] == pytest.approx(token_entropy * n / len(train))
    byte_counts = Counter(train)
    byte_entropy = -sum(c / len(train) * math.log(c / len(train)) for c in byte_counts.values())
    assert a["byte_unigram_nats_per_byte"] == pytest.approx(byte_entropy)
    # merges use context the byte unigram cannot: fewer nats per byte
    assert a["token_unigram_nats_per_byte"] < a["byte_unigram_nats_per_byte"] < math.log(256)
    assert a["corpus_modules"] == SMALL["data"]["corpus_modules"]
    assert len(a["tokenizer_sha256"]) == len(a["corpus_sha256"]) == 64


# ---------------------------------------------------------------- model and metrics


def test_model_config(bundle: TaskBundle) -> None:
    c = bundle.model.config
    a = bundle.artifacts
    assert (c.vocab_size, c.n_positions) == (a["vocab_size"], a["block_size"])
    assert (c.n_layer, c.n_head, c.n_embd) == (2, 4, 64)
    assert c.resid_pdrop == c.embd_pdrop == c.attn_pdrop == causal_lm.ModelConfig().dropout
    assert c.eos_token_id == c.bos_token_id == bundle.tokenizer.eos_token_id
    assert bundle.tokens_per_sample == a["block_size"]
    # the runner seeds the default RNG before build: the weights come from it
    other = build({**SMALL, "seed": 7}).model.state_dict()
    assert not torch.equal(other["transformer.h.0.attn.c_attn.weight"],
                           bundle.model.state_dict()["transformer.h.0.attn.c_attn.weight"])


def test_param_groups(bundle: TaskBundle) -> None:
    decay, keep = bundle.param_groups(bundle.model)
    unique = {id(p): p for p in bundle.model.parameters()}
    assert len(decay["params"]) + len(keep["params"]) == len(unique)  # tied head counted once
    assert keep["weight_decay"] == 0.0
    assert all(p.dim() == 1 for p in keep["params"])  # biases and LayerNorm weights
    assert any(p is bundle.model.transformer.wte.weight for p in decay["params"])


def test_metrics_match_model_loss(bundle: TaskBundle) -> None:
    model = bundle.model.eval()
    batch = next(iter(DataLoader(bundle.val, batch_size=4)))
    bs = bundle.artifacts["block_size"]
    table = causal_lm.token_byte_lengths(bundle.tokenizer.backend_tokenizer)
    with torch.no_grad():
        out = model(**batch)
    m = bundle.metrics_fn(out, batch)
    assert set(m) == {"loss", "nats_per_byte"}
    (ce, n), (ce2, n_bytes) = m["loss"], m["nats_per_byte"]
    assert all(isinstance(v, float) for v in (ce, n, ce2, n_bytes))
    assert ce == ce2 and n == 4 * (bs - 1)
    assert n_bytes == float(table[batch["input_ids"][:, 1:]].sum())
    assert ce / n == pytest.approx(out.loss.item(), rel=1e-5)
    assert abs(ce / n - math.log(len(bundle.tokenizer))) < 0.5  # untrained: near uniform
    # labels of -100 are skipped, as by the model's own loss
    masked = {**batch, "labels": batch["labels"].clone()}
    masked["labels"][:, : bs // 2] = -100
    with torch.no_grad():
        out = model(**masked)
    (ce, n), (_, n_bytes) = bundle.metrics_fn(out, masked).values()
    assert n == 4 * (bs - bs // 2)
    assert n_bytes == float(table[batch["input_ids"][:, bs // 2 :]].sum())
    assert ce / n == pytest.approx(out.loss.item(), rel=1e-5)


def test_causal(bundle: TaskBundle) -> None:
    model = bundle.model.eval()
    x = bundle.val[0]["input_ids"]
    x2 = x.clone()
    x2[32:] = (x2[32:] + 1) % len(bundle.tokenizer)
    with torch.no_grad():
        a, b = model(input_ids=x[None]).logits, model(input_ids=x2[None]).logits
    torch.testing.assert_close(a[:, :32], b[:, :32])
    assert not torch.allclose(a[:, 32:], b[:, 32:])


def test_overfits_a_small_batch(bundle: TaskBundle) -> None:
    torch.manual_seed(0)
    model = copy.deepcopy(bundle.model).train()  # the shared bundle's model stays untrained
    batch = next(iter(DataLoader(bundle.train, batch_size=4)))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first = None
    for _ in range(60):
        loss = model(**batch).loss
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        final = model(**batch).loss.item()
    assert first > 5.0 and final < 1.0, (first, final)


def test_save_pretrained_and_generate(bundle: TaskBundle, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = bundle.model.eval()
    model.save_pretrained(tmp_path)
    bundle.tokenizer.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    x = bundle.val[0]["input_ids"][None]
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=x).logits, model(input_ids=x).logits)
    prompt = "def main(argv):\n    "
    ids = bundle.tokenizer(prompt, return_tensors="pt")["input_ids"]
    torch.manual_seed(0)
    out = loaded.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                          max_new_tokens=8, pad_token_id=bundle.tokenizer.pad_token_id)
    assert out.shape == (1, ids.shape[1] + 8)
    assert bundle.tokenizer.decode(out[0]).startswith(prompt)


# ---------------------------------------------------------------- config


def test_config_file_loads() -> None:
    cfg = load_config(ROOT / "configs" / "causal_lm.yaml")
    assert cfg.task == "causal_lm"
    assert isinstance(cfg.data, causal_lm.DataConfig)
    assert isinstance(cfg.model, causal_lm.ModelConfig)
    assert cfg.early_stopping.enabled and cfg.early_stopping.metric == "val_loss"
    assert cfg.checkpoint.dir == "runs/causal_lm/checkpoints"


def test_config_overrides(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"data\.vocab_sizes.*did you mean 'data\.vocab_size'"):
        from_dict({"task": TASK, "data": {"vocab_sizes": 300}})
    path = tmp_path / "lm.yaml"
    path.write_text(f"task: {TASK}\ndata:\n  block_size: 32\n")
    cfg = load_config(path, ["model.n_embd=32", "data.corpus_modules=[textwrap]"])
    assert cfg.data.corpus_modules == ["textwrap"] and cfg.model.n_embd == 32


@pytest.mark.parametrize(("data", "model", "key"), [
    ({"block_size": 1}, {}, r"data\.block_size"),
    ({"vocab_size": 256}, {}, r"data\.vocab_size"),
    ({"corpus_modules": []}, {}, r"data\.corpus_modules"),
    ({"corpus_modules": ["textwrap", "no_such_module_xyz"]}, {}, r"data\.corpus_modules\[1\]"),
    ({"corpus_modules": ["sys"]}, {}, r"data\.corpus_modules\[0\]"),  # built in, no source
    ({"val_fraction": 0.0}, {}, r"data\.val_fraction"),
    ({"val_fraction": 0.5, "test_fraction": 0.5}, {}, r"data\.val_fraction \+ data\.test"),
    ({"corpus_modules": ["textwrap"], "block_size": 5000}, {}, r"data\.block_size.*split has"),
    ({}, {"n_layer": 0}, r"model\.n_layer"),
    ({}, {"n_head": 3}, r"model\.n_embd.*model\.n_head \(3\)"),
    ({}, {"dropout": 1.0}, r"model\.dropout"),
])
def test_bad_config(data: dict[str, Any], model: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        build({"task": TASK, "data": data, "model": model})
