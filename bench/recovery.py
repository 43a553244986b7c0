"""Recovery time: from a fault to the first completed optimizer step after the group resumed,
split into phases, for c10d and etcd-v2 rendezvous.

Scenarios (digits task, one gloo worker per CPU core, checkpoint every 10 steps, metrics on):

* ``sigkill``: one node, 2 workers; rank 1 SIGKILLs itself after step 35 (the runner's fault
  injection), the agent restarts the group (a *failure* restart);
* ``sigterm``: one node, 2 workers; rank 1 gets SIGTERM after step 35 (a preempted worker: all
  ranks checkpoint that step, exit 143, the agent restarts them);
* ``node-leave``: two agents ("nodes", 1 worker each, ``--nnodes 1:2``); node B's agent and
  worker are SIGKILLed after step 15; node A's worker fails in its next collective and A goes
  on alone (a new rendezvous round that waits ``last_call_timeout`` for more nodes);
* ``node-join``: then node C starts; A notices a waiting node at its next monitor tick, stops its
  worker (SIGTERM: it checkpoints the step) and both rendezvous (2 = max nodes: no last call).

Phases, read from the surviving agent's log (millisecond stamps; see ``worker.log_startup`` and
``agent_metrics.AgentMonitor``); they add up to the total by construction:

* ``detection``: fault (the fault's log line, the kill, or node C's launch) -> the agent acts
  (it signals the surviving workers, records the failed group, or stops workers for a new node);
* ``stop``: -> the agent enters the rendezvous (surviving workers exited);
* ``rendezvous``: torchelastic's ``_rendezvous`` duration (for ``node-leave`` mostly the last
  call);
* ``start+import``: -> the new worker enters ``main`` (forked from the agent's fork server, or
  with ``--starts popen`` a new interpreter that imports torch and the runner);
* ``device``: the CUDA context created (~0 on CPU);
* ``process group``: ``init_process_group`` plus the per-attempt store namespace;
* ``data+model``: the task's data and model, DDP's parameter broadcast (digits imports
  scikit-learn here, ~1.3 s);
* ``ckpt load``: finding, verifying and loading the newest checkpoint;
* ``first step``: -> the first committed optimizer step after the resume.

``steps redone`` = the last step finished before the fault minus the step the group resumed
from.

The scenarios above run the restart path (``recovery.mode=restart``: torchrun's agent restarts
every worker). Two more compare it with in-place recovery (``recovery.mode=in_place``, the
default of ``elastic-runner run`` on one node):

* ``kill``: one node, 2 workers, digits and char_lm in the built-in trainer and digits in a
  user's own loop (``examples/own_loop.py``, ``own_loop``) (``--tasks``); rank 1 is SIGKILLed from
  outside (in place: once the warm spare is ready). Total = the kill -> the first optimizer
  step committed after the recovery. In-place phases come from the survivor's recovery line
  (``rejoin.RecoveryReport``): ``notice`` (kill -> the survivor's collective fails),
  ``detection`` (-> the agent names the failed rank), ``teardown``, ``group`` (new process group
  with the replacement), ``state`` (progress exchanged, the peer's state sent, DDP re-wrapped),
  ``first step``.
* ``ettr``: digits for ``--ettr-seconds`` (300) with a worker SIGKILLed every 30 s and every
  10 s (``--ettr-intervals``), restart path vs in place; the ETTR and the badput by cause are read
  from rank 0's series on the job's metrics endpoint (``elastic_runner_ettr``,
  ``elastic_runner_goodput_seconds``) once the last kill's recovery is done and rank 0 logged
  after it. ``wall`` = productive / ETTR (rank 0's job wall time, ``observe/goodput.py``); the causes
  sum to it (``unattributed`` = wall - their sum, ~0). ``kills`` = the signals sent;
  ``failures`` = the failures the agent saw ("replaced in place", "worker group failed"
  lines); ``recoveries`` = those the job came back from, read in its log (distinct generations
  of the survivors' "in-place recovery N done" lines; rank 0's "resumed from" or "no
  checkpoint" lines after its first start: restarts, and in-place recoveries with no survivor
  left). A signal can hit a replacement still joining or a restart still starting: the three
  differ, and the table says so.

Times are medians over repeats (min-max in the JSON); every scenario runs in each repeat, so
drift on this shared machine hits all alike.

    python -m bench.recovery [--repeats 2] [--scenarios sigkill node-leave kill ettr ...]
                             [--backends c10d etcd-v2] [--tasks digits char_lm own_loop]
                             [--starts fork popen]
                             [--ettr-seconds 300] [--ettr-intervals 30 10] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import shutil
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil

from elastic_runner.data.audit import read_entries
from elastic_runner.observe.rank_series import GOODPUT_CAUSES
from tests.procs import CONFIGS, REPO, Job, cli, wait_until

from .common import etcd_server, free_port, log_time, spread

SCENARIOS = ("sigkill", "sigterm", "node-leave", "node-join", "kill", "ettr")
PATHS = ("restart", "in_place")
INPLACE_PHASES = ("notice", "detection", "teardown", "group", "state", "first step")
BACKENDS = ("c10d", "etcd-v2")
PHASES = ("detection", "stop", "rendezvous", "start+import", "device", "process group",
          "data+model", "ckpt load", "first step")
FAULT_STEP = 35
# a lost node is declared dead after 1 s x 8 missed keep-alives
RDZV_CONF = "last_call_timeout=4,join_timeout=120,keep_alive_interval=1,keep_alive_max_attempt=8"
RUN_TIMEOUT_S = 180

_STAMP = r"(\d\d:\d\d:\d\d\.\d\d\d)"
_TORCH_STAMP = r"[WE]\d{4} (\d\d:\d\d:\d\d\.\d{3})\d*"
_DETECT = re.compile(rf"^(?:{_TORCH_STAMP} .*Sending process \d+ closing signal"
                     rf"|{_STAMP} INFO elastic_runner\.observe\.node_metrics: (?:worker group "
                     r"(?:failed|unhealthy)|workers stopped for a membership change))")
_RDZV = re.compile(rf"^{_STAMP} INFO elastic_runner\.observe\.node_metrics: rendezvous round \d+ took "
                   r"([\d.]+) s")
_STARTUP = re.compile(rf"^{_STAMP} \[rank0\] INFO elastic_runner\.worker: startup: interpreter "
                      r"and imports ([\d.]+) s, device ([\d.]+) s, process group ([\d.]+) s, "
                      r"data and model ([\d.]+) s, checkpoint load ([\d.]+) s")
_FAULT = re.compile(rf"^{_STAMP} \[rank1\] WARNING elastic_runner\.train\.faults: fault")
_RESUMED = re.compile(rf"^{_STAMP} \[rank0\] INFO elastic_runner\.train\.session: resumed from \S+: "
                      r"step (\d+)")


def phases(log: str, t_fault: float, first_step_time: float) -> dict[str, float]:
    """The phases (seconds) of the first recovery after ``t_fault`` in an agent's ``log``;
    ``first_step_time``: wall-clock time of the first step committed after the resume.

    Raises:
        RuntimeError: a line of the timeline is missing from the log.
    """
    lines = log.splitlines()

    def first(pattern: re.Pattern[str], after: float) -> tuple[float, re.Match[str]]:
        for ln in lines:
            if (m := pattern.match(ln)) and (t := log_time(m[1] or m[2], t_fault)) >= after - 1e-3:
                return t, m
        raise RuntimeError(f"no line matching {pattern.pattern!r} after {after:.3f} in the "
                           f"log:\n{log[-3000:]}")

    t_detect, _ = first(_DETECT, t_fault)
    t_rdzv, m = first(_RDZV, t_detect)
    t_rdzv_start = t_rdzv - float(m[2])
    t_loaded, m = first(_STARTUP, t_rdzv)
    imports, device, group, data, load = (float(m[i]) for i in range(2, 7))
    t_main = t_loaded - load - data - group - device
    return {"detection": t_detect - t_fault, "stop": t_rdzv_start - t_detect,
            "rendezvous": t_rdzv - t_rdzv_start, "start+import": t_main - t_rdzv,
            "device": device, "process group": group, "data+model": data, "ckpt load": load,
            "first step": first_step_time - t_loaded, "total": first_step_time - t_fault,
            "process start+import (worker's own clock)": imports}


def _trace_steps(trace: Path) -> list[tuple[float, int, int]]:
    """(time, step, world_size) of the committed steps in the sample trace (rank files)."""
    return sorted({(e["time"], e["step"], e["world_size"]) for e in read_entries(trace)
                   if "time" in e})


def _run_argv(backend: str, endpoint: str, rdzv_id: str, ck: Path, trace: Path, nnodes: str,
              nproc: int, max_steps: int, *extra: str, is_host: bool = True) -> list[str]:
    # c10d: the first node hosts the TCPStore at the endpoint (if it left, the rendezvous
    # would go with it; etcd has no such node); is_host says which one, no bind race
    conf = RDZV_CONF + (f",is_host={str(is_host).lower()}" if backend == "c10d" else "")
    return cli("run", str(CONFIGS / "digits.yaml"), "logging.tensorboard_dir=null",
               "early_stopping.enabled=false", f"checkpoint.dir={ck}",
               "checkpoint.every_steps=10", "training.log_every_steps=1",
               f"training.max_steps={max_steps}", "training.max_epochs=1000",
               f"metrics.port={free_port()}", "recovery.mode=restart", *extra,
               "--nnodes", nnodes, "--nproc-per-node", str(nproc), "--rdzv-backend", backend,
               "--rdzv-endpoint", endpoint, "--rdzv-id", rdzv_id,
               "--rdzv-conf", conf, "--max-restarts", "3", "--monitor-interval", "0.1",
               "--trace-samples", str(trace))


def single_node(kind: str, backend: str, endpoint: str, workdir: Path, start: str = "fork"
                ) -> dict[str, float]:
    """``sigkill`` or ``sigterm`` of rank 1 after step 35 on one node with 2 workers; ``start``:
    how the agent starts the workers (``fork``: from its fork server; ``popen``: a new
    interpreter each, ``--no-fork-server``)."""
    ck, trace = workdir / "ck", workdir / "trace"
    workdir.mkdir(parents=True)
    t_start = time.time()
    job = Job(_run_argv(backend, endpoint, f"bench-{time.time_ns()}", ck, trace, "1", 2, FAULT_STEP + 10,
                        f"faults.inject=[{{kind: {kind}, rank: 1, step: {FAULT_STEP}}}]",
                        *(["--no-fork-server"] if start == "popen" else [])),
              workdir / "node.log")
    try:
        if job.wait(RUN_TIMEOUT_S) != 0:
            raise RuntimeError(f"{kind}/{backend}: run failed:\n{job.output[-3000:]}")
    finally:
        job.kill_all()
    log = job.output
    t_fault = log_time(next(m[1] for ln in log.splitlines() if (m := _FAULT.match(ln))), t_start)
    # a SIGTERM after FAULT_STEP makes every rank discard the next step and checkpoint this one
    return _measure(log, t_fault, trace, FAULT_STEP)


def _measure(log: str, t_fault: float, trace: Path, last_done: int, script: bool = False
             ) -> dict[str, float]:
    """The restart path's phases (``script``: a user's loop, whose workers log no start-up
    line: detection, stop, rendezvous, then the new workers' start to their first step)."""
    t_resumed, resumed_step = _resumed(log, t_fault)
    t_first = min(t for t, _, _ in _trace_steps(trace) if t > t_resumed)
    out = script_phases(log, t_fault, t_first) if script else phases(log, t_fault, t_first)
    out["steps_redone"] = last_done - resumed_step
    return out


