"""A real Slurm cluster on this machine, for the tests of ``deploy/slurm/elastic-runner.sbatch``.

Debian's Slurm 22.05 (``slurmctld``, ``slurmd``, the client commands) and ``munge``, each
daemon a process this module starts and kills by pid:

- ``munged`` with a key made for the cluster, its socket in the cluster's directory (Slurm reads
  it from ``AuthInfo=socket=...``); one daemon serves every node, as the nodes share this
  machine's filesystem;
- ``slurmctld`` in the root network namespace, on the nodes' bridge address;
- one ``slurmd`` per node, each node a network namespace of :class:`tests.netns.Nodes` with its
  own address and, through a UTS namespace, its own hostname (``n0``, ``n1``, ...), which
  ``ip netns exec`` makes resolvable on every node from ``/etc/netns/<namespace>/hosts``: the
  batch script's ``scontrol show hostnames`` gives names that torchrun resolves, as on a real
  cluster.

What the sandbox needs from ``slurm.conf`` (what a real site sets differently is in
``docs/deployment/slurm.md``): ``ProctrackType=proctrack/linuxproc`` and ``TaskPlugin=task/none``
(no cgroup hierarchy inside a network namespace: ``ip netns exec`` mounts a fresh ``/sys``, and
slurmd then fails with "No filesystem mounted on /sys/fs/cgroup" unless ``cgroup.conf`` names a
directory; with these two plugins slurmd uses nothing in it), ``SlurmUser=root`` (the tests run
as root), and the waits that a requeue or a lost node costs, each cut down for a cluster on one
machine (each default of Slurm 22.05 would add tens of seconds to a test):

- ``AuthInfo=...,cred_expire=5``: a requeued job waits ``cred_expire`` + 1 seconds before it may
  start again (the default is 120 s; 5 is the least that Slurm takes, below it falls back to the
  default);
- ``SlurmdTimeout=5`` and ``MessageTimeout=3``: slurmctld marks a lost node DOWN once it has not
  answered for ``SlurmdTimeout`` seconds, pinging it every ``SlurmdTimeout``/3 seconds, and each
  ping of a node that refuses the connection retries it for ``MessageTimeout`` seconds (at most
  10) before the next ping may start: 10 to 13 s from the loss to DOWN here, 28 to 30 s with
  ``SlurmdTimeout=10`` and the default ``MessageTimeout`` of 10 (the default ``SlurmdTimeout`` is
  300 s). 3 s is still far more than any reply between the daemons takes on this machine;
- ``bf_interval=1``: the backfill scheduler starts a requeued job within a second of the time it
  may start (the default interval is 30 s).
- ``OverTimeLimit=1``: a job past its time limit runs one more minute before Slurm ends it as
  TIMEOUT. The limit's ``--signal`` still lands before the limit itself (slurmctld reckons it
  from the job's end time); the minute is the margin a signalled run on a loaded machine needs
  to checkpoint, stop and requeue itself (the default 0 left 15 s at ``--time=1
  --signal=TERM@15``, and one CI run took longer).

:func:`slurm_cluster` (session scope) starts one cluster for the whole tier; a missing daemon
fails the test in CI and skips it elsewhere (:mod:`tests.needs`).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from .needs import debian, require, require_netns
from .netns import Nodes
from .procs import free_port, wait_until

SLURM_PACKAGES = "slurmctld slurmd slurm-client munge"
_COMMANDS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "unshare")
START_TIMEOUT_S = 60
SLURMD_PORT = 6818  # each node has its own port space


def _short_hostname() -> str:
    """This machine's name as slurmctld matches it against ``SlurmctldHost`` (up to the first
    dot)."""
    return socket.gethostname().split(".")[0]


def _conf(root: Path, names: list[str], nodes: Nodes, ctld_port: int) -> str:
    node_lines = "\n".join(f"NodeName={name} NodeAddr={nodes.address(i)} CPUs=2 State=UNKNOWN"
                           for i, name in enumerate(names))
    return f"""\
