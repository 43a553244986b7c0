"""The interface between the runner and a task (built-in or user-supplied).

A task is a function ``build(cfg: Config) -> TaskBundle`` named in the config as
``task: package.module:build`` (importable from ``PYTHONPATH`` or installed; an installed package
can also register a short name in the ``elastic_runner.tasks`` entry-point group). Its module
may define ``DataConfig`` and ``ModelConfig`` pydantic models (subclassing
:class:`elastic_runner.config.DataConfig` / :class:`~elastic_runner.config.ModelConfig`); the
config loader then validates the ``data`` and ``model`` sections against them and passes
instances in ``cfg``.

``build`` is called once per rank and process start, after the global torch seed is set to
``cfg.seed``, so a model built from the default RNG has the same initial weights on every rank.
It must be deterministic: the same config gives the same splits on every rank and every restart.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from elastic_runner.config import ConfigError

# (sum, count): metric value = sum / count after summing both over ranks, so a sharded
# evaluation equals the single-process one exactly.
MetricSums = dict[str, tuple[float, float]]


@dataclass
class TaskBundle:
    """What a task hands to the runner.

    Attributes:
        model: the module to train (unwrapped; the runner wraps it in DDP).
        train, val, test: map-style datasets; ``ds[i]`` returns ``(inputs, targets)`` tensors.
            Batches are collated with the default collate function (stacked along dim 0).
        loss_fn: ``loss_fn(outputs, targets) -> scalar tensor``, the mean loss of a micro-batch.
        metrics_fn: ``metrics_fn(outputs, targets) -> {name: (sum, count)}`` for one batch, e.g.
            ``{"loss": (sum of per-sample losses, n), "accuracy": (n_correct, n)}``. Validation
            reports each as ``val_<name>``; ``evaluate`` as ``test_<name>``.
        artifacts: JSON-serialisable preprocessing needed to use the model outside the runner
            (vocabulary, normalisation); written by ``export``.
        sample_fn: optional ``sample_fn(model, prompt: str, max_new_tokens: int, seed: int) -> str``
            for generative tasks (``elastic-runner generate``).
        tokens_per_sample: tokens in one training sample, for language-model tasks (exported as
            ``elastic_runner_tokens_total`` and ``_tokens_per_second``); None otherwise.
    """

    model: nn.Module
    train: Dataset
    val: Dataset
    test: Dataset
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    metrics_fn: Callable[[torch.Tensor, torch.Tensor], MetricSums]
    artifacts: dict[str, Any] = field(default_factory=dict)
    sample_fn: Callable[..., str] | None = None
    tokens_per_sample: int | None = None


def check_split_fractions(val_fraction: float, test_fraction: float) -> None:
    """Raise :class:`ConfigError` unless both fractions are in (0, 1) and leave a train split."""
    for key, frac in (("val_fraction", val_fraction), ("test_fraction", test_fraction)):
        if not 0.0 < frac < 1.0:
            raise ConfigError(f"data.{key}: must be in (0, 1), got {frac!r}")
    if val_fraction + test_fraction >= 1.0:
        raise ConfigError(
            "data.val_fraction + data.test_fraction: must be < 1 to leave a training split, "
            f"got {val_fraction + test_fraction!r}"
        )


@torch.no_grad()
def metric_sums(model: nn.Module, loader: Any, metrics_fn: Callable[..., MetricSums],
                device: torch.device, dtype: torch.dtype | None = None,
                max_batches: int | None = None) -> MetricSums:
    """``{name: (sum, count)}`` of ``metrics_fn`` over ``loader``'s ``(inputs, targets)``
    batches (at most ``max_batches``), with the model in eval mode and autocast to ``dtype``
    when given; the model's train/eval mode is restored afterwards."""
    sums: dict[str, tuple[float, float]] = {}
    was_training = model.training
    model.eval()
    try:
        for i, (x, y) in enumerate(loader):
            if max_batches is not None and i >= max_batches:
                break
            x, y = x.to(device), y.to(device)
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                out = model(x)
            for name, (s, c) in metrics_fn(out.float(), y).items():
                s0, c0 = sums.get(name, (0.0, 0.0))
                sums[name] = (s0 + s, c0 + c)
    finally:
        model.train(was_training)
    return sums