def script_phases(log: str, t_fault: float, first_step_time: float) -> dict[str, float]:
    """:func:`phases` of a script's restart: its workers log no start-up split."""
    times = {}
    for name, pattern in (("detect", _DETECT), ("rdzv", _RDZV)):
        t, m = next((t, m) for ln in log.splitlines() if (m := pattern.match(ln))
                    and (t := log_time(m[1] or m[2], t_fault)) >= times.get("detect", t_fault) - 1e-3)
        times[name], times[f"{name}_m"] = t, m
    t_rdzv_start = times["rdzv"] - float(times["rdzv_m"][2])
    return {"detection": times["detect"] - t_fault, "stop": t_rdzv_start - times["detect"],
            "rendezvous": times["rdzv"] - t_rdzv_start,
            "start to first step": first_step_time - times["rdzv"],
            "total": first_step_time - t_fault}


def _resumed(log: str, after: float) -> tuple[float, int]:
    """Time and step of the first "resumed from" line of rank 0 at or after ``after``."""
    return next((t, int(m[2])) for ln in log.splitlines()
                if (m := _RESUMED.match(ln)) and (t := log_time(m[1], after)) >= after - 1e-3)


def node_leave_join(backend: str, endpoint: str, workdir: Path
                    ) -> tuple[dict[str, float], dict[str, float]]:
    """Nodes A and B (1 worker each), B lost (SIGKILL of agent and worker) at world size 2,
    then C joins; the phases of both recoveries, read from A's log."""
    ck, trace = workdir / "ck", workdir / "trace"
    rdzv_id = f"bench-{time.time_ns()}"
    workdir.mkdir(parents=True)

    def start(name: str) -> Job:  # each node serves its metrics on a port of its own
        return Job(_run_argv(backend, endpoint, rdzv_id, ck, trace, "1:2", 1, 100000,
                             "batch.micro_batch_size=4", "batch.global_batch_size=16",
                             is_host=name == "a"), workdir / f"node-{name}.log")

    jobs = [start("a")]
    try:
        jobs.append(start("b"))

        def world(ws: int, n: int, after: float = 0.0) -> bool:
            return sum(1 for t, _, w in _trace_steps(trace) if w == ws and t > after) >= n

        wait_until(lambda: world(2, 15), RUN_TIMEOUT_S, "15 steps at world size 2")
        t_kill = time.time()
        jobs[1].kill_all()
        last_done = max(s for _, s, _ in _trace_steps(trace))
        wait_until(lambda: world(1, 10, t_kill), RUN_TIMEOUT_S,
                   "10 steps at world size 1 after node B was lost")
        leave = _measure(jobs[0].output, t_kill, trace, last_done)
        t_join = time.time()
        jobs.append(start("c"))
        wait_until(lambda: world(2, 3, t_join), RUN_TIMEOUT_S,
                   "3 steps at world size 2 after node C joined")
        log = jobs[0].output
        # the steps A finished before it stopped its worker for C
        last_done = max(s for t, s, w in _trace_steps(trace)
                        if w == 1 and t < _resumed(log, t_join)[0])
        join = _measure(log, t_join, trace, last_done)
    finally:
        for job in jobs:
            job.kill_all()
    return leave, join


