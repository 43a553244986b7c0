"""Built-in task ``text_classification``: which WordNet lexicographer file a gloss belongs to.

Data: the 117,659 synsets of WordNet 3.0 (``data.noun``, ``data.verb``, ``data.adj`` and
``data.adv`` of the Debian package ``wordnet-base``, or ``data.wordnet_dir``). Each synset's
gloss is the text; its lexicographer file number (``lex_filenum``, 0..44: ``noun.artifact``,
``verb.motion``, ``adj.all``, ... as listed in lexnames(5WN)) is the label, so the task is a
45-way semantic category of a dictionary definition. The largest class, ``adj.all``, is 12% of
the synsets.

By default (``data.keep_examples: false``) the text is the definition only: the quoted example
sentences after it (``...; "the abaxial surface of a leaf"``) are dropped: they exist for only
28% of the synsets, 97% of them quote the headword itself (so they give away its part of speech
by its form rather than the definition's meaning), and they make the texts 24% longer on
average (12.4 vs 10.0 words), which every training step pays for. The bag-of-words baseline of
:func:`baselines` is also slightly more accurate without them (76.8% vs 76.0% test accuracy).

Split: one permutation of all synsets seeded with ``cfg.seed``; ``data.max_samples`` (> 0) keeps
its first ``max_samples`` entries, then the first ``val_fraction`` of those are validation, the
next ``test_fraction`` test, the rest training. Each split stays in permutation order, so any
prefix of it (evaluation with ``eval.max_batches``) is a random sample, not the nouns, which come
first in file order.

Tokenizer: a WordPiece vocabulary (BERT normaliser, lower-cased, accents stripped; BERT
pre-tokeniser; ``[CLS] text [SEP]``) trained with the ``tokenizers`` library on the training
split only at every build, wrapped as a ``transformers.PreTrainedTokenizerFast`` (so
``save_pretrained`` / ``AutoTokenizer.from_pretrained`` work). ``build`` runs on every rank and
after every restart, so training must give the same vocabulary, ids included, in every process:
see :func:`train_tokenizer` for the one source of non-determinism in ``tokenizers`` and how it
is removed; ``artifacts["vocab_sha256"]`` records the result.

Samples: ``{"input_ids": list[int], "attention_mask": list[int], "labels": int}`` tokenised once
at build time (truncated to ``data.max_length`` tokens including ``[CLS]``/``[SEP]``, unpadded);
``collate_fn`` is ``transformers.DataCollatorWithPadding``, which pads each batch to its longest
sample and returns int64 tensors ``input_ids``/``attention_mask`` ``[B, T]`` and ``labels``
``[B]``. Model: a small ``DistilBertForSequenceClassification`` (no pretrained weights), whose
``outputs.loss`` is the mean cross entropy of the batch.

:func:`baselines` gives the majority-class and a TF-IDF + logistic-regression accuracy on the
same split; run ``python -m elastic_runner.tasks.text_classification CONFIG`` to print them.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch.nn.functional as F
from torch.utils.data import Dataset

from ..config import Config
from ..config_base import ConfigError
from ..data.config import DataConfig as BaseDataConfig
from ..train.config import ModelConfig as BaseModelConfig
from .base import MetricSums, TaskBundle, check_split_fractions, weight_decay_groups

try:
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import (
        DataCollatorWithPadding,
        DistilBertConfig,
        DistilBertForSequenceClassification,
        PreTrainedTokenizerFast,
    )
except ModuleNotFoundError as e:  # the [hf] extra; the runner's task loading names it too
    if __name__ != "__main__":
        raise
    print(f"error: {e.name!r} is not installed; install the Hugging Face extra: "
          "pip install 'elastic-runner[hf]'", file=sys.stderr)
    raise SystemExit(2) from None

log = logging.getLogger(__name__)

POS_FILES: tuple[str, ...] = ("noun", "verb", "adj", "adv")  # data.<pos>, read in this order

# Lexicographer file numbers and names, from the table in lexnames(5WN) (WordNet 3.0,
# /usr/share/man/man5/lexnames.5WN.gz). The database's own ``lexnames`` file is read instead when
# the WordNet directory has one; Debian's wordnet-base ships only the man page.
LEXNAMES: tuple[str, ...] = (
    "adj.all", "adj.pert", "adv.all", "noun.Tops", "noun.act", "noun.animal", "noun.artifact",
    "noun.attribute", "noun.body", "noun.cognition", "noun.communication", "noun.event",
    "noun.feeling", "noun.food", "noun.group", "noun.location", "noun.motive", "noun.object",
    "noun.person", "noun.phenomenon", "noun.plant", "noun.possession", "noun.process",
    "noun.quantity", "noun.relation", "noun.shape", "noun.state", "noun.substance", "noun.time",
    "verb.body", "verb.change", "verb.cognition", "verb.communication", "verb.competition",
    "verb.consumption", "verb.contact", "verb.creation", "verb.emotion", "verb.motion",
    "verb.perception", "verb.possession", "verb.social", "verb.stative", "verb.weather",
    "adj.ppl",
)

PAD, UNK, CLS, SEP, MASK = "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, UNK, CLS, SEP, MASK)  # ids 0..4, in this order
CONTINUATION = "##"  # WordPiece prefix of a token that continues a word


class DataConfig(BaseDataConfig):
    """``data:`` section. Fractions are of the synsets kept (all, or ``max_samples``)."""

    wordnet_dir: str = "/usr/share/wordnet"
    """Holds data.noun, data.verb, data.adj, data.adv."""
    keep_examples: bool = False
    """Keep the quoted example sentences after the definition."""
    max_samples: int = 0
    """A seeded random subset of this many synsets (quick runs); 0: all of them."""
    vocab_size: int = 8000
    """WordPiece vocabulary, special tokens included."""
    min_frequency: int = 2
    """A merge must occur this often in the training split."""
    max_length: int = 32
    """Tokens per sample, [CLS] and [SEP] included (4.5% of definitions are longer and get
    truncated); also the model's positions."""
    val_fraction: float = 0.05
    """The validation split's share of the synsets kept."""
    test_fraction: float = 0.05
    """The test split's share of the synsets kept."""


