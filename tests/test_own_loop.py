"""The own-loop example (``examples/own_loop.py``, the DDP tutorial's loop plus elastic-runner in
a few lines) under real torchrun process groups: kill -9 and SIGTERM of a worker, a 2 -> 1 -> 2
world-size change with the sample audit, and the diff from the tutorial loop."""

from __future__ import annotations

import difflib
import re
import signal
import sys
import urllib.request

import pytest
import torch

from elastic_runner.checkpoint import storage as ckpt
from elastic_runner.data import audit

from .evidence import assert_exact_audit, assert_same_optimizer, assert_same_tensors
from .procs import REPO, cli, free_port, run_cli, wait_until

EXAMPLES = REPO / "examples"
pytestmark = pytest.mark.slow


def code_diff() -> list[str]:
    """Changed lines from the tutorial loop to the fault-tolerant one, module docstrings
    aside."""
    def code(name: str) -> list[str]:
        text = (EXAMPLES / name).read_text()
        return text.split('"""', 2)[2].splitlines()

    return [ln for ln in difflib.unified_diff(code("ddp_tutorial.py"), code("own_loop.py"),
                                              lineterm="", n=0)
            if ln[:1] in "+-" and not ln.startswith(("+++", "---"))]


@pytest.mark.timeout(30)
def test_at_most_20_changed_lines_and_the_readme_and_guide_show_them():
    diff = code_diff()
    added = [ln for ln in diff if ln.startswith("+")]
    assert 0 < len(added) <= 20, "\n".join(diff)
    guide = (REPO / "docs" / "guides" / "own-loop.md").read_text()
    # the guide's diff is made from the two files when the site is built, not pasted
    assert "{er-diff} ../../examples/ddp_tutorial.py ../../examples/own_loop.py" in guide
    removed = [ln for ln in diff if ln.startswith("-")]
    readme = (REPO / "README.md").read_text()
    assert f"({len(added)} added, {len(removed)}\nremoved" in readme
    missing = [ln for ln in diff if ln.strip("+- ") and ln not in readme]
    assert not missing, missing


def test_the_tutorial_loop_runs_under_torchrun(launch):
    job = launch([sys.executable, "-m", "torch.distributed.run", "--standalone",
                  "--nproc-per-node", "2", str(EXAMPLES / "ddp_tutorial.py"), "--steps", "20"],
                 name="tutorial")
    assert job.wait(timeout=240) == 0, job.output[-3000:]
    assert re.search(r"step 20 loss \d", job.output), job.output[-3000:]


def torchrun(*args: str, nproc: int = 2, restarts: int = 2) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            str(nproc), "--max-restarts", str(restarts), "--monitor-interval", "0.2",
            str(EXAMPLES / "own_loop.py"), *args]


