"""The training loop in one process (world size 1, no launcher): schedule, accumulation,
precision and optimizer options, and resume of a finished run."""

import math
import time

import pytest
import torch

from elastic_runner.config import load_config
from elastic_runner.dist import init_distributed
from elastic_runner.train.stop import StopReason
from elastic_runner.trainer.build import build_trainer
from elastic_runner.trainer.loop import lr_factor

from .procs import CONFIGS


def trainer(tmp_path, *overrides):
    cfg = load_config(CONFIGS / "digits.yaml", [
        f"checkpoint.dir={tmp_path}", "logging.tensorboard_dir=null", "logging.progress_bar=false",
        *overrides])
    return build_trainer(cfg, init_distributed(cfg.distributed.backend))


def test_lr_schedule_warmup_then_cosine_to_floor():
    f = [lr_factor(s, warmup_steps=4, total_steps=20, min_ratio=0.1) for s in range(21)]
    assert f[:4] == [0.25, 0.5, 0.75, 1.0]
    assert f[4] == pytest.approx(1.0) and f[12] == pytest.approx(0.55)
    assert f[20] == pytest.approx(0.1) and all(a >= b for a, b in zip(f[3:], f[4:], strict=False))
    assert lr_factor(10, 0, 20, 0.1, cosine=False) == 1.0


def test_gradient_accumulation_matches_one_large_micro_batch(tmp_path):
    common = ["model.dropout=0.0", "training.max_steps=3", "optimizer.name=sgd",
              "checkpoint.every_steps=0"]
    a = trainer(tmp_path / "a", *common, "batch.micro_batch_size=8", "batch.grad_accum_steps=2")
    b = trainer(tmp_path / "b", *common, "batch.micro_batch_size=16", "batch.grad_accum_steps=1")
    a.fit()
    b.fit()
    assert a.state.step == b.state.step == 3
    for (name, pa), pb in zip(a.model.named_parameters(), b.model.parameters(), strict=True):
        assert torch.allclose(pa, pb, atol=1e-6), name


def test_bf16_constant_schedule_and_finished_run_is_not_resumed(tmp_path):
    t = trainer(tmp_path, "training.precision=bf16", "schedule.name=constant",
                "schedule.warmup_steps=0", "training.max_steps=4")
    # the dtype each linear layer computed in, training forwards and evaluation forwards apart:
    # fp32 parameters give bf16 outputs only under autocast
    seen: dict[bool, list[torch.dtype]] = {True: [], False: []}
    hooks = [m.register_forward_hook(lambda m, i, out: seen[m.training].append(out.dtype))
             for m in t.model.modules() if isinstance(m, torch.nn.Linear)]
    res = t.fit()
    for h in hooks:
        h.remove()
    assert t.state.step == 4 and math.isfinite(res["test_loss"])
    # 4 steps x 2 micro-batches x 2 linear layers, all under autocast
    assert seen[True] == [torch.bfloat16] * 16, seen[True]
    assert seen[False] and set(seen[False]) == {torch.bfloat16}  # evaluation too
    assert all(p.dtype == torch.float32 for p in t.model.parameters())  # fp32 master weights
    assert t.scheduler.get_last_lr()[0] == pytest.approx(t.cfg.optimizer.lr)
    again = trainer(tmp_path, "training.precision=bf16", "training.max_steps=4")
    assert again.resume() and again.stop.stopped
    again.fit()
    assert again.state.step == 4


def test_fp16_on_cpu_is_a_config_error(tmp_path):
    from elastic_runner.config import ConfigError

    with pytest.raises(ConfigError, match="training.precision: 'fp16' needs CUDA"):
        trainer(tmp_path, "training.precision=fp16")


def test_wall_clock_checkpoint_cadence(tmp_path):
    t = trainer(tmp_path, "checkpoint.every_steps=0", "checkpoint.every_seconds=60")
    t.state.step = 7
    assert not t.checkpoints.due(7)  # just started
    t.checkpoints._last_save = time.monotonic() - 61
    assert t.checkpoints.due(7)
    assert not t._after_step(end_of_epoch=True)  # the epoch-end checkpoint covers it
    t.save()
    t.checkpoints.wait()
    assert not t.checkpoints.due(7)
    assert (tmp_path / "step-00000007" / "manifest.json").is_file()
    t.close()


def test_hang_watchdog_closes_its_thread():
    from elastic_runner.observe.watchdog import HangWatchdog

    w = HangWatchdog(rank=0)
    w.arm(60, "a step")
    w.close()
    assert not w._thread.is_alive()


def test_seed_step_gives_the_same_stream_as_manual_seed():
    from elastic_runner.train.state import seed_step

    torch.manual_seed(123)
    want = torch.rand(5)
    seed_step(123, torch.device("cpu"))
    assert torch.equal(torch.rand(5), want)


def test_checkpoint_of_the_previous_layout_resumes(tmp_path):
    """A checkpoint written before the stop policy had its own state (stop reason as text in
    train_state) still resumes, stopped for the same reason."""
    from elastic_runner.checkpoint import storage as ckpt
    from elastic_runner.checkpoint.fencing import Fence

    t = trainer(tmp_path, "training.max_steps=3", "checkpoint.every_steps=0")
    t.fit()
    info = ckpt.latest_valid(tmp_path)
    raw = ckpt.load_state(info.path)
    raw["train_state"].update(finished=True, stop_reason="max_steps reached")
    raw["early_stopping"] = raw.pop("stop")["early_stopping"]
    # rewritten by the group that wrote it (its fencing token): replaced, not set aside
    ckpt.write_checkpoint(tmp_path, "step-00000003", raw, {"step": 3, "epoch": 0},
                          Fence(str(tmp_path), info.fence))
    again = trainer(tmp_path, "training.max_steps=3", "checkpoint.every_steps=0")
    assert again.resume() and again.state.step == 3
    assert (again.stop.reason, again.stop.message) == (StopReason.MAX_STEPS,
                                                       "max_steps reached")
    again.close()
