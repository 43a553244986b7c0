"""The CUDA path on a real GPU: NCCL at world size 1, two ranks on one GPU (gloo with CUDA
tensors: NCCL refuses two ranks on one device), bf16 autocast, fp16 with a GradScaler and a
planted overflow, pinned asynchronous checkpoints and their resume, kill -9 and resume (DDP and
FSDP2), FSDP's peer copies through pinned memory, in-place recovery with CUDA tensors, the CUDA
memory series in a live scrape, and no host synchronisation in the step.

Every test is marked ``gpu`` and skipped, with the reason, where CUDA is not available (the CI
machine); docs/gpu.md says where and how they ran.
"""

from __future__ import annotations

import collections
import math
import re
import signal

import pytest
import torch

from elastic_runner.checkpoint import storage as ckpt
from elastic_runner.config import load_config
from elastic_runner.dist import init_distributed
from elastic_runner.train.callbacks import Callback
from elastic_runner.train.consensus import LaggedConsensus
from elastic_runner.trainer.build import build_trainer

from .evidence import assert_same_optimizer, assert_same_tensors
from .procs import CONFIGS, cli, free_port, wait_until
from .test_metrics import get, samples
from .test_sharded_checkpoint import local_copy_round_trip
from .test_train_torchrun import final_state

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="needs CUDA (a GPU machine; see docs/gpu.md)")]

DIGITS = str(CONFIGS / "digits.yaml")
CAUSAL_LM = str(CONFIGS / "causal_lm.yaml")
QUIET = ["logging.tensorboard_dir=null", "early_stopping.enabled=false", "logging.progress_bar=false",
         "training.max_epochs=1000", "training.log_every_steps=10", "recovery.spare_delay_seconds=0"]


@pytest.fixture(autouse=True)
def _restore_determinism():
    """``training.deterministic`` switches process-wide settings: undo them after each test."""
    yield
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.deterministic = False


def trainer(tmp_path, *overrides):
    """A trainer in this process: world size 1 on cuda:0 (no launcher, no process group)."""
    cfg = load_config(DIGITS, [f"checkpoint.dir={tmp_path}", *QUIET, *overrides])
    return build_trainer(cfg, init_distributed(cfg.distributed.backend))


class _Each(Callback):
    """Calls ``begin(step)`` / ``end(event)`` at every step."""

    def __init__(self, begin=lambda step: None, end=lambda event: None) -> None:
        self.begin, self.end = begin, end

    def on_step_begin(self, step: int, steps_this_attempt: int) -> None:
        self.begin(step)

    def on_step_end(self, event) -> None:
        self.end(event)


class _Skipped(Callback):
    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_skipped_step(self, step: int, in_row: int, limit: int) -> None:
        self.steps.append(step)


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# ------------------------------------------------------------ one process, world size 1


def test_bf16_autocast_runs_the_model_in_bf16_on_cuda(tmp_path):
    t = trainer(tmp_path, "training.precision=bf16", "training.max_steps=5")
    seen = collections.Counter()
    for m in t.model.modules():
        if isinstance(m, torch.nn.Linear | torch.nn.Conv2d):
            m.register_forward_hook(lambda mod, inp, out: seen.update([out.dtype]))
    t.fit()
    assert t.info.device.type == "cuda"
    assert seen[torch.bfloat16] > 0 and seen[torch.float32] == 0, seen
    assert all(p.dtype == torch.float32 and p.is_cuda for p in t.model.parameters())
    assert math.isfinite(t.results["val_loss"])