# ---------------------------------------------------------------- restart vs in place

KILL_AFTER_STEP = 30
_SPARE_READY = re.compile(r"spare \S+ ready")  # "spare 0" or "spare 0.0" (node.number)
_DONE = re.compile(rf"^{_STAMP} \[rank\d\] WARNING elastic_runner\.(?:train\.loop|own_loop): in-place recovery \d+ "
                   r"done: step (\d+) committed [\d.]+ s after the failure \(([^)]*)\)"
                   r"(?:; the state phase: ([^;]*))?(?:; \d+ committed step\(s\) redone)?$", re.M)
# a joiner's own parts of the state phase (recovery/rejoin.py, StateParts)
_JOINER = re.compile(r"WARNING elastic_runner\.recovery\.rejoin: in-place recovery: rank \d+ took "
                     r"the state of step \d+ from rank\(s\) \[[\d, ]+\]: the state phase: (.*)$",
                     re.M)


def _task_argv(task: str, path: str, ck: Path, trace: Path, port: int, *extra: str
               ) -> list[str]:
    """One node, 2 workers, c10d, the task's config with a long run and frequent logging."""
    return cli("run", str(CONFIGS / f"{task}.yaml"), "logging.tensorboard_dir=null",
               "early_stopping.enabled=false", f"checkpoint.dir={ck}",
               "training.log_every_steps=1", "training.max_steps=10000000",
               "training.max_epochs=10000000", f"metrics.port={port}", f"recovery.mode={path}",
               "recovery.spare_delay_seconds=0",
               *extra, "--nproc-per-node", "2", "--max-restarts", "100",
               "--monitor-interval", "0.1", "--trace-samples", str(trace))