class ModelConfig(BaseModelConfig):
    """``model:`` section: a ``DistilBertConfig`` (names as there)."""

    dim: int = 128
    """Hidden size."""
    n_layers: int = 1
    """Transformer layers."""
    n_heads: int = 4
    """Must divide dim."""
    hidden_dim: int = 512
    """Feed-forward inner size."""
    dropout: float = 0.0
    """Dropout on the embeddings, residual branches and feed-forward layers (none by default: a few
    epochs of 106k samples underfit, and dropout only slowed learning)."""
    attention_dropout: float = 0.0
    """Dropout on the attention weights."""
    seq_classif_dropout: float = 0.0
    """Before the classification head."""


# ---------------------------------------------------------------- WordNet


@dataclass(frozen=True)
class Gloss:
    """One synset: ``pos`` file (``noun``...), byte ``offset`` (its id within that file),
    ``label`` = lexicographer file number (0..44), ``ss_type`` (n, v, a, s, r) and ``gloss``
    (definition and any quoted examples, as in the file)."""

    pos: str
    offset: int
    label: int
    ss_type: str
    gloss: str

    def text(self, keep_examples: bool) -> str:
        """The gloss, or only its definition: the part before the first ``; "`` example."""
        return self.gloss if keep_examples else self.gloss.split('; "', 1)[0]


def parse_data_line(pos: str, line: str) -> Gloss:
    """Parse one synset line of a WordNet ``data.<pos>`` file (wndb(5WN)):
    ``synset_offset lex_filenum ss_type w_cnt word lex_id ... | gloss``.

    Raises:
        ValueError: the line has no ``|`` gloss separator or a malformed header field.
    """
    head, sep, gloss = line.partition(" | ")
    fields = head.split(maxsplit=3)
    if not sep or len(fields) < 3:
        raise ValueError(f"not a synset line: {line[:80]!r}")
    label = int(fields[1])
    if not 0 <= label < len(LEXNAMES):
        raise ValueError(f"lex_filenum {fields[1]!r} outside 00..{len(LEXNAMES) - 1}")
    return Gloss(pos, int(fields[0]), label, fields[2], gloss.strip())


