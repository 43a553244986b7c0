"""``deploy/slurm/elastic-runner.sbatch`` on a real Slurm cluster (tests/slurm.py: slurmctld,
one slurmd per node in its own network namespace and hostname, munge), submitted as a user
submits it, and ended by Slurm itself: a time limit's ``--signal``, a preempting job in a
higher-priority partition, a lost node with and without ``--no-kill``, ``scancel``.

Every job trains digits on 2 nodes x 1 worker (world size 2). The uninterrupted job is the
reference: a job Slurm stopped and requeued resumes from the checkpoint its workers wrote when
signalled and ends bitwise equal to it; every job's sample audit (the indices the DataLoader
fetched, over every run of the job) is exact, also when a lost node shrank the world."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from elastic_runner.checkpoint import storage

from .evidence import (
    DIGITS_GLOBAL_BATCH,
    DIGITS_TRAIN,
    assert_exact_audit,
    assert_same_optimizer,
    assert_same_tensors,
)
from .procs import REPO, Pace
from .slurm import SlurmCluster, wait_for_log
from .test_inplace_nodes import common
from .test_train_torchrun import final_state

pytestmark = pytest.mark.slow

SCRIPT = REPO / "deploy" / "slurm" / "elastic-runner.sbatch"
STEPS = 60  # 19 steps an epoch at world size 2
EVERY = 20  # the periodic checkpoints' cadence: the faults land after the first one
CPU_PARTITION = ["--gpus-per-node=0", "--cpus-per-task=2"]  # the script asks for 8 GPUs
JOB_TIMEOUT_S = 400
PACE_S = 0.1  # rank 0's slow-down until the fault: the job is still training when it lands
PREEMPTION_PACE_S = 2.0  # the slow-down while a preempting job waits for Slurm
_PREEMPTED = re.compile(r"preempted by signal after step (\d+); checkpoint step-0*(\d+) committed")
_RESUMED = re.compile(r"resumed from \S+/step-0*(\d+): step (\d+)")


class SlurmJob:
    """A submission of the batch script: its id, its output file and its checkpoints."""

    def __init__(self, cluster: SlurmCluster, directory: Path, sbatch: list[str],
                 env: dict[str, str] | None = None, pace: Pace | None = None) -> None:
        self.cluster, self.dir = cluster, directory
        args = [*(a for a in common(steps=STEPS) if not a.startswith("checkpoint.every_steps=")),
                f"checkpoint.every_steps={EVERY}", f"checkpoint.dir={directory / 'ck'}",
                # no warm spare: no job here loses a worker whose node goes on (Slurm ends or
                # requeues the job, or a lost node leaves it), and a spare per node is a
                # process each run starts for nothing
                "recovery.spare=false",
                *(pace.args if pace else []), "--trace-samples", str(directory / "trace")]
        self.id = cluster.sbatch([*CPU_PARTITION, *sbatch, str(SCRIPT), *args], cwd=directory,
                                 env={"GLOO_SOCKET_IFNAME": "eth0", "NPROC_PER_NODE": "1",
                                      **(env or {})})
        self.out = directory / f"elastic-runner-{self.id}.out"

    @property
    def output(self) -> str:
        return self.out.read_text(errors="replace") if self.out.exists() else ""

    def wait_for(self, pattern: str, timeout: float = JOB_TIMEOUT_S) -> re.Match:
        try:
            return wait_for_log(self.out, pattern, timeout)
        except AssertionError as e:
            raise AssertionError(f"{e}\njob {self.id}: {self.cluster.job(self.id)}\n"
                                 f"its output's tail:\n{self.output[-4000:]}") from None

    def training(self) -> None:
        """Wait until both ranks trained ``EVERY`` steps (the first periodic checkpoint)."""
        self.wait_for(rf"committed checkpoint \S+/step-{EVERY:08d}")

    def finish(self, state: str = "COMPLETED") -> dict[str, str]:
        record = self.cluster.wait_job(self.id, {state, "FAILED", "CANCELLED", "TIMEOUT",
                                                 "NODE_FAIL", "COMPLETED"}, JOB_TIMEOUT_S)
        assert record["JobState"] == state, (record, self.output[-5000:])
        return record

    def assert_audit_exact(self, global_batch: int | None = DIGITS_GLOBAL_BATCH,
                           killed: int = 0) -> None:
        """Every step to ``STEPS`` traced, every sample once: digits at 2 nodes x 1 worker
        (``global_batch`` None: the world size changed; ``killed``: the workers killed in
        place after committing steps, each may leave one entry repaired)."""
        assert_exact_audit(self.dir / "trace", steps=STEPS, global_batch=global_batch,
                           num_samples=DIGITS_TRAIN, repaired_at_most=killed)

    def assert_resumed_where_it_stopped(self) -> None:
        """Each run Slurm stopped committed the step it stopped at, and the next run resumed
        from exactly that step."""
        stopped = {int(m[1]) for m in _PREEMPTED.finditer(self.output)}
        resumed = [int(m[1]) for m in _RESUMED.finditer(self.output)]
        # a run signalled again before it trained resumes from the same step as the one before
        assert stopped and resumed == sorted(resumed) and set(resumed) == stopped, \
            self.output[-5000:]


@pytest.fixture(scope="module")
def uninterrupted(slurm_cluster, tmp_path_factory) -> SlurmJob:
    """The batch script's job, run to its end without a fault: every other job's reference."""
    job = SlurmJob(slurm_cluster, tmp_path_factory.mktemp("uninterrupted"), [])
    job.record = job.finish()
    return job


def test_the_batch_script_runs_a_two_node_job_to_its_end(uninterrupted):
    out = uninterrupted.output
    assert uninterrupted.record["ExitCode"] == "0:0" and uninterrupted.record["Restarts"] == "0"
    assert uninterrupted.record["NodeList"] == "n[0-1]"
    # srun --label: one agent per node, each naming the node's share of the job
    for node in (0, 1):
        assert re.search(rf"^{node}: .* recovery: in place .* the c10d rendezvous store at n0:",
                         out, re.MULTILINE), out[-3000:]
    assert re.search(rf"^0: .*\[rank0\] .* finished: .* step={STEPS} ", out, re.MULTILINE)
    assert "srun exited with 0" in out and "requeue" not in out.split("srun exited")[1]
    uninterrupted.assert_audit_exact()


def test_a_time_limit_signals_the_workers_which_checkpoint_and_the_job_requeues(
        slurm_cluster, uninterrupted, tmp_path):
    # slurmctld checks time limits every 30 s and sends --signal=TERM@T at the first check
    # less than T + 30 s before the limit (send_job_warn_signal; sbatch(1): "up to 60 seconds
    # earlier"): at 1 min with TERM@15 it lands 15 to 45 s into the run (with TERM@30 it came
    # 0 s into one: before the workers train), while rank 0 is paced to train for longer (the
    # workers train about 8 s into a run); the requeued runs go at full speed and end in about
    # 10 s (each one that Slurm signals again requeues again)
    pace = Pace(tmp_path / "pace", 0.9)
    job = SlurmJob(slurm_cluster, tmp_path, ["--time=1", "--signal=TERM@15"], pace=pace)
    job.wait_for(r"srun exited with 143")
    pace.end()
    record = job.finish()
    assert int(record["Restarts"]) >= 1 and record["ExitCode"] == "0:0"
    assert f"requeueing job {job.id}; it resumes from the newest checkpoint" in job.output
    job.assert_resumed_where_it_stopped()
    job.assert_audit_exact()
    assert_same_final_state(job, uninterrupted)


def assert_same_final_state(job: SlurmJob, reference: SlurmJob) -> None:
    ours, theirs = final_state(job.dir / "ck"), final_state(reference.dir / "ck")
    assert_same_tensors(theirs["model"], ours["model"])
    assert_same_optimizer(theirs["optimizer"], ours["optimizer"])


def test_a_preempting_job_stops_it_at_a_checkpoint_and_it_resumes_after(
        slurm_cluster, uninterrupted, tmp_path):
    # partition "urgent" has the higher PriorityTier (PreemptType=preempt/partition_prio,
    # PreemptMode=REQUEUE, GraceTime=30 on "main"): its job takes both nodes
    pace = Pace(tmp_path / "pace", PACE_S)
    job = SlurmJob(slurm_cluster, tmp_path, [], pace=pace)
    job.training()
    # the job's 40 steps left outlast Slurm's preemption, however busy the machine (CI: at
    # 0.1 s a step the job once ended first, and no SIGTERM came)
    pace.set(PREEMPTION_PACE_S)
    urgent = slurm_cluster.sbatch(["--partition=urgent", "--nodes=2", "--output=urgent.out",
                                   "--wrap=hostname"], cwd=tmp_path, env={})
    job.wait_for(r"srun exited with 143")
    pace.end()
    assert slurm_cluster.wait_job(urgent, {"COMPLETED"}, JOB_TIMEOUT_S)["ExitCode"] == "0:0"
    record = job.finish()
    assert record["Restarts"] == "1" and record["ExitCode"] == "0:0"
    job.assert_resumed_where_it_stopped()
    job.assert_audit_exact()
    assert_same_final_state(job, uninterrupted)


class NodeLoss:
    """Node 1 lost (every process there SIGKILLed) and started again; the fixture brings it
    back, idle, after the test if the test did not."""

    def __init__(self, cluster: SlurmCluster) -> None:
        self.cluster, self.lost = cluster, False

    def lose(self) -> None:
        self.cluster.lose_node(1)
        self.lost = True

    def restore(self) -> None:
        if self.lost:
            self.cluster.start_node(1)
            self.lost = False


@pytest.fixture
def node_loss(slurm_cluster):
    loss = NodeLoss(slurm_cluster)
    yield loss
    loss.restore()
    slurm_cluster.wait_idle()


def test_a_lost_node_with_no_kill_leaves_the_job_in_place_and_it_goes_on(
        slurm_cluster, node_loss, tmp_path):
    pace = Pace(tmp_path / "pace", PACE_S)
    job = SlurmJob(slurm_cluster, tmp_path, ["--no-kill"], env={"NNODES": "1:2"}, pace=pace)
    job.training()
    node_loss.lose()
    job.wait_for(r"in-place recovery 1 done")
    pace.end()
    record = job.finish()
    assert record["Restarts"] == "0" and record["NodeList"] == "n0", record
    out = job.output
    assert "srun: error: Node failure on n1" in out
    assert "resumed from" not in out  # node 0's worker kept its state
    assert re.search(rf"^0: .*\[rank0\] .* finished: .* step={STEPS} ", out, re.MULTILINE)
    # every sample once, across the shrink from 2 ranks to 1 (no batch.global_batch_size: the
    # first world size's global batch is kept, the accumulation doubles); node 1's worker killed
    # in place
    job.assert_audit_exact(killed=1)


def test_a_lost_node_without_no_kill_ends_the_job_and_slurm_requeues_it(
        slurm_cluster, uninterrupted, node_loss, tmp_path):
    pace = Pace(tmp_path / "pace", PACE_S)
    job = SlurmJob(slurm_cluster, tmp_path, [], pace=pace)
    job.training()
    node_loss.lose()
    # Slurm marks the node down, ends the job (NODE_FAIL) and requeues it (--requeue): it waits
    # for two nodes
    slurm_cluster.wait_job(job.id, {"PENDING"}, JOB_TIMEOUT_S)
    pace.end()
    node_loss.restore()
    record = job.finish()
    assert record["Restarts"] == "1" and record["ExitCode"] == "0:0"
    resumed = [int(m[1]) for m in _RESUMED.finditer(job.output)]
    assert len(resumed) == 1 and resumed[0] >= EVERY, job.output[-5000:]
    job.assert_audit_exact()
    assert_same_final_state(job, uninterrupted)


def test_scancel_ends_the_job_for_good_with_its_last_step_checkpointed(slurm_cluster, tmp_path):
    job = SlurmJob(slurm_cluster, tmp_path, [], pace=Pace(tmp_path / "pace", PACE_S))
    job.training()
    slurm_cluster.run("scancel", str(job.id))
    job.wait_for(r"not requeueing: Slurm ended the job")
    record = slurm_cluster.wait_job(job.id, {"CANCELLED"}, JOB_TIMEOUT_S)
    assert record["Restarts"] == "0", record
    (stopped,) = {int(m[1]) for m in _PREEMPTED.finditer(job.output)}
    assert stopped >= EVERY and storage.latest_valid(tmp_path / "ck").step == stopped
    job.wait_for(r"srun exited with 143")
    assert slurm_cluster.job(job.id)["JobState"] == "CANCELLED"  # the script did not requeue it