OWN_LOOP = REPO / "examples" / "own_loop.py"


def _own_loop_argv(path: str, ck: Path, trace: Path, port: int) -> list[str]:
    """``examples/own_loop.py`` (digits, a user's DDP loop) under ``elastic-runner run``: one
    node, 2 workers, c10d, a long run; ``--recovery PATH``."""
    return cli("run", str(OWN_LOOP), "--nproc-per-node", "2", "--max-restarts", "100",
               "--monitor-interval", "0.1", "--metrics-port", str(port), "--recovery", path,
               "--", "--steps", "10000000", "--checkpoint-dir", str(ck), "--trace-dir",
               str(trace))


def _committed(trace: Path) -> dict[int, float]:
    """step -> the earliest commit time (unix seconds) over the ranks' trace entries."""
    out: dict[int, float] = {}
    for t, step, _ in _trace_steps(trace):
        out[step] = min(t, out.get(step, t))
    return out


def kill_one(task: str, path: str, workdir: Path, overrides: tuple[str, ...] = (),
             kill_after: int = KILL_AFTER_STEP, parts: bool = False) -> dict[str, float]:
    """SIGKILL rank 1 (from outside) after step ``kill_after``, in place once the spare is
    ready; the phases of the recovery, its total and the steps redone. ``overrides``: config
    overrides of the task (a larger model, a backend). ``parts``: in place, also the state
    phase's parts as the survivor and the joiner logged them (``survivor send``, ``joiner
    install``, ...: recovery/rejoin.py ``StateParts``), inside the ``state`` phase."""
    ck, trace = workdir / "ck", workdir / "trace"
    workdir.mkdir(parents=True)
    extra = ["checkpoint.every_steps=10"] + (["eval.every_steps=0"] if task == "digits" else [])
    if task == "own_loop":  # the loop checkpoints every 20 steps itself
        job = Job(_own_loop_argv(path, ck, trace, free_port()), workdir / "node.log",
                  env={"ELASTIC_RUNNER_RECOVERY": "{spare_delay_seconds: 0}"})
    else:
        job = Job(_task_argv(task, path, ck, trace, free_port(), *extra, *overrides),
                  workdir / "node.log")
    try:
        wait_until(lambda: max(_committed(trace), default=0) >= kill_after, RUN_TIMEOUT_S,
                   f"{kill_after} steps")
        if path == "in_place":
            wait_until(lambda: _SPARE_READY.search(job.output) is not None, RUN_TIMEOUT_S,
                       "the warm spare")
        victim = job.workers(str(OWN_LOOP) if task == "own_loop" else "train")[1]
        t_kill = time.time()
        victim.kill()
        before = max(s for s, t in _committed(trace).items() if t <= t_kill)
        if path == "in_place":
            wait_until(lambda: _DONE.search(job.output) is not None, RUN_TIMEOUT_S,
                       "the in-place recovery")
            out = _inplace_phases(job.output, trace, t_kill, parts)
            # a step whose all-reduce completed before the kill still commits: none redone
            out["steps_redone"] = max(0, before - (out.pop("step") - 1))
        else:
            wait_until(lambda: "resumed from" in job.output and any(
                t > _resumed(job.output, t_kill)[0] for t in _committed(trace).values()),
                RUN_TIMEOUT_S, "the restarted group's first step")
            out = _measure(job.output, t_kill, trace, before, script=task == "own_loop")
    finally:
        job.kill_all()
    return out