@functools.lru_cache(maxsize=2)
def load_glosses(wordnet_dir: str) -> tuple[Gloss, ...]:
    """All synsets of ``data.noun``, ``data.verb``, ``data.adj``, ``data.adv`` in that order and
    file order (117,659 for WordNet 3.0; 0.3 s). License header lines (starting with two
    spaces) are skipped.

    Raises:
        FileNotFoundError: a data file is missing.
        ValueError: a malformed line (the message names file and line number).
    """
    out: list[Gloss] = []
    for pos in POS_FILES:
        path = Path(wordnet_dir) / f"data.{pos}"
        with path.open(encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.startswith("  "):
                    continue
                try:
                    out.append(parse_data_line(pos, line))
                except ValueError as e:
                    raise ValueError(f"{path}:{n}: {e}") from e
    return tuple(out)


def lexnames(wordnet_dir: str) -> tuple[str, ...]:
    """The 45 lexicographer file names by number: from ``<wordnet_dir>/lexnames`` (lines
    ``NN<TAB>name<TAB>category``) when it exists, else :data:`LEXNAMES`.

    Raises:
        ValueError: the ``lexnames`` file does not number 0..44 in order.
    """
    path = Path(wordnet_dir) / "lexnames"
    if not path.is_file():
        return LEXNAMES
    rows = [line.split() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if [int(r[0]) for r in rows] != list(range(len(LEXNAMES))):
        raise ValueError(f"{path}: expected file numbers 00..{len(LEXNAMES) - 1} in order")
    return tuple(r[1] for r in rows)


def wordnet_sha256(wordnet_dir: str) -> str:
    """sha256 (hex) of the four data files' bytes, concatenated in :data:`POS_FILES` order."""
    h = hashlib.sha256()
    for pos in POS_FILES:
        h.update((Path(wordnet_dir) / f"data.{pos}").read_bytes())
    return h.hexdigest()


# ---------------------------------------------------------------- splits


@dataclass(frozen=True)
class Split:
    """Texts and labels (0..44) of one split."""

    texts: list[str]
    labels: list[int]


def split_indices(n: int, val_fraction: float, test_fraction: float, seed: int,
                  max_samples: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """int64 indices into ``n`` items for (train, val, test), in permutation order.

    A permutation of ``range(n)`` from ``np.random.default_rng(seed)``; with ``max_samples``
    > 0 only its first ``max_samples`` entries are kept. Of those ``m``, the first
    ``round(val_fraction * m)`` are val, the next ``round(test_fraction * m)`` test, the rest
    train.
    """
    perm = np.random.default_rng(seed).permutation(n)
    if 0 < max_samples < n:
        perm = perm[:max_samples]
    m = len(perm)
    n_val, n_test = round(val_fraction * m), round(test_fraction * m)
    return perm[n_val + n_test:], perm[:n_val], perm[n_val:n_val + n_test]


def load_splits(cfg: Config) -> dict[str, Split]:
    """``{"train", "val", "test"}`` splits of the glosses as the config says (see the module
    docstring).

    Raises:
        ConfigError: the WordNet directory or a data file is missing, or a split is empty.
    """
    d = cfg.data
    glosses = _glosses(d.wordnet_dir)
    parts = split_indices(len(glosses), d.val_fraction, d.test_fraction, cfg.seed,
                          d.max_samples)
    splits = {}
    for name, idx in zip(("train", "val", "test"), parts, strict=True):
        if len(idx) == 0:
            raise ConfigError(f"data.max_samples: the {name} split is empty with "
                              f"{d.max_samples} samples; use more (or 0 for all)")
        chosen = [glosses[i] for i in idx]
        splits[name] = Split([g.text(d.keep_examples) for g in chosen], [g.label for g in chosen])
    return splits


def _glosses(wordnet_dir: str) -> tuple[Gloss, ...]:
    """:func:`load_glosses`, with a missing directory or file or a malformed line as a
    :class:`ConfigError` (a worker exits with code 2 instead of being restarted)."""
    if not Path(wordnet_dir).is_dir():
        raise ConfigError(
            f"data.wordnet_dir: {wordnet_dir!r} is not a directory; install WordNet 3.0 with "
            "the Debian package wordnet-base (apt-get install wordnet-base) or set "
            "data.wordnet_dir to a directory holding data.noun, data.verb, data.adj, data.adv")
    try:
        return load_glosses(wordnet_dir)
    except FileNotFoundError as e:
        raise ConfigError(f"data.wordnet_dir: {e.filename} is missing; install the Debian "
                          "package wordnet-base or point data.wordnet_dir at WordNet 3.0's "
                          "dict directory") from e
    except ValueError as e:
        raise ConfigError(f"data.wordnet_dir: not a WordNet 3.0 data file: {e}") from e


# ---------------------------------------------------------------- tokenizer


def _normalizer() -> normalizers.Normalizer:
    return normalizers.BertNormalizer(lowercase=True)  # also strips accents, cleans controls


def continuation_alphabet(texts: list[str]) -> list[str]:
    """Sorted characters that can continue a word after normalisation and pre-tokenisation:
    those of the normalised ``texts`` that the BERT pre-tokeniser does not split off (it
    splits at whitespace and around punctuation). A superset of the characters that do occur
    inside a word."""
    norm, pre = _normalizer(), pre_tokenizers.BertPreTokenizer()
    # the BERT normaliser maps each character on its own, so normalising the distinct raw
    # characters gives the normalised text's characters (0.05 s instead of 1.5 s)
    chars = set(norm.normalize_str("\n".join(set("".join(texts)))))
    return sorted(c for c in chars if len(pre.pre_tokenize_str(f"a{c}a")) == 1)


def train_tokenizer(texts: list[str], vocab_size: int, min_frequency: int, max_length: int
                    ) -> PreTrainedTokenizerFast:
    """Train a WordPiece tokenizer on ``texts`` and wrap it for transformers.

    Ids 0..4 are ``[PAD] [UNK] [CLS] [SEP] [MASK]``; encoding adds ``[CLS]``/``[SEP]``;
    ``model_max_length`` is ``max_length``; the model inputs are ``input_ids`` and
    ``attention_mask`` (DistilBERT takes no ``token_type_ids``). About 3 s for 106k glosses.

    Deterministic across processes: ``tokenizers``' trainer gives the ``##c`` continuation
    characters ids in the iteration order of a Rust ``HashMap`` of words, which is seeded per
    process, and breaks ties between equally frequent merges by token id, so the vocabulary
    (its ids, and at the size cut-off even its tokens) would differ between ranks and restarts.
    Declaring every ``##c`` as a special token of the trainer, in sorted order, fixes their ids
    before any word is seen; everything after that is ordered by (count, ids). The trained
    vocabulary is then loaded into a fresh WordPiece model, so those ``##c`` are ordinary
    tokens again and only the five above are special.
    """
    continuation = [CONTINUATION + c for c in continuation_alphabet(texts)]
    draft = Tokenizer(models.WordPiece(unk_token=UNK))
    draft.normalizer = _normalizer()
    draft.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, show_progress=False,
        special_tokens=[*SPECIAL_TOKENS, *continuation], continuing_subword_prefix=CONTINUATION)
    draft.train_from_iterator(texts, trainer=trainer, length=len(texts))

    tok = Tokenizer(models.WordPiece(vocab=draft.get_vocab(), unk_token=UNK,
                                     continuing_subword_prefix=CONTINUATION))
    tok.normalizer = _normalizer()
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix=CONTINUATION)
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    cls_id, sep_id = tok.token_to_id(CLS), tok.token_to_id(SEP)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{CLS} $A {SEP}", pair=f"{CLS} $A {SEP} $B:1 {SEP}:1",
        special_tokens=[(CLS, cls_id), (SEP, sep_id)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token=UNK, pad_token=PAD, cls_token=CLS, sep_token=SEP,
        mask_token=MASK, model_max_length=max_length, padding_side="right",
        model_input_names=["input_ids", "attention_mask"])


def vocab_sha256(tokenizer: PreTrainedTokenizerFast) -> str:
    """sha256 (hex) of the vocabulary as a ``vocab.txt`` (one token per line, in id order)."""
    vocab = tokenizer.get_vocab()
    lines = sorted(vocab, key=vocab.__getitem__)
    return hashlib.sha256("".join(t + "\n" for t in lines).encode("utf-8")).hexdigest()


# ---------------------------------------------------------------- dataset


class TokenizedGlosses(Dataset):
    """Pre-tokenised glosses. Item ``i`` is ``{"input_ids": list[int] (<= max_length, with
    [CLS]/[SEP]), "attention_mask": list[int] (all 1), "labels": int (0..44)}``; ``texts[i]``
    is its text."""

    def __init__(self, split: Split, tokenizer: PreTrainedTokenizerFast, max_length: int
                 ) -> None:
        self.texts = split.texts
        self.labels = split.labels
        self.input_ids: list[list[int]] = tokenizer(
            split.texts, truncation=True, max_length=max_length)["input_ids"]

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, Any]:
        ids = self.input_ids[i]
        return {"input_ids": list(ids), "attention_mask": [1] * len(ids),
                "labels": self.labels[i]}


