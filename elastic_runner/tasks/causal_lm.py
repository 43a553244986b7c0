"""Built-in task ``causal_lm``: a small Hugging Face GPT-2 over byte-level BPE tokens.

The same text and split as ``char_lm`` (:mod:`elastic_runner.tasks.char_lm`): the source of a
fixed list of standard-library modules, split contiguously by character fractions into train,
val and test. A byte-level BPE tokenizer (the GPT-2 scheme: every byte is a base token, so any
text round-trips exactly) is trained with ``tokenizers`` on the train split only, at build time,
and wrapped in ``transformers.PreTrainedTokenizerFast`` (``<|endoftext|>`` is its BOS, EOS, UNK
and PAD), so the export loads with ``AutoTokenizer.from_pretrained``. Training is deterministic
(the same vocabulary and merges in every process, whatever its thread count; ``artifacts``
records their sha256), which ``build`` needs: it runs on every rank after every restart.

Each split is encoded once and cut into non-overlapping windows of ``block_size`` tokens (the
tail that does not fill a window is dropped). Samples are ``{"input_ids", "labels"}``;
``GPT2LMHeadModel`` shifts the labels itself and returns the mean next-token cross entropy as
``outputs.loss``, which the runner trains on. Validation reports ``val_loss`` (nats per
predicted token) and ``val_nats_per_byte`` (the same cross entropy per UTF-8 byte of text
predicted), comparable across tokenizers and with ``char_lm``'s nats per character (the corpus
is nearly ASCII). ``artifacts`` holds two context-free baselines on the train split.
"""

from __future__ import annotations

import functools
import hashlib
import json
import platform
from typing import Any

import numpy as np
import tokenizers
import torch
import torch.nn.functional as F
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

from ..config import Config
from ..config_base import ConfigError
from . import char_lm
from .base import MetricSums, TaskBundle, check_split_fractions, weight_decay_groups
from .char_lm import check_gpt_config, configured_corpus

EOT = "<|endoftext|>"  # GPT-2's only special token: BOS, EOS, UNK and PAD at once
N_BYTE_TOKENS = 256  # the byte-level base alphabet
IGNORE_INDEX = -100  # label value the transformers losses skip


class DataConfig(char_lm.DataConfig):
    """``data:`` section: char_lm's (corpus modules, fractions of the corpus length in
    characters), with ``block_size`` in tokens and the BPE vocabulary size."""

    block_size: int = 128
    """Tokens per training window, the model's context (GPT-2's `n_positions`)."""
    vocab_size: int = 4096
    """BPE vocabulary: 256 byte tokens + <|endoftext|> + merges."""


class ModelConfig(char_lm.ModelConfig):
    """``model:`` section: char_lm's GPT sizes, for the ``GPT2Config``."""

    dropout: float = 0.1
    """GPT-2's resid_pdrop, embd_pdrop and attn_pdrop."""


# ---------------------------------------------------------------- corpus and split


def split_bounds(n: int, val_fraction: float, test_fraction: float) -> dict[str, tuple[int, int]]:
    """``{"train" | "val" | "test": (start, end)}`` character ranges of a corpus of ``n``
    characters: train first, then val, then test; val and test are ``round(fraction * n)``
    characters. The same arithmetic as ``char_lm.build``, so both tasks see the same text."""
    n_val = int(round(val_fraction * n))
    n_test = int(round(test_fraction * n))
    n_train = n - n_val - n_test
    return {"train": (0, n_train), "val": (n_train, n_train + n_val),
            "test": (n_train + n_val, n)}


# ---------------------------------------------------------------- tokenizer


def train_tokenizer(text: str, vocab_size: int) -> Tokenizer:
    """A byte-level BPE ``tokenizers.Tokenizer`` trained on ``text``.

    Ids: 0 is ``<|endoftext|>``, 1-256 the byte alphabet, then merges in order; at most
    ``vocab_size`` tokens (fewer when ``text`` runs out of pairs to merge). The result depends
    only on ``text`` and ``vocab_size`` (not on the process, its hash seed or thread count).
    """
    tok = Tokenizer(models.BPE())
    # add_prefix_space=False: code is not prose, and decode(encode(text)) must give text back
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, seen or not
        special_tokens=[EOT],
        show_progress=False,
    )
    tok.train_from_iterator([text], trainer=trainer)
    return tok


def wrap_tokenizer(tok: Tokenizer, block_size: int) -> PreTrainedTokenizerFast:
    """``tok`` as a transformers tokenizer (``save_pretrained``, ``AutoTokenizer``) with
    ``<|endoftext|>`` as BOS, EOS, UNK and PAD and ``model_max_length = block_size``."""
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOT,
        eos_token=EOT,
        unk_token=EOT,
        pad_token=EOT,
        model_max_length=block_size,
        # recorded in tokenizer_config.json: loaders whose default is True would turn " ." into
        # "." and break decode(encode(text)) == text
        clean_up_tokenization_spaces=False,
    )


