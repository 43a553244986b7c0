"""Chaos: a 2-node job (two torchrun agents, one worker each, etcd-v2) under every kind of fault
once (crash, exception, eviction, hang, NaN streak), in a seeded order at seeded steps on seeded
ranks. The signals come from outside: the test sends SIGKILL and SIGTERM to the worker's pid;
the exception, the hang (a process really stuck in its step) and the NaN loss are injected in
the worker. The job must finish with an exact sample audit and the same final weights as a
fault-free run: the world size ends where it began, skipped NaN steps are rolled back and
replayed, and every other fault only costs redone steps. The restart path
(``recovery.mode=restart``, as under plain torchrun): in place across nodes is
``test_inplace_nodes.py``'s."""

from __future__ import annotations

import random
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from elastic_runner.data import audit

from .evidence import DIGITS_GLOBAL_BATCH, DIGITS_TRAIN, assert_exact_audit, assert_same_tensors
from .procs import CONFIGS, Job, cli, wait_until
from .test_outside_faults import trainers
from .test_train_torchrun import final_state

pytestmark = pytest.mark.slow

SEED = 20261121
COMMON = [str(CONFIGS / "digits.yaml"), "logging.tensorboard_dir=null",
          "early_stopping.enabled=false", "training.max_steps=60", "checkpoint.every_steps=5",
          "training.max_bad_steps=2", "watchdog.hang_timeout_seconds=3",
          "watchdog.long_op_timeout_seconds=120", "watchdog.dump_grace_seconds=1",
          "recovery.mode=restart"]


KINDS = ("sigkill", "raise", "sigterm", "hang", "nan")
OUTSIDE = {"sigkill": signal.SIGKILL, "sigterm": signal.SIGTERM}  # sent by the test
# rank 0 takes 50 ms longer per step in every attempt: the test sees each target step coming
PACE = "{kind: slow, rank: 0, step: 1, count: 100000, seconds: 0.05, attempts: 99}"


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int

    def spec(self) -> str:
        """The ``faults.inject`` entry of an injected kind (once per job: ``once_dir``)."""
        extra = ", count: 2" if self.kind == "nan" else ""  # a streak: forces the rollback
        return f"{{kind: {self.kind}, rank: {self.rank}, step: {self.step}, attempts: 99{extra}}}"


def fault_plan(seed: int) -> list[Fault]:
    """Every kind once, in a seeded order, at seeded steps 6-12 apart, on seeded ranks."""
    rng = random.Random(seed)
    kinds = list(KINDS)
    rng.shuffle(kinds)
    return [Fault(kind, rng.randrange(2), 5 + 9 * i + rng.randrange(4))
            for i, kind in enumerate(kinds)]


def progressed(trace: Path, step: int, since: float) -> bool:
    """A rank committed step ``step`` or a later one after the unix time ``since``."""
    return any(e["step"] >= step and e["time"] > since
               for e in audit.read_entries(trace) if "indices" in e)


def send(nodes: list[Job], fault: Fault) -> tuple[int, int]:
    """Signal the worker that is rank ``fault.rank`` now; returns (its node, its pid)."""
    for i, node in enumerate(nodes):
        worker = trainers(node).get(fault.rank)
        if worker is not None:
            worker.send_signal(OUTSIDE[fault.kind])
            return i, worker.pid
    raise AssertionError(f"no worker is rank {fault.rank}")


def inflict(plan: list[Fault], nodes: list[Job], trace: Path, fired: Path) -> dict[Fault, int]:
    """Wait for each fault's step in plan order: send the outside ones, wait for the injected
    ones to fire. Returns the pid each outside signal went to."""
    injected = [f for f in plan if f.kind not in OUTSIDE]
    pids: dict[Fault, int] = {}
    since = 0.0
    for fault in plan:
        if fault.kind in OUTSIDE:
            # a step at or past the target, trained by the group formed after the last fault
            wait_until(lambda f=fault, t=since: progressed(trace, f.step, t), 240,
                       f"step {fault.step} for {fault}", poll=0.01)
            node, pids[fault] = send(nodes, fault)
            # the node's agent saw it die (SIGKILL), or both ranks left with 143 (SIGTERM)
            wait_until(lambda n=node, p=pids[fault]: f"(pid: {p})" in nodes[n].output, 60,
                       f"node {node}'s agent to see {fault}")
        else:
            marker = fired / f"fault-{injected.index(fault)}-step-{fault.step}"
            wait_until(marker.exists, 240, f"{fault} to fire")
        since = time.time()
    return pids


