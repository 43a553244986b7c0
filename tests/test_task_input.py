"""Task input errors end a job at once, with real torchrun process groups: samples of a type the
runner cannot pass to a model, and a build that differs between ranks, each exit 2 with one
message per rank naming what was found, and no restart."""

from __future__ import annotations

import pytest

from .procs import cli

pytestmark = pytest.mark.slow


BAD_TASKS = {
    "strings": '''
def build(cfg):
    from torch import nn
    from elastic_runner.tasks.base import TaskBundle
    texts = ["a cat sat", "a dog ran"] * 8
    return TaskBundle(model=nn.Linear(2, 2), train=texts, val=texts, test=texts)
''',
    "unseeded": '''
import os
import torch
from torch import nn
from torch.utils.data import TensorDataset
from elastic_runner.tasks.base import TaskBundle

def build(cfg):
    # a split drawn from the OS's entropy: each rank gets other samples
    x = torch.frombuffer(bytearray(os.urandom(64 * 4 * 4)), dtype=torch.float32).reshape(64, 4)
    data = TensorDataset(x.nan_to_num(), torch.zeros(64, dtype=torch.long))
    return TaskBundle(model=nn.Linear(4, 2), train=data, val=data, test=data,
                      loss_fn=nn.functional.cross_entropy)
''',
}


@pytest.mark.parametrize(("task", "message"), [
    ("strings", "task badtask:build: train[0] is builtins.str ('a cat sat'); a sample must be "
                "a tensor, a tuple/list (inputs, targets) or a mapping of tensors"),
    ("unseeded", "task badtask:build's build differs between ranks (ranks [0]: splits "
                 "64/64/64, samples "),
])
def test_bad_task_input_exits_2_at_once_without_restarts(launch, tmp_path, task, message):
    (tmp_path / "badtask.py").write_text(BAD_TASKS[task])
    (tmp_path / "bad.yaml").write_text("task: badtask:build\nbatch: {micro_batch_size: 4}\n"
                                       f"checkpoint: {{dir: {tmp_path / 'ck'}}}\n")
    job = launch(cli("run", "bad.yaml", "--max-restarts", "3", "--monitor-interval", "0.2"),
                 name=task, cwd=tmp_path, env={"PYTHONPATH": str(tmp_path)})
    assert job.wait(timeout=200) == 2, job.output[-3000:]
    errors = [ln for ln in job.output.splitlines() if "ERROR elastic_runner.worker" in ln]
    assert len(errors) == 2 and all(message in ln for ln in errors), job.output[-3000:]
    assert "not restarting, a restart would fail the same way" in job.output
    assert "Traceback" not in job.output
    summary = [ln for ln in job.output.splitlines() if ln.startswith("elastic-runner: job failed")]
    assert len(summary) == 1 and "exited with code 2: ConfigError: " in summary[0]
