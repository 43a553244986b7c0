"""Soak: one long training under 100+ faults injected from outside, one at a time, seeded.

The job: the digits task on 2 nodes x 2 workers, i.e. two ``elastic-runner run`` agents on
loopback (``--nnodes 2:2 --nproc-per-node 2``) with the etcd-v2 rendezvous against a real etcd
(``tests/etcd.py``), ``--max-restarts 10000``, a sample trace (``--trace-samples``) and a
checkpoint every ``--every-steps`` (5) steps; evaluation only after the last step. ``2:2``
rather than ``1:2``: a lost node stops the group until it returns, so the world size stays 4
and the final weights must equal an uninterrupted run's bitwise (a group that went on at world
size 2 would sum its gradients in another order). ``distributed.ddp.find_unused_parameters=true``
(:data:`EXACT_DDP`): with the default, DDP rebuilds its gradient buckets after the first
iteration of every attempt, so the first step after a restart all-reduces in another bucket
layout than the uninterrupted run did at that step; with 4 ranks the ring then adds each element
in another order and the weights drift by a few ulps (2 ranks hide it: a + b == b + a).

``--min-nodes 1`` runs the job at ``--nnodes 1:2`` instead: a node that leaves (killed,
preempted, or taken out by its worker's SIGTERM) no longer stops the group; the other node goes
on without it in place (``recovery/membership.py``: ranks renumbered, the global batch constant), and the
driver starts it again, to join in place, before the next fault (:func:`restore`). The class
``node-preempt`` is added. The world size changes, so there is no reference run (the weights
differ in summation order); the audit still must be exact. An etcd outage longer than the
rendezvous keep-alive lapse followed by a node that returns is the case that once (seed 20261122,
fault 9) ended with the returning node in a rendezvous round of its own beside the running one,
fenced: torch's handler drops its own node after such an outage; ``compat`` fix 2 now keeps it
(``tests/test_etcd.py``). The same ending came back once more (2026-11-25, fault 45: an outage at
fault 39, then a node SIGKILLed and started again): with etcd SIGSTOPped the reads hung instead of
failing, so no grace started; a hung read now starts it too. ``tests/test_soak.py`` runs this mode with 5 faults, without outages.

Fault classes (the plan holds every class ``n // 7`` times, the remainder drawn; the order, the
victims and the variants come from ``random.Random(seed)``):

* ``worker-sigkill`` / ``worker-sigterm``: the signal to one worker (by rank, by pid; a
  replaced rank's replacement, by the pid in its trace entries): a SIGKILL is recovered in place
  (the agents' recovery store is a TCPStore in an agent; with etcd no node is special), a
  SIGTERM is a preemption (the restart path);
* ``worker-hang``: SIGSTOP of one worker; its agent finds its heartbeat stale
  (``recovery.heartbeat_timeout_seconds``, :attr:`Settings.heartbeat_timeout_s`, below the step
  watchdog's ``hang_timeout_s``), kills it and replaces it in place; were the watchdog first,
  its peers would report the hang and the group restart; SIGCONT once either was logged;
* ``node-kill``: SIGKILL of one node's agent and its workers (by pid; torchrun workers live in
  their own sessions), then that node's agent is started again;
* ``node-preempt`` (``--min-nodes 1``): SIGTERM to one node's agent (a pod eviction): its workers
  leave at the next step boundary, its agent exits 143, and it is started again;
* ``etcd-outage``: etcd SIGSTOPped (a hung server) or SIGKILLed, for at least ``hold_s`` seconds
  and until the job committed 5 steps without it, then SIGCONTed or restarted (same data dir);
* ``ckpt-corrupt``: once a checkpoint was committed, every worker is SIGSTOPped, the newest
  checkpoint has its ``state.pt`` truncated or one bit flipped (a new file: a hard-linked best
  checkpoint keeps its bytes), and every worker is SIGKILLed: with no survivor to copy, the
  replacements must resume from an older checkpoint;
* ``nan``: ``nan rank=R`` written to the job's ``faults.trigger_file`` (``train/faults.py``): rank R's
  next loss is NaN and every rank must skip that update (the trace marks it ``skipped``).

One at a time: a fault is injected only after the job recovered from the previous one and then
committed a new checkpoint and a step after it (so a crash-loop guard sees checkpoint progress);
every wait polls the agents' logs and the sample trace (no sleep stands in for an event).

Per fault: ``path`` (``in_place``: an ``in-place recovery N done`` line, no checkpoint read;
``restart``: rank 0 resumed from a checkpoint), ``recovery_s`` = the fault -> the first step
committed after the recovery (after the resume for a restart; after etcd is back for an outage;
the first committed step after the skipped one for a NaN); ``steps_redone`` = the last step
committed before the fault minus the step the group went on from. For the job: completed (both agents exit 0, the final checkpoint is at
``max_steps``), the sample audit per completed epoch (``elastic_runner.data.audit``), resumes from a
checkpoint that the driver had corrupted (must be 0; read from the ``resumed from`` lines), and
the final model tensors against a reference run of the same config (same launch, no faults
except NaNs at the steps the soak skipped, so both skip the same updates), bitwise.

    python -m bench.soak [--faults 100] [--seed 20261122] [--steps N] [--every-steps 5]
                         [--outage-seconds 2 10] [--dir DIR] [--json docs/bench/soak.json]
                         [--timeout 5400] [--min-nodes 1]
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import fcntl
import json
import os
import random
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil
import torch

from elastic_runner.checkpoint import storage as ckpt
from elastic_runner.data import audit
from tests.etcd import EtcdServer
from tests.procs import CONFIGS, Job, cli

CLASSES = ("worker-sigkill", "worker-sigterm", "worker-hang", "node-kill", "etcd-outage",
           "ckpt-corrupt", "nan")
# --min-nodes 1: nodes leave and join the running group in place (recovery/membership.py)
MEMBERSHIP_CLASSES = (*CLASSES, "node-preempt")
PREEMPTED = 143  # a node's agent after SIGTERM, or after its node left in place
LEAVES = ("node-kill", "node-preempt", "worker-sigterm")  # --min-nodes 1: a node leaves
REJOIN_S = 12.0  # seconds a node that left may take to start again and join (2 cores)
NODES = ("a", "b")
FULL_GLOBAL_BATCH = 128  # 2 nodes x 2 ranks x micro-batch 16 x accumulation 2 (digits.yaml)
WORLD = 4  # 2 nodes x 2 workers
# a lost node is declared dead after 1 s x 8 missed keep-alives
RDZV_CONF = "last_call_timeout=4,join_timeout=300,keep_alive_interval=1,keep_alive_max_attempt=8"
OUTAGE_STEPS = 5  # steps the job must commit while etcd is down before it comes back
STEP_RATE_CAP = 50.0  # steps/s this job can reach on 2 cores (it does ~15-35): step budget
# DDP rebuilds its gradient buckets in the order the gradients became ready, after the first
# iteration of every attempt: a restarted group's first step all-reduces in the initial bucket
# layout, the uninterrupted run's in the rebuilt one, and with more than 2 ranks the ring sums
# each element in another order (a few ulps, see the module docstring). No unused-parameter
# search means no rebuild: one layout in every attempt.
EXACT_DDP = ("distributed.ddp.find_unused_parameters=true",)
POLL_S = 0.1
# log stamps are cut to the millisecond: an event logged within 1 ms of the driver's clock
# reading (a NaN request consumed at once) reads as earlier than it
LOG_SLACK_S = 0.001


class SoakError(RuntimeError):
    """The job failed a fault (not recovered in time, or an agent exited)."""


# ---------------------------------------------------------------- the plan


@dataclass
class Fault:
    """One planned fault. ``rank``: the victim worker (worker faults; the NaN's rank; a
    corruption always kills rank 0); ``node``: ``node-kill``'s node; ``variant``: ``etcd-outage``
    ``sigstop``/``sigkill``, ``ckpt-corrupt`` ``truncate``/``bitflip``; ``hold_s``: the least
    seconds etcd stays down; ``where``: the corruption's place in the file (fraction)."""

    index: int
    kind: str
    rank: int
    node: str
    variant: str = ""
    hold_s: float = 0.0
    where: float = 0.0


