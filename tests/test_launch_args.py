"""Translation of ``run`` options into torchrun's arguments (parsed by torchrun's own parser)."""

import logging
import os

import pytest
from torch.distributed.run import config_from_args, get_args_parser

from elastic_runner.agent.launch import agent_environment, omp_threads, torchrun_argv
from elastic_runner.cli import build_parser
from elastic_runner.compat import agent as compat_agent
from elastic_runner.compat.registry import check_torch
from elastic_runner.compat.rendezvous import SHARE_STORE_SWITCH


def torchrun_args(*cmd: str):
    return get_args_parser().parse_args(torchrun_argv(build_parser().parse_args(["run", *cmd])))


def test_defaults_are_standalone_c10d_on_loopback(monkeypatch):
    for var in ("PET_NPROC_PER_NODE", "PET_N_PROC_PER_NODE", "PET_RDZV_ENDPOINT",
                "PET_MAX_RESTARTS"):
        monkeypatch.delenv(var, raising=False)
    t = torchrun_args("c.yaml", "optimizer.lr=0.1")
    assert (t.rdzv_backend, t.rdzv_endpoint) == ("c10d", "127.0.0.1:0")
    assert t.nproc_per_node == "2" and t.max_restarts == 3 and t.monitor_interval == 1.0
    assert t.module and t.training_script == "elastic_runner"
    assert t.training_script_args == ["train", "c.yaml", "optimizer.lr=0.1"]


def test_explicit_options_pass_through():
    t = torchrun_args("c.yaml", "--nnodes", "1:4", "--nproc-per-node", "1", "--rdzv-backend",
                      "etcd-v2", "--rdzv-endpoint", "10.0.0.1:2379", "--rdzv-id", "job7",
                      "--rdzv-conf", "join_timeout=60", "--rdzv-conf", "protocol=https",
                      "--max-restarts", "5", "--monitor-interval", "0.5", "--no-resume")
    assert (t.nnodes, t.nproc_per_node, t.rdzv_backend) == ("1:4", "1", "etcd-v2")
    assert (t.rdzv_endpoint, t.rdzv_id) == ("10.0.0.1:2379", "job7")
    assert t.rdzv_conf == "join_timeout=60,protocol=https"
    assert (t.max_restarts, t.monitor_interval) == (5, 0.5)
    assert t.training_script_args[-1] == "--no-resume"


def test_preemption_grace_becomes_the_agents_shutdown_timeout():
    args = build_parser().parse_args(["run", "c.yaml"])
    args.shutdown_timeout = 75  # what cmd_run sets from preemption.grace_seconds
    assert get_args_parser().parse_args(torchrun_argv(args)).shutdown_timeout == 75


def test_a_torchrun_without_shutdown_timeout_is_not_given_one(monkeypatch):
    """torch 2.11 (inside the declared range; found on a GPU machine) has no
    ``--shutdown-timeout``: ``run`` leaves it out instead of failing with torchrun's usage
    error, and the agent's start-up check says the grace is torch's fixed 30 s."""
    def older_parser():
        parser = get_args_parser()
        parser._actions = [a for a in parser._actions
                           if "--shutdown-timeout" not in a.option_strings]
        parser._option_string_actions.pop("--shutdown-timeout")
        return parser

    monkeypatch.setattr(compat_agent, "get_args_parser", older_parser)
    compat_agent.shutdown_timeout_supported.cache_clear()
    try:
        args = build_parser().parse_args(["run", "c.yaml"])
        args.shutdown_timeout = 75
        argv = torchrun_argv(args)
        assert "--shutdown-timeout" not in argv
        assert older_parser().parse_args(argv).training_script_args == ["train", "c.yaml"]
        warnings = check_torch("agent")
        assert any("torchrun has no --shutdown-timeout" in w and "30 s after SIGTERM" in w
                   for w in warnings), warnings
    finally:
        monkeypatch.undo()
        compat_agent.shutdown_timeout_supported.cache_clear()
    assert "--shutdown-timeout" in torchrun_argv(args)  # torch 2.13's parser has it


