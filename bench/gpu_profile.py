"""The runner's step against a bare loop in one process, on the GPT-2-small-sized model of
``bench.gpu``: where the runner's time per step goes on the host.

The built-in trainer runs at world size 1 without a launcher or DDP (``bench.gpu``'s model, bf16,
fused AdamW, the lagged vote, callbacks, metrics and watchdog as configured, no checkpoint or
evaluation in the measured steps) under ``cProfile``; then a bare loop (forward under bf16
autocast, backward, gradient clipping, fused AdamW) trains the same model on the same batches in
the same process. Prints the median wall time per step of each (steps 11-80 of the trainer,
11-70 of the loop, from host clocks: no host synchronisation happens in either step, so the
wall time per step is the GPU's once the host is ahead) and the profile's costliest functions.

    python -m bench.gpu_profile [overrides ...]
"""

from __future__ import annotations

import cProfile
import io
import pstats
import statistics
import sys
import tempfile
import time

import torch
from torch.utils.data import DataLoader, default_collate

from elastic_runner.config import load_config
from elastic_runner.dist import init_distributed
from elastic_runner.task_registry import task_builder
from elastic_runner.train.callbacks import Callback
from elastic_runner.trainer.build import build_trainer

from .gpu import CONFIG, GPT2_SMALL


class _Clock(Callback):
    def __init__(self) -> None:
        self.t: list[float] = []

    def on_step_begin(self, step: int, steps_this_attempt: int) -> None:
        self.t.append(time.perf_counter())


def _median_ms(stamps: list[float]) -> float:
    return 1000 * statistics.median(b - a for a, b in zip(stamps[10:], stamps[11:], strict=False))


def main(overrides: list[str]) -> None:
    cfg = load_config(CONFIG, [*GPT2_SMALL, f"checkpoint.dir={tempfile.mkdtemp()}",
                               "training.max_steps=80", "training.max_epochs=1000",
                               "logging.tensorboard_dir=null", "early_stopping.enabled=false",
                               "checkpoint.every_steps=0", "checkpoint.at_epoch_end=false",
                               "eval.every_steps=100000", "recovery.spare=false", *overrides])
    trainer = build_trainer(cfg, init_distributed(cfg.distributed.backend))
    clock = _Clock()
    trainer.session.callbacks.append(clock)
    profile = cProfile.Profile()
    profile.enable()
    trainer.fit()
    profile.disable()
    print("runner step wall ms median", round(_median_ms(clock.t), 2), "lagged vote",
          trainer.session.consensus.lagged)
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(22)
    print(text.getvalue())

    bundle = task_builder(cfg.task)(cfg)
    model = bundle.model.cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    loader = DataLoader(bundle.train, batch_size=8, shuffle=True,
                        collate_fn=bundle.collate_fn or default_collate)
    stamps: list[float] = []
    for i, batch in enumerate(loader):
        if i == 70:
            break
        stamps.append(time.perf_counter())
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(**{k: v.cuda(non_blocking=True) for k, v in batch.items()}).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    print("bare in-process step wall ms median", round(_median_ms(stamps), 2))


if __name__ == "__main__":
    main(sys.argv[1:])
