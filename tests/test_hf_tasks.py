"""The built-in Hugging Face tasks end to end under ``elastic-runner run`` on 2 CPU workers
(real torchrun, gloo): quality against baselines measured in the same test, a kill -9 mid-epoch
(causal_lm: weights bitwise equal to an uninterrupted run, dropout on), ``export`` loaded by
``from_pretrained`` in a process that cannot import elastic_runner (same logits as the runner's
model), ``evaluate`` and ``generate``."""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest
import torch

from .needs import HF_EXTRA, require_modules

require_modules("transformers", "tokenizers", install_hint=HF_EXTRA)

from elastic_runner.config import load_config  # noqa: E402
from elastic_runner.data import audit  # noqa: E402
from elastic_runner.tasks import char_lm, text_classification  # noqa: E402
from elastic_runner.tasks.export import model_from_checkpoint  # noqa: E402

from .evidence import assert_exact_audit, assert_same_optimizer, assert_same_tensors  # noqa: E402
from .hf_helpers import fresh_load, runner_logits  # noqa: E402
from .procs import CONFIGS, cli, run_cli  # noqa: E402
from .test_train_torchrun import final_state, results  # noqa: E402

pytestmark = pytest.mark.slow

CAUSAL_LM = str(CONFIGS / "causal_lm.yaml")
TEXT_CLASSIFICATION = str(CONFIGS / "text_classification.yaml")


def run_job(launch, name, *args, timeout=500):
    job = launch(cli("run", *args, "logging.tensorboard_dir=null", "--monitor-interval", "0.2"),
                 name=name)
    assert job.wait(timeout=timeout) == 0, job.output[-3000:]
    return job


def entropy(counts: Counter) -> float:
    n = sum(counts.values())
    return -sum(c / n * math.log(c / n) for c in counts.values())


def test_causal_lm_quality_bitwise_resume_export_and_generate(launch, tmp_path):
    # 60 steps per epoch at global batch 32; dropout 0.1 (the config's) stays on
    common = [CAUSAL_LM, "training.max_epochs=2", "early_stopping.enabled=false",
              "checkpoint.every_steps=20"]
    ref_ck, ck = tmp_path / "ref", tmp_path / "ck"
    run_job(launch, "reference", *common, f"checkpoint.dir={ref_ck}")
    # in place: the survivor keeps its process, the replacement gets GPT-2's state from it
    killed = run_job(launch, "killed", *common, f"checkpoint.dir={ck}",
                     "faults.inject=[{kind: sigkill, rank: 1, after_steps: 40}]",
                     f"faults.once_dir={tmp_path / 'once'}")
    assert "fault injection: rank 1 sigkill after step 40" in killed.output
    assert "in-place recovery 1 done: step 41 committed" in killed.output, killed.output[-3000:]
    assert "resumed from" not in killed.output
    want, got = final_state(ref_ck), final_state(ck)
    assert got["train_state"]["step"] == want["train_state"]["step"] == 120
    assert_same_tensors(want["model"], got["model"])  # bitwise, with dropout on
    assert_same_optimizer(want["optimizer"], got["optimizer"])

    # quality: below the context-free baselines of the same train split, measured here
    _, bundle, model, _ = model_from_checkpoint(None, ck)
    corpus = char_lm.load_corpus(tuple(char_lm.DEFAULT_CORPUS_MODULES))
    n_train = len(corpus) - 2 * round(0.05 * len(corpus))
    train_bytes = corpus[:n_train].encode("utf-8")
    byte_unigram = entropy(Counter(train_bytes))
    ids = bundle.tokenizer(corpus[:n_train])["input_ids"]
    token_unigram = entropy(Counter(ids)) * len(ids) / len(train_bytes)
    res = results(ck)
    assert res["val_nats_per_byte"] < token_unigram < byte_unigram, (res, token_unigram,
                                                                      byte_unigram)

    evaluated = run_cli("evaluate", CAUSAL_LM, "--checkpoint", str(ck), timeout=300)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert json.loads(evaluated.stdout)["test_nats_per_byte"] == pytest.approx(
        res["test_nats_per_byte"], rel=1e-4)

    out = tmp_path / "export"
    exported = run_cli("export", str(ck), str(out), timeout=300)
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert {"config.json", "generation_config.json", "model.safetensors",
            "tokenizer.json"} <= {p.name for p in out.iterdir()}
    loaded = fresh_load(out, "AutoModelForCausalLM", ["def main(argv):\n    return 0\n"])
    assert loaded["model"] == "GPT2LMHeadModel"
    # the export loads with sdpa attention where the runner used eager: equal up to rounding
    assert torch.allclose(torch.tensor(loaded["logits"]), runner_logits(model, loaded),
                          rtol=0, atol=1e-4)

    prompt = "def __init__(self"
    sampled = run_cli("generate", str(ck), "--prompt", prompt, "--max-new-tokens", "40",
                      timeout=300)
    assert sampled.returncode == 0, sampled.stderr[-3000:]
    text = sampled.stdout.rstrip("\n")
    assert text.startswith(prompt) and len(text) > len(prompt) + 40, text
    again = run_cli("generate", str(ck), "--prompt", prompt, "--max-new-tokens", "40",
                    timeout=300)
    assert again.stdout == sampled.stdout  # seeded