@pytest.mark.parametrize("var, value, attr, expected", [
    ("PET_NPROC_PER_NODE", "4", "nproc_per_node", "4"),
    ("PET_N_PROC_PER_NODE", "3", "nproc_per_node", "3"),  # training-operator's spelling
    ("PET_MAX_RESTARTS", "7", "max_restarts", 7),
    ("PET_RDZV_ENDPOINT", "etcd:2379", "rdzv_endpoint", "etcd:2379"),
])
def test_unset_options_defer_to_pet_environment(monkeypatch, var, value, attr, expected):
    """What the Kubeflow operator sets wins over our defaults, not over explicit options."""
    monkeypatch.setenv(var, value)
    assert getattr(torchrun_args("c.yaml"), attr) == expected


TRAINER_ENV = ("PET_MASTER_ADDR", "PET_MASTER_PORT", "PET_NODE_RANK", "PET_NNODES",
               "PET_NPROC_PER_NODE", "PET_RDZV_ENDPOINT", "PET_RDZV_BACKEND", "PET_RDZV_CONF")


@pytest.mark.parametrize("node_rank, is_host", [("0", "true"), ("1", "false"), ("3", "false")])
def test_kubeflow_trainer_master_address_becomes_the_c10d_endpoint(monkeypatch, node_rank,
                                                                   is_host):
    """Trainer v2's torch plugin injects PET_MASTER_ADDR/PORT (torchrun's static rendezvous);
    run makes node 0's agent host the c10d store there, not a standalone store per pod."""
    for var in TRAINER_ENV:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PET_MASTER_ADDR", "train-1-node-0-0.train-1")
    monkeypatch.setenv("PET_MASTER_PORT", "29400")
    monkeypatch.setenv("PET_NODE_RANK", node_rank)
    monkeypatch.setenv("PET_NNODES", "3")
    monkeypatch.setenv("PET_NPROC_PER_NODE", "2")
    t = torchrun_args("c.yaml")
    assert (t.rdzv_backend, t.rdzv_endpoint) == ("c10d", "train-1-node-0-0.train-1:29400")
    assert t.rdzv_conf == f"is_host={is_host}"
    assert (t.nnodes, t.nproc_per_node, t.node_rank) == ("3", "2", int(node_rank))
    config, _, _ = config_from_args(t)
    assert (config.min_nodes, config.max_nodes) == (3, 3)
    assert config.rdzv_configs["is_host"] == is_host  # torch reads it with get_as_bool


def test_kubeflow_trainer_defaults_and_what_wins_over_them(monkeypatch):
    for var in TRAINER_ENV:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PET_MASTER_ADDR", "10.0.0.7")  # no port, no node rank
    t = torchrun_args("c.yaml")
    assert t.rdzv_endpoint == "10.0.0.7:29400" and t.rdzv_conf == ""
    monkeypatch.setenv("PET_NODE_RANK", "1")
    monkeypatch.setenv("PET_RDZV_CONF", "join_timeout=60,is_host=true")  # the user's wins
    assert torchrun_args("c.yaml").rdzv_conf == "join_timeout=60,is_host=true"
    t = torchrun_args("c.yaml", "--rdzv-conf", "read_timeout=30")
    assert t.rdzv_conf == "read_timeout=30,is_host=false"
    monkeypatch.delenv("PET_RDZV_CONF")
    t = torchrun_args("c.yaml", "--rdzv-endpoint", "h:1")  # an explicit endpoint wins
    assert t.rdzv_endpoint == "h:1" and t.rdzv_conf == ""
    monkeypatch.setenv("PET_RDZV_ENDPOINT", "etcd:2379")  # the PyTorchJob (v1) way wins too
    monkeypatch.setenv("PET_RDZV_BACKEND", "etcd-v2")
    t = torchrun_args("c.yaml")
    assert (t.rdzv_backend, t.rdzv_endpoint) == ("etcd-v2", "etcd:2379")


# --- the agent's environment: OMP_NUM_THREADS (no torchrun banner) and torch's rdzv switch ---

_BANNER = "Setting OMP_NUM_THREADS environment variable"


@pytest.fixture
def torchrun_log():
    """Messages of torchrun's logger (torch's logging set-up keeps them from pytest's caplog)."""
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore
    logger = logging.getLogger("torch.distributed.run")
    logger.addHandler(handler)
    yield messages
    logger.removeHandler(handler)