def test_every_fault_kind_once_on_two_nodes(launch, etcd_server, tmp_path):
    ref = launch(cli("run", *COMMON, f"checkpoint.dir={tmp_path / 'ref'}"), name="reference")
    assert ref.wait(timeout=240) == 0, ref.output[-3000:]

    plan = fault_plan(SEED)
    assert sorted(f.kind for f in plan) == sorted(KINDS), plan
    specs = [f.spec() for f in plan if f.kind not in OUTSIDE]
    ck, trace, fired = tmp_path / "ck", tmp_path / "trace", tmp_path / "fired"
    nodes = [launch(cli(
        "run", *COMMON, f"checkpoint.dir={ck}", f"faults.inject=[{', '.join([*specs, PACE])}]",
        f"faults.once_dir={fired}", "--nnodes", "1:2", "--nproc-per-node", "1",
        "--rdzv-backend", "etcd-v2", "--rdzv-endpoint", etcd_server.endpoint,
        "--rdzv-id", "chaos", "--rdzv-conf", "last_call_timeout=3,join_timeout=120",
        "--max-restarts", "6", "--monitor-interval", "0.2", "--trace-samples", str(trace)),
        name=f"node{i}") for i in range(2)]
    pids = inflict(plan, nodes, trace, fired)
    for node in nodes:
        assert node.wait(timeout=400) == 0, f"plan {plan}\n" + node.output[-4000:]
    log = "".join(node.output for node in nodes)
    for fault in plan:  # each one happened, as planned
        assert happened(fault, log, pids.get(fault), ck), (fault, plan)

    names = sorted(p.name for p in fired.iterdir())
    assert len({name.split("-step-")[0] for name in names}) == len(specs), (plan, names)
    # 19 steps of 64 samples per epoch: epochs 0-2 and part of 3; the restart path only (each
    # resume rewinds the trace to a checkpoint every rank reached): nothing repaired
    reports = assert_exact_audit(trace, steps=60, global_batch=DIGITS_GLOBAL_BATCH,
                                 num_samples=DIGITS_TRAIN)
    assert [r.epoch for r in reports] == [0, 1, 2, 3], reports
    want, got = final_state(tmp_path / "ref"), final_state(ck)
    assert got["train_state"]["step"] == want["train_state"]["step"] == 60
    assert_same_tensors(want["model"], got["model"])


def happened(fault: Fault, log: str, pid: int | None, ck: Path) -> bool:
    """The log lines that show ``fault`` took place (``pid``: where an outside signal went)."""
    r, s = fault.rank, fault.step
    if fault.kind == "sigkill":
        return f"failed (exitcode: -9) local_rank: 0 (pid: {pid})" in log
    if fault.kind == "sigterm":  # both ranks checkpointed the same step, resumed from it
        saved = {int(n) for n in _PREEMPTED.findall(log)}
        return (f"[rank{r}] WARNING elastic_runner.preempt: received SIGTERM" in log
                and f"failed (exitcode: 143) local_rank: 0 (pid: {pid})" in log
                and len(_PREEMPTED.findall(log)) == 2 and len(saved) == 1 and min(saved) >= s
                and f"resumed from {ck}/step-{min(saved):08d}: step {min(saved)}," in log)
    if fault.kind == "raise":
        return f"InjectedFault: fault injection: rank {r} raises after step {s}" in log
    if fault.kind == "hang":
        return (f"fault injection: rank {r} hangs in step {s}" in log
                and f"rank {r}: step {s} exceeded its 3 s budget (hang)" in log)
    return (f"step {s}: non-finite loss or gradient" in log
            and f"step {s + 1}: non-finite loss or gradient" in log
            and "rolling back to the last valid checkpoint after 2 non-finite steps" in log)


_PREEMPTED = re.compile(r"WARNING elastic_runner\.worker: preempted by signal after step (\d+);")