def classes(min_nodes: int) -> tuple[str, ...]:
    """The fault classes of a soak at ``--nnodes MIN:2``: with 1, nodes also leave in place."""
    return MEMBERSHIP_CLASSES if min_nodes < len(NODES) else CLASSES


def make_plan(seed: int, n: int, hold_s: tuple[float, float] = (2.0, 10.0),
              kinds_of: tuple[str, ...] = CLASSES) -> list[Fault]:
    """``n`` faults: every class of ``kinds_of`` ``n // k`` times plus ``n % k`` distinct
    drawn classes (``k`` classes), in a seeded order with seeded victims and variants; etcd
    outages last ``hold_s`` (a range, seconds; beyond 8 s the agents' keep-alives lapse).

    Raises:
        ValueError: ``n`` is smaller than the number of classes.
    """
    if n < len(kinds_of):
        raise ValueError(f"--faults: at least {len(kinds_of)} (one per class), got {n}")
    rng = random.Random(seed)
    kinds = list(kinds_of) * (n // len(kinds_of)) + rng.sample(kinds_of, n % len(kinds_of))
    rng.shuffle(kinds)
    plan = []
    for i, kind in enumerate(kinds):
        variant = {"etcd-outage": rng.choice(["sigstop", "sigkill"]),
                   "ckpt-corrupt": rng.choice(["truncate", "bitflip"])}.get(kind, "")
        plan.append(Fault(i, kind, rank=rng.randrange(WORLD), node=rng.choice(NODES),
                          variant=variant, hold_s=round(rng.uniform(*hold_s), 1),
                          where=round(rng.random(), 4)))
    return plan


@dataclass
class Settings:
    """The job and the driver's bounds. ``steps``: ``training.max_steps``; ``every_steps``:
    the checkpoint cadence; ``hang_timeout_s``: the step watchdog; ``fault_timeout_s``: one
    fault, from its injection to the progress after it; ``timeout_s``: the whole soak;
    ``min_nodes``: ``--nnodes MIN:2`` (1: a node that leaves, the group goes on without it in
    place, and the driver starts it again to join in place)."""

    steps: int
    every_steps: int = 5
    min_nodes: int = 2
    hang_timeout_s: float = 6.0
    heartbeat_timeout_s: float = 3.0
    fault_timeout_s: float = 300.0
    timeout_s: float = 5400.0


def cost(f: Fault, every_steps: int, elastic: bool = False) -> int:
    """The most steps ``f`` and the pacing after it may take: ~2 checkpoint intervals of net
    progress plus a few steps of reaction time; an etcd outage trains on meanwhile, and so does
    the smaller group while a node that left starts again (``elastic``)."""
    hold = f.hold_s if f.kind == "etcd-outage" else 0.0
    if elastic and f.kind in LEAVES:
        hold = REJOIN_S
    return 2 * every_steps + 6 + int(hold * STEP_RATE_CAP)


def default_steps(plan: list[Fault], every_steps: int = 5, elastic: bool = False) -> int:
    """``training.max_steps`` that leaves room for every fault of ``plan``, then a tail."""
    return sum(cost(f, every_steps, elastic) for f in plan) + 60


# ---------------------------------------------------------------- watching the job

_LINE = re.compile(r"^(\d\d:\d\d:\d\d\.\d{3}) (?:\[rank(\d+)\] )?[A-Z]+ \S+: (.*)$")
_RESUMED = re.compile(r"^resumed from (\S+): step (\d+)")
_COMMITTED = re.compile(r"^committed checkpoint (.+) \(written in")
_SKIPPING = re.compile(r"^skipping checkpoint (\S+): (.*)$")
_POISON = re.compile(r"^fault injection: rank (\d+) poisons its loss at step (\d+)")
_HANG = re.compile(r"^rank \d+: .* exceeded its .* budget \(hang\)")
_IN_PLACE = re.compile(r"^in-place recovery (\d+) done: step (\d+) committed")
_HEARTBEAT = re.compile(r"^local_rank \d+ \(pid \d+\) sent no heartbeat")


@dataclass
class Events:
    """Timestamped (unix seconds) events read from every agent log of the job."""

    resumes: list[tuple[float, str, int]] = field(default_factory=list)  # rank 0's lines
    commits: list[tuple[float, str, int]] = field(default_factory=list)  # step checkpoints
    skips: list[tuple[float, str, str]] = field(default_factory=list)
    poisons: list[tuple[float, int, int]] = field(default_factory=list)
    hangs: list[float] = field(default_factory=list)  # a watchdog's report, or a heartbeat kill
    # (generation, the first step committed after it) -> (t, that step); generations count
    # from 1 in every attempt (a restart starts a new one), so the step tells them apart
    in_place: dict[tuple[int, int], tuple[float, int]] = field(default_factory=dict)

    def add(self, t: float, rank: int | None, text: str) -> None:
        if (m := _RESUMED.match(text)) and rank == 0:
            self.resumes.append((t, m[1], int(m[2])))
        elif m := _COMMITTED.match(text):
            for path in m[1].split(", "):
                if (name := re.match(r"step-(\d{8})$", Path(path).name)) is not None:
                    self.commits.append((t, path, int(name[1])))
        elif m := _SKIPPING.match(text):
            self.skips.append((t, m[1], m[2]))
        elif m := _POISON.match(text):
            self.poisons.append((t, int(m[1]), int(m[2])))
        elif _HANG.match(text) or _HEARTBEAT.match(text):
            self.hangs.append(t)
        elif m := _IN_PLACE.match(text):
            self.in_place.setdefault((int(m[1]), int(m[2])), (t, int(m[2])))


class LogTail:
    """New complete lines of a growing log file."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.partial = path, 0, b""

    def lines(self) -> list[str]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        *done, self.partial = (self.partial + data).split(b"\n")
        return [ln.decode(errors="replace") for ln in done]


class TraceTail:
    """The sample trace's step entries, read incrementally: a rank file that was rewound (a new
    inode, ``audit.rewind``) is read again from its start."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._files: dict[Path, tuple[int, int, bytes, list[dict[str, Any]]]] = {}

    def poll(self) -> None:
        for path in sorted(self.directory.glob("rank-*.jsonl")):
            try:
                st = path.stat()
                ino, offset, partial, entries = self._files.get(path, (st.st_ino, 0, b"", []))
                if ino != st.st_ino or st.st_size < offset:
                    ino, offset, partial, entries = st.st_ino, 0, b"", []
                with open(path, "rb") as f:
                    f.seek(offset)
                    data = f.read()
            except FileNotFoundError:
                continue
            *done, partial = (partial + data).split(b"\n")
            for line in done:
                with contextlib.suppress(ValueError):
                    e = json.loads(line)
                    if "time" in e:
                        entries.append(e)
            self._files[path] = (ino, offset + len(data), partial, entries)

    def entries(self) -> Iterator[dict[str, Any]]:
        for _, _, _, entries in self._files.values():
            yield from entries

    def last_step(self) -> int:
        return max((e["step"] for e in self.entries()), default=0)

    def first_commit_after(self, t: float, step_above: int = 0, applied: bool = False,
                           world_size: int | None = None) -> tuple[float, int] | None:
        """(time, step) of the first step entry after ``t`` (and above ``step_above``;
        ``applied``: not a skipped update; at ``world_size``, if given)."""
        found = [(e["time"], e["step"]) for e in self.entries() if e["time"] > t
                 and e["step"] > step_above and not (applied and e.get("skipped"))
                 and world_size in (None, e.get("world_size"))]
        return min(found) if found else None

    def newest_full(self, rank: int, world_size: int) -> dict[str, Any] | None:
        """``rank``'s entry of the newest recent step that all ``world_size`` ranks committed at
        that world size (each rank file's last 50 entries), or None."""
        steps: dict[int, dict[int, dict[str, Any]]] = {}
        for _, _, _, entries in self._files.values():
            for e in entries[-50:]:
                if e.get("world_size") == world_size and "pid" in e:
                    steps.setdefault(e["step"], {})[e["rank"]] = e
        full = [step for step, ranks in steps.items() if len(ranks) == world_size]
        return steps[max(full)].get(rank) if full else None

    def steps_after(self, t: float) -> int:
        return len({e["step"] for e in self.entries() if e["time"] > t})