# ---------------------------------------------------------------- metrics, baselines


def metrics_fn(outputs: Any, batch: Any) -> MetricSums:
    """``{"loss": (sum of per-sample CE in nats, n), "accuracy": (n correct, n)}`` as python
    floats, from ``outputs.logits`` ``[B, 45]`` and ``batch["labels"]`` int64 ``[B]``."""
    logits = outputs.logits.detach().float()
    labels = batch["labels"]
    loss = F.cross_entropy(logits, labels, reduction="sum").item()
    correct = (logits.argmax(dim=-1) == labels).sum().item()
    n = float(labels.numel())
    return {"loss": (float(loss), n), "accuracy": (float(correct), n)}


def majority(train_labels: list[int], test_labels: list[int]) -> tuple[int, float]:
    """The most frequent training label (smallest on ties) and its accuracy on
    ``test_labels``."""
    counts = Counter(train_labels)
    label = min(counts, key=lambda k: (-counts[k], k))
    return label, sum(y == label for y in test_labels) / len(test_labels)


def baselines(cfg: Config) -> dict[str, Any]:
    """Test accuracies of two non-neural baselines on the split ``build(cfg)`` uses.

    ``majority``: always the most frequent training label. ``tfidf_logreg``: scikit-learn
    ``TfidfVectorizer`` (lower-cased word unigrams and bigrams seen in >= 2 training texts,
    sublinear tf) + multinomial ``LogisticRegression`` (saga, C=10, tol 1e-3: converges in about
    30 epochs; lbfgs needs minutes on these 125k features), fitted on the training split. About
    15 s on one CPU core for the full data; ``seconds`` records it.

    Raises:
        ConfigError: scikit-learn is not installed (the ``sklearn`` extra).
    """
    try:
        from sklearn.feature_extraction.text import TfidfVectorizer
        from sklearn.linear_model import LogisticRegression
    except ModuleNotFoundError as e:
        raise ConfigError("the baselines need scikit-learn: "
                          "pip install 'elastic-runner[sklearn]'") from e

    _check(cfg)
    splits = load_splits(cfg)
    train, test = splits["train"], splits["test"]
    label, majority_acc = majority(train.labels, test.labels)
    start = time.perf_counter()
    vectorizer = TfidfVectorizer(ngram_range=(1, 2), min_df=2, sublinear_tf=True)
    x_train = vectorizer.fit_transform(train.texts)
    clf = LogisticRegression(C=10.0, solver="saga", tol=1e-3, max_iter=100)
    clf.fit(x_train, train.labels)
    pred = clf.predict(vectorizer.transform(test.texts))
    accuracy = float(np.mean(pred == np.asarray(test.labels)))
    return {
        "test_samples": len(test.labels),
        "majority": {"label": label, "name": lexnames(cfg.data.wordnet_dir)[label],
                     "test_accuracy": majority_acc},
        "tfidf_logreg": {"test_accuracy": accuracy, "features": x_train.shape[1],
                         "seconds": round(time.perf_counter() - start, 1)},
    }


