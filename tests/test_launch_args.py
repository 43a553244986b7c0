"""Translation of ``run`` options into torchrun's arguments (parsed by torchrun's own parser)."""

import pytest
from torch.distributed.run import get_args_parser

from elastic_runner.cli import build_parser
from elastic_runner.launch import torchrun_argv


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