class Cluster:
    """The two nodes of one job around one etcd; a node that is killed and started again gets
    a new log (``node-b.2.log``); every log stays watched."""

    def __init__(self, workdir: Path, etcd: EtcdServer, settings: Settings, rdzv_id: str,
                 extra: tuple[str, ...] = ()) -> None:
        self.workdir, self.etcd, self.settings = workdir, etcd, settings
        self.ck, self.trace_dir = workdir / "ck", workdir / "trace"
        self.trigger = workdir / "trigger"
        self.rdzv_id, self.extra = rdzv_id, extra
        self.nodes: dict[str, Job] = {}
        self.killed: set[str] = set()  # nodes the driver killed and has not started again
        self.incarnations: dict[str, int] = {}
        self.logs: list[LogTail] = []
        self.events = Events()
        self.trace = TraceTail(self.trace_dir)
        self.day = datetime.now().date()
        self.t0 = time.time()
        workdir.mkdir(parents=True, exist_ok=True)

    def argv(self) -> list[str]:
        s = self.settings
        return cli("run", str(CONFIGS / "digits.yaml"), "logging.tensorboard_dir=null",
                   "early_stopping.enabled=false", f"checkpoint.dir={self.ck}",
                   f"checkpoint.every_steps={s.every_steps}", "training.log_every_steps=10",
                   f"training.max_steps={s.steps}", "training.max_epochs=100000",
                   f"eval.every_steps={s.steps + 1}",
                   f"watchdog.hang_timeout_seconds={s.hang_timeout_s}",
                   f"recovery.heartbeat_timeout_seconds={s.heartbeat_timeout_s}",
                   "recovery.spare_delay_seconds=2",
                   "watchdog.long_op_timeout_seconds=300", "watchdog.dump_grace_seconds=1",
                   f"faults.trigger_file={self.trigger}", *EXACT_DDP, *self.constant_batch(),
                   *self.extra,
                   "--nnodes", f"{s.min_nodes}:{len(NODES)}", "--nproc-per-node", "2",
                   "--rdzv-backend", "etcd-v2",
                   "--rdzv-endpoint", self.etcd.endpoint, "--rdzv-id", self.rdzv_id,
                   "--rdzv-conf", RDZV_CONF, "--max-restarts", "10000",
                   "--monitor-interval", "0.2", "--trace-samples", str(self.trace_dir))

    def constant_batch(self) -> list[str]:
        """``--min-nodes 1``: the global batch of the full world (4 ranks x 16 x 2), so that a
        world of 2 accumulates 4 micro-batches instead of halving it."""
        return [f"batch.global_batch_size={FULL_GLOBAL_BATCH}"] if self.elastic else []

    def start(self, name: str) -> None:
        self.killed.discard(name)
        n = self.incarnations[name] = self.incarnations.get(name, 0) + 1
        log = self.workdir / (f"node-{name}.log" if n == 1 else f"node-{name}.{n}.log")
        self.nodes[name] = Job(self.argv(), log)
        self.logs.append(LogTail(log))

    def kill_node(self, name: str) -> None:
        """SIGKILL of the node's agent and all its workers, by pid; waits until they are gone."""
        self.killed.add(name)
        self.nodes[name].kill_all()

    def close(self) -> None:
        for job in self.nodes.values():
            with contextlib.suppress(Exception):
                job.kill_all()

    def unix(self, hms: str) -> float:
        t = datetime.combine(self.day, datetime.strptime(hms, "%H:%M:%S.%f").time()).timestamp()
        return t + 86400 if t < self.t0 - 3600 else t  # the soak crossed midnight

    def update(self) -> None:
        for tail in self.logs:
            for line in tail.lines():
                if m := _LINE.match(line):
                    self.events.add(self.unix(m[1]), int(m[2]) if m[2] else None, m[3])
        self.trace.poll()

    @property
    def elastic(self) -> bool:
        """Nodes leave and join in place (``--nnodes 1:2``)."""
        return self.settings.min_nodes < len(NODES)

    def check_alive(self, what: str = "") -> None:
        for name, job in self.nodes.items():
            if (rc := job.proc.poll()) is not None and name not in self.killed and not (
                    self.elastic and rc == PREEMPTED):
                raise SoakError(f"node {name}'s agent exited with code {rc} while waiting for "
                                f"{what} (last step seen {self.trace.last_step()}); log tail:\n"
                                + job.output[-3000:])

    def wait(self, predicate: Callable[[], Any], timeout: float, what: str,
             alive: bool = True) -> Any:
        """Poll the logs and the trace until ``predicate()`` is truthy; its value.

        Raises:
            SoakError: ``timeout`` seconds passed, or (``alive``) an agent exited.
        """
        deadline = time.monotonic() + timeout
        while True:
            self.update()
            if value := predicate():
                return value
            if alive:
                self.check_alive(what)
            if time.monotonic() > deadline:
                raise SoakError(f"timed out after {timeout:.0f} s waiting for {what} (last step "
                                f"seen {self.trace.last_step()})")
            time.sleep(POLL_S)

    def worker(self, rank: int) -> psutil.Process:
        """The live process of global ``rank``: the one that committed that rank's part of one of
        the newest steps at the full world size (waits for the group to be complete). By the
        trace's ``pid``: replacements and joined nodes start as spares (no RANK variable), and
        ranks are renumbered when a node leaves."""
        def find() -> psutil.Process | None:
            self.update()
            entry = self.trace.newest_full(rank, WORLD)
            with contextlib.suppress(psutil.NoSuchProcess):
                if entry is not None and entry["step"] >= self.trace.last_step() - 2:
                    p = psutil.Process(entry["pid"])
                    if p.status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_STOPPED):
                        return p
            return None
        return self.wait(find, 60, f"the worker of rank {rank}")

    def resume_after(self, t: float) -> tuple[float, str, int] | None:
        return next((r for r in self.events.resumes if r[0] > t - LOG_SLACK_S), None)

    def in_place_after(self, t: float) -> tuple[float, int] | None:
        return next((r for r in sorted(self.events.in_place.values()) if r[0] > t - LOG_SLACK_S),
                    None)

    def commit_after(self, t: float) -> tuple[float, str, int] | None:
        return next((c for c in self.events.commits if c[0] > t - LOG_SLACK_S), None)

    def request_nan(self, rank: int) -> None:
        """Append ``nan rank=R`` to the trigger file under its flock (as the workers take it)."""
        with open(self.trigger, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            f.write(f"nan rank={rank}\n")


# ---------------------------------------------------------------- the faults


def _after_restart(c: Cluster, t_fault: float, last_before: int) -> dict[str, Any]:
    """Wait for the group to recover after ``t_fault`` (in place, or resumed from a
    checkpoint) and commit a step; the recovery."""
    def recovered() -> dict[str, Any] | None:
        if (r := c.resume_after(t_fault)) and (first := c.trace.first_commit_after(r[0])):
            return {"path": "restart", "t_recovered": first[0], "resumed_from": r[1],
                    "resumed_step": r[2], "steps_redone": max(0, last_before - r[2])}
        # the step the recovery line names, not the first entry after the fault: the other
        # ranks may commit the step in flight just after the kill (a 0.0 s "recovery")
        if ((done := c.in_place_after(t_fault))
                and (first := c.trace.first_commit_after(t_fault, step_above=done[1] - 1))):
            return {"path": "in_place", "t_recovered": first[0],
                    "steps_redone": max(0, last_before - (first[1] - 1))}
        return None

    rec = c.wait(recovered, c.settings.fault_timeout_s, "the group to recover and commit a step")
    return {**rec, "recovery_s": rec["t_recovered"] - t_fault}


def _last_step(c: Cluster) -> tuple[int, float]:
    """The last committed step, read now, and the time (the moment of the fault)."""
    c.update()
    return c.trace.last_step(), time.time()


def fault_worker_signal(c: Cluster, f: Fault, sig: signal.Signals) -> dict[str, Any]:
    victim = c.worker(f.rank)
    last, t = _last_step(c)
    victim.send_signal(sig)
    return {"t_fault": t, **_after_restart(c, t, last)}


def fault_worker_hang(c: Cluster, f: Fault) -> dict[str, Any]:
    victim = c.worker(f.rank)
    last, t = _last_step(c)
    victim.suspend()  # SIGSTOP
    try:
        t_seen = c.wait(lambda: next((h for h in c.events.hangs if h > t - LOG_SLACK_S), None),
                        c.settings.hang_timeout_s + 60,
                        "its agent's heartbeat check or a peer's watchdog to report the hang")
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):
            victim.resume()  # SIGCONT: the agent's SIGTERM, pending while stopped, ends it
    return {"t_fault": t, "detected_s": t_seen - t, **_after_restart(c, t, last)}


