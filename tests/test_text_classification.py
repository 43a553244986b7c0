"""Fast single-process tests of the built-in task ``text_classification`` (WordNet glosses ->
lexicographer file, DistilBERT with its own WordPiece tokenizer)."""

from __future__ import annotations

import copy
import gzip
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from .needs import HF_EXTRA, debian, require, require_modules

require_modules("transformers", "tokenizers", install_hint=HF_EXTRA)

from torch.utils.data import DataLoader  # noqa: E402

from elastic_runner.config import ConfigError, from_dict, load_config  # noqa: E402
from elastic_runner.data.batches import check_samples  # noqa: E402
from elastic_runner.task_registry import task_target  # noqa: E402
from elastic_runner.tasks import text_classification as tc  # noqa: E402
from elastic_runner.tasks.base import TaskBundle, metric_sums  # noqa: E402

from .evidence import assert_same_tensors  # noqa: E402

WORDNET = Path(tc.DataConfig().wordnet_dir)
CONFIG = Path(__file__).resolve().parents[1] / "configs" / "text_classification.yaml"
TASK = "elastic_runner.tasks.text_classification:build"
SMALL = {"max_samples": 3000, "vocab_size": 1000, "max_length": 32}

require((WORDNET / "data.noun").is_file(), f"WordNet 3.0 ({WORDNET})", debian("wordnet-base"))


def make_cfg(data: dict[str, Any] | None = None, model: dict[str, Any] | None = None,
             seed: int = 1234) -> Any:
    return from_dict({"task": TASK, "seed": seed, "data": {**SMALL, **(data or {})},
                      "model": model or {}})


def build(cfg: Any) -> TaskBundle:
    """As the runner does: seed the global RNG with cfg.seed, then build."""
    torch.manual_seed(cfg.seed)
    return tc.build(cfg)


@pytest.fixture(scope="module")
def bundle() -> TaskBundle:
    return build(make_cfg())


# ---------------------------------------------------------------- WordNet parsing


def test_known_synsets() -> None:
    by_key = {(g.pos, g.offset): g for g in tc.load_glosses(str(WORDNET))}
    entity = by_key[("noun", 1740)]
    assert tc.LEXNAMES[entity.label] == "noun.Tops" and entity.ss_type == "n"
    assert entity.text(False) == ("that which is perceived or known or inferred to have its own "
                                  "distinct existence (living or nonliving)")
    thin = by_key[("adv", 516401)]  # "very thin; "it was cut wafer-thin""
    assert tc.LEXNAMES[thin.label] == "adv.all"
    assert thin.text(True) == 'very thin; "it was cut wafer-thin"'
    assert thin.text(False) == "very thin"


def test_offsets_point_at_their_lines() -> None:
    """A synset offset is the byte offset of its line in the data file (wndb(5WN)); reading
    there independently gives the same label and gloss for every 500th synset."""
    glosses = tc.load_glosses(str(WORDNET))
    for g in glosses[::500]:
        with (WORDNET / f"data.{g.pos}").open("rb") as f:
            f.seek(g.offset)
            line = f.readline().decode("utf-8")
        fields = line.split()
        assert int(fields[0]) == g.offset and int(fields[1]) == g.label
        assert line.split(" | ", 1)[1].strip() == g.gloss


def test_counts_and_label_ranges() -> None:
    glosses = tc.load_glosses(str(WORDNET))
    per_pos: dict[str, int] = {}
    for g in glosses:
        per_pos[g.pos] = per_pos.get(g.pos, 0) + 1
        # a lexicographer file holds one part of speech: its name says which
        assert tc.LEXNAMES[g.label].split(".")[0] == g.pos, g
    # synsets per part of speech in WordNet 3.0 (wnstats(7WN))
    assert per_pos == {"noun": 82115, "verb": 13767, "adj": 18156, "adv": 3621}
    assert {g.label for g in glosses} == set(range(45))  # every class occurs


def test_lexnames_table_matches_man_page() -> None:
    page = Path("/usr/share/man/man5/lexnames.5WN.gz")
    require(page.is_file(), f"the lexnames(5WN) man page ({page})", debian("wordnet-base"))
    rows = re.findall(r"^(\d\d)\t(\S+)", gzip.decompress(page.read_bytes()).decode(), flags=re.M)
    assert [int(n) for n, _ in rows] == list(range(45))
    assert tuple(name for _, name in rows) == tc.LEXNAMES