def _seconds(listed: str) -> dict[str, float]:
    """``"a 0.1 s, b 0.2 s"`` as ``{"a": 0.1, "b": 0.2}``."""
    return {k.strip().rsplit(" ", 2)[0]: float(k.strip().rsplit(" ", 2)[1])
            for k in listed.split(",")}


def _inplace_phases(log: str, trace: Path, t_kill: float, parts: bool = False
                    ) -> dict[str, float]:
    m = next(m for ln in log.splitlines() if (m := _DONE.match(ln)))
    step = int(m[2])
    phases = _seconds(m[3])
    total = _committed(trace)[step] - t_kill
    out = {"notice": max(0.0, total - sum(phases.values())), **phases, "total": total}
    joiner = _JOINER.search(log)
    if parts and m[4]:  # the state phase's parts: the survivor's (its report) and the joiner's
        out.update({f"survivor {k}": v for k, v in _seconds(m[4]).items()})
    if parts and joiner:
        out.update({f"joiner {k}": v for k, v in _seconds(joiner[1]).items()})
    out["step"] = step
    return out


ETTR_LOG_EVERY = 20  # training.log_every_steps of the ettr runs: rank 0 publishes its figures


def ettr_run(path: str, interval: float, seconds: float, workdir: Path) -> dict[str, float]:
    """digits for ``seconds`` with a worker SIGKILLed every ``interval`` seconds (alternating
    ranks; none at the very end); once the last recovery is done and rank 0 published after
    it, the ETTR and the seconds by cause from the metrics endpoint, the wall time they add up
    to, and the kills sent next to the failures and recoveries the job's log shows
    (:func:`count_recoveries`)."""
    ck, trace, port = workdir / "ck", workdir / "trace", free_port()
    workdir.mkdir(parents=True)
    job = Job(_task_argv("digits", path, ck, trace, port, "checkpoint.every_steps=100",
                         "eval.every_steps=500", f"training.log_every_steps={ETTR_LOG_EVERY}"),
              workdir / "node.log")
    kills = 0
    try:
        wait_until(lambda: bool(_committed(trace)), RUN_TIMEOUT_S, "the first step")
        t0 = time.time()
        next_kill = t0 + interval
        while next_kill < t0 + seconds:  # pacing the kills, not waiting for an event
            time.sleep(max(0.0, next_kill - time.time()))
            workers = _workers(job)
            victim = workers.get(kills % 2) or workers.get(1 - kills % 2)
            if victim is not None:
                with contextlib.suppress(psutil.NoSuchProcess):
                    victim.kill()
                    kills += 1
            next_kill += interval
        time.sleep(max(0.0, t0 + seconds - time.time()))
        # the figures of a live rank 0 that logged after the last recovery
        wait_until(lambda: count_recoveries(job.output)["settled"], RUN_TIMEOUT_S,
                   "the last recovery")
        t_settled = time.time()
        wait_until(lambda: sum(1 for t in _committed(trace).values() if t > t_settled)
                   > ETTR_LOG_EVERY, RUN_TIMEOUT_S, "a logging step after the last recovery")
        if job.proc.poll() is not None:
            raise RuntimeError(f"ettr/{path}: the job ended before {seconds:.0f} s:\n"
                               f"{job.output[-3000:]}")
        figures = scrape_goodput(port)
        counts = count_recoveries(job.output)
    finally:
        job.kill_all()
    wall = figures["productive"] / figures["ettr"] if figures.get("ettr") else float("nan")
    causes = sum(figures.get(c, 0.0) for c in GOODPUT_CAUSES)
    return {**figures, "wall": wall, "unattributed": wall - causes, "kills": kills,
            "failures": counts["failures"], "recoveries": counts["recoveries"]}