@pytest.mark.parametrize("fused", [True, False], ids=["fused-lagged", "eager"])
def test_fp16_planted_overflow_skips_one_update_halves_the_scale_and_is_not_a_bad_step(
        tmp_path, caplog, fused):
    t = trainer(tmp_path, "training.precision=fp16", "training.max_steps=60",
                f"optimizer.fused={str(fused).lower()}", "checkpoint.every_steps=0",
                "checkpoint.at_epoch_end=false")
    assert isinstance(t.session.consensus, LaggedConsensus) == fused
    scaler, planted = t.engine.scaler, 10
    snaps, scales = {}, {}

    def begin(step: int) -> None:
        if step == planted:  # scaled gradients far beyond fp16's 65504: an overflow
            scaler.update(2.0 ** 40)

    def end(event) -> None:
        if event.step in (planted - 1, planted):
            snaps[event.step] = params(t.model)
            scales[event.step] = scaler.get_scale()

    t.session.callbacks.append(_Each(begin, end))
    t.fit()
    assert_same_tensors(snaps[planted - 1], snaps[planted])  # the update was skipped
    assert scales[planted] == 2.0 ** 39  # and the scale halved, once
    assert t.state.bad_steps == 0 and t.state.rollbacks == 0  # no false non-finite vote
    assert "non-finite" not in caplog.text
    assert any(not torch.equal(a, b) for a, b in zip(snaps[planted].values(),
                                                     params(t.model).values(), strict=True))


def test_async_checkpoint_stages_in_pinned_memory_and_resumes_bitwise(tmp_path):
    t = trainer(tmp_path, "training.max_steps=30", "checkpoint.every_steps=10",
                "checkpoint.async_save=true", "checkpoint.at_epoch_end=false")
    t.fit()
    staged = t.checkpoints._writer.buffers.tensors()
    on_device = [*t.model.state_dict().values(),
                 *(v for s in t.optimizer.state.values() for v in s.values() if v.is_cuda)]
    pinned = [b for b in staged if b.is_pinned()]  # the CPU RNG states' copies need not be
    assert sum(b.numel() * b.element_size() for b in pinned) == sum(
        v.numel() * v.element_size() for v in on_device) > 0
    again = trainer(tmp_path, "training.max_steps=30", "checkpoint.every_steps=10")
    assert again.resume() and again.state.step == 30
    assert_same_tensors(t.model.state_dict(), again.model.state_dict())
    assert all(v.is_cuda for v in again.model.state_dict().values())
    assert_same_optimizer(t.optimizer.state_dict(), again.optimizer.state_dict())


def test_the_step_has_no_host_synchronisation(tmp_path):
    from bench.host_syncs import count

    result = count(DIGITS, ["training.precision=bf16", "checkpoint.every_steps=25",
                            "eval.every_steps=25", "training.log_every_steps=10"], steps=60)
    plain = result["kinds"]["plain"]
    assert plain["steps"] >= 40 and plain["max"] == 0, plain


def test_lagged_vote_skips_a_nan_step_on_the_device_like_the_eager_vote(tmp_path):
    faults = "faults.inject=[{kind: nan, rank: 0, step: 7}, {kind: nan, rank: 0, step: 20, count: 2}]"
    runs = {}
    for lagged in (True, False):
        t = trainer(tmp_path / str(lagged), "training.max_steps=40", "optimizer.fused=true",
                    f"training.lagged_vote={str(lagged).lower()}", "training.deterministic=true",
                    faults)
        skipped = _Skipped()
        t.session.callbacks.append(skipped)
        t.fit()
        assert isinstance(t.session.consensus, LaggedConsensus) == lagged
        runs[lagged] = (params(t.model), skipped.steps, t.state.bad_steps)
    assert runs[True][1] == runs[False][1] == [7, 20, 21]
    assert_same_tensors(runs[True][0], runs[False][0])


@pytest.mark.parametrize("param_dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_an_fsdp_peer_copy_goes_through_pinned_memory_and_loads_back_bitwise(tmp_path,
                                                                            param_dtype):
    """FSDP2 on NCCL (world size 1): the peer copies' device-to-host copy of the local shards
    lands in pinned memory, and loaded into a module sharded on a new group it gives back the
    weights and AdamW moments, on the GPU, and the next step bitwise."""
    local_copy_round_trip(tmp_path, torch.device("cuda", 0), "nccl", param_dtype)


