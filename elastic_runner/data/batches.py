"""Batches as users have them: a tensor, a tuple/list or a mapping of tensors (nested).

One calling convention, used by training (:class:`~elastic_runner.trainer.engine.StepEngine`),
evaluation and your own loop:

=============================  ==========================  =====================================
batch                          forward                     loss
=============================  ==========================  =====================================
mapping (``dict``,             ``model(**batch)``          ``loss_fn(outputs, batch)``, or
``BatchEncoding``)                                         ``outputs.loss`` without ``loss_fn``
2-tuple/list ``(x, y)``        ``model(x)``                ``loss_fn(outputs, y)``
other tuple/list               ``model(*batch)``           ``loss_fn(outputs, batch)`` or
                                                           ``outputs.loss``
tensor                         ``model(batch)``            ``loss_fn(outputs, batch)`` or
                                                           ``outputs.loss``
=============================  ==========================  =====================================

``outputs.loss`` is an attribute or a ``"loss"`` key (a Hugging Face ``ModelOutput`` has both).
:func:`check_samples` rejects anything else when the trainer is built, with a
:class:`~elastic_runner.config.ConfigError` (exit code 2) that names what it got.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, default_collate

from .. import nested
from ..config_base import ConfigError

MetricSums = dict[str, tuple[float, float]]
Collate = Callable[[list[Any]], Any]
_CONTAINERS = (Mapping, list, tuple)  # what a batch nests: any mapping (a BatchEncoding too)


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor moved to ``device`` (``non_blocking``), same nesting and
    container types (mappings, lists, tuples, namedtuples; a mapping type that cannot be
    rebuilt from a dict becomes a dict); any other value is kept."""
    def move(_: nested.Path, v: Any) -> Any:
        return v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v

    return nested.map_leaves(move, batch, into=_CONTAINERS)


def _is_pair(batch: Any) -> bool:
    return isinstance(batch, list | tuple) and len(batch) == 2


def forward(model: nn.Module, batch: Any) -> Any:
    """The model's outputs on ``batch``, called as the table in the module docstring says."""
    if isinstance(batch, Mapping):
        return model(**batch)
    if _is_pair(batch):
        return model(batch[0])
    if isinstance(batch, list | tuple):
        return model(*batch)
    return model(batch)


def targets(batch: Any) -> Any:
    """What ``loss_fn`` and ``metrics_fn`` get besides the outputs: ``y`` of an ``(x, y)``
    pair, else the whole batch."""
    return batch[1] if _is_pair(batch) else batch


def output_loss(outputs: Any) -> torch.Tensor:
    """``outputs.loss`` (attribute or ``"loss"`` key).

    Raises:
        ConfigError: the outputs carry no loss (a task without ``loss_fn`` whose model does
            not compute its loss, e.g. a Hugging Face model given no ``labels``).
    """
    loss = outputs.get("loss") if isinstance(outputs, Mapping) else getattr(outputs, "loss", None)
    if loss is None:
        raise ConfigError(
            f"the task has no loss_fn and the model's output ({type(outputs).__name__}) has no "
            "'loss': give the task a loss_fn, or batches the model computes its loss from "
            "(e.g. a 'labels' key for a transformers model)")
    return loss


def batch_loss(model: nn.Module, batch: Any, loss_fn: Callable[..., torch.Tensor] | None
               ) -> torch.Tensor:
    """The mean loss of one micro-batch (scalar tensor): ``loss_fn(outputs, targets(batch))``,
    or ``outputs.loss`` when ``loss_fn`` is None."""
    outputs = forward(model, batch)
    return loss_fn(outputs, targets(batch)) if loss_fn is not None else output_loss(outputs)


def batch_size(batch: Any) -> int:
    """Samples in ``batch``: the length of dim 0 of its first tensor (0 when it has none)."""
    for _, t in nested.tensors(batch, _CONTAINERS):
        n = int(t.shape[0]) if t.dim() else 1
        if n:
            return n
    return 0


def loss_metrics(outputs: Any, batch: Any, loss_fn: Callable[..., torch.Tensor] | None
                 ) -> MetricSums:
    """The default ``metrics_fn``: ``{"loss": (mean loss x samples, samples)}``, i.e. the
    sample-weighted mean of the per-batch loss."""
    loss = loss_fn(outputs, targets(batch)) if loss_fn is not None else output_loss(outputs)
    n = float(batch_size(batch))
    return {"loss": (float(loss.detach().float()) * n, n)}


# ---------------------------------------------------------------- checks at build time


def describe(value: Any) -> str:
    """A short description of a sample or batch for error messages: its type, and for a
    tensor its dtype and shape."""
    if isinstance(value, torch.Tensor):
        return f"tensor {str(value.dtype).removeprefix('torch.')} {tuple(value.shape)}"
    text = repr(value)
    return f"{type(value).__module__}.{type(value).__qualname__} ({text[:60]}" \
           f"{'...' if len(text) > 60 else ''})"


def _non_tensor_leaf(batch: Any, path: str) -> tuple[str, Any] | None:
    """The first leaf of ``batch`` that is not a tensor, as (key path, value)."""
    for keys, v in nested.leaves(batch, _CONTAINERS):
        if not isinstance(v, torch.Tensor):
            return path + "".join(f"[{k!r}]" for k in keys), v
    return None


def check_samples(dataset: Dataset, split: str, collate_fn: Collate | None, task: str) -> None:
    """Check that ``dataset``'s samples and their collated batches follow the convention.

    A sample must be a tensor, a tuple/list or a mapping; the batch that ``collate_fn``
    (default: ``torch.utils.data.default_collate``) makes of two samples must hold only tensors.

    Raises:
        ConfigError: naming the task, the split, the key path and what was found.
    """
    if len(dataset) == 0:  # type: ignore[arg-type]
        raise ConfigError(f"task {task}: the {split} split is empty")
    sample = dataset[0]
    allowed = ("a sample must be a tensor, a tuple/list (inputs, targets) or a mapping of "
               "tensors (passed as model(**batch))")
    if not isinstance(sample, torch.Tensor | list | tuple | Mapping):
        raise ConfigError(f"task {task}: {split}[0] is {describe(sample)}; {allowed}")
    samples = [sample, dataset[min(1, len(dataset) - 1)]]  # type: ignore[arg-type]
    try:
        batch = (collate_fn or default_collate)(samples)
    except Exception as e:  # noqa: BLE001 - any collate failure is the task's input error
        raise ConfigError(f"task {task}: collating {split}[0:2] failed ({type(e).__name__}: "
                          f"{e}); {allowed}, or give the task a collate_fn") from e
    bad = _non_tensor_leaf(batch, "batch")
    if bad:
        raise ConfigError(f"task {task}: the collated {split} {bad[0]} is {describe(bad[1])}, "
                          "not a tensor; drop it from the samples or convert it in collate_fn")
