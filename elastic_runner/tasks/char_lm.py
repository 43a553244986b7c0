"""Built-in task ``char_lm``: a small GPT-style character-level language model.

The corpus is the source code of a fixed list of pure-Python standard-library modules,
concatenated in list order (about 1.1 M characters on CPython 3.11), so the task needs no
download and uses real text nobody in this project wrote. Its exact contents depend on the Python
version; ``artifacts`` records the version, the corpus length and its sha256.

The corpus is split contiguously (train = first part, then val, then test). The vocabulary is the
sorted set of characters (Unicode code points, not bytes) of the whole corpus, so val and test
contain no unknown characters. Each split is cut into non-overlapping windows of ``block_size``
characters; the model (nanoGPT-style: learned positional embeddings, pre-LN blocks, causal
``scaled_dot_product_attention``, 4x MLP, untied output head) predicts the next character at
every position.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import math
import platform
from collections import Counter
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn
from torch.utils.data import Dataset

from ..config import Config
from ..config_base import ConfigError
from ..data.config import DataConfig as BaseDataConfig
from ..train.config import ModelConfig as BaseModelConfig
from .base import MetricSums, TaskBundle, check_split_fractions

DEFAULT_CORPUS_MODULES: tuple[str, ...] = (
    "argparse",
    "difflib",
    "inspect",
    "pathlib",
    "textwrap",
    "typing",
    "dataclasses",
    "enum",
    "functools",
    "collections",
    "tarfile",
    "zipfile",
    "logging",
    "email.message",
    "unittest.case",
)

SAMPLE_TEMPERATURE = 0.8
SAMPLE_TOP_K = 20


class DataConfig(BaseDataConfig):
    """``data:`` section. Fractions are of the corpus length in characters."""

    block_size: int = 128
    """Characters per training window = model context length."""
    corpus_modules: list[str] = Field(default_factory=lambda: list(DEFAULT_CORPUS_MODULES))
    """The standard-library modules whose source text is the corpus."""
    val_fraction: float = 0.05
    """The validation split's share of the corpus (the end of the text before the test split)."""
    test_fraction: float = 0.05
    """The test split's share of the corpus (the end of the text)."""


class ModelConfig(BaseModelConfig):
    """``model:`` section of :class:`CharGPT`."""

    n_layer: int = 2
    """Transformer blocks."""
    n_head: int = 4
    """Attention heads; must divide n_embd."""
    n_embd: int = 128
    """Residual stream width."""
    dropout: float = 0.0
    """On embeddings, attention weights and residual branches."""


# ---------------------------------------------------------------- corpus


def module_source_path(name: str) -> Path:
    """Path of the ``.py`` source of importable module ``name`` (also for frozen stdlib modules).

    Raises:
        ValueError: the module cannot be found or has no Python source file.
    """
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError) as e:
        raise ValueError(f"cannot find module {name!r}: {e}") from e
    if spec is None:
        raise ValueError(f"cannot find module {name!r}")
    origin = spec.origin
    if origin == "frozen":  # e.g. os, abc on 3.11: the source file is still installed
        origin = getattr(spec.loader_state, "filename", None)
    if not origin or not origin.endswith(".py") or not Path(origin).is_file():
        raise ValueError(f"module {name!r} has no Python source file (origin {spec.origin!r})")
    return Path(origin)


@functools.lru_cache(maxsize=4)
def load_corpus(modules: tuple[str, ...]) -> str:
    """Concatenated source text (UTF-8, newlines normalised to ``\\n``) of ``modules``, in order.

    Raises:
        ValueError: a module cannot be found or has no Python source file.
    """
    return "".join(module_source_path(m).read_text(encoding="utf-8") for m in modules)


def unigram_entropy(text: str) -> float:
    """Entropy in nats of the character unigram distribution of ``text`` (0.0 when empty).

    The cross entropy of a model that ignores context; a language model should go below it.
    """
    n = len(text)
    if n == 0:
        return 0.0
    counts = np.fromiter(Counter(text).values(), dtype=np.float64)
    p = counts / n
    return float(-(p * np.log(p)).sum())