def _unset(monkeypatch, *names: str) -> None:
    """Unset ``names`` for the test, restored (or removed) afterwards even if code under test
    sets them."""
    for name in names:
        monkeypatch.setenv(name, "x")
        monkeypatch.delenv(name)


def _configure(nproc: str) -> None:
    """What ``launch`` does next: torchrun's own configuration of the run."""
    config_from_args(torchrun_args("c.yaml", "--nproc-per-node", nproc))


def test_omp_threads_share_the_cores_among_the_workers():
    assert [omp_threads(n, cores=8) for n in (1, 2, 3, 8, 16)] == [8, 4, 2, 1, 1]
    assert omp_threads(2) >= 1  # this machine's cores


def test_run_sets_omp_num_threads_instead_of_torchruns_banner(monkeypatch, caplog,
                                                               torchrun_log):
    _unset(monkeypatch, "OMP_NUM_THREADS", "PET_NPROC_PER_NODE", SHARE_STORE_SWITCH)
    caplog.set_level(logging.INFO)
    with agent_environment(2, cores=8) as env:
        assert os.environ["OMP_NUM_THREADS"] == "4" and os.environ[SHARE_STORE_SWITCH] == "1"
        _configure("2")
        assert os.environ["OMP_NUM_THREADS"] == "4"  # torchrun left it alone
    assert env == {"OMP_NUM_THREADS": "4", SHARE_STORE_SWITCH: "1"}
    assert "OMP_NUM_THREADS" not in os.environ and SHARE_STORE_SWITCH not in os.environ
    assert not any(_BANNER in m for m in torchrun_log), torchrun_log
    messages = [r.getMessage() for r in caplog.records]
    (line,) = [m for m in messages if m.startswith("OMP_NUM_THREADS=")]
    assert line.startswith("OMP_NUM_THREADS=4 for each of the 2 workers")


def test_torchrun_prints_its_banner_without_it(monkeypatch, torchrun_log):
    """The banner the test above checks for (torch.distributed.run.config_from_args)."""
    _unset(monkeypatch, "OMP_NUM_THREADS", "PET_NPROC_PER_NODE")
    _configure("2")
    assert os.environ["OMP_NUM_THREADS"] == "1"
    assert any(_BANNER in m for m in torchrun_log)


def test_users_omp_num_threads_and_switch_are_kept(monkeypatch, caplog):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.setenv(SHARE_STORE_SWITCH, "0")
    caplog.set_level(logging.INFO)
    with agent_environment(2, cores=8) as env:
        assert env == {} and os.environ["OMP_NUM_THREADS"] == "3"
        assert os.environ[SHARE_STORE_SWITCH] == "0"
    assert os.environ["OMP_NUM_THREADS"] == "3" and os.environ[SHARE_STORE_SWITCH] == "0"
    messages = [r.getMessage() for r in caplog.records]
    assert not any(m.startswith("OMP_NUM_THREADS=") for m in messages)
    assert any(m.startswith(f"{SHARE_STORE_SWITCH}=0 (not 1)") for m in messages)


@pytest.mark.parametrize("failures, named", [
    ({0: (4, 100), 1: (1, 100)}, 1),  # the crash, not the peer that lost it in the same second
    ({0: (4, 99), 1: (1, 100)}, 1),  # ... even when the loss has the earlier timestamp
    ({0: (-15, 99), 1: (-11, 100)}, 1),  # the signal, not the rank the agent stopped
    ({0: (1, 99), 1: (1, 100)}, 0),  # two crashes: the earlier
    ({0: (4, 100), 1: (4, 100)}, 0),  # only losses (the cause is on another node): rank order
])
def test_the_root_cause_line_names_the_rank_that_failed_on_its_own(tmp_path, failures, named):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from elastic_runner.agent.launch import root_cause_line

    procs = {}
    for rank, (code, timestamp) in failures.items():
        f = ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=code,
                           error_file=str(tmp_path / "none"))
        f.timestamp = timestamp
        procs[rank] = f
    line = root_cause_line(ChildFailedError("train", procs))
    assert line.startswith(f"rank {named} (local_rank {named}) exited with code "
                           f"{failures[named][0]}: ")