# one failure the agent saw: a worker replaced in place, or the worker group restarted
_FAILED = re.compile(r"^\S+ (?:WARNING elastic_runner\.agent\.inplace_agent: rank\(s\) .*: replaced in "
                     r"place by|INFO elastic_runner\.observe\.node_metrics: worker group failed: "
                     r"restarting it)", re.M)
# the job came back: a step committed after an in-place recovery (one line per survivor), or
# rank 0 loaded the newest checkpoint (a restart, or in place with no survivor left) or found
# none (a restart before the first checkpoint; also the job's first start)
_DONE_IN_PLACE = re.compile(r"^\S+ \[rank\d+\] WARNING elastic_runner\.train\.loop: in-place recovery "
                            r"(\d+) done", re.M)
_STARTED = re.compile(r"^\S+ \[rank0\] INFO elastic_runner\.[\w.]+: (?:resumed from \S+: step|no "
                      r"checkpoint in .*: starting from scratch)", re.M)


def count_recoveries(log: str) -> dict[str, Any]:
    """What one node's ``log`` (``elastic-runner run`` from an empty checkpoint directory) shows
    of its failures: ``failures`` (the agent's lines: a worker replaced in place, the worker
    group restarted), ``recoveries`` (the job came back: distinct generations of "in-place
    recovery N done", and rank 0's (re)starts after its first) and ``settled`` (no failure,
    or a recovery after the last one)."""
    failed = list(_FAILED.finditer(log))
    done = list(_DONE_IN_PLACE.finditer(log))
    started = list(_STARTED.finditer(log))
    last_back = max([m.start() for m in done] + [m.start() for m in started[1:]], default=-1)
    return {"failures": len(failed), "recoveries": len({m[1] for m in done}) + len(started[1:]),
            "settled": not failed or last_back > failed[-1].start()}