def tokenizer_sha256(tok: Tokenizer) -> str:
    """sha256 (hex) of the BPE model's vocabulary and merges, as canonical JSON."""
    bpe = json.loads(tok.to_str())["model"]
    blob = json.dumps({"vocab": bpe["vocab"], "merges": bpe["merges"]}, sort_keys=True,
                      ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def token_byte_lengths(tok: Tokenizer) -> torch.Tensor:
    """int64 ``[vocab_size]``: UTF-8 bytes of text each token id stands for.

    A byte-level token string spells its bytes one character each in the ByteLevel alphabet,
    so its byte length is its length in characters (a multi-byte character split across
    tokens counts its bytes where they fall). A special token counts the bytes of its own text
    (what ``decode`` without ``skip_special_tokens`` writes).

    Raises:
        ValueError: a non-special token has a character outside the byte alphabet.
    """
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    special = {t.content for t in tok.get_added_tokens_decoder().values()}
    table = torch.zeros(tok.get_vocab_size(), dtype=torch.int64)
    for token, i in tok.get_vocab().items():
        if token in special:
            table[i] = len(token.encode("utf-8"))
        elif set(token) <= alphabet:
            table[i] = len(token)
        else:
            raise ValueError(f"token {i} ({token!r}) is not in the byte-level alphabet")
    return table


# ---------------------------------------------------------------- data


class TokenWindows(Dataset):
    """Non-overlapping windows over an encoded split (int64 ``[n_tokens]``).

    Item ``i`` is ``{"input_ids": ids[i*B : (i+1)*B], "labels": a copy of it}``, int64 ``[B]``
    (B = block_size): the model shifts labels itself. The labels are a copy so a collator that
    masks them in place cannot change the inputs or the split. ``len = n_tokens // B``.
    """

    def __init__(self, ids: torch.Tensor, block_size: int) -> None:
        self.ids = ids
        self.block_size = block_size

    def __len__(self) -> int:
        return len(self.ids) // self.block_size

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"window {i} out of range for {n} windows")
        window = self.ids[i * self.block_size : (i + 1) * self.block_size].clone()
        return {"input_ids": window, "labels": window.clone()}


def encode(tok: Tokenizer, text: str) -> torch.Tensor:
    """int64 ``[n_tokens]`` ids of ``text`` (no special tokens added)."""
    # the backend tokenizer, not the transformers wrapper: a whole split is far longer than
    # model_max_length, which the wrapper would warn about
    return torch.tensor(tok.encode(text, add_special_tokens=False).ids, dtype=torch.int64)


# ---------------------------------------------------------------- baselines and metrics


def _entropy(counts: np.ndarray) -> float:
    """Entropy in nats of the distribution proportional to ``counts`` (0.0 when all zero)."""
    total = counts.sum()
    if total == 0:
        return 0.0
    p = counts[counts > 0] / total
    return float(-(p * np.log(p)).sum())


def byte_unigram_entropy(data: bytes) -> float:
    """Entropy of the byte unigram distribution of ``data`` in nats per byte."""
    return _entropy(np.bincount(np.frombuffer(data, dtype=np.uint8), minlength=N_BYTE_TOKENS))


def token_unigram_nats_per_byte(ids: torch.Tensor, n_bytes: int) -> float:
    """Entropy of the token unigram distribution of ``ids`` (int64 ``[n]``), in nats per byte of
    the ``n_bytes`` of text they encode: entropy per token x tokens / bytes."""
    if n_bytes == 0:
        return 0.0
    return _entropy(np.bincount(ids.numpy())) * len(ids) / n_bytes


def metrics_fn(outputs: Any, batch: dict[str, torch.Tensor], *, byte_lengths: torch.Tensor
               ) -> MetricSums:
    """``{"loss": (CE sum, predicted tokens), "nats_per_byte": (CE sum, their bytes)}``.

    The cross entropy (nats, summed in float32) is of ``outputs.logits[:, :-1]`` (``[B, T-1, V]``)
    against ``batch["labels"][:, 1:]``, skipping labels of -100; ``byte_lengths`` is int64
    ``[V]`` (:func:`token_byte_lengths`). All four numbers are python floats.
    """
    logits = outputs.logits[:, :-1].detach().float()
    target = batch["labels"][:, 1:]
    keep = target != IGNORE_INDEX
    ce = F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=IGNORE_INDEX,
                         reduction="sum")
    n_bytes = byte_lengths.to(target.device)[target[keep]].sum()
    return {"loss": (float(ce), float(keep.sum())), "nats_per_byte": (float(ce), float(n_bytes))}


