"""Helpers for the Hugging Face tests: load an export in a fresh process that cannot import
elastic_runner, and the runner's own logits for the same batch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

# a process that loads an export the way a user without elastic-runner does: importing
# elastic_runner fails there, and it prints the logits of the tokenized texts as JSON
FRESH_LOAD = r"""
import json, sys

class NoRunner:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "elastic_runner":
            raise ImportError("elastic_runner must not be needed to load an export")

sys.meta_path.insert(0, NoRunner())
import torch
import transformers
from transformers import AutoTokenizer

out_dir, auto_class, texts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
model = getattr(transformers, auto_class).from_pretrained(out_dir).eval()
tokenizer = AutoTokenizer.from_pretrained(out_dir)
batch = tokenizer(texts, padding=True, return_tensors="pt")
with torch.no_grad():
    logits = model(**batch).logits
print(json.dumps({"model": type(model).__name__, "logits": logits.tolist(),
                  "input_ids": batch["input_ids"].tolist(),
                  "attention_mask": batch["attention_mask"].tolist()}))
"""


def fresh_load(out_dir: Path, auto_class: str, texts: list[str]) -> dict:
    """Run :data:`FRESH_LOAD` on ``out_dir``; returns its JSON (model class, logits, ids)."""
    res = subprocess.run([sys.executable, "-c", FRESH_LOAD, str(out_dir), auto_class,
                          json.dumps(texts)], capture_output=True, text=True, timeout=180,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def runner_logits(model: torch.nn.Module, loaded: dict) -> torch.Tensor:
    """The logits of the runner's model (eval mode) for the batch :func:`fresh_load` used."""
    with torch.no_grad():
        return model.eval()(input_ids=torch.tensor(loaded["input_ids"]),
                            attention_mask=torch.tensor(loaded["attention_mask"])).logits