def fault_node_kill(c: Cluster, f: Fault) -> dict[str, Any]:
    """SIGKILL of a node's agent and workers. ``2:2``: it is started again at once and the
    group waits for it; ``1:2``: the other node goes on without it (found lost by its silent
    heartbeat, in place), and :func:`restore` starts it again afterwards."""
    c.worker(f.rank)  # the group is complete
    last, t = _last_step(c)
    c.kill_node(f.node)
    if not c.elastic:
        c.start(f.node)  # the node returns
    return {"t_fault": t, **_after_restart(c, t, last)}


def fault_node_preempt(c: Cluster, f: Fault) -> dict[str, Any]:
    """SIGTERM to a node's agent (a pod eviction): its workers leave at the next step boundary
    and the other node goes on at the smaller world size in place (when the node hosts the
    recovery store, the store moves to the other node's agent with the departure); its agent
    exits 143; :func:`restore` starts it again."""
    c.worker(f.rank)
    job = c.nodes[f.node]
    last, t = _last_step(c)
    job.proc.send_signal(signal.SIGTERM)
    rec = _after_restart(c, t, last)
    c.wait(lambda: job.proc.poll() is not None, 120, f"node {f.node}'s agent to exit",
           alive=False)
    return {"t_fault": t, **rec, "exit_code": job.proc.returncode}