def test_causal_lm_world_size_1_to_2_trains_every_sample_once(launch, tmp_path):
    """Dict samples keep the global cursor's guarantee: 1 worker (accumulation 2), then 2
    workers (accumulation 1) inside one epoch, each sample exactly once."""
    common = [CAUSAL_LM, "training.max_epochs=1", "early_stopping.enabled=false",
              "checkpoint.every_steps=10", f"checkpoint.dir={tmp_path / 'ck'}",
              "--trace-samples", str(tmp_path / "trace")]
    run_job(launch, "one", *common, "training.max_steps=25", "--nproc-per-node", "1")
    two = run_job(launch, "two", *common, "--nproc-per-node", "2")
    assert "resumed from" in two.output and "global batch changed" not in two.output
    # causal_lm.yaml: batch.global_batch_size 32 at both world sizes, 60 steps in one epoch
    (report,) = assert_exact_audit(tmp_path / "trace", steps=60, global_batch=32)
    assert report.complete and report.seen_once == report.expected, report
    worlds = {e["step"]: e["world_size"] for e in audit.read_entries(tmp_path / "trace")
              if "world_size" in e}
    assert worlds[25] == 1 and worlds[26] == 2 and max(worlds) == 60


def test_text_classification_beats_its_baselines_exports_and_evaluates(launch, tmp_path):
    ck = tmp_path / "ck"
    run_job(launch, "text", TEXT_CLASSIFICATION, f"checkpoint.dir={ck}", *QUICK)
    res = results(ck)
    # the baselines on the same split, measured here: majority class, tf-idf + logistic regression
    base = text_classification.baselines(load_config(TEXT_CLASSIFICATION, QUICK))
    majority, logreg = (base[k]["test_accuracy"] for k in ("majority", "tfidf_logreg"))
    assert res["test_accuracy"] > max(3 * majority, 0.6 * logreg), (res, base)

    evaluated = run_cli("evaluate", TEXT_CLASSIFICATION, *QUICK, "--checkpoint", str(ck),
                        timeout=300)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert json.loads(evaluated.stdout)["test_accuracy"] == pytest.approx(res["test_accuracy"])

    out = tmp_path / "export"
    exported = run_cli("export", str(ck), str(out), timeout=300)
    assert exported.returncode == 0, exported.stderr[-3000:]
    _, bundle, model, _ = model_from_checkpoint(None, ck)
    texts = ["a domesticated animal kept for companionship", "move fast by using one's feet"]
    loaded = fresh_load(out, "AutoModelForSequenceClassification", texts)
    assert loaded["model"] == "DistilBertForSequenceClassification"
    assert torch.allclose(torch.tensor(loaded["logits"]), runner_logits(model, loaded),
                          rtol=0, atol=1e-4)
    assert loaded["input_ids"] == bundle.tokenizer(texts, padding=True)["input_ids"]


# 20,000 of the 117,659 glosses, 2 epochs: about 35 s on 2 workers
QUICK = ["data.max_samples=20000", "training.max_epochs=2"]
