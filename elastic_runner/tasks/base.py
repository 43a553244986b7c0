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

import hashlib
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import fsspec
import torch
from torch import nn
from torch.utils.data import Dataset

from ..checkpoint.storage import CheckpointError
from ..config import Config, build_key
from ..config_base import ConfigError
from ..data.batches import forward, loss_metrics, targets, to_device
from ..dist import broadcast_object, current_rank

# (sum, count): metric value = sum / count after summing both over ranks, so a sharded
# evaluation equals the single-process one exactly.
MetricSums = dict[str, tuple[float, float]]


@dataclass
class TaskBundle:
    """What a task hands to the runner.

    Attributes:
        model: the module to train (unwrapped; the runner wraps it in DDP or shards it with
            FSDP2). A ``transformers.PreTrainedModel`` is exported in its ``save_pretrained``
            layout.
        train, val, test: map-style datasets. ``ds[i]`` is a tensor, a tuple/list or a mapping
            of tensors (nested); see :mod:`elastic_runner.data.batches` for how each is passed to
            the model: an ``(inputs, targets)`` pair as ``model(inputs)``, a mapping as
            ``model(**batch)``.
        loss_fn: ``loss_fn(outputs, targets) -> scalar tensor``, the mean loss of a micro-batch;
            ``targets`` is ``y`` of an ``(x, y)`` pair, else the whole batch. None: the model
            computes it (``outputs.loss``, e.g. a transformers model given ``labels``).
        metrics_fn: ``metrics_fn(outputs, targets) -> {name: (sum, count)}`` for one batch
            (``targets`` as for ``loss_fn``), e.g. ``{"loss": (sum of per-sample losses, n),
            "accuracy": (n_correct, n)}``. Validation reports each as ``val_<name>``;
            ``evaluate`` as ``test_<name>``. None: ``{"loss": (mean loss x samples, samples)}``.
        collate_fn: ``collate_fn(list of samples) -> batch`` for training and evaluation (e.g.
            ``transformers.DataCollatorWithPadding(tokenizer)`` for dynamic padding). None:
            ``torch.utils.data.default_collate`` (stacked along dim 0).
        tokenizer: exported beside the model: any object with ``save_pretrained(dir)`` (a
            transformers tokenizer) or a ``tokenizers.Tokenizer``; None for tasks without one.
        param_groups: ``param_groups(model) -> list of dicts`` for the configured optimizer
            (``optimizer.name``); a group's own keys (e.g. ``"weight_decay": 0.0``) override the
            config's. See :func:`weight_decay_groups`. None: one group of all parameters.
        optimizer_fn: ``optimizer_fn(model) -> torch.optim.Optimizer``: the task's own
            optimizer, replacing the ``optimizer`` section and ``param_groups``.
        scheduler_fn: ``scheduler_fn(optimizer, total_steps) -> LRScheduler`` stepped once per
            optimizer step (e.g. ``transformers.get_linear_schedule_with_warmup``), replacing
            the ``schedule`` section; ``total_steps`` is the run's optimizer steps.
        artifacts: JSON-serialisable preprocessing needed to use the model outside the runner
            (vocabulary, normalisation); written by ``export``.
        sample_fn: optional ``sample_fn(model, prompt: str, max_new_tokens: int, seed: int) -> str``
            for generative tasks (``elastic-runner generate``); a transformers model with a
            tokenizer uses its own ``generate()`` without one.
        tokens_per_sample: tokens in one training sample, for language-model tasks (exported as
            ``elastic_runner_tokens_total`` and ``_tokens_per_second``); None otherwise.
        shard_units: ``shard_units(model) -> list of submodules`` that FSDP2 shards one by one
            (``distributed.strategy: fsdp``, ``distributed.fsdp.units``; the root takes the
            rest), e.g. ``lambda m: list(m.layers)``. None: the largest ``nn.ModuleList`` of
            modules of one type (see :func:`elastic_runner.parallel.fsdp.find_blocks`).
    """

    model: nn.Module
    train: Dataset
    val: Dataset
    test: Dataset
    loss_fn: Callable[..., torch.Tensor] | None = None
    metrics_fn: Callable[..., MetricSums] | None = None
    collate_fn: Callable[[list[Any]], Any] | None = None
    tokenizer: Any = None
    param_groups: Callable[[nn.Module], list[dict[str, Any]]] | None = None
    optimizer_fn: Callable[[nn.Module], torch.optim.Optimizer] | None = None
    scheduler_fn: Callable[[torch.optim.Optimizer, int],
                           torch.optim.lr_scheduler.LRScheduler] | None = None
    artifacts: dict[str, Any] = field(default_factory=dict)
    sample_fn: Callable[..., str] | None = None
    tokens_per_sample: int | None = None
    shard_units: Callable[[nn.Module], list[nn.Module]] | None = None