ClusterName=elastic-runner-tests
SlurmctldHost={_short_hostname()}({nodes.host_address})
SlurmctldPort={ctld_port}
SlurmdPort={SLURMD_PORT}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/socket,cred_expire=5
StateSaveLocation={root}/ctld
SlurmctldPidFile={root}/ctld/slurmctld.pid
SlurmctldLogFile={root}/ctld/slurmctld.log
SlurmdSpoolDir={root}/nodes/%n
SlurmdPidFile={root}/nodes/%n/slurmd.pid
SlurmdLogFile={root}/nodes/%n/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1
MpiDefault=none
SwitchType=switch/none
JobRequeue=1
ReturnToService=2
SlurmdTimeout=5
MessageTimeout=3
KillWait=30
OverTimeLimit=1
MinJobAge=600
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
{node_lines}
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
PartitionName=main Nodes={",".join(names)} Default=YES MaxTime=INFINITE State=UP \
PriorityTier=1 GraceTime=30
PartitionName=urgent Nodes={",".join(names)} MaxTime=INFINITE State=UP PriorityTier=2
"""


class SlurmCluster:
    """``count`` Slurm nodes (``n0`` ...) and their controller; :meth:`close` stops everything.

    Client commands run with :attr:`env` (``SLURM_CONF``); a job submitted with it inherits it,
    so the batch script's ``srun`` and ``scontrol`` reach the same controller."""

    def __init__(self, count: int) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="er-slurm-", dir="/tmp"))
        self.root.chmod(0o755)  # munged wants every directory above its socket searchable
        self.names = [f"n{i}" for i in range(count)]
        self._procs: dict[str, subprocess.Popen] = {}
        self.nodes: Nodes | None = None
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    @property
    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.root / "slurm.conf")}

    def _start(self) -> None:
        self.nodes = Nodes(len(self.names))
        for d in ("munge", "ctld", "fakecgroup", *(f"nodes/{n}" for n in self.names)):
            (self.root / d).mkdir(parents=True)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        (self.root / "slurm.conf").write_text(_conf(self.root, self.names, self.nodes,
                                                    free_port()))
        (self.root / "cgroup.conf").write_text(
            f"CgroupPlugin=cgroup/v1\nCgroupMountpoint={self.root}/fakecgroup\n")
        hosts = "127.0.0.1 localhost\n" + "".join(
            f"{self.nodes.address(i)} {name}\n" for i, name in enumerate(self.names))
        for ns in self.nodes.names:
            (Path("/etc/netns") / ns).mkdir(parents=True, exist_ok=True)
            (Path("/etc/netns") / ns / "hosts").write_text(hosts)
        munge = self.root / "munge"
        self._spawn("munged", ["munged", "--foreground", f"--key-file={key}",
                               f"--socket={munge}/socket", f"--pid-file={munge}/munged.pid",
                               f"--log-file={munge}/munged.log",
                               f"--seed-file={munge}/munged.seed"])
        wait_until((munge / "socket").exists, START_TIMEOUT_S, "munged's socket")
        self._spawn("slurmctld", ["slurmctld", "-D"])
        for i in range(len(self.names)):
            self.start_node(i)
        self.wait_idle()

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.root / f"{name}.out", "ab")  # noqa: SIM115 - the child holds it
        self._procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                             env={**os.environ, **self.env},
                                             start_new_session=True)
        log.close()

    def start_node(self, i: int) -> None:
        """Start node ``i``'s slurmd in its namespace, under its own hostname (every step
        execs the next: the pid is slurmd's)."""
        assert self.nodes is not None
        name = self.names[i]
        sethostname = ("import os, socket, sys; socket.sethostname(sys.argv[1]); "
                       "os.execvp(sys.argv[2], sys.argv[2:])")
        self._spawn(name, self.nodes.argv(i, ["unshare", "--uts", "python3", "-c",
                                              sethostname, name, "slurmd", "-D"]))

    def lose_node(self, i: int) -> None:
        """Node ``i`` dies: SIGKILL to every process in its namespace (its slurmd, the job
        step's slurmstepd, the agent and the workers there), as a power loss would."""
        assert self.nodes is not None
        self._kill_namespace(self.nodes.names[i])
        self._procs.pop(self.names[i]).wait(timeout=30)

    def _kill_namespace(self, ns: str) -> None:
        done = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True,
                              timeout=30)
        for pid in done.stdout.split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)

    def states(self) -> dict[str, str]:
        """Each node's state as ``sinfo`` reports it (``idle``, ``alloc``, ``down*`` ...)."""
        out = self.run("sinfo", "-h", "-N", "-o", "%N %t").stdout
        return dict(line.split() for line in out.splitlines())

    def wait_idle(self, timeout: float = START_TIMEOUT_S) -> None:
        wait_until(lambda: set(self.states().values()) == {"idle"}, timeout,
                   f"every Slurm node idle (the daemons' logs are in {self.root})", poll=0.5)

    def run(self, *argv: str) -> subprocess.CompletedProcess:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60,
                              env={**os.environ, **self.env})
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: exit {done.returncode}: {done.stderr}")
        return done

    def sbatch(self, argv: list[str], cwd: Path, env: dict[str, str]) -> int:
        """Submit ``sbatch argv`` from ``cwd`` with ``env`` on top of ours; the job id."""
        done = subprocess.run(["sbatch", "--parsable", *argv], capture_output=True, text=True,
                              timeout=60, cwd=cwd, env={**os.environ, **self.env, **env})
        if done.returncode != 0:
            raise RuntimeError(f"sbatch {' '.join(argv)}: exit {done.returncode}: "
                               f"{done.stderr}")
        return int(done.stdout.split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job`` as a dict (``JobState``, ``Restarts``, ``ExitCode``, ...)."""
        out = self.run("scontrol", "show", "job", "-o", str(job_id)).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait_job(self, job_id: int, states: set[str], timeout: float) -> dict[str, str]:
        """Wait until the job is in one of ``states``; its record then."""
        wait_until(lambda: self.job(job_id)["JobState"] in states, timeout,
                   f"job {job_id} in {sorted(states)}", poll=0.5)
        return self.job(job_id)

    def close(self) -> None:
        """Cancel every job, kill every daemon and every process on the nodes, remove it all."""
        if "slurmctld" in self._procs:
            subprocess.run(["scancel", "--full", "--user=root"], capture_output=True, timeout=30,
                           env={**os.environ, **self.env})
        if self.nodes is not None:
            for ns in self.nodes.names:
                self._kill_namespace(ns)
                shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
        for proc in self._procs.values():
            proc.kill()
            proc.wait(timeout=30)
        self._procs.clear()
        if self.nodes is not None:
            self.nodes.close()
        shutil.rmtree(self.root, ignore_errors=True)


def require_slurm() -> None:
    for command in _COMMANDS:
        require(shutil.which(command) is not None, command, debian(SLURM_PACKAGES))


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    """One two-node Slurm cluster for every test of the tier."""
    require_slurm()
    require_netns()
    cluster = SlurmCluster(2)
    yield cluster
    cluster.close()


def wait_for_log(path: Path, pattern: str, timeout: float) -> re.Match:
    """Wait until the job's output file has a line matching ``pattern``; the match."""
    found: list[re.Match] = []

    def seen() -> bool:
        text = path.read_text(errors="replace") if path.exists() else ""
        m = re.search(pattern, text, re.MULTILINE)
        if m:
            found.append(m)
        return m is not None

    wait_until(seen, timeout, f"{pattern!r} in {path}", poll=0.25)
    return found[0]
