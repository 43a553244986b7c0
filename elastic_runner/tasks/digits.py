"""Built-in task ``digits``: 10-class classification of the UCI 8x8 handwritten digits.

The data (1797 grey-scale images, pixel values 0..16, UCI "optdigits" test set, as scikit-learn
ships it) is carried in the package (:data:`DIGITS_FILE`), so the task works offline. The split
is a random permutation drawn from a numpy ``Generator`` seeded with ``cfg.seed``, identical on
every rank and restart. Inputs are standardised with one scalar mean/std computed on the
training split only.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from ..config import Config
from ..config_base import ConfigError
from ..data.config import DataConfig as BaseDataConfig
from ..train.config import ModelConfig as BaseModelConfig
from .base import MetricSums, TaskBundle, check_split_fractions

DIGITS_FILE = Path(__file__).parent / "data" / "digits.csv.gz"
"""1,797 rows of 65 integers: 64 pixels (0..16, row-major 8x8), then the label (0..9)."""

NUM_CLASSES = 10
IMAGE_SHAPE = (1, 8, 8)  # (channels, height, width)


class DataConfig(BaseDataConfig):
    """``data:`` section. Fractions are of all 1797 samples; train gets the rest."""

    val_fraction: float = 0.15
    """The validation split's share of the 1797 samples (a seeded random split)."""
    test_fraction: float = 0.15
    """The test split's share of the 1797 samples."""


class ModelConfig(BaseModelConfig):
    """``model:`` section of :class:`DigitsCNN`."""

    channels: int = 32
    """First conv layer's output channels; the second has 2x."""
    hidden: int = 128
    """Width of the hidden fully connected layer."""
    dropout: float = 0.1
    """Dropout probability before the first linear layer."""


class DigitsCNN(nn.Module):
    """Small CNN: conv3x3(1->c) ReLU, conv3x3(c->2c) ReLU, maxpool2, dropout, fc(hidden), fc(10).

    Input: float32 ``[B, 1, 8, 8]`` standardised pixels. Output: float32 logits ``[B, 10]``.
    """

    def __init__(self, channels: int = 32, hidden: int = 128, dropout: float = 0.1) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, channels, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.Conv2d(channels, 2 * channels, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),  # [B, 2c, 4, 4]
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Dropout(dropout),
            nn.Linear(2 * channels * 4 * 4, hidden),
            nn.ReLU(),
            nn.Linear(hidden, NUM_CLASSES),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def split_indices(
    n: int, val_fraction: float, test_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Disjoint (train, val, test) int64 index arrays covering ``range(n)``.

    Val and test get ``round(fraction * n)`` samples each, train the rest; membership is a
    permutation from ``np.random.default_rng(seed)``, so it depends only on the arguments.
    """
    n_val = int(round(val_fraction * n))
    n_test = int(round(test_fraction * n))
    n_train = n - n_val - n_test
    perm = np.random.default_rng(seed).permutation(n)
    return perm[:n_train], perm[n_train : n_train + n_val], perm[n_train + n_val :]


def _check(cfg: Config) -> None:
    data, model = cfg.data, cfg.model
    check_split_fractions(data.val_fraction, data.test_fraction)
    for key in ("channels", "hidden"):
        if getattr(model, key) < 1:
            raise ConfigError(f"model.{key}: must be >= 1, got {getattr(model, key)!r}")
    if not 0.0 <= model.dropout < 1.0:
        raise ConfigError(f"model.dropout: must be in [0, 1), got {model.dropout!r}")


def loss_fn(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy (nats) of logits ``[B, 10]`` against int64 labels ``[B]``."""
    return F.cross_entropy(outputs.float(), targets)


def metrics_fn(outputs: torch.Tensor, targets: torch.Tensor) -> MetricSums:
    """``{"loss": (sum of per-sample CE in nats, n), "accuracy": (n correct, n)}`` as floats."""
    outputs = outputs.detach().float()
    n = float(targets.numel())
    loss_sum = F.cross_entropy(outputs, targets, reduction="sum").item()
    correct = (outputs.argmax(dim=-1) == targets).sum().item()
    return {"loss": (float(loss_sum), n), "accuracy": (float(correct), n)}


def load_digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """The UCI handwritten digits as scikit-learn's ``load_digits`` gives them: images float64
    ``[1797, 8, 8]`` (0..16) and labels int64 ``[1797]``.

    Read from ``tasks/data/digits.csv.gz`` (per row the 64 pixels, then the label), a copy of
    the file scikit-learn ships (``sklearn/datasets/data/digits.csv.gz``, BSD-3-Clause; the data:
    E. Alpaydin and C. Kaynak, "Optical Recognition of Handwritten Digits", UCI Machine Learning
    Repository, 1998, CC BY 4.0, its test set). The task needs no scikit-learn, whose import
    (scipy) took 0.8 s of every worker's and spare's start here;
    ``tests/test_tasks.py`` checks the copy against ``load_digits`` bit for bit.
    """
    data = np.loadtxt(DIGITS_FILE, delimiter=",")
    return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(np.int64)


def build(cfg: Config) -> TaskBundle:
    """Build the digits task: splits, CNN (from the default torch RNG) and metrics.

    Datasets yield ``(x, y)``: x float32 ``[1, 8, 8]`` standardised pixels, y int64 scalar label.
    """
    _check(cfg)
    images, labels = load_digits_arrays()
    train_idx, val_idx, test_idx = split_indices(
        len(labels), cfg.data.val_fraction, cfg.data.test_fraction, cfg.seed
    )
    for name, idx in (("train", train_idx), ("val", val_idx), ("test", test_idx)):
        if len(idx) == 0:
            raise ConfigError(f"data: the {name} split of {len(labels)} samples is empty")
    mean = float(images[train_idx].mean())
    std = float(images[train_idx].std())

    def make(idx: np.ndarray) -> TensorDataset:
        x = ((images[idx] - mean) / std).astype(np.float32)[:, None, :, :]
        return TensorDataset(torch.from_numpy(x), torch.from_numpy(labels[idx].copy()))

    m = cfg.model
    return TaskBundle(
        model=DigitsCNN(channels=m.channels, hidden=m.hidden, dropout=m.dropout),
        train=make(train_idx),
        val=make(val_idx),
        test=make(test_idx),
        loss_fn=loss_fn,
        metrics_fn=metrics_fn,
        artifacts={
            "input_shape": list(IMAGE_SHAPE),
            "mean": mean,
            "std": std,
            "classes": list(range(NUM_CLASSES)),
            "split_seed": cfg.seed,
        },
    )