def encode(text: str, vocab: str) -> torch.Tensor:
    """int64 ``[len(text)]`` indices of the characters of ``text`` in the sorted string ``vocab``.

    Every character of ``text`` must be in ``vocab``.
    """
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    table = np.frombuffer(vocab.encode("utf-32-le"), dtype=np.uint32)
    idx = np.searchsorted(table, codes)
    if len(codes) and (idx.max() >= len(table) or not np.array_equal(table[idx], codes)):
        raise ValueError("text contains characters outside the vocabulary")
    return torch.from_numpy(idx.astype(np.int64))


class CharWindows(Dataset):
    """Non-overlapping next-character windows over an encoded split.

    Item ``i`` is ``(x, y)``, both int64 ``[block_size]``: ``x = data[i*B : i*B+B]`` and
    ``y = data[i*B+1 : i*B+B+1]`` (B = block_size). ``len = (len(data) - 1) // B``.
    """

    def __init__(self, data: torch.Tensor, block_size: int) -> None:
        self.data = data
        self.block_size = block_size

    def __len__(self) -> int:
        return max(0, (len(self.data) - 1) // self.block_size)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"window {i} out of range for {n} windows")
        start = i * self.block_size
        chunk = self.data[start : start + self.block_size + 1]
        return chunk[:-1], chunk[1:]


# ---------------------------------------------------------------- model


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: float ``[B, T, C]`` -> ``[B, T, C]``."""

    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.n_head = n_head
        self.dropout = dropout
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )  # [B, H, T, C/H]
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_dropout(self.proj(y))


class Block(nn.Module):
    """Pre-LN transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``; ``[B, T, C]``."""

    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd),
            nn.GELU(),
            nn.Linear(4 * n_embd, n_embd),
            nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class CharGPT(nn.Module):
    """GPT decoder over characters: int64 indices ``[B, T]`` (T <= block_size) -> float logits
    ``[B, T, vocab_size]`` for the next character at each position.

    The output head is untied from the token embedding, so no two parameters share storage
    (plain safetensors ``save_file``/``load_file`` work too). Initialisation follows GPT-2: N(0, 0.02), residual output
    projections scaled by ``1/sqrt(2 * n_layer)``; it draws from the default torch RNG.
    """

    def __init__(
        self,
        vocab_size: int,
        block_size: int,
        n_layer: int = 2,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("attn.proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {self.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


# ---------------------------------------------------------------- loss, metrics, sampling


def loss_fn(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy (nats per character) of logits ``[B, T, V]`` vs int64 ``[B, T]``."""
    return F.cross_entropy(outputs.float().flatten(0, -2), targets.flatten())


def metrics_fn(outputs: torch.Tensor, targets: torch.Tensor) -> MetricSums:
    """``{"loss": (sum of per-token CE in nats, number of tokens)}`` as python floats."""
    loss_sum = F.cross_entropy(
        outputs.detach().float().flatten(0, -2), targets.flatten(), reduction="sum"
    ).item()
    return {"loss": (float(loss_sum), float(targets.numel()))}


@torch.no_grad()
def sample(
    model: nn.Module,
    prompt: str,
    max_new_tokens: int,
    seed: int,
    *,
    vocab: str,
    block_size: int,
    temperature: float = SAMPLE_TEMPERATURE,
    top_k: int | None = SAMPLE_TOP_K,
) -> str:
    """Continue ``prompt`` by ``max_new_tokens`` sampled characters; returns prompt + new text.

    Prompt characters outside ``vocab`` are dropped from the model's context (the returned
    string still starts with the prompt as given); an empty context starts from ``"\\n"``.
    The context is cropped to the last ``block_size`` characters. Sampling uses softmax with
    ``temperature`` over the ``top_k`` most likely characters (all when None), drawn with a
    CPU ``torch.Generator`` seeded with ``seed``, so it does not touch the global RNG. The model
    runs in eval mode; its previous training mode is restored afterwards.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    stoi = {ch: i for i, ch in enumerate(vocab)}
    context = [stoi[ch] for ch in prompt if ch in stoi]
    if not context:
        context = [stoi.get("\n", 0)]
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    was_training = model.training
    model.eval()
    out: list[str] = []
    try:
        for _ in range(max_new_tokens):
            idx = torch.tensor([context[-block_size:]], dtype=torch.long, device=device)
            logits = model(idx)[0, -1].float().cpu() / temperature  # [V]
            if top_k is not None and top_k < logits.numel():
                kth = torch.topk(logits, top_k).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen))
            context.append(nxt)
            out.append(vocab[nxt])
    finally:
        model.train(was_training)
    return prompt + "".join(out)


# ---------------------------------------------------------------- build


def configured_corpus(modules: tuple[str, ...]) -> str:
    """:func:`load_corpus` of ``data.corpus_modules``.

    Raises:
        ConfigError: naming ``data.corpus_modules[i]`` when a module has no source file.
    """
    for i, name in enumerate(modules):
        try:
            module_source_path(name)
        except ValueError as e:
            raise ConfigError(f"data.corpus_modules[{i}]: {e}") from e
    return load_corpus(modules)


def _check(cfg: Config) -> None:
    data = cfg.data
    if data.block_size < 1:
        raise ConfigError(f"data.block_size: must be >= 1, got {data.block_size!r}")
    if not data.corpus_modules:
        raise ConfigError("data.corpus_modules: must name at least one module")
    check_split_fractions(data.val_fraction, data.test_fraction)
    check_gpt_config(cfg.model)


def check_gpt_config(model: ModelConfig) -> None:
    """Raise :class:`ConfigError` naming the ``model.*`` key of a GPT config (``n_layer``,
    ``n_head``, ``n_embd``, ``dropout``) that cannot build a model."""
    for key in ("n_layer", "n_head", "n_embd"):
        if getattr(model, key) < 1:
            raise ConfigError(f"model.{key}: must be >= 1, got {getattr(model, key)!r}")
    if model.n_embd % model.n_head:
        raise ConfigError(
            f"model.n_embd: must be divisible by model.n_head ({model.n_head}), got {model.n_embd}"
        )
    if not 0.0 <= model.dropout < 1.0:
        raise ConfigError(f"model.dropout: must be in [0, 1), got {model.dropout!r}")


def build(cfg: Config) -> TaskBundle:
    """Build the char_lm task: corpus, contiguous splits, vocabulary, model and sampler.

    Datasets yield ``(x, y)`` int64 ``[block_size]`` character indices, y shifted by one.
    """
    _check(cfg)
    data = cfg.data
    modules = tuple(data.corpus_modules)
    corpus = configured_corpus(modules)
    vocab = "".join(sorted(set(corpus)))
    n = len(corpus)
    n_val = int(round(data.val_fraction * n))
    n_test = int(round(data.test_fraction * n))
    n_train = n - n_val - n_test
    encoded = encode(corpus, vocab)
    bounds = {
        "train": (0, n_train),
        "val": (n_train, n_train + n_val),
        "test": (n_train + n_val, n),
    }
    splits = {}
    for name, (lo, hi) in bounds.items():
        splits[name] = CharWindows(encoded[lo:hi].clone(), data.block_size)
        if len(splits[name]) == 0:
            raise ConfigError(
                f"data: the {name} split ({hi - lo} characters) is shorter than "
                f"data.block_size + 1 = {data.block_size + 1}"
            )

    m = cfg.model
    model = CharGPT(
        vocab_size=len(vocab),
        block_size=data.block_size,
        n_layer=m.n_layer,
        n_head=m.n_head,
        n_embd=m.n_embd,
        dropout=m.dropout,
    )
    return TaskBundle(
        model=model,
        train=splits["train"],
        val=splits["val"],
        test=splits["test"],
        loss_fn=loss_fn,
        metrics_fn=metrics_fn,
        tokens_per_sample=data.block_size,
        artifacts={
            "vocab": vocab,
            "block_size": data.block_size,
            "corpus_modules": list(modules),
            "python_version": platform.python_version(),
            "corpus_sha256": hashlib.sha256(corpus.encode("utf-8")).hexdigest(),
            "corpus_chars": n,
            "unigram_entropy_nats": unigram_entropy(corpus[:n_train]),
        },
        sample_fn=functools.partial(sample, vocab=vocab, block_size=data.block_size),
    )