# ------------------------------------------------------------ real launches


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
@pytest.mark.parametrize("task", ["digits", "causal_lm"])
def test_nccl_kill9_and_resume_is_bitwise_with_deterministic_algorithms(launch, tmp_path, task,
                                                                      strategy):
    """DDP, and FSDP2 (bf16 parameters through its MixedPrecisionPolicy, sharded DCP
    checkpoints staged in pinned memory), on NCCL."""
    config = {"digits": [DIGITS, "training.precision=bf16"],
              "causal_lm": [CAUSAL_LM, "training.precision=bf16", "data.vocab_size=512",
                            "model.n_layer=2", "eval.every_steps=1000"]}[task]
    common = [*config, *QUIET, "training.max_steps=60", "checkpoint.every_steps=20",
              "training.deterministic=true", f"distributed.strategy={strategy}",
              "--nproc-per-node", "1"]
    ref = launch(cli("run", *common, f"checkpoint.dir={tmp_path / 'ref'}"), name="ref")
    assert ref.wait(timeout=300) == 0, ref.output[-3000:]
    job = launch(cli("run", *common, f"checkpoint.dir={tmp_path / 'ck'}",
                     "faults.inject=[{kind: sigkill, rank: 0, step: 50}]",
                     f"faults.once_dir={tmp_path / 'once'}"), name="job")
    assert job.wait(timeout=300) == 0, job.output[-3000:]
    assert "process group: backend nccl, world size 1, rank 0 on cuda:0" in job.output
    if strategy == "fsdp":
        assert "parameters in torch.bfloat16" in job.output
        assert ckpt.is_sharded(ckpt.latest_valid(tmp_path / "ck").path)
    assert re.search(r"resumed from \S+step-00000040: step 40, epoch", job.output), \
        job.output[-3000:]  # the newest checkpoint before the kill
    a, b = final_state(tmp_path / "ref"), final_state(tmp_path / "ck")
    assert a["train_state"]["step"] == b["train_state"]["step"] == 60
    assert_same_tensors(a["model"], b["model"])


def test_two_ranks_on_one_gpu_recover_in_place_bitwise(launch, tmp_path):
    common = [DIGITS, *QUIET, "distributed.backend=gloo", "training.max_steps=120",
              "checkpoint.every_steps=40", "training.deterministic=true",
              "--nproc-per-node", "2"]
    ref = launch(cli("run", *common, f"checkpoint.dir={tmp_path / 'ref'}"), name="ref")
    assert ref.wait(timeout=300) == 0, ref.output[-3000:]
    # rank 1 dies after step 70 (steps slowed so its warm spare is ready by then)
    job = launch(cli("run", *common, f"checkpoint.dir={tmp_path / 'ck'}",
                     "faults.inject=[{kind: sigkill, rank: 1, step: 70},"
                     " {kind: slow, rank: 0, step: 1, count: 100000, seconds: 0.1}]",
                     f"faults.once_dir={tmp_path / 'once'}", "--max-restarts", "3"), name="job")
    assert job.wait(timeout=400) == 0, job.output[-4000:]
    log = job.output
    assert "in-place recovery 1 done" in log and "resumed from" not in log, log[-4000:]
    assert re.search(r"in-place recovery: rank\(s\) \[1\] died", log), log[-4000:]
    a, b = final_state(tmp_path / "ref"), final_state(tmp_path / "ck")
    assert_same_tensors(a["model"], b["model"])
    assert_same_optimizer(a["optimizer"], b["optimizer"])


def test_cuda_memory_series_in_a_live_scrape_and_sigterm_on_the_lagged_path(launch, tmp_path):
    port, ck = free_port(), tmp_path / "ck"
    job = launch(cli("run", DIGITS, *QUIET, "training.max_steps=100000",
                     f"checkpoint.dir={ck}", "--nproc-per-node", "1",
                     "--metrics-port", str(port)), name="job")

    def allocated() -> list[float]:
        try:
            return samples(get(port)[1], "elastic_runner_cuda_memory_allocated_bytes")
        except OSError:
            return []

    wait_until(lambda: any(v > 0 for v in allocated()), 120, "a CUDA memory sample")
    text = get(port)[1]
    assert samples(text, "elastic_runner_cuda_memory_reserved_bytes")[0] >= allocated()[0] > 0
    job.proc.send_signal(signal.SIGTERM)  # the agent (an eviction): it signals its worker
    assert job.wait(timeout=120) == 143, job.output[-3000:]
    log = job.output
    assert "no step in flight" in log or "discarded, redone after the restart" in log
    newest = ckpt.latest_valid(ck)
    assert newest is not None and f"step-{newest.step:08d} committed" in log