# ---------------------------------------------------------------- model


def build_model(m: ModelConfig, vocab_size: int, block_size: int, eot_id: int) -> GPT2LMHeadModel:
    """A randomly initialised ``GPT2LMHeadModel`` (weights from the default torch RNG; the LM
    head is tied to the token embedding, as in GPT-2) with ``n_positions = block_size``."""
    config = GPT2Config(
        vocab_size=vocab_size,
        n_positions=block_size,
        n_embd=m.n_embd,
        n_layer=m.n_layer,
        n_head=m.n_head,
        resid_pdrop=m.dropout,
        embd_pdrop=m.dropout,
        attn_pdrop=m.dropout,
        bos_token_id=eot_id,
        eos_token_id=eot_id,
        pad_token_id=eot_id,
        # CPU: eager, as fast as sdpa at this size (head_dim 32, 128 positions), and one code
        # path in training and evaluation where sdpa picks a kernel by mode and hardware; CUDA:
        # sdpa (flash attention; eager materialises every [T, T] attention matrix)
        attn_implementation="sdpa" if torch.cuda.is_available() else "eager",
    )
    model = GPT2LMHeadModel(config)
    # the class name does not say "ForCausalLM", so transformers warns once per process that it
    # falls back to that loss; name it (same loss) to keep every rank's log quiet
    model.loss_type = "ForCausalLM"
    return model


# ---------------------------------------------------------------- build


def _check(cfg: Config) -> None:
    data, model = cfg.data, cfg.model
    if data.block_size < 2:  # one window must hold a context token and a predicted one
        raise ConfigError(f"data.block_size: must be >= 2, got {data.block_size!r}")
    if data.vocab_size < N_BYTE_TOKENS + 1:
        raise ConfigError(f"data.vocab_size: must be >= {N_BYTE_TOKENS + 1} (256 byte tokens "
                          f"and {EOT}), got {data.vocab_size!r}")
    if not data.corpus_modules:
        raise ConfigError("data.corpus_modules: must name at least one module")
    check_split_fractions(data.val_fraction, data.test_fraction)
    check_gpt_config(model)


def build(cfg: Config) -> TaskBundle:
    """Build the causal_lm task: corpus and split as char_lm, BPE tokenizer trained on train,
    token windows, GPT-2 model and metrics.

    Raises:
        ConfigError: a bad config value, or a split too short for one window.
    """
    _check(cfg)
    data = cfg.data
    modules = tuple(data.corpus_modules)
    corpus = configured_corpus(modules)
    bounds = split_bounds(len(corpus), data.val_fraction, data.test_fraction)
    texts = {name: corpus[lo:hi] for name, (lo, hi) in bounds.items()}
    tok = train_tokenizer(texts["train"], data.vocab_size)
    ids = {name: encode(tok, text) for name, text in texts.items()}
    splits = {name: TokenWindows(x, data.block_size) for name, x in ids.items()}
    for name, ds in splits.items():
        if len(ds) == 0:
            raise ConfigError(f"data.block_size: the {name} split has {len(ids[name])} tokens, "
                              f"fewer than one window of {data.block_size}")

    eot_id = tok.token_to_id(EOT)
    byte_lengths = token_byte_lengths(tok)
    train_bytes = texts["train"].encode("utf-8")
    model = build_model(cfg.model, tok.get_vocab_size(), data.block_size, eot_id)
    return TaskBundle(
        model=model,
        train=splits["train"],
        val=splits["val"],
        test=splits["test"],
        metrics_fn=functools.partial(metrics_fn, byte_lengths=byte_lengths),
        tokenizer=wrap_tokenizer(tok, data.block_size),
        param_groups=weight_decay_groups,
        tokens_per_sample=data.block_size,
        artifacts={
            "tokenizer_sha256": tokenizer_sha256(tok),
            "vocab_size": tok.get_vocab_size(),
            "eot_token": EOT,
            "eot_token_id": eot_id,
            "block_size": data.block_size,
            "corpus_modules": list(modules),
            "python_version": platform.python_version(),
            "tokenizers_version": tokenizers.__version__,
            "transformers_version": transformers.__version__,
            "corpus_sha256": hashlib.sha256(corpus.encode("utf-8")).hexdigest(),
            "corpus_chars": len(corpus),
            "corpus_bytes": len(corpus.encode("utf-8")),
            "split_chars": {name: len(text) for name, text in texts.items()},
            "split_tokens": {name: len(x) for name, x in ids.items()},
            # context-free baselines on the train split, in nats per byte: a language model's
            # val_nats_per_byte should end well below both
            "byte_unigram_nats_per_byte": byte_unigram_entropy(train_bytes),
            "token_unigram_nats_per_byte": token_unigram_nats_per_byte(
                ids["train"], len(train_bytes)),
        },
    )