_REPLACED = re.compile(r"rank\(s\) \[(\d+)\] exited with code\(s\) \[-?\d+\]: replaced in place "
                       r"by \w+ spare\(s\) pid\(s\) \[(\d+)\]")


def _workers(job: Job) -> dict[int, psutil.Process]:
    """Live workers by rank: torch's (RANK in their environment) and the spares the agent
    put in a dead worker's place (their environment says RANK=-1; the agent's log says which
    rank they took)."""
    out = {r: p for r, p in job.workers().items() if r >= 0}
    for m in _REPLACED.finditer(job.output):
        with contextlib.suppress(psutil.NoSuchProcess):
            proc = psutil.Process(int(m[2]))
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                out[int(m[1])] = proc
    return out


def scrape_goodput(port: int, host: str = "127.0.0.1") -> dict[str, float]:
    """Rank 0's ETTR and goodput seconds by cause from an agent's metrics endpoint."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10).read()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            if sample.labels.get("rank") != "0":
                continue
            if sample.name == "elastic_runner_ettr":
                out["ettr"] = sample.value
            elif sample.name == "elastic_runner_goodput_seconds":
                out[sample.labels["cause"]] = sample.value
    return out


def run_repeat(scenarios: list[str], backends: list[str], etcd: str | None,
               workdir: Path, tasks: tuple[str, ...] = ("digits", "char_lm", "own_loop"),
               starts: tuple[str, ...] = ("fork",)) -> dict[str, dict[str, float]]:
    """One run of every (scenario, backend) pair; keyed ``"scenario/backend"`` (``kill``:
    ``"kill/task/path"``; ``sigkill`` and ``sigterm`` started with Popen:
    ``"scenario/backend/popen"``)."""
    out: dict[str, dict[str, float]] = {}
    if "kill" in scenarios:
        for task in tasks:
            for path in PATHS:
                out[f"kill/{task}/{path}"] = kill_one(task, path, workdir / f"kill-{task}-{path}")
    backends = [b for b in backends if {"sigkill", "sigterm", "node-leave", "node-join"}
                & set(scenarios)]
    for backend in backends:
        endpoint = etcd if backend == "etcd-v2" and etcd else f"127.0.0.1:{free_port()}"
        for kind in ("sigkill", "sigterm"):
            for start in starts if kind in scenarios else ():
                case = f"{kind}/{backend}" + ("/popen" if start == "popen" else "")
                out[case] = single_node(kind, backend, endpoint,
                                        workdir / case.replace("/", "-"), start)
        if {"node-leave", "node-join"} & set(scenarios):
            leave, join = node_leave_join(backend, endpoint, workdir / f"nodes-{backend}")
            for kind, result in (("node-leave", leave), ("node-join", join)):
                if kind in scenarios:
                    out[f"{kind}/{backend}"] = result
    return out


def summarize(repeats: list[dict[str, dict[str, float]]]) -> dict[str, dict]:
    """Per case: median/min/max of each phase, the total and steps redone."""
    return {case: {k: spread([r[case][k] for r in repeats]) for k in repeats[0][case]}
            for case in repeats[0]}


def print_table(summary: dict[str, dict]) -> None:
    restart = {k: v for k, v in summary.items() if "in_place" not in k}
    inplace = {k: v for k, v in summary.items() if "in_place" in k}
    for rows, cols in ((restart, PHASES), (inplace, INPLACE_PHASES)):
        if not rows:
            continue
        cols = [*cols, "total"]
        print(f"{'case':<24}" + "".join(f"{c:>14}" for c in cols) + f"{'redone':>8}")
        for case, s in rows.items():  # a script's restart has no start-up split: "-"
            print(f"{case:<24}" + "".join(f"{s[c]['median']:>14.3f}" if c in s else f"{'-':>14}"
                                          for c in cols)
                  + f"{s['steps_redone']['median']:>8.0f}")
    print("(seconds, medians; fault -> first committed step after the recovery; see the module "
          "docstring for the phases)")


def print_ettr(ettr: dict[str, dict[str, float]]) -> None:
    """The ETTR table; a row whose kills, failures and recoveries differ says so below."""
    print(f"{'path, kill every':<26}{'ETTR':>7}{'kills':>7}{'recov.':>7}{'wall':>8}"
          + "".join(f"{c:>12}" for c in GOODPUT_CAUSES))
    for case, r in ettr.items():
        print(f"{case:<26}{r.get('ettr', float('nan')):>7.3f}{r['kills']:>7.0f}"
              f"{r.get('recoveries', float('nan')):>7.0f}{r.get('wall', float('nan')):>8.1f}"
              + "".join(f"{r.get(c, 0.0):>12.1f}" for c in GOODPUT_CAUSES))
    print("(ETTR = productive seconds / job wall seconds; the rest in seconds, rank 0's account; "
          "kills: signals sent, recov.: recoveries in the job's log)")
    for case, r in ettr.items():
        if not r["kills"] == r.get("failures") == r.get("recoveries"):
            print(f"{case}: {r['kills']:.0f} kills sent, {r.get('failures', 0):.0f} failed "
                  f"workers seen by the agent, {r.get('recoveries', 0):.0f} recoveries")
        if abs(r.get("unattributed", 0.0)) > 0.01 * r.get("wall", 0.0):
            print(f"{case}: {r['unattributed']:.1f} s of {r['wall']:.1f} s not attributed")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    p.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    p.add_argument("--tasks", nargs="+", default=["digits", "char_lm", "own_loop"],
                   choices=["digits", "char_lm", "own_loop"],
                   help="the kill scenario's jobs: the built-in trainer's tasks, and own_loop "
                        "(examples/own_loop.py, digits in a user's loop)")
    p.add_argument("--starts", nargs="+", default=["fork"], choices=["fork", "popen"],
                   help="how the agent starts the workers of the sigkill and sigterm runs: "
                        "forked from its fork server (the default), and/or each a new "
                        "interpreter (--no-fork-server), in the same repeat")
    p.add_argument("--ettr-seconds", type=float, default=300.0)
    p.add_argument("--ettr-intervals", nargs="+", type=float, default=[30.0, 10.0])
    p.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS,
                   help="recovery paths of the ettr runs")
    p.add_argument("--dir", default=None, help="keep the runs' logs here (default: a temporary "
                   "directory, removed)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    backends = list(args.backends)
    if "etcd-v2" in backends and shutil.which("etcd") is None:
        print("etcd not on PATH (Debian: apt-get install etcd-server): etcd-v2 skipped",
              file=sys.stderr)
        backends.remove("etcd-v2")
    with contextlib.ExitStack() as stack:
        d = args.dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="recovery-"))
        etcd = stack.enter_context(etcd_server()) if "etcd-v2" in backends else None
        repeats: list[dict[str, dict[str, float]]] = []
        ettr: dict[str, dict[str, float]] = {}

        def save() -> None:  # after every run: a late failure keeps what was measured
            if args.json:
                Path(args.json).write_text(json.dumps(
                    {"repeats": repeats, "ettr": ettr, "ettr_seconds": args.ettr_seconds},
                    indent=1))

        for i in range(args.repeats):
            repeats.append(run_repeat(args.scenarios, backends, etcd, Path(d) / str(i),
                                      tuple(args.tasks), tuple(args.starts)))
            save()
        if "ettr" in args.scenarios:
            for interval in args.ettr_intervals:
                for path in args.paths:
                    ettr[f"{path}, {interval:.0f} s"] = ettr_run(
                        path, interval, args.ettr_seconds, Path(d) / f"ettr-{path}-{interval}")
                    save()
    summary = summarize(repeats) if repeats and repeats[0] else {}
    if summary:
        print_table(summary)
    if ettr:
        print_ettr(ettr)
    result = {"rdzv_conf": RDZV_CONF, "monitor_interval_s": 0.1, "repeats": repeats,
              "summary": summary, "ettr": ettr, "ettr_seconds": args.ettr_seconds}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