def restore(c: Cluster) -> dict[str, Any]:
    """``1:2``: start again each node whose agent ended (killed, preempted, or its workers left
    with a worker's SIGTERM) and wait for a step at the full world size; ``join_path``:
    ``in_place`` when no rank resumed from a checkpoint meanwhile."""
    t0 = time.time()

    def settled() -> tuple[list[str]] | None:
        """A node that leaves ends its agent just after the others went on without it: wait
        for that, or for a step at the full world size (nothing left)."""
        gone = [name for name, job in c.nodes.items() if job.proc.poll() is not None]
        full = c.trace.first_commit_after(t0, world_size=WORLD)
        return (gone,) if gone or full else None

    (gone,) = c.wait(settled, c.settings.fault_timeout_s, "a node that left to end its agent, "
                     "or a step at the full world size", alive=False)
    t = time.time()
    for name in gone:
        c.start(name)
    t_full, _ = c.wait(lambda: c.trace.first_commit_after(t, world_size=WORLD),
                       c.settings.fault_timeout_s, "a step at the full world size")
    out: dict[str, Any] = {"t_rejoined": t_full, "world_sizes_after":
                           sorted({e["world_size"] for e in c.trace.entries()
                                   if e["time"] > t and e["time"] <= t_full})}
    if gone:
        out.update(returned=gone, rejoin_s=t_full - t,
                   join_path="restart" if c.resume_after(t) else "in_place")
    return out


def fault_etcd_outage(c: Cluster, f: Fault) -> dict[str, Any]:
    etcd = c.etcd
    assert etcd.proc is not None
    t = time.time()
    if f.variant == "sigstop":
        os.kill(etcd.proc.pid, signal.SIGSTOP)
    else:
        etcd.stop()
    near_end = c.settings.steps - 2 * c.settings.every_steps - 10
    try:
        c.wait(lambda: c.trace.steps_after(t) >= OUTAGE_STEPS and (
            time.time() >= t + f.hold_s or c.trace.last_step() >= near_end),
            c.settings.fault_timeout_s, f"{OUTAGE_STEPS} steps while etcd is down")
        steps_down, cut_short = c.trace.steps_after(t), time.time() < t + f.hold_s
    finally:
        if f.variant == "sigstop":
            os.kill(etcd.proc.pid, signal.SIGCONT)
        else:
            etcd.start()
    t_back = time.time()
    c.wait(etcd.healthy, 60, "etcd to answer /health again")
    t_rec, _ = c.wait(lambda: c.trace.first_commit_after(t_back), c.settings.fault_timeout_s,
                      "a step after etcd came back")
    return {"t_fault": t, "outage_s": t_back - t, "steps_during_outage": steps_down,
            "cut_short": cut_short,
            "t_recovered": t_rec, "recovery_s": t_rec - t_back, "steps_redone": 0}


def corrupt(state: Path, variant: str, where: float) -> None:
    """Truncate ``state`` at ``where`` (a fraction of its size) or flip one bit there; written
    as a new file so that a hard link (a best checkpoint of the same step) keeps its bytes."""
    data = bytearray(state.read_bytes())
    pos = min(len(data) - 1, int(where * len(data)))
    if variant == "truncate":
        data = data[:pos]
    else:
        data[pos] ^= 1 << (pos % 8)
    tmp = state.with_name(".soak-corrupt")
    tmp.write_bytes(bytes(data))
    os.replace(tmp, state)


def fault_ckpt_corrupt(c: Cluster, f: Fault, corrupted: list[tuple[float, str]]
                       ) -> dict[str, Any]:
    """Once a new checkpoint was committed: every worker SIGSTOPped (nothing commits now), the
    newest checkpoint corrupted, every worker SIGKILLed (no survivor holds the state: the
    replacements must resume from an older checkpoint)."""
    t_mark = time.time()
    c.wait(lambda: c.commit_after(t_mark), c.settings.fault_timeout_s,
           "a new checkpoint to corrupt")
    workers = [c.worker(rank) for rank in range(WORLD)]
    for p in workers:
        p.suspend()
    try:
        last, t = _last_step(c)
        newest = ckpt.latest_valid(c.ck)
        assert newest is not None  # one was just committed
        corrupt(Path(newest.path) / ckpt.STATE_FILE, f.variant, f.where)
        corrupted.append((t, newest.path))
    finally:
        for p in workers:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
    out = {"t_fault": t, "corrupted": newest.path, "corrupted_step": newest.step,
           **_after_restart(c, t, last)}
    out["warned"] = any(p == newest.path and ts > t for ts, p, _ in c.events.skips)
    return out