def weight_decay_groups(model: nn.Module, no_decay: Callable[[str, nn.Module], bool] | None = None
                        ) -> list[dict[str, Any]]:
    """Two parameter groups: weight decay on most weights, none (``weight_decay: 0.0``) on
    biases and normalisation weights, as Hugging Face's ``Trainer`` does
    (``Trainer.get_decay_parameter_names``: parameters of ``nn.LayerNorm`` modules and names
    matching ``bias``, ``layernorm``, ``rmsnorm``, ``norm``).

    Args:
        model: the module whose trainable parameters are grouped (each exactly once).
        no_decay: ``no_decay(parameter name, owning module) -> bool`` replacing that rule.

    Returns:
        ``[{"params": decayed}, {"params": not decayed, "weight_decay": 0.0}]`` (for
        ``TaskBundle.param_groups``); the first group takes the config's ``weight_decay``.
    """
    rule = no_decay or _hf_no_decay
    decay: list[nn.Parameter] = []
    keep: list[nn.Parameter] = []
    seen: set[int] = set()  # tied weights (an LM head sharing the embedding) count once
    for module_name, module in model.named_modules():
        for name, p in module.named_parameters(recurse=False):
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                full = f"{module_name}.{name}" if module_name else name
                (keep if rule(full, module) else decay).append(p)
    return [{"params": decay}, {"params": keep, "weight_decay": 0.0}]


_NO_DECAY_NAME = re.compile(r"bias|layernorm|rmsnorm|(?:^|\.)norm(?:$|\.)|_norm(?:$|\.)")


def _hf_no_decay(name: str, module: nn.Module) -> bool:
    return isinstance(module, nn.LayerNorm) or bool(_NO_DECAY_NAME.search(name.lower()))


ARTIFACTS_DIR = "task-artifacts"  # under checkpoint.dir
_ARTIFACT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


def job_artifact(cfg: Config, name: str, make: Callable[[], str]) -> str:
    """``make()``, computed once per job and identical on every rank and every restart.

    For what a task builds that cannot be made deterministic, e.g. a tokenizer trained with
    ``tokenizers`` (its BPE/WordPiece trainers break count ties in hash-map order, so two
    trainings on the same text can differ: huggingface/tokenizers#1794). Rank 0 reads
    ``{checkpoint.dir}/task-artifacts/{key}/{name}`` or, at the job's first start, runs
    ``make()`` and writes the file (atomically on a filesystem); then it broadcasts the text to
    the other ranks. ``key`` is :func:`~elastic_runner.config.build_key`: the task, seed, data
    and model sections, so a changed data config makes a new artifact while a changed learning
    rate reuses it. Without a process group (world size 1, ``export``, ``evaluate``) the process
    does the same alone. ``checkpoint.resume: false`` or ``--no-resume`` does not reuse a
    stored one.

    Args:
        cfg: the job's config (``checkpoint.dir``: local path or fsspec URL).
        name: file name (letters, digits, ``._-``; no path).
        make: returns the artifact as text (e.g. ``tokenizers.Tokenizer.to_str()``).

    Raises:
        ValueError: ``name`` is not a plain file name.
    """
    if not _ARTIFACT_NAME.fullmatch(name):
        raise ValueError(f"artifact name {name!r}: use letters, digits and ._- only")
    text: str | None = None
    if current_rank() == 0:
        key = build_key(cfg.to_dict())
        url = f"{cfg.checkpoint.dir.rstrip('/')}/{ARTIFACTS_DIR}/{key}/{name}"
        text = _read_or_make(url, make, reuse=cfg.checkpoint.resume)
    return broadcast_object(text)


