"""Hugging Face models end to end, with real torchrun process groups (gloo on CPU): the
transformers task of the docs (``examples/glosses``) (kill -9 mid-epoch, resume at the same step, exact sample audit, export loaded
by ``from_pretrained`` in a process that cannot import elastic_runner)."""

from __future__ import annotations

import json
import sys
from collections import Counter

import pytest
import torch

from .needs import HF_EXTRA, require_modules

require_modules("transformers", "tokenizers", install_hint=HF_EXTRA)

from elastic_runner.tasks.export import model_from_checkpoint  # noqa: E402

from .evidence import assert_exact_audit  # noqa: E402
from .hf_helpers import fresh_load, runner_logits  # noqa: E402
from .procs import cli, cli_here  # noqa: E402
from .test_docs import copy_example  # noqa: E402

pytestmark = pytest.mark.slow


def test_readme_transformers_task_resumes_exports_and_loads_without_the_runner(launch,
                                                                               tmp_path,
                                                                               capsys):
    copy_example("glosses", tmp_path)
    ck, trace = tmp_path / "runs/glosses/checkpoints", tmp_path / "trace"
    # 156 steps per epoch at world size 2; rank 1 crashes right after step 100 is checkpointed
    job = launch(cli("run", "glosses.yaml", "logging.tensorboard_dir=null",
                     "training.max_epochs=1", "checkpoint.every_steps=50",
                     "faults.inject=[{kind: sigkill, rank: 1, after_steps: 100}]",
                     "recovery.mode=restart",  # the restart path (in place: test_hf_tasks)
                     "--trace-samples", str(trace), "--monitor-interval", "0.2"),
                 name="glosses", cwd=tmp_path, env={"PYTHONPATH": str(tmp_path)})
    assert job.wait(timeout=400) == 0, job.output[-3000:]
    assert "fault injection: rank 1 sigkill after step 100" in job.output
    assert f"resumed from {ck}/step-00000100: step 100" in job.output, job.output[-3000:]
    # glosses.yaml: micro-batch 32 at 2 ranks (global batch 64), 156 steps in its one epoch;
    # the restart path: nothing repaired
    (report,) = assert_exact_audit(trace, steps=156, global_batch=64)
    assert report.complete and report.seen_once == 156 * 64, report

    sys.path.insert(0, str(tmp_path))  # where the user's task package is
    try:
        _, bundle, model, _ = model_from_checkpoint(None, ck)
        # the CLI's export in this process (cli_here): its exit code
        assert cli_here(capsys, "export", str(ck), str(tmp_path / "out"))[0] == 0
    finally:
        sys.path.remove(str(tmp_path))
    labels = Counter(int(s["labels"]) for s in bundle.test)
    majority = max(labels.values()) / len(bundle.test)
    results = json.loads((ck / "results.json").read_text())
    assert results["test_accuracy"] > majority + 0.3, (results, majority)

    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "out" / name).is_file(), name
    texts = ["in a quick manner", "cause to move or shift", "a small domesticated carnivore"]
    loaded = fresh_load(tmp_path / "out", "AutoModelForSequenceClassification", texts)
    assert loaded["model"] == "BertForSequenceClassification"
    want = runner_logits(model, loaded)
    assert torch.allclose(torch.tensor(loaded["logits"]), want, rtol=0, atol=1e-5)
    # the exported tokenizer is the one the job trained (and checkpointed beside the weights)
    assert loaded["input_ids"] == bundle.tokenizer(texts, padding=True)["input_ids"]