def test_lexnames_file_is_preferred(tmp_path: Path) -> None:
    names = [f"x.{i}" for i in range(45)]
    (tmp_path / "lexnames").write_text("".join(f"{i:02d}\t{n}\t1\n" for i, n in enumerate(names)))
    assert tc.lexnames(str(tmp_path)) == tuple(names)
    assert tc.lexnames(str(WORDNET)) == tc.LEXNAMES  # Debian ships no lexnames file
    (tmp_path / "lexnames").write_text("00\tadj.all\t3\n02\tadv.all\t4\n")
    with pytest.raises(ValueError, match="lexnames"):
        tc.lexnames(str(tmp_path))


def test_bad_data_line() -> None:
    with pytest.raises(ValueError, match="not a synset line"):
        tc.parse_data_line("noun", "00001740 03 n 01 entity 0 003")
    with pytest.raises(ValueError, match="lex_filenum"):
        tc.parse_data_line("noun", "00001740 45 n 01 entity 0 000 | a gloss")


# ---------------------------------------------------------------- splits


def test_split_indices_disjoint_and_deterministic() -> None:
    n = 1000
    tr, va, te = tc.split_indices(n, 0.1, 0.2, seed=7)
    assert (len(tr), len(va), len(te)) == (700, 100, 200)
    assert sorted([*tr, *va, *te]) == list(range(n))
    again = tc.split_indices(n, 0.1, 0.2, seed=7)
    assert all((a == b).all() for a, b in zip((tr, va, te), again, strict=True))
    assert not (tc.split_indices(n, 0.1, 0.2, seed=8)[1] == va).all()
    # max_samples: a subset of the same permutation, taken before splitting
    sub = tc.split_indices(n, 0.1, 0.2, seed=7, max_samples=100)
    assert [len(p) for p in sub] == [70, 10, 20]
    assert len(set().union(*map(set, sub))) == 100
    assert (sub[1] == va[:10]).all()


def test_bundle_splits_match_wordnet(bundle: TaskBundle) -> None:
    cfg = make_cfg()
    glosses = tc.load_glosses(str(WORDNET))
    parts = tc.split_indices(len(glosses), 0.05, 0.05, cfg.seed, 3000)
    for ds, idx in zip((bundle.train, bundle.val, bundle.test), parts, strict=True):
        assert ds.texts == [glosses[i].text(False) for i in idx]
        assert ds.labels == [glosses[i].label for i in idx]
    assert bundle.artifacts["split_sizes"] == {"train": 2700, "val": 150, "test": 150}
    assert len(set().union(*(set(p.tolist()) for p in parts))) == 3000  # disjoint
    # permutation order: a prefix (eval.max_batches) is not just the nouns of file order
    assert len({tc.LEXNAMES[y].split(".")[0] for y in bundle.val.labels[:50]}) > 1


# ---------------------------------------------------------------- tokenizer


TRAIN_SCRIPT = """
import json, sys
from elastic_runner.tasks import text_classification as tc
texts = json.load(open(sys.argv[1]))
print(tc.vocab_sha256(tc.train_tokenizer(texts, 1000, 2, 32)))
"""


def test_tokenizer_identical_across_processes(bundle: TaskBundle, tmp_path: Path) -> None:
    """Each rank trains its own tokenizer: separate processes (differently seeded Rust hash
    maps, different thread counts) must give the same vocabulary and ids. A fresh interpreter
    on one Rust thread trains it again; this process trained the bundle's on its default
    thread count (a pool of one per core)."""
    texts = tmp_path / "texts.json"
    texts.write_text(json.dumps(bundle.train.texts))
    threads = os.environ.get("RAYON_NUM_THREADS") or str(os.cpu_count())
    proc = subprocess.Popen([sys.executable, "-c", TRAIN_SCRIPT, str(texts)],
                            env={**os.environ, "RAYON_NUM_THREADS": "2" if threads == "1" else "1",
                                 "TOKENIZERS_PARALLELISM": "true"},
                            stdout=subprocess.PIPE, text=True)
    assert proc.communicate(timeout=120)[0].strip() == bundle.artifacts["vocab_sha256"]
    assert proc.returncode == 0