def model_state(ck) -> dict[str, torch.Tensor]:
    state = ckpt.load_state(ckpt.latest_valid(ck).path)
    return {**state["model"], "adam_step": state["optimizer"]["state"][0]["step"]}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted 80-step run, shared by the tests that compare weights with it."""
    ck = tmp_path_factory.mktemp("own-loop-ref")
    from .procs import Job

    job = Job(torchrun("--steps", "80", "--checkpoint-dir", str(ck)), ck / "job.log")
    try:
        assert job.wait(timeout=240) == 0, job.output[-3000:]
    finally:
        job.kill_all()
    return model_state(ck)


def test_kill_9_under_torchrun_resumes_bitwise(launch, tmp_path, reference):
    ck = tmp_path / "ck"
    job = launch(torchrun("--steps", "80", "--checkpoint-dir", str(ck)), name="kill",
                 env={"ELASTIC_RUNNER_FAULTS": "[{kind: sigkill, rank: 1, step: 30}]"})
    assert job.wait(timeout=240) == 0, job.output[-3000:]
    assert f"resumed from {ck / 'step-00000020'}: step 20" in job.output
    assert_same_tensors(reference, model_state(ck))


def test_sigterm_checkpoints_that_step_exits_143_and_loses_nothing(launch, tmp_path,
                                                                   reference):
    ck, trace = tmp_path / "ck", tmp_path / "trace"
    job = launch(torchrun("--steps", "80", "--checkpoint-dir", str(ck), "--trace-dir",
                          str(trace)), name="sigterm",
                 env={"ELASTIC_RUNNER_FAULTS": "[{kind: sigterm, rank: 1, step: 27}]"})
    assert job.wait(timeout=240) == 0, job.output[-3000:]
    out = job.output
    # the signal lands after step 27; every rank discards step 28 and saves step 27
    assert "preemption: checkpointing step 27" in out and "exitcode: 143" in out, out[-3000:]
    assert f"resumed from {ck / 'step-00000027'}: step 27" in out
    assert "sample trace: dropped" not in out  # zero lost steps
    # own_loop.py: all 1797 samples, 16 per rank and step (global batch 32 at 2 ranks); the
    # restart resumed the preemption's checkpoint: nothing repaired
    epoch0 = assert_exact_audit(trace, steps=80, global_batch=32)[0]
    assert epoch0.complete and epoch0.seen_once == 56 * 32
    assert_same_tensors(reference, model_state(ck))


def test_world_size_2_1_2_sample_audit_is_exact(launch, tmp_path):
    ck, trace = tmp_path / "ck", tmp_path / "trace"
    for i, (nproc, steps) in enumerate([(2, 30), (1, 100), (2, 140)]):
        job = launch(torchrun("--steps", str(steps), "--checkpoint-dir", str(ck),
                              "--trace-dir", str(trace), nproc=nproc), name=f"phase{i}")
        assert job.wait(timeout=240) == 0, job.output[-3000:]
        if i:
            assert "resumed from" in job.output
    worlds = {e["step"]: e["world_size"] for e in audit.read_entries(trace) if "world_size" in e}
    assert (worlds[30], worlds[31], worlds[100], worlds[101]) == (2, 1, 1, 2)
    # epoch 0: 30 steps of 32 samples, then 52 of 16 (world size 1), 5 left as the tail
    # the global batch is 16 per rank: 32, 16, then 32 again
    first, second = assert_exact_audit(trace, steps=140, global_batch=None)
    assert first.complete and first.seen_once == 1797 - 5 and first.dropped == 5
    assert not second.duplicated and second.seen_once == 18 * 16 + 40 * 32
    assert run_cli("audit", str(trace)).stdout.count(" ok ") == 1


def scrape(port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            return r.read().decode()
    except OSError:
        return ""


def test_kill_9_from_outside_under_elastic_runner_run_with_metrics(launch, tmp_path, reference):
    """``elastic-runner run examples/own_loop.py``: the node endpoint serves both ranks' series;
    SIGKILL of a worker from outside; the restarted group resumes, bitwise equal at the end."""
    ck, port = tmp_path / "ck", free_port()
    # rank 0 slows steps 21-60 by 50 ms (numerics unchanged): room to scrape and to kill
    slow = "[{kind: slow, rank: 0, step: 21, count: 40, seconds: 0.05}]"
    job = launch(cli("run", str(EXAMPLES / "own_loop.py"), "--nproc-per-node", "2",
                     "--metrics-port", str(port), "--monitor-interval", "0.2", "--",
                     "--steps", "80", "--checkpoint-dir", str(ck)),
                 name="run", env={"ELASTIC_RUNNER_FAULTS": slow})
    wait_until(lambda: (ck / "step-00000020").is_dir(), 120, "the checkpoint of step 20")
    series = re.compile(r'^elastic_runner_step\{[^}]*rank="(\d)"[^}]*\} (\d+)', re.M)
    wait_until(lambda: {m[1] for m in series.finditer(scrape(port))} == {"0", "1"}, 30,
               "both ranks' step series on the node endpoint")
    victim = next(p for p in job.descendants()
                  if "own_loop.py" in " ".join(p.cmdline()) and p.environ().get("RANK") == "1")
    victim.send_signal(signal.SIGKILL)
    assert job.wait(timeout=240) == 0, job.output[-3000:]
    resumed = re.search(r"resumed from \S+/step-(\d+): step (\d+)", job.output)
    assert resumed and int(resumed[2]) >= 20, job.output[-3000:]
    assert_same_tensors(reference, model_state(ck))


def fsdp_loop(*args: str, nproc: int = 2) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            str(nproc), "--max-restarts", "1", "--monitor-interval", "0.2",
            str(EXAMPLES / "own_loop_fsdp.py"), *args]


def test_an_fsdp2_loop_resumes_bitwise_after_kill_9_and_reshards_to_3_ranks(launch, tmp_path):
    """``examples/own_loop_fsdp.py``: a kill -9 mid-run resumes from the sharded checkpoint
    bitwise equal to an uninterrupted run; then 3 ranks continue its checkpoint (resharded,
    uneven shards) with every sample of the epoch exactly once."""
    ref, ck, trace = tmp_path / "ref", tmp_path / "ck", tmp_path / "trace"
    job = launch(fsdp_loop("--steps", "50", "--checkpoint-dir", str(ref)), name="reference")
    assert job.wait(timeout=240) == 0, job.output[-3000:]
    job = launch(fsdp_loop("--steps", "50", "--checkpoint-dir", str(ck), "--trace-dir",
                           str(trace)), name="kill",
                 env={"ELASTIC_RUNNER_FAULTS": "[{kind: sigkill, rank: 1, step: 30}]"})
    assert job.wait(timeout=240) == 0, job.output[-3000:]
    assert f"resumed from {ck / 'step-00000020'}: step 20" in job.output
    assert ckpt.is_sharded(ckpt.latest_valid(ck).path)
    want = ckpt.load_state(ckpt.latest_valid(ref).path)
    got = ckpt.load_state(ckpt.latest_valid(ck).path)
    assert_same_tensors(want["model"], got["model"])
    assert_same_optimizer(want["optimizer"], got["optimizer"])

    job = launch(fsdp_loop("--steps", "80", "--checkpoint-dir", str(ck), "--trace-dir",
                           str(trace), nproc=3), name="three")
    assert job.wait(timeout=240) == 0, job.output[-3000:]
    assert f"resumed from {ck / 'step-00000050'}: step 50" in job.output
    worlds = {e["step"]: e["world_size"] for e in audit.read_entries(trace) if "world_size" in e}
    assert (worlds[50], worlds[51]) == (2, 3)
    # epoch 0: 56 steps of 32 samples at world size 2, then 48-sample steps (the restart after
    # the kill resumed a checkpoint every rank reached: nothing repaired)
    first = assert_exact_audit(trace, steps=80, global_batch=None)[0]
    assert first.complete, first
