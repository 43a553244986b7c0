"""Hugging Face models in the export and generate commands (the ``[hf]`` extra).

A task whose model is a ``transformers.PreTrainedModel`` is exported in the layout that
``save_pretrained`` writes (``config.json``, ``model.safetensors``, ``generation_config.json``
when the model can generate) plus its tokenizer's files, so ``AutoModel*.from_pretrained(dir)``
and ``AutoTokenizer.from_pretrained(dir)`` load it without this package installed. Nothing here
imports ``transformers`` unless the model is one of its models.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn


def is_hf_model(model: nn.Module) -> bool:
    """Whether ``model`` is a ``transformers.PreTrainedModel`` (False when transformers was
    never imported: then it cannot be one)."""
    modeling = sys.modules.get("transformers.modeling_utils")
    return modeling is not None and isinstance(model, modeling.PreTrainedModel)


def pretrained_tokenizer(tokenizer: Any) -> Any:
    """``tokenizer`` as an object with ``save_pretrained``: a transformers tokenizer as is, a
    ``tokenizers.Tokenizer`` wrapped in ``PreTrainedTokenizerFast`` (its special tokens then
    need setting by the task to be known to ``AutoTokenizer``).

    Raises:
        TypeError: neither.
    """
    if hasattr(tokenizer, "save_pretrained"):
        return tokenizer
    tokenizers = sys.modules.get("tokenizers")
    if tokenizers is not None and isinstance(tokenizer, tokenizers.Tokenizer):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast(tokenizer_object=tokenizer)
    raise TypeError(f"TaskBundle.tokenizer must have save_pretrained() or be a "
                    f"tokenizers.Tokenizer, got {type(tokenizer).__name__}")


def save_pretrained(model: nn.Module, tokenizer: Any, out: Path) -> None:
    """Write ``model`` with ``save_pretrained`` into ``out``, and its tokenizer."""
    model.save_pretrained(str(out), safe_serialization=True)  # type: ignore[operator]
    save_tokenizer(tokenizer, out)


def save_tokenizer(tokenizer: Any, out: Path) -> None:
    """Write ``tokenizer`` (see :func:`pretrained_tokenizer`; None: nothing) into ``out`` with
    ``save_pretrained``."""
    if tokenizer is not None:
        pretrained_tokenizer(tokenizer).save_pretrained(str(out))


@torch.no_grad()
def generate(model: nn.Module, tokenizer: Any, prompt: str, max_new_tokens: int, seed: int,
             temperature: float = 0.8, top_k: int = 20) -> str:
    """Continue ``prompt`` with the model's own ``generate()`` (sampling with ``temperature``
    and ``top_k``; seeded with ``seed`` through the global torch RNG) and return the decoded
    text, prompt included. New tokens are capped so the sequence fits the model's context
    (``config.n_positions`` / ``max_position_embeddings``).

    Raises:
        ValueError: the prompt alone fills the context.
    """
    tok = pretrained_tokenizer(tokenizer)
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    if ids.shape[1] == 0:  # an empty prompt starts from the beginning-of-text token
        ids = torch.tensor([[tok.bos_token_id if tok.bos_token_id is not None else 0]])
    context = getattr(model.config, "n_positions", None) or getattr(
        model.config, "max_position_embeddings", None)
    if context is not None:
        if ids.shape[1] >= context:
            raise ValueError(f"the prompt is {ids.shape[1]} tokens, the model's context is "
                             f"{context}")
        max_new_tokens = min(max_new_tokens, context - ids.shape[1])
    torch.manual_seed(seed)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),  # type: ignore
                         do_sample=True, temperature=temperature, top_k=top_k,
                         max_new_tokens=max_new_tokens, pad_token_id=pad)
    return tok.decode(out[0], skip_special_tokens=True)
