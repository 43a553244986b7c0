"""Chaos: a 2-node job (two torchrun agents, one worker each, etcd-v2) under a seeded random mix
of faults (crash, exception, eviction, hang, NaN streak), each firing once. The job must finish
with an exact sample audit and the same final weights as a fault-free run: the world size ends
where it began, skipped NaN steps are rolled back and replayed, and every other fault only costs
redone steps."""

from __future__ import annotations

import random

import pytest

from elastic_runner import audit

from .procs import CONFIGS, cli
from .test_train_torchrun import assert_same_tensors, final_state

pytestmark = pytest.mark.slow

SEED = 20261121
COMMON = [str(CONFIGS / "digits.yaml"), "logging.tensorboard_dir=null",
          "early_stopping.enabled=false", "training.max_steps=60", "checkpoint.every_steps=5",
          "training.max_bad_steps=2", "watchdog.hang_timeout_seconds=3",
          "watchdog.long_op_timeout_seconds=120", "watchdog.dump_grace_seconds=1"]


def fault_plan(seed: int, n: int = 3) -> list[str]:
    """``n`` distinct fault kinds at steps at least 10 apart, on random ranks."""
    rng = random.Random(seed)
    kinds = rng.sample(["sigkill", "raise", "sigterm", "hang", "nan"], n)
    steps = sorted(rng.sample(range(8, 50, 10), n))
    plan = []
    for kind, step in zip(kinds, steps, strict=True):
        rank = rng.randrange(2)
        extra = ", count: 2" if kind == "nan" else ""  # a streak: forces the rollback
        plan.append(f"{{kind: {kind}, rank: {rank}, step: {step + rng.randrange(4)}, "
                    f"attempts: 99{extra}}}")  # once per job via faults.once_dir
    return plan


def test_seeded_fault_mix_on_two_nodes(launch, etcd_server, tmp_path):
    ref = launch(cli("run", *COMMON, f"checkpoint.dir={tmp_path / 'ref'}"), name="reference")
    assert ref.wait(timeout=240) == 0, ref.output[-3000:]

    plan = fault_plan(SEED)
    ck, trace = tmp_path / "ck", tmp_path / "trace"
    nodes = [launch(cli(
        "run", *COMMON, f"checkpoint.dir={ck}", f"faults.inject=[{', '.join(plan)}]",
        f"faults.once_dir={tmp_path / 'fired'}", "--nnodes", "1:2", "--nproc-per-node", "1",
        "--rdzv-backend", "etcd-v2", "--rdzv-endpoint", etcd_server.endpoint,
        "--rdzv-id", "chaos", "--rdzv-conf", "last_call_timeout=3,join_timeout=120",
        "--max-restarts", "6", "--monitor-interval", "0.2", "--trace-samples", str(trace)),
        name=f"node{i}") for i in range(2)]
    for node in nodes:
        assert node.wait(timeout=400) == 0, f"plan {plan}\n" + node.output[-4000:]

    fired = sorted(p.name for p in (tmp_path / "fired").iterdir())
    assert len({name.split("-step-")[0] for name in fired}) == len(plan), (plan, fired)
    reports = audit.audit(trace)  # 19 steps of 64 samples per epoch: epochs 0-2 and part of 3
    assert [r.epoch for r in reports] == [0, 1, 2, 3], reports
    for r in reports:
        assert not r.duplicated and (r.ok or not r.complete), r
    assert all(r.complete for r in reports[:3])
    want, got = final_state(tmp_path / "ref"), final_state(ck)
    assert got["train_state"]["step"] == want["train_state"]["step"] == 60
    assert_same_tensors(want["model"], got["model"])