def fault_nan(c: Cluster, f: Fault) -> dict[str, Any]:
    c.worker(f.rank)
    t = time.time()
    c.request_nan(f.rank)
    _, _, step = c.wait(lambda: next((p for p in c.events.poisons if p[0] > t - LOG_SLACK_S
                                      and p[1] == f.rank), None),
                        c.settings.fault_timeout_s, f"rank {f.rank} to take the NaN request")

    def after() -> tuple[float, int] | None:
        ranks = {e["rank"] for e in c.trace.entries() if e["step"] == step}
        return c.trace.first_commit_after(t, step, applied=True) if len(ranks) == WORLD \
            else None

    t_rec, _ = c.wait(after, c.settings.fault_timeout_s, f"step {step} on every rank and one "
                      "applied step after it")
    flags = [bool(e.get("skipped")) for e in c.trace.entries() if e["step"] == step]
    return {"t_fault": t, "nan_step": step, "skipped_on_all_ranks": all(flags),
            "t_recovered": t_rec, "recovery_s": t_rec - t, "steps_redone": 0}


def inject(c: Cluster, f: Fault, corrupted: list[tuple[float, str]]) -> dict[str, Any]:
    """Inject ``f`` and wait for the recovery; the record (without the pacing after it)."""
    if f.kind == "worker-sigkill":
        return fault_worker_signal(c, f, signal.SIGKILL)
    if f.kind == "worker-sigterm":
        return fault_worker_signal(c, f, signal.SIGTERM)
    if f.kind == "worker-hang":
        return fault_worker_hang(c, f)
    if f.kind == "node-kill":
        return fault_node_kill(c, f)
    if f.kind == "node-preempt":
        return fault_node_preempt(c, f)
    if f.kind == "etcd-outage":
        return fault_etcd_outage(c, f)
    if f.kind == "ckpt-corrupt":
        return fault_ckpt_corrupt(c, f, corrupted)
    if f.kind == "nan":
        return fault_nan(c, f)
    raise ValueError(f"unknown fault class {f.kind!r} (allowed: "
                     f"{', '.join(MEMBERSHIP_CLASSES)})")


def survived(f: Fault, rec: dict[str, Any]) -> bool:
    """The class's own outcome on top of the recovery itself."""
    if f.kind == "ckpt-corrupt":  # the corrupted one was the newest: an older one, not it
        return rec.get("path") == "restart" and rec["resumed_from"] != rec["corrupted"] and \
            rec["resumed_step"] < rec["corrupted_step"]
    if f.kind == "nan":
        return rec["skipped_on_all_ranks"] and rec["restarts"] == 0
    if f.kind == "etcd-outage":
        return rec["restarts"] == 0
    if f.kind == "node-preempt":
        return rec["exit_code"] == PREEMPTED
    return True


def progress(c: Cluster, after: float) -> float:
    """Wait for a checkpoint committed after ``after`` and a step after it; the step's time."""
    _, _, step = c.wait(lambda: c.commit_after(after), c.settings.fault_timeout_s,
                        "a checkpoint after the recovery")
    t, _ = c.wait(lambda: c.trace.first_commit_after(after, step), c.settings.fault_timeout_s,
                  f"a step after the checkpoint of step {step}")
    return t


# ---------------------------------------------------------------- the run


def corrupt_resumes(events: Events, corrupted: list[tuple[float, str]]) -> list[dict[str, Any]]:
    """Resumes from a path the driver corrupted that was not committed anew in between."""
    bad = []
    for t_r, path, step in events.resumes:
        for t_c, p in corrupted:
            rewritten = any(p == q and t_c < t_w < t_r for t_w, q, _ in events.commits)
            if p == path and t_c < t_r and not rewritten:
                bad.append({"time": t_r, "path": path, "step": step})
    return bad


def epoch_audit(trace: Path) -> list[dict[str, Any]]:
    return [{"epoch": r.epoch, "complete": r.complete, "expected": r.expected,
             "seen_once": r.seen_once, "lost": len(r.missing), "duplicated": len(r.duplicated)}
            for r in audit.audit(trace)]


def final_model(ck: Path) -> tuple[int, dict[str, torch.Tensor]]:
    info = ckpt.latest_valid(ck)
    if info is None:
        raise SoakError(f"no valid checkpoint in {ck}")
    state = ckpt.load_state(info.path)
    return state["train_state"]["step"], state["model"]


def compare(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, Any]:
    same_keys = a.keys() == b.keys()
    diffs = [(a[k].double() - b[k].double()).abs().max().item() for k in a if k in b]
    return {"bitwise": bool(a) and same_keys and all(torch.equal(a[k], b[k]) for k in a),
            "max_abs_diff": max(diffs, default=float("nan")), "tensors": len(a)}


def wait_done(c: Cluster, timeout: float) -> dict[str, int]:
    """Wait for both agents to exit; their exit codes."""
    c.wait(lambda: all(j.proc.poll() is not None for j in c.nodes.values()), timeout,
           "the job to finish", alive=False)
    return {name: job.proc.returncode for name, job in c.nodes.items()}