def test_tokenizer_layout(bundle: TaskBundle) -> None:
    tok = bundle.tokenizer
    assert [tok.convert_tokens_to_ids(t) for t in tc.SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    assert tok.all_special_tokens and set(tok.all_special_tokens) == set(tc.SPECIAL_TOKENS)
    assert len(tok) == bundle.artifacts["vocab_size"] <= 1000
    enc = tok("Très RUNNING")
    assert list(enc) == ["input_ids", "attention_mask"]  # DistilBERT takes no token_type_ids
    ids = enc["input_ids"]
    assert ids[0] == tok.cls_token_id and ids[-1] == tok.sep_token_id
    assert tok.decode(ids, skip_special_tokens=True) == "tres running"
    assert tc.vocab_sha256(tok) == bundle.artifacts["vocab_sha256"]


def test_tokenizer_save_and_reload(bundle: TaskBundle, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    bundle.tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    texts = bundle.val.texts[:20]
    assert loaded(texts)["input_ids"] == bundle.tokenizer(texts)["input_ids"]
    assert loaded.get_vocab() == bundle.tokenizer.get_vocab()
    assert loaded.pad_token_id == bundle.model.config.pad_token_id


# ---------------------------------------------------------------- samples and batches


def test_samples_and_collated_batch(bundle: TaskBundle) -> None:
    tok = bundle.tokenizer
    samples = [bundle.train[i] for i in range(8)]
    for s, text, label in zip(samples, bundle.train.texts, bundle.train.labels, strict=False):
        assert set(s) == {"input_ids", "attention_mask", "labels"}
        assert s["labels"] == label and isinstance(label, int)
        assert s["input_ids"] == tok(text, truncation=True, max_length=32)["input_ids"]
        assert s["attention_mask"] == [1] * len(s["input_ids"])
        assert len(s["input_ids"]) <= 32
    batch = bundle.collate_fn(samples)
    lengths = [len(s["input_ids"]) for s in samples]
    assert batch["input_ids"].shape == (8, max(lengths)) and batch["input_ids"].dtype == torch.int64
    assert batch["labels"].tolist() == [s["labels"] for s in samples]
    assert batch["attention_mask"].sum(1).tolist() == lengths
    pad = batch["input_ids"][batch["attention_mask"] == 0]
    assert len(pad) == 8 * max(lengths) - sum(lengths) > 0 and (pad == tok.pad_token_id).all()
    check_samples(bundle.train, "train", bundle.collate_fn, "text_classification")


def test_truncation_to_max_length() -> None:
    tok = tc.train_tokenizer(["a b c d e f g h"] * 4, 50, 1, 5)
    ids = tok("a b c d e f g h", truncation=True, max_length=5)["input_ids"]
    assert len(ids) == 5 and ids[0] == tok.cls_token_id and ids[-1] == tok.sep_token_id


# ---------------------------------------------------------------- model, metrics


def test_metrics_match_model_loss(bundle: TaskBundle) -> None:
    model = bundle.model.eval()
    batch = bundle.collate_fn([bundle.val[i] for i in range(16)])
    with torch.no_grad():
        out = model(**batch)
    m = bundle.metrics_fn(out, batch)
    assert m["loss"][1] == m["accuracy"][1] == 16.0
    assert all(isinstance(v, float) for pair in m.values() for v in pair)
    assert m["loss"][0] / 16 == pytest.approx(out.loss.item(), rel=1e-5)
    assert m["accuracy"][0] == (out.logits.argmax(-1) == batch["labels"]).sum().item()
    model.train()


def test_evaluation_over_a_loader(bundle: TaskBundle) -> None:
    loader = DataLoader(bundle.val, batch_size=64, collate_fn=bundle.collate_fn)
    sums = metric_sums(bundle.model, loader, bundle.metrics_fn, torch.device("cpu"))
    assert sums["accuracy"][1] == sums["loss"][1] == len(bundle.val)
    assert 0 <= sums["accuracy"][0] <= len(bundle.val)
    assert bundle.model.training  # mode restored


def test_model_config(bundle: TaskBundle) -> None:
    c = bundle.model.config
    assert c.num_labels == 45 and c.id2label[6] == "noun.artifact"
    assert c.label2id["verb.weather"] == 43
    assert c.max_position_embeddings == 32 and c.vocab_size == len(bundle.tokenizer)
    assert c.pad_token_id == bundle.tokenizer.pad_token_id
    groups = bundle.param_groups(bundle.model)
    assert groups[1]["weight_decay"] == 0.0
    n = sum(p.numel() for g in groups for p in g["params"])
    assert n == sum(p.numel() for p in bundle.model.parameters())


def test_model_overfits_a_batch(bundle: TaskBundle) -> None:
    torch.manual_seed(0)
    model = copy.deepcopy(bundle.model).train()
    batch = bundle.collate_fn([bundle.train[i] for i in range(16)])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first = None
    for _ in range(40):
        loss = model(**batch).loss
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        out = model(**batch)
    assert out.loss.item() < 0.1 * first
    assert (out.logits.argmax(-1) == batch["labels"]).all()


def test_build_is_deterministic(bundle: TaskBundle) -> None:
    again = build(make_cfg())
    assert again.artifacts == bundle.artifacts
    a, b = again.model.state_dict(), bundle.model.state_dict()
    assert_same_tensors(a, b)
    assert again.train[5] == bundle.train[5]
    other = build(make_cfg(seed=99))
    assert other.val.texts != bundle.val.texts


def test_artifacts(bundle: TaskBundle) -> None:
    a = bundle.artifacts
    json.dumps(a)
    assert a["label_names"] == list(tc.LEXNAMES)
    labels = bundle.train.labels
    top = a["majority_class"]
    assert labels.count(top["label"]) == max(labels.count(k) for k in set(labels))
    assert top["name"] == tc.LEXNAMES[top["label"]]
    assert top["test_accuracy"] == bundle.test.labels.count(top["label"]) / len(bundle.test)
    assert re.fullmatch(r"[0-9a-f]{64}", a["vocab_sha256"])
    assert a["train_at_max_length"] == sum(len(x) == 32 for x in bundle.train.input_ids)


def test_baselines_on_the_same_split(bundle: TaskBundle) -> None:
    result = tc.baselines(make_cfg())
    assert result["test_samples"] == len(bundle.test)
    assert result["majority"]["test_accuracy"] == bundle.artifacts["majority_class"][
        "test_accuracy"]
    assert result["tfidf_logreg"]["test_accuracy"] > result["majority"]["test_accuracy"] + 0.1


# ---------------------------------------------------------------- config


def test_config_file_loads_and_validates() -> None:
    assert task_target("text_classification") == TASK
    cfg = load_config(CONFIG)
    assert cfg.task == "text_classification"
    assert isinstance(cfg.data, tc.DataConfig) and isinstance(cfg.model, tc.ModelConfig)
    assert cfg.data.wordnet_dir == str(WORDNET)
    tc._check(cfg)
    model = tc.build_model(cfg, tc.LEXNAMES, 0, cfg.data.vocab_size)
    assert model.config.n_layers == cfg.model.n_layers
    # early stopping watches a metric that metrics_fn reports on validation
    assert cfg.early_stopping.metric.removeprefix("val_") in {"loss", "accuracy"}
    assert cfg.early_stopping.mode == "max"
    assert cfg.checkpoint.dir == "runs/text_classification/checkpoints"


@pytest.mark.parametrize(("section", "key", "value", "match"), [
    ("data", "vocab_size", 5, "data.vocab_size"),
    ("data", "max_length", 2, "data.max_length"),
    ("data", "max_samples", -1, "data.max_samples"),
    ("data", "max_samples", 5, "data.max_samples"),  # a split would be empty
    ("data", "min_frequency", 0, "data.min_frequency"),
    ("data", "val_fraction", 0.0, "data.val_fraction"),
    ("data", "wordnet_dir", "/nonexistent/wordnet", "data.wordnet_dir.*wordnet-base"),
    ("model", "n_heads", 3, "model.dim"),
    ("model", "n_layers", 0, "model.n_layers"),
    ("model", "dropout", 1.0, "model.dropout"),
])
def test_bad_config_values(section: str, key: str, value: Any, match: str) -> None:
    data, model = ({key: value}, None) if section == "data" else (None, {key: value})
    with pytest.raises(ConfigError, match=match):
        tc.build(make_cfg(data, model))


def test_missing_or_malformed_data_file(tmp_path: Path) -> None:
    (tmp_path / "data.noun").write_text("")
    with pytest.raises(ConfigError, match=r"data\.wordnet_dir.*data\.verb"):
        tc.build(make_cfg({"wordnet_dir": str(tmp_path)}))
    (tmp_path / "data.noun").write_text("  1 license header\n00001740 03 n 01 entity 0 000\n")
    with pytest.raises(ConfigError, match=r"data\.wordnet_dir.*data\.noun:2: not a synset"):
        tc.build(make_cfg({"wordnet_dir": str(tmp_path)}))  # errors are not cached


def test_unknown_key_is_rejected() -> None:
    with pytest.raises(ConfigError, match="data.vocab"):
        make_cfg({"vocab": 100})


def test_the_baselines_command_without_the_hf_extra_names_it(monkeypatch, capsys) -> None:
    """``python -m elastic_runner.tasks.text_classification`` without tokenizers: one line
    naming the extra and exit 2, not an import traceback; an import by the runner still raises
    (its task loading names the extra, test_config.py)."""
    import runpy

    monkeypatch.setitem(sys.modules, "tokenizers", None)  # an import of it now fails
    monkeypatch.delitem(sys.modules, tc.__name__)
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_module(tc.__name__, run_name="__main__")
    assert exit_info.value.code == 2
    assert "'tokenizers' is not installed" in capsys.readouterr().err
    with pytest.raises(ModuleNotFoundError):
        runpy.run_module(tc.__name__)
