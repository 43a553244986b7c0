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
from .procs import (  # noqa: E402
    CONFIGS,
    cli,
    cli_here,  # noqa: E402
)
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


# causal_lm.yaml's task at a size that gets below both context-free baselines in one epoch of
# 163 steps, about 8 s of training on 2 CPU workers (the config's 128-token windows, 4,096-token
# BPE and 128-wide model took 2 epochs, 120 steps and 40 s): 64-token windows, a 1,024-token BPE,
# a 64-wide GPT-2. The bar is unchanged: below the token unigram of the same tokenizer (about
# 2.00 nats per byte at this vocabulary, measured in the test), which a model that uses no
# context cannot pass; the run ends near 1.76.
SMALL = ["data.block_size=64", "data.vocab_size=1024", "model.n_embd=64"]


def test_causal_lm_quality_bitwise_resume_export_and_generate(launch, tmp_path, reference,
                                                              capsys):
    # 163 steps in one epoch at global batch 32; dropout 0.1 (the config's) stays on. No warm
    # spare: the kill comes before one would have started (10 s after the task is built), so
    # the replacement starts cold either way, and no new spare competes with the rest of the run
    common = [CAUSAL_LM, *SMALL, "training.max_epochs=1", "early_stopping.enabled=false",
              "checkpoint.every_steps=20", "recovery.spare=false"]
    ref_ck = reference(*common, "logging.tensorboard_dir=null")
    ck = tmp_path / "ck"
    # in place: the survivor keeps its process, the replacement gets GPT-2's state from it
    killed = run_job(launch, "killed", *common, f"checkpoint.dir={ck}",
                     "faults.inject=[{kind: sigkill, rank: 1, after_steps: 40}]",
                     f"faults.once_dir={tmp_path / 'once'}")
    assert "fault injection: rank 1 sigkill after step 40" in killed.output
    assert "in-place recovery 1 done: step 41 committed" in killed.output, killed.output[-3000:]
    assert "resumed from" not in killed.output
    want, got = final_state(ref_ck), final_state(ck)
    assert got["train_state"]["step"] == want["train_state"]["step"] == 163
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

    # evaluate, export and generate: the CLI's commands in this process (cli_here)
    code, evaluated = cli_here(capsys, "evaluate", CAUSAL_LM, *SMALL, "--checkpoint", str(ck))
    assert code == 0
    assert json.loads(evaluated)["test_nats_per_byte"] == pytest.approx(
        res["test_nats_per_byte"], rel=1e-4)

    out = tmp_path / "export"
    assert cli_here(capsys, "export", str(ck), str(out))[0] == 0
    assert {"config.json", "generation_config.json", "model.safetensors",
            "tokenizer.json"} <= {p.name for p in out.iterdir()}
    loaded = fresh_load(out, "AutoModelForCausalLM", ["def main(argv):\n    return 0\n"])
    assert loaded["model"] == "GPT2LMHeadModel"
    # the export loads with sdpa attention where the runner used eager: equal up to rounding
    assert torch.allclose(torch.tensor(loaded["logits"]), runner_logits(model, loaded),
                          rtol=0, atol=1e-4)

    prompt = "def __init__(self"
    args = ["generate", str(ck), "--prompt", prompt, "--max-new-tokens", "40"]
    code, sampled = cli_here(capsys, *args)
    assert code == 0
    text = sampled.rstrip("\n")
    assert text.startswith(prompt) and len(text) > len(prompt) + 40, text
    # seeded: the same sample again, though this process's RNG has moved on since (two fresh
    # processes would agree without a seed too: torch starts every process from the same one)
    torch.rand(1)
    assert cli_here(capsys, *args) == (0, sampled)


def test_causal_lm_world_size_1_to_2_trains_every_sample_once(launch, tmp_path):
    """Dict samples keep the global cursor's guarantee: 1 worker (accumulation 2), then 2
    workers (accumulation 1) inside one epoch, each sample exactly once. A small corpus (the
    source of argparse: 486 windows of 64 tokens, 15 steps per epoch) keeps the epoch short;
    what is checked does not depend on its length. The world-size-1 part runs without a
    launcher (``train``): one process instead of three."""
    common = [CAUSAL_LM, "data.corpus_modules=[argparse]", "data.vocab_size=512",
              "data.block_size=64", "training.max_epochs=1", "early_stopping.enabled=false",
              "checkpoint.every_steps=3", f"checkpoint.dir={tmp_path / 'ck'}",
              "logging.tensorboard_dir=null", "--trace-samples", str(tmp_path / "trace")]
    one = launch(cli("train", *common, "training.max_steps=6"), name="one")
    assert one.wait(timeout=300) == 0, one.output[-3000:]
    two = run_job(launch, "two", *common, "recovery.spare=false", "--nproc-per-node", "2")
    assert "resumed from" in two.output and "global batch changed" not in two.output
    # causal_lm.yaml: batch.global_batch_size 32 at both world sizes, 15 steps in one epoch
    (report,) = assert_exact_audit(tmp_path / "trace", steps=15, global_batch=32)
    assert report.complete and report.seen_once == report.expected, report
    worlds = {e["step"]: e["world_size"] for e in audit.read_entries(tmp_path / "trace")
              if "world_size" in e}
    assert worlds[6] == 1 and worlds[7] == 2 and max(worlds) == 15


def test_text_classification_beats_its_baselines_exports_and_evaluates(launch, tmp_path,
                                                                       capsys):
    ck = tmp_path / "ck"
    # no warm spare: this run has no fault, and a spare would take a core from the workers
    run_job(launch, "text", TEXT_CLASSIFICATION, f"checkpoint.dir={ck}", *QUICK,
            "recovery.spare=false")
    res = results(ck)
    # the baselines on the same split, measured here: majority class, tf-idf + logistic regression
    base = text_classification.baselines(load_config(TEXT_CLASSIFICATION, QUICK))
    majority, logreg = (base[k]["test_accuracy"] for k in ("majority", "tfidf_logreg"))
    assert res["test_accuracy"] > max(3 * majority, 0.6 * logreg), (res, base)

    # evaluate and export: the CLI's commands in this process (cli_here)
    code, evaluated = cli_here(capsys, "evaluate", TEXT_CLASSIFICATION, *QUICK,
                               "--checkpoint", str(ck))
    assert code == 0
    assert json.loads(evaluated)["test_accuracy"] == pytest.approx(res["test_accuracy"])

    out = tmp_path / "export"
    assert cli_here(capsys, "export", str(ck), str(out))[0] == 0
    _, bundle, model, _ = model_from_checkpoint(None, ck)
    texts = ["a domesticated animal kept for companionship", "move fast by using one's feet"]
    loaded = fresh_load(out, "AutoModelForSequenceClassification", texts)
    assert loaded["model"] == "DistilBertForSequenceClassification"
    assert torch.allclose(torch.tensor(loaded["logits"]), runner_logits(model, loaded),
                          rtol=0, atol=1e-4)
    assert loaded["input_ids"] == bundle.tokenizer(texts, padding=True)["input_ids"]


# 20,000 of the 117,659 glosses, 2 epochs: about 35 s on 2 workers
QUICK = ["data.max_samples=20000", "training.max_epochs=2"]