def run_soak(plan: list[Fault], settings: Settings, workdir: Path, etcd: EtcdServer,
             save: Callable[[dict[str, Any]], None] = lambda r: None) -> dict[str, Any]:
    """The soak of ``plan``; its record (``save`` gets the partial record after each fault)."""
    t0 = time.time()
    result: dict[str, Any] = {"faults": [], "settings": asdict(settings),
                              "plan": [asdict(f) for f in plan]}
    corrupted: list[tuple[float, str]] = []
    c = Cluster(workdir / "soak", etcd, settings, f"soak-{time.time_ns()}")
    try:
        for name in NODES:
            c.start(name)
        t_ok = c.wait(lambda: c.trace.first_commit_after(0.0), settings.fault_timeout_s,
                      "the first step")[0]
        t_ok = progress(c, t_ok)
        for f in plan:
            if time.time() - t0 > settings.timeout_s:
                raise SoakError(f"--timeout {settings.timeout_s:.0f} s reached before fault "
                                f"{f.index}")
            if c.trace.last_step() + cost(f, settings.every_steps, c.elastic) > \
                    settings.steps - 10:
                raise SoakError(f"the job may end (step {c.trace.last_step()} of "
                                f"{settings.steps}) during fault {f.index}: raise --steps")
            rec: dict[str, Any] = {**asdict(f), "survived": False}
            result["faults"].append(rec)
            t_inject = time.time()
            # a stuck driver shows where it waits (stderr), well before the fault's timeout
            faulthandler.dump_traceback_later(settings.fault_timeout_s / 2)
            try:
                rec.update(inject(c, f, corrupted))
                if c.elastic:  # nodes that left come back; the group grows to full size
                    rec.update(restore(c))
                t_ok = progress(c, rec.get("t_rejoined", rec["t_recovered"]))
            except Exception as e:
                rec["error"] = f"{type(e).__name__}: {e}"[:4000]
                t_ok = time.time()
                raise SoakError(f"fault {f.index} ({f.kind}): {rec['error']}") from e
            finally:
                faulthandler.cancel_dump_traceback_later()
                c.update()
                rec["restarts"] = sum(1 for r in c.events.resumes
                                      if rec.get("t_fault", t_inject) < r[0] <= t_ok)
                rec["survived"] = "error" not in rec and survived(f, rec)
                save(result)
        last = c.trace.last_step()
        rc = wait_done(c, settings.fault_timeout_s + 2.0 * (settings.steps - last))
    except SoakError as e:
        result["error"] = str(e)[:4000]
        rc = {name: job.proc.poll() for name, job in c.nodes.items()}
    finally:
        c.close()
        c.update()
    step = final_model(c.ck)[0] if ckpt.latest_valid(c.ck) else 0
    sizes = sorted({e["world_size"] for e in audit.read_entries(c.trace_dir) if "world_size" in e})
    result["job"] = {
        "completed": all(v == 0 for v in rc.values()) and step == settings.steps
                     and "error" not in result,
        "exit_codes": rc, "final_step": step, "world_sizes": sizes,
        "epochs": epoch_audit(c.trace_dir),
        "resumes": len(c.events.resumes),
        "corrupt_resumes": corrupt_resumes(c.events, corrupted),
        "node_starts": dict(c.incarnations)}
    result["soak_wall_s"] = time.time() - t0
    save(result)
    return result


def reference(result: dict[str, Any], settings: Settings, workdir: Path, etcd: EtcdServer
              ) -> dict[str, Any]:
    """The same job without faults, except NaNs at the steps the soak's final trace skipped
    (the rank that poisoned each, from its log); the final model compared with the soak's."""
    t0 = time.time()
    soak = workdir / "soak"
    skipped = sorted({e["step"] for e in audit.read_entries(soak / "trace") if e.get("skipped")})
    poisoned = {f["nan_step"]: f["rank"] for f in result["faults"] if "nan_step" in f}
    nans = [f"{{kind: nan, rank: {poisoned[s]}, step: {s}}}" for s in skipped if s in poisoned]
    full = replace(settings, min_nodes=len(NODES))  # both nodes from the first step
    c = Cluster(workdir / "reference", etcd, full, f"soak-ref-{time.time_ns()}",
                extra=(f"faults.inject=[{', '.join(nans)}]",))
    try:
        for name in NODES:
            c.start(name)
        rc = wait_done(c, settings.fault_timeout_s + 2.0 * settings.steps)
    finally:
        c.close()
    if any(rc.values()):
        raise SoakError(f"the reference run failed: {rc}; see {c.workdir}")
    out = {"exit_codes": rc, "skipped_steps": skipped,
           "unexplained_skips": [s for s in skipped if s not in poisoned],
           "wall_s": time.time() - t0}
    if ckpt.latest_valid(soak / "ck") is not None:
        step, want = final_model(c.ck)
        got_step, got = final_model(soak / "ck")
        out.update(compare(want, got), reference_step=step, soak_step=got_step)
    return out


def soak(plan: list[Fault], seed: int, settings: Settings, workdir: Path,
         save: Callable[[dict[str, Any]], None] = lambda r: None) -> dict[str, Any]:
    """The soak of ``plan`` (drawn with ``seed``), the reference run (at ``2:2`` only: where
    the world size changes, the weights differ in summation order anyway) and the summary,
    around one throw-away etcd in ``workdir``."""
    t0 = time.time()
    etcd_dir = workdir / "etcd"
    etcd_dir.mkdir(parents=True, exist_ok=True)
    etcd = EtcdServer(etcd_dir)
    result: dict[str, Any] = {}

    def saving(r: dict[str, Any]) -> None:
        result.update(r, seed=seed, wall_s=time.time() - t0)
        save(result)

    try:
        etcd.start()
        saving(run_soak(plan, settings, workdir, etcd, saving))
        if result["job"]["completed"] and settings.min_nodes >= len(NODES):
            try:
                result["job"]["final_weights"] = reference(result, settings, workdir, etcd)
            except SoakError as e:
                result["job"]["final_weights"] = {"error": str(e)[:4000]}
    finally:
        with contextlib.suppress(ProcessLookupError, OSError):
            if etcd.proc is not None:
                os.kill(etcd.proc.pid, signal.SIGCONT)
        etcd.stop()
    result["summary"] = summarize(result)
    result["passed"] = passed(result)
    saving(result)
    return result


# ---------------------------------------------------------------- report


