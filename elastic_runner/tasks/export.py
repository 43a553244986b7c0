"""Use a checkpoint outside training: export to safetensors, evaluate, sample.

An export directory holds ``model.safetensors`` (the unwrapped module's weights),
``config.yaml`` (the resolved config the model was trained with), ``preprocessing.json`` (the
task's artifacts: vocabulary, normalisation) and the task's tokenizer files when it has one.
For a ``transformers.PreTrainedModel`` the weights and ``config.json`` (and
``generation_config.json``) are written by its ``save_pretrained``, so
``AutoModel*.from_pretrained(out_dir)`` and ``AutoTokenizer.from_pretrained(out_dir)`` load the
directory without this package (see :mod:`elastic_runner.tasks.hf`). :func:`load_exported` rebuilds the
model from the directory alone.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors.torch import load_model, save_model

from ..checkpoint import storage as ckpt
from ..config import Config, from_dict
from ..task_registry import task_builder
from . import hf
from .base import TaskBundle, check_same_build, metric_sums, task_fingerprint

log = logging.getLogger(__name__)


def resolve_checkpoint(path: str | Path) -> str:
    """A checkpoint (directory or URL), or, when ``path`` is a ``checkpoint.dir``, its newest
    valid best checkpoint (the weights a run's test figures are from), else its newest valid
    one; which one is logged.

    Raises:
        CheckpointError: nothing valid at ``path``.
    """
    info = ckpt.inspect(path, verify=True)
    if info.valid:
        return info.path
    if info.step >= 0:  # named like a checkpoint, but broken
        raise ckpt.CheckpointError(f"checkpoint {path} is not valid: {info.reason}")
    found = ckpt.latest_valid(path, kind="best") or ckpt.latest_valid(path)
    if found is None:
        raise ckpt.CheckpointError(f"no valid checkpoint at {path}")
    log.info("using %s (the %s checkpoint of %s; name a checkpoint directory to use another)",
             found.path.rstrip("/").rsplit("/", 1)[-1], "best" if found.kind == "best" else
             "newest", path)
    return found.path


def model_from_checkpoint(cfg: Config | None, path: str | Path
                          ) -> tuple[Config, TaskBundle, torch.nn.Module, dict[str, Any]]:
    """Build the task of ``cfg`` (default: the config stored in the checkpoint) and load the
    checkpoint's weights into its model (CPU). Returns (config, bundle, model, manifest state)."""
    p = resolve_checkpoint(path)
    state = ckpt.load_state(p)
    cfg = cfg or from_dict(state["config"])
    # the task's job artifacts (a trained tokenizer) are those stored beside this checkpoint
    cfg.checkpoint.dir, cfg.checkpoint.resume = str(p).rstrip("/").rsplit("/", 1)[0], True
    torch.manual_seed(cfg.seed)
    bundle = task_builder(cfg.task)(cfg)
    check_same_build(state, cfg.to_dict(), task_fingerprint(bundle), str(p))
    ckpt.check_compatible(bundle.model.state_dict(), state["model"], str(p))
    bundle.model.load_state_dict(state["model"])
    bundle.model.eval()
    return cfg, bundle, bundle.model, state


def export(path: str | Path, out_dir: str | Path) -> tuple[Path, list[str]]:
    """Write the model (``save_pretrained`` layout for a transformers model, else
    ``model.safetensors``), the tokenizer's files, ``config.yaml`` and ``preprocessing.json``
    to ``out_dir``; returns (``out_dir``, the names of the files in it)."""
    cfg, bundle, model, state = model_from_checkpoint(None, path)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if hf.is_hf_model(model):
        hf.save_pretrained(model, bundle.tokenizer, out)
    else:
        # save_model (not save_file) handles tied weights, which share storage
        save_model(model, str(out / "model.safetensors"), metadata={
            "task": cfg.task, "step": str(state["train_state"]["step"]),
            "exported_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
        hf.save_tokenizer(bundle.tokenizer, out)
    (out / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    (out / "preprocessing.json").write_text(json.dumps(bundle.artifacts, indent=1))
    return out, sorted(p.name for p in out.iterdir())


def load_exported(out_dir: str | Path) -> tuple[torch.nn.Module, dict[str, Any]]:
    """Rebuild a model from an export directory; returns (model in eval mode, preprocessing)."""
    out = Path(out_dir)
    cfg = from_dict(yaml.safe_load((out / "config.yaml").read_text()))
    torch.manual_seed(cfg.seed)
    model = task_builder(cfg.task)(cfg).model
    if hf.is_hf_model(model):
        model = type(model).from_pretrained(str(out))
    else:
        load_model(model, str(out / "model.safetensors"))
    return model.eval(), json.loads((out / "preprocessing.json").read_text())


def evaluate_split(bundle: TaskBundle, model: torch.nn.Module, split: str = "test",
                   batch_size: int = 256) -> dict[str, float]:
    """Single-process metrics of ``model`` on one split: ``{f"{split}_{name}": value}``."""
    loader = torch.utils.data.DataLoader(getattr(bundle, split), batch_size=batch_size,
                                         collate_fn=bundle.collate_fn)
    sums = metric_sums(model, loader, bundle.metrics_fn, torch.device("cpu"),
                       loss_fn=bundle.loss_fn)
    return {f"{split}_{k}": s / c for k, (s, c) in sums.items()}


def sample(bundle: TaskBundle, model: torch.nn.Module, prompt: str, max_new_tokens: int,
           seed: int) -> str | None:
    """A sample continuing ``prompt``: the task's ``sample_fn``, else a transformers model's own
    ``generate()`` with the task's tokenizer; None when the task is not generative."""
    if bundle.sample_fn is not None:
        return bundle.sample_fn(model, prompt, max_new_tokens, seed)
    if hf.is_hf_model(model) and bundle.tokenizer is not None and model.can_generate():
        return hf.generate(model, bundle.tokenizer, prompt, max_new_tokens, seed)
    return None