def _read_or_make(url: str, make: Callable[[], str], reuse: bool) -> str:
    fs, path = fsspec.core.url_to_fs(url)
    if reuse and fs.exists(path):
        with fs.open(path, "r", encoding="utf-8") as f:
            return f.read()
    text = make()
    fs.makedirs(fs._parent(path), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with fs.open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    fs.mv(tmp, path)  # a rename on a filesystem: readers see the old or the new file
    return text


def task_fingerprint(bundle: TaskBundle) -> str:
    """A short digest of what ``build`` made, for checking that every rank built the same task:
    the split sizes, the first and last training samples and the tokenizer's vocabulary
    (``get_vocab()``, when it has one). Not the model: DDP broadcasts rank 0's weights."""
    h = hashlib.sha256()
    train = bundle.train
    for i in sorted({0, len(train) - 1}):  # type: ignore[arg-type]
        _digest(train[i], h)
    vocab = getattr(bundle.tokenizer, "get_vocab", None)
    tok = "-"
    if vocab is not None:
        tok = hashlib.sha256(repr(sorted(vocab().items())).encode()).hexdigest()[:12]
    sizes = "/".join(str(len(d)) for d in (bundle.train, bundle.val, bundle.test))  # type: ignore
    return f"splits {sizes}, samples {h.hexdigest()[:12]}, tokenizer {tok}"


def check_same_build(state: dict[str, Any], config: dict[str, Any], now: str, where: str
                     ) -> None:
    """Refuse a checkpoint whose task was built differently (other data or tokenizer: its
    stored :func:`task_fingerprint` is not ``now``) from the same task, seed, data and model
    config (:func:`~elastic_runner.config.build_key` of ``config``): its weights would meet
    other token ids or samples. Under another build config a difference is expected; not
    checked.

    Raises:
        CheckpointError: naming both builds.
    """
    stored = state.get("task_fingerprint")
    if stored is None or build_key(state.get("config", {})) != build_key(config):
        return
    if stored != now:
        raise CheckpointError(
            f"checkpoint {where} was trained on another build of the same task config "
            f"({stored}) than this process made ({now}): the task's build is not "
            "deterministic; keep what it trains or draws at random in "
            "elastic_runner.tasks.base.job_artifact")


def _digest(value: Any, h: Any) -> None:
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(value, Mapping):
        for k, v in value.items():
            h.update(repr(k).encode())
            _digest(v, h)
    elif isinstance(value, list | tuple):
        for v in value:
            _digest(v, h)
    else:
        h.update(repr(value).encode())


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
def metric_sums(model: nn.Module, loader: Any, metrics_fn: Callable[..., MetricSums] | None,
                device: torch.device, dtype: torch.dtype | None = None,
                max_batches: int | None = None,
                loss_fn: Callable[..., torch.Tensor] | None = None,
                pad_to: int | None = None, pad_batch: Callable[[], Any] | None = None
                ) -> MetricSums:
    """``{name: (sum, count)}`` of ``metrics_fn`` (default: the sample-weighted loss, see
    :func:`elastic_runner.data.batches.loss_metrics`) over ``loader``'s batches (at most
    ``max_batches``), with the model in eval mode and autocast to ``dtype`` when given; the
    model's train/eval mode is restored afterwards. Tensor outputs reach ``metrics_fn`` as
    float32. ``pad_to``: run that many forwards in all, the ones past the loader's on
    ``pad_batch()`` with their outputs discarded (a sharded model's forward is collective: every
    rank must run as many)."""
    sums: dict[str, tuple[float, float]] = {}
    was_training = model.training
    model.eval()
    done = 0
    try:
        for i, batch in enumerate(loader):
            if max_batches is not None and i >= max_batches:
                break
            batch = to_device(batch, device)
            done += 1
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                out = forward(model, batch)
            if isinstance(out, torch.Tensor):
                out = out.float()
            batch_sums = (metrics_fn(out, targets(batch)) if metrics_fn is not None
                          else loss_metrics(out, batch, loss_fn))
            for name, (s, c) in batch_sums.items():
                s0, c0 = sums.get(name, (0.0, 0.0))
                sums[name] = (s0 + s, c0 + c)
        for _ in range(done, pad_to or 0):
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                forward(model, to_device(pad_batch(), device))  # type: ignore[misc]
    finally:
        model.train(was_training)
    return sums