# ---------------------------------------------------------------- build


def _check(cfg: Config) -> None:
    data, model = cfg.data, cfg.model
    check_split_fractions(data.val_fraction, data.test_fraction)
    minimum = {"max_samples": 0, "vocab_size": len(SPECIAL_TOKENS) + 1, "min_frequency": 1,
               "max_length": 3}  # max_length: [CLS], one token, [SEP]
    for key, low in minimum.items():
        if getattr(data, key) < low:
            raise ConfigError(f"data.{key}: must be >= {low}, got {getattr(data, key)!r}")
    for key in ("dim", "n_layers", "n_heads", "hidden_dim"):
        if getattr(model, key) < 1:
            raise ConfigError(f"model.{key}: must be >= 1, got {getattr(model, key)!r}")
    if model.dim % model.n_heads:
        raise ConfigError(
            f"model.dim: must be divisible by model.n_heads ({model.n_heads}), got {model.dim}")
    for key in ("dropout", "attention_dropout", "seq_classif_dropout"):
        if not 0.0 <= getattr(model, key) < 1.0:
            raise ConfigError(f"model.{key}: must be in [0, 1), got {getattr(model, key)!r}")


def build_model(cfg: Config, names: tuple[str, ...], pad_token_id: int, vocab_size: int
                ) -> DistilBertForSequenceClassification:
    """A randomly initialised (default torch RNG) DistilBERT classifier over ``len(names)``
    labels with ``data.max_length`` learned positions."""
    m = cfg.model
    config = DistilBertConfig(
        vocab_size=vocab_size, max_position_embeddings=cfg.data.max_length, dim=m.dim,
        n_layers=m.n_layers, n_heads=m.n_heads, hidden_dim=m.hidden_dim, dropout=m.dropout,
        attention_dropout=m.attention_dropout, seq_classif_dropout=m.seq_classif_dropout,
        num_labels=len(names), id2label=dict(enumerate(names)),
        label2id={name: i for i, name in enumerate(names)}, pad_token_id=pad_token_id,
        problem_type="single_label_classification")
    return DistilBertForSequenceClassification(config)