def summarize(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per fault class: injected, survived, recovery (median, max, seconds), steps redone."""
    out = {}
    for kind in classes(result["settings"].get("min_nodes", len(NODES))):
        recs = [r for r in result["faults"] if r["kind"] == kind]
        times = [r["recovery_s"] for r in recs if "recovery_s" in r]
        redone = [r.get("steps_redone", 0) for r in recs]
        in_place = [r["recovery_s"] for r in recs
                    if r.get("path") == "in_place" and "recovery_s" in r]
        rejoins = [r for r in recs if "rejoin_s" in r]
        out[kind] = {"injected": len(recs), "survived": sum(r["survived"] for r in recs),
                     "rejoined": len(rejoins),
                     "rejoined_in_place": sum(r["join_path"] == "in_place" for r in rejoins),
                     "rejoin_median_s": statistics.median(r["rejoin_s"] for r in rejoins)
                     if rejoins else None,
                     "in_place": len(in_place),
                     "in_place_median_s": statistics.median(in_place) if in_place else None,
                     "recovery_median_s": statistics.median(times) if times else None,
                     "recovery_max_s": max(times) if times else None,
                     "steps_redone_total": sum(redone), "steps_redone_max": max(redone,
                                                                                default=0)}
    return out


def _s(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def table(result: dict[str, Any]) -> str:
    """The markdown tables of a soak record."""
    rows = ["| fault | injected | survived | in place (median s) | recovery median (s) | "
            "recovery max (s) | steps redone (total, max) | node back: in place of (median s) |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for kind, s in result["summary"].items():
        back = (f"{s['rejoined_in_place']} of {s['rejoined']} ({_s(s['rejoin_median_s'])})"
                if s.get("rejoined") else "-")
        rows.append(f"| {kind} | {s['injected']} | {s['survived']} | "
                    f"{s.get('in_place', 0)} ({_s(s.get('in_place_median_s'), 2)}) | "
                    f"{_s(s['recovery_median_s'])} | {_s(s['recovery_max_s'])} | "
                    f"{s['steps_redone_total']}, {s['steps_redone_max']} | {back} |")
    job = result.get("job", {})
    weights = job.get("final_weights", {})
    epochs = [e for e in job.get("epochs", []) if e["complete"]]
    lost = sum(e["lost"] for e in epochs)
    dup = sum(e["duplicated"] for e in epochs)
    bitwise = weights.get("bitwise")
    changed = len(job.get("world_sizes", [])) > 1
    rows += ["", "| job | |", "| --- | --- |",
             f"| seed | {result.get('seed')} |",
             f"| faults injected, survived | {len(result['faults'])}, "
             f"{sum(r['survived'] for r in result['faults'])} |",
             f"| completed | {'yes' if job.get('completed') else 'no'} "
             f"(step {job.get('final_step')}, exit codes {job.get('exit_codes')}) |",
             f"| samples lost, duplicated (over {len(epochs)} completed epochs) | {lost}, "
             f"{dup} |",
             f"| resumes, from a corrupted checkpoint | {job.get('resumes')}, "
             f"{len(job.get('corrupt_resumes', []))} |",
             f"| world sizes | {job.get('world_sizes')} |",
             f"| final weights vs uninterrupted run | "
             f"{'bitwise equal' if bitwise else 'n/a' if bitwise is None else 'differ'}"
             f"{' (the world size changed: another summation order)' if changed else ''}"
             f" (max abs diff {weights.get('max_abs_diff', float('nan')):.3g}) |",
             f"| wall time | {result.get('wall_s', 0) / 60:.1f} min (soak "
             f"{result.get('soak_wall_s', 0) / 60:.1f}, reference "
             f"{weights.get('wall_s', 0) / 60:.1f}) |"]
    if "error" in result:
        rows.append(f"| error | {result['error'].splitlines()[0]} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--faults", type=int, default=100)
    p.add_argument("--seed", type=int, default=20261122)
    p.add_argument("--steps", type=int, default=None,
                   help="training.max_steps (default: enough for the faults)")
    p.add_argument("--every-steps", type=int, default=5, help="checkpoint cadence (steps)")
    p.add_argument("--outage-seconds", type=float, nargs=2, default=[2.0, 10.0],
                   metavar=("MIN", "MAX"), help="range of the etcd outages' length")
    p.add_argument("--timeout", type=float, default=5400.0, help="the whole soak, seconds")
    p.add_argument("--min-nodes", type=int, choices=(1, 2), default=2,
                   help="--nnodes MIN:2 of the job; 1: nodes leave and join in place (adds "
                        "node-preempt; the world size changes, so no reference run: the "
                        "weights would differ in summation order)")
    p.add_argument("--dir", default=None, help="keep the runs here (default: a temporary "
                   "directory, removed when the soak passed)")
    p.add_argument("--json", default=None, help="write the record here, after every fault")
    args = p.parse_args(argv)
    if shutil.which("etcd") is None:
        p.error("etcd not on PATH (Debian: apt-get install etcd-server)")
    kinds = classes(args.min_nodes)
    if args.faults < len(kinds):
        p.error(f"--faults: at least {len(kinds)} (one per class), got {args.faults}")
    plan = make_plan(args.seed, args.faults, tuple(args.outage_seconds), kinds)
    settings = Settings(steps=args.steps or default_steps(plan, args.every_steps,
                                                          args.min_nodes < len(NODES)),
                        every_steps=args.every_steps, timeout_s=args.timeout,
                        min_nodes=args.min_nodes)

    def save(r: dict[str, Any]) -> None:
        if args.json:
            tmp = Path(args.json).with_suffix(".tmp")
            tmp.write_text(json.dumps(r, indent=1, default=str))
            os.replace(tmp, args.json)

    d = Path(args.dir or tempfile.mkdtemp(prefix="soak-"))
    result = soak(plan, args.seed, settings, d, save)
    print(table(result))
    if args.dir is None and passed(result):
        shutil.rmtree(d, ignore_errors=True)
    elif args.dir is None:  # a failed run's agent logs are what explains it
        print(f"the run's logs and checkpoints are kept in {d}", file=sys.stderr)
    return result


def passed(result: dict[str, Any]) -> bool:
    """Every fault survived, the job completed, the audit exact, no corrupt resume, and the
    final weights bitwise equal to the reference's where the world size never changed."""
    job = result.get("job", {})
    weights = job.get("final_weights", {})
    return (all(r["survived"] for r in result["faults"]) and bool(job.get("completed"))
            and all(e["lost"] == 0 and e["duplicated"] == 0 for e in job["epochs"]
                    if e["complete"])
            and not job["corrupt_resumes"]
            and (bool(weights.get("bitwise")) if job.get("world_sizes") == [WORLD]
                 else "error" not in weights))


if __name__ == "__main__":
    sys.exit(0 if passed(main()) else 1)