def build(cfg: Config) -> TaskBundle:
    """Build the text_classification task: glosses, split, tokenizer (trained on the training
    split), tokenised datasets and model; see the module docstring.

    Raises:
        ConfigError: an invalid ``data``/``model`` value or a missing WordNet (names the key).
    """
    _check(cfg)
    d = cfg.data
    splits = load_splits(cfg)
    try:
        names = lexnames(d.wordnet_dir)
    except ValueError as e:
        raise ConfigError(f"data.wordnet_dir: {e}") from e
    start = time.perf_counter()
    tokenizer = train_tokenizer(splits["train"].texts, d.vocab_size, d.min_frequency,
                                d.max_length)
    log.info("text_classification: trained a %d-token WordPiece vocabulary on %d glosses in "
             "%.1f s", len(tokenizer), len(splits["train"].texts), time.perf_counter() - start)
    datasets = {k: TokenizedGlosses(s, tokenizer, d.max_length) for k, s in splits.items()}
    model = build_model(cfg, names, tokenizer.pad_token_id, len(tokenizer))
    label, acc = majority(splits["train"].labels, splits["test"].labels)
    truncated = sum(len(ids) == d.max_length for ids in datasets["train"].input_ids)
    return TaskBundle(
        model=model,
        train=datasets["train"],
        val=datasets["val"],
        test=datasets["test"],
        metrics_fn=metrics_fn,
        collate_fn=DataCollatorWithPadding(tokenizer),
        tokenizer=tokenizer,
        param_groups=weight_decay_groups,
        artifacts={
            "label_names": list(names),
            "max_length": d.max_length,
            "keep_examples": d.keep_examples,
            "vocab_size": len(tokenizer),
            "vocab_sha256": vocab_sha256(tokenizer),
            "wordnet_sha256": wordnet_sha256(d.wordnet_dir),
            "split_seed": cfg.seed,
            "split_sizes": {k: len(v) for k, v in datasets.items()},
            "train_at_max_length": truncated,  # samples that may have been truncated
            "majority_class": {"label": label, "name": names[label], "test_accuracy": acc},
        },
    )


def main(argv: list[str]) -> int:
    """``python -m elastic_runner.tasks.text_classification CONFIG [key=value ...]``: print
    :func:`baselines` as JSON."""
    from ..config import load_config

    if not argv:
        print(main.__doc__, file=sys.stderr)
        return 2
    try:
        print(json.dumps(baselines(load_config(argv[0], argv[1:])), indent=2))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
