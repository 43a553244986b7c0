"""Kubeflow Trainer v2 (``deploy/k8s/trainer-v2``), checked offline like the PyTorchJob: render
the Kustomize tree with ``kubectl kustomize``, validate every object against its CRD schema
(Trainer v2.3 TrainJob / ClusterTrainingRuntime / TrainingRuntime, JobSet v0.12) and for keys
the schema does not know (``tests/k8s.py``); render the JobSet that Trainer would make of the
runtime and the TrainJob (:func:`trainer_jobset`) and cross-check it against the code (command,
config, ``PET_*`` rendezvous, ports, probes, grace period, volumes, failure policy), each check a
function that a planted fault must fail; and rehearse the operator: the ``PET_*`` environment
that Trainer's torch plugin injects for node ranks 0..N-1, each "pod" a separate
``elastic-runner run`` on loopback with c10d, one pod killed, then the JobSet-style restart of
all of them resuming from the newest checkpoint."""

from __future__ import annotations

import copy
import json
import os
import re
import signal
import sys
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from elastic_runner.agent.launch import TRAINER_PORT, torchrun_argv
from elastic_runner.checkpoint import storage as ckpt
from elastic_runner.cli import build_parser
from elastic_runner.config import load_config
from elastic_runner.exit_codes import EXIT_BAD_INPUT, EXIT_CRASH_LOOP, EXIT_FENCED, EXIT_PREEMPTED
from elastic_runner.observe import health

from .evidence import DIGITS_TRAIN, assert_exact_audit, world_sizes
from .k8s import K8S, by_kind, problems, render
from .procs import free_port, wait_until

TREE = K8S / "trainer-v2"
TRAINER = "trainer.kubeflow.org/trainjob-ancestor-step"  # Trainer's label of the trainer job
NODE = "node"  # the job and container name that Trainer's torch plugin looks for
COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"


@cache
def _rendered() -> list[dict[str, Any]]:
    return render(TREE)


def one(kind: str, objects: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    (obj,) = by_kind(_rendered() if objects is None else objects, kind)
    return obj


# ------------------------------------------------------------------ the JobSet Trainer makes


def _upsert(items: list[dict[str, Any]], new: dict[str, Any], key: str) -> None:
    for i, item in enumerate(items):
        if item.get(key) == new[key]:
            items[i] = new
            return
    items.append(new)


def trainer_jobset(runtime: dict[str, Any], trainjob: dict[str, Any]) -> dict[str, Any]:
    """The JobSet that Kubeflow Trainer v2.3 creates for ``trainjob`` on ``runtime``, as far as
    its documented merge goes: the runtime's JobSet template named after the TrainJob; in the
    replicated job labelled ``trainjob-ancestor-step: trainer``, ``numNodes`` pods
    (``parallelism`` = ``completions``) and in its container ``node`` the TrainJob's image,
    command, args, resources and env (``pkg/runtime/framework/plugins/jobset/builder.go``,
    ``Builder.Trainer``), then the torch plugin's ``PET_*`` variables and port
    (``pkg/runtime/framework/plugins/torch/torch.go``, ``EnforceMLPolicy``); plus the JobSet
    webhook's defaults that the plugin relies on (Indexed Jobs, DNS host names under the
    JobSet's name). Raises AssertionError when the TrainJob does not name the runtime or the
    runtime has no trainer job with a ``node`` container."""
    ref = trainjob["spec"]["runtimeRef"]
    assert (ref.get("apiGroup"), ref.get("kind"), ref["name"]) == (
        runtime["apiVersion"].split("/")[0], runtime["kind"], runtime["metadata"]["name"])
    assert "torch" in runtime["spec"]["mlPolicy"]
    name, trainer = trainjob["metadata"]["name"], trainjob["spec"].get("trainer", {})
    spec = copy.deepcopy(runtime["spec"]["template"]["spec"])
    (job,) = [j for j in spec["replicatedJobs"]
              if j["template"].get("metadata", {}).get("labels", {}).get(TRAINER) == "trainer"]
    nodes = trainer.get("numNodes", runtime["spec"]["mlPolicy"].get("numNodes", 1))
    job["replicas"] = 1
    job_spec = job["template"]["spec"]
    job_spec.update(parallelism=nodes, completions=nodes)
    job_spec.setdefault("completionMode", "Indexed")
    (c,) = [c for c in job_spec["template"]["spec"]["containers"] if c["name"] == NODE]
    for key in ("image", "command", "args"):
        if key in trainer:
            c[key] = trainer[key]
    if "resourcesPerNode" in trainer:
        c["resources"] = trainer["resourcesPerNode"]
    env = c.setdefault("env", [])
    for e in trainer.get("env", []):
        _upsert(env, e, "name")
    for e in ({"name": "PET_NNODES", "value": str(nodes)},
              {"name": "PET_NPROC_PER_NODE", "value": str(trainer.get("numProcPerNode", "auto"))},
              {"name": "PET_NODE_RANK", "valueFrom": {"fieldRef": {"fieldPath": COMPLETION_INDEX}}},
              {"name": "PET_MASTER_ADDR", "value": f"{name}-{NODE}-0-0.{name}"},
              {"name": "PET_MASTER_PORT", "value": str(TRAINER_PORT)}):
        _upsert(env, e, "name")
    _upsert(c.setdefault("ports", []), {"containerPort": TRAINER_PORT}, "containerPort")
    network = spec.setdefault("network", {})
    network.setdefault("enableDNSHostnames", True)
    network.setdefault("subdomain", name)
    return {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
            "metadata": {"name": name, "labels": {"trainer.kubeflow.org/trainjob-name": name}},
            "spec": spec}


def jobset(objects: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return trainer_jobset(one("ClusterTrainingRuntime", objects), one("TrainJob", objects))


def node_job(js: dict[str, Any]) -> dict[str, Any]:
    (job,) = [j for j in js["spec"]["replicatedJobs"] if j["name"] == NODE]
    return job["template"]["spec"]


def pod_spec(js: dict[str, Any]) -> dict[str, Any]:
    return node_job(js)["template"]["spec"]


def node_container(js: dict[str, Any]) -> dict[str, Any]:
    (c,) = [c for c in pod_spec(js)["containers"] if c["name"] == NODE]
    return c


def pod_env(js: dict[str, Any], node_rank: int, pod_ip: str) -> dict[str, str]:
    """The container's environment in the pod of ``node_rank``, field references resolved as
    the kubelet would (the pod IP, the completion index, the JobSet name label)."""
    fields = {"status.podIP": pod_ip, COMPLETION_INDEX: str(node_rank),
              "metadata.labels['jobset.sigs.k8s.io/jobset-name']": js["metadata"]["name"]}
    env = {}
    for e in node_container(js)["env"]:
        if "value" in e:
            env[e["name"]] = e["value"]
        else:
            env[e["name"]] = fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
    return env


def command_args(js: dict[str, Any]):
    c = node_container(js)
    cmd = c["command"] + c.get("args", [])
    assert cmd[0] == "elastic-runner"
    return build_parser().parse_args(cmd[1:])


def config_text(objects: list[dict[str, Any]]) -> str:
    for cm in by_kind(objects, "ConfigMap"):
        if "job.yaml" in cm.get("data", {}):
            return cm["data"]["job.yaml"]
    raise AssertionError("no ConfigMap holds job.yaml")


def job_config(objects: list[dict[str, Any]], js: dict[str, Any], directory: Path):
    """The runner config as the container loads it: the ConfigMap's file plus the overrides."""
    path = directory / "job.yaml"
    path.write_text(config_text(objects))
    return load_config(path, command_args(js).overrides)


# ------------------------------------------------------------------ the failure policy


def job_failure(job_spec: dict[str, Any], exit_code: int,
                conditions: tuple[str, ...] = ()) -> tuple[str, str] | None:
    """How the Job controller fails a Job one of whose pods failed with ``exit_code`` (its
    container ``node``) and pod ``conditions``: ``(reason, message)``, or None when the Job
    goes on (the pod is replaced). ``podFailurePolicy`` rules in order, first match wins, with
    the controller's messages (``pkg/controller/job/pod_failure_policy.go``); then
    ``backoffLimit`` (one failure here)."""
    pod = "ns/pod"
    if exit_code == 0 and not conditions:
        return None  # the pod succeeded
    for index, rule in enumerate(job_spec.get("podFailurePolicy", {}).get("rules", [])):
        on_exit, on_conditions = rule.get("onExitCodes"), rule.get("onPodConditions", [])
        if on_exit and on_exit.get("containerName", NODE) == NODE and exit_code != 0 and \
                (exit_code in on_exit["values"]) == (on_exit["operator"] == "In"):
            message = (f"Container {NODE} for pod {pod} failed with exit code {exit_code} "
                       f"matching {rule['action']} rule at index {index}")
        elif any(c["type"] in conditions and c.get("status", "True") == "True"
                 for c in on_conditions):
            matched = next(c["type"] for c in on_conditions if c["type"] in conditions)
            message = f"Pod {pod} has condition {matched} matching {rule['action']} rule at " \
                      f"index {index}"
        else:
            continue
        if rule["action"] == "FailJob":
            return "PodFailurePolicy", message
        if rule["action"] == "Ignore":
            return None
        break  # Count: counted against backoffLimit
    if job_spec.get("backoffLimit", 6) < 1:
        return "BackoffLimitExceeded", "Job has reached the specified backoff limit"
    return None


def jobset_action(js: dict[str, Any], failure: tuple[str, str]) -> str:
    """The JobSet failurePolicy's action for a failed Job: the first rule whose reasons and
    message patterns match (RE2; the patterns here use the syntax RE2 and Python share), else
    RestartJobSet (jobset.x-k8s.io v1alpha2 ``FailurePolicyRule``)."""
    reason, message = failure
    for rule in js["spec"].get("failurePolicy", {}).get("rules", []):
        if rule.get("onJobFailureReasons") and reason not in rule["onJobFailureReasons"]:
            continue
        patterns = rule.get("onJobFailureMessagePatterns")
        if patterns and not any(re.search(p, message) for p in patterns):
            continue
        return rule["action"]
    return "RestartJobSet"


def action_for(js: dict[str, Any], exit_code: int, conditions: tuple[str, ...] = ()) -> str:
    failure = job_failure(node_job(js), exit_code, conditions)
    return "Continue" if failure is None else jobset_action(js, failure)


# ------------------------------------------------------------------ cross-checks
# Each returns what is wrong (empty: nothing); the shipped manifests pass all, a planted fault
# fails the one that covers it.

Check = Callable[[list[dict[str, Any]], dict[str, Any], Path], list[str]]


def check_command_and_config(objects, js, tmp) -> list[str]:
    args = command_args(js)
    out = []
    if args.func.__name__ != "cmd_run":
        out.append(f"the command runs {args.func.__name__}, not `elastic-runner run`")
    mounts = {m["mountPath"]: m["name"] for m in node_container(js)["volumeMounts"]}
    volumes = {v["name"]: v for v in pod_spec(js)["volumes"]}
    mount = mounts.get(str(Path(args.config).parent))
    maps = {c["metadata"]["name"] for c in by_kind(objects, "ConfigMap")}
    if mount is None or volumes[mount].get("configMap", {}).get("name") not in maps:
        out.append(f"{args.config} is not on a mounted ConfigMap of {sorted(maps)}")
    job_config(objects, js, tmp)  # raises on a config that does not load
    return out


def check_checkpoint_volume(objects, js, tmp) -> list[str]:
    cfg = job_config(objects, js, tmp)
    claims = {p["metadata"]["name"] for p in by_kind(objects, "PersistentVolumeClaim")
              if p["spec"]["accessModes"] == ["ReadWriteMany"]}
    volumes = {v["name"]: v for v in pod_spec(js)["volumes"]}
    shared = [m for m in node_container(js)["volumeMounts"]
              if volumes.get(m["name"], {}).get("persistentVolumeClaim", {}).get("claimName")
              in claims and not m.get("readOnly")]
    if not any(Path(cfg.checkpoint.dir).is_relative_to(m["mountPath"]) for m in shared):
        return [f"checkpoint.dir {cfg.checkpoint.dir} is not on a writable ReadWriteMany claim"]
    return []


def check_metrics_port_and_probes(objects, js, tmp) -> list[str]:
    cfg, c = job_config(objects, js, tmp), node_container(js)
    ports = {p.get("name"): p["containerPort"] for p in c["ports"]}
    monitor = one("PodMonitor", objects)
    labels = node_job(js)["template"]["metadata"]["labels"]
    out = []
    if not monitor["spec"]["selector"]["matchLabels"].items() <= labels.items():
        out.append("the PodMonitor does not select the node pods")
    for endpoint in monitor["spec"]["podMetricsEndpoints"]:
        if ports.get(endpoint["port"]) != cfg.metrics.port:
            out.append(f"PodMonitor port {endpoint['port']!r} = {ports.get(endpoint['port'])}, "
                       f"the runner serves metrics.port {cfg.metrics.port}")
    for probe, path in (("livenessProbe", health.LIVENESS), ("readinessProbe", health.READINESS)):
        get = c[probe]["httpGet"]
        port = ports.get(get["port"], get["port"])
        if (get["path"], port) != (path, cfg.metrics.port):
            out.append(f"{probe} {get} does not reach {path} on {cfg.metrics.port}")
    if cfg.metrics.address != "0.0.0.0":
        out.append(f"metrics.address {cfg.metrics.address} is not reachable from outside")
    return out


def check_rendezvous(objects, js, tmp) -> list[str]:
    """Every node's ``run`` turns the injected PET_* into one c10d rendezvous at node 0's
    pod, on a port its container exposes, with node 0 (only) hosting the store."""
    out = []
    ports = {p["containerPort"] for p in node_container(js)["ports"]}
    nodes, name = node_job(js)["parallelism"], js["metadata"]["name"]
    node_0 = f"{name}-{NODE}-0-0.{js['spec']['network']['subdomain']}"  # its DNS name
    for rank in range(nodes):
        env = pod_env(js, rank, f"10.0.0.{rank + 1}")
        t = _torchrun_args(command_args(js), env)
        host, _, port = t.rdzv_endpoint.rpartition(":")
        if (t.rdzv_backend, host) != ("c10d", node_0):
            out.append(f"node {rank}: rendezvous {t.rdzv_backend} at {t.rdzv_endpoint}")
        if int(port) not in ports:
            out.append(f"node {rank}: rendezvous port {port} is not a container port {ports}")
        if f"is_host={'true' if rank == 0 else 'false'}" not in t.rdzv_conf:
            out.append(f"node {rank}: rdzv conf {t.rdzv_conf!r}")
        if (t.nnodes, t.rdzv_id, env.get("PET_LOCAL_ADDR")) != (str(nodes), name,
                                                                f"10.0.0.{rank + 1}"):
            out.append(f"node {rank}: nnodes {t.nnodes}, rdzv id {t.rdzv_id}, local addr "
                       f"{env.get('PET_LOCAL_ADDR')}")
    return out


def check_world_size(objects, js, tmp) -> list[str]:
    cfg = job_config(objects, js, tmp)
    env = pod_env(js, 0, "10.0.0.1")
    nproc = env["PET_NPROC_PER_NODE"]
    if not nproc.isdigit():
        return [f"numProcPerNode {nproc!r}: set a number (auto is the node's CPU count on CPU)"]
    world_size = node_job(js)["parallelism"] * int(nproc)
    try:
        cfg.batch.accumulation_for(world_size)
    except ValueError as e:
        return [f"world size {world_size}: {e}"]
    return []


def check_stop_and_restart(objects, js, tmp) -> list[str]:
    """A preempted pod checkpoints within its grace period; the failure policy restarts every
    pod on a crash or a preemption (the latter without spending maxRestarts) and never on an
    exit that would fail the same way again."""
    cfg, pod = job_config(objects, js, tmp), pod_spec(js)
    out = []
    if pod.get("terminationGracePeriodSeconds", 30) <= cfg.preemption.grace_seconds + 10:
        out.append(f"terminationGracePeriodSeconds {pod.get('terminationGracePeriodSeconds')} "
                   f"<= preemption.grace_seconds {cfg.preemption.grace_seconds} + 10")
    if not pod.get("shareProcessNamespace"):
        out.append("elastic-runner would be PID 1 (shareProcessNamespace)")
    expected = {0: "Continue", 1: "RestartJobSet", 137: "RestartJobSet",
                EXIT_BAD_INPUT: "FailJobSet", EXIT_FENCED: "FailJobSet",
                EXIT_CRASH_LOOP: "FailJobSet",
                EXIT_PREEMPTED: "RestartJobSetAndIgnoreMaxRestarts"}
    for code, action in expected.items():
        if action_for(js, code) != action:
            out.append(f"exit {code}: {action_for(js, code)}, not {action}")
    if action_for(js, 137, ("DisruptionTarget",)) != "RestartJobSetAndIgnoreMaxRestarts":
        out.append("a disrupted pod spends maxRestarts")
    policy = js["spec"]["failurePolicy"]
    if policy.get("maxRestarts", 0) < 1 or policy.get("restartStrategy") != "BlockingRecreate":
        out.append(f"failurePolicy {policy.get('maxRestarts')} restarts, "
                   f"{policy.get('restartStrategy')}")
    return out


CHECKS: dict[str, Check] = {
    "command": check_command_and_config, "checkpoints": check_checkpoint_volume,
    "metrics": check_metrics_port_and_probes, "rendezvous": check_rendezvous,
    "world_size": check_world_size, "stop": check_stop_and_restart}


def _torchrun_args(args, env: dict[str, str]):
    """torchrun's arguments for ``run`` in a pod whose environment holds ``env`` and no other
    ``PET_*`` (this process's environment is restored afterwards)."""
    from torch.distributed.run import get_args_parser

    with mock.patch.dict(os.environ):
        for key in [k for k in os.environ if k.startswith("PET_")]:
            del os.environ[key]
        os.environ.update(env)
        return get_args_parser().parse_args(torchrun_argv(args))


# ------------------------------------------------------------------ tests


def test_every_object_validates_against_its_schema():
    objects = _rendered()
    assert [p for obj in [*objects, jobset()] for p in problems(obj)] == []
    assert sorted(o["kind"] for o in objects) == sorted([
        "ClusterTrainingRuntime", "ConfigMap", "ConfigMap", "PersistentVolumeClaim",
        "PodMonitor", "PrometheusRule", "TrainJob"])


def test_the_runtime_is_also_a_valid_namespaced_training_runtime():
    runtime = one("ClusterTrainingRuntime")
    runtime["kind"] = "TrainingRuntime"
    assert problems(runtime) == []


@pytest.mark.parametrize("kind, path, typo", [
    ("ClusterTrainingRuntime",
     ["spec", "template", "spec", "replicatedJobs", 0, "template", "spec", "template", "spec"],
     ("terminationGracePeriodSeconds", "terminationGracePeriodSecond")),
    ("ClusterTrainingRuntime", ["spec", "template", "spec", "failurePolicy"],
     ("rules", "rule")),
    ("TrainJob", ["spec", "trainer"], ("numNodes", "numNode")),
])
def test_a_misspelt_field_fails_validation(kind, path, typo):
    obj = one(kind)
    parent = obj
    for key in path:
        parent = parent[key]
    right, wrong = typo
    parent[wrong] = parent.pop(right)
    found = problems(obj)
    assert len(found) == 1 and found[0].endswith(f"unknown field .{'.'.join(map(str, path))}"
                                                 f".{wrong}".replace(".0.", "[0]."))


def test_the_rendered_jobset_is_what_trainer_makes_of_the_trainjob():
    js, trainjob = jobset(), one("TrainJob")
    trainer = trainjob["spec"]["trainer"]
    assert node_job(js)["parallelism"] == node_job(js)["completions"] == trainer["numNodes"]
    c = node_container(js)
    assert c["args"] == trainer["args"] and c["resources"] == trainer["resourcesPerNode"]
    env = pod_env(js, 1, "10.0.0.2")
    assert env["PET_NODE_RANK"] == "1" and env["PET_NNODES"] == str(trainer["numNodes"])
    assert env["OMP_NUM_THREADS"] == "1"
    assert int(env["OMP_NUM_THREADS"]) * trainer["numProcPerNode"] == \
        int(trainer["resourcesPerNode"]["limits"]["cpu"])
    assert pod_spec(js)["restartPolicy"] == "Never"  # podFailurePolicy requires it


@pytest.mark.parametrize("name", CHECKS)
def test_cross_check(name, tmp_path):
    assert CHECKS[name](_rendered(), jobset(), tmp_path) == []


def _plant(mutate: Callable[[dict[str, Any]], None]) -> list[dict[str, Any]]:
    objects = copy.deepcopy(_rendered())
    mutate({o["kind"]: o for o in objects})
    return objects


def _runtime_container(objs: dict[str, Any]) -> dict[str, Any]:
    return objs["ClusterTrainingRuntime"]["spec"]["template"]["spec"]["replicatedJobs"][0][
        "template"]["spec"]["template"]["spec"]["containers"][0]


def _runtime_job(objs: dict[str, Any]) -> dict[str, Any]:
    return objs["ClusterTrainingRuntime"]["spec"]["template"]["spec"]["replicatedJobs"][0][
        "template"]["spec"]


PLANTED = {
    "metrics port": ("metrics", lambda o: _runtime_container(o)["ports"][0].update(
        containerPort=9401)),
    "probe path": ("metrics", lambda o: _runtime_container(o)["livenessProbe"]["httpGet"]
                   .update(path="/health")),
    "monitor label": ("metrics", lambda o: o["PodMonitor"]["spec"]["selector"]["matchLabels"]
                      .update({"app.kubernetes.io/component": "trainer"})),
    "etcd endpoint left from v1": ("rendezvous", lambda o: _runtime_container(o)["env"].append(
        {"name": "PET_RDZV_ENDPOINT", "value": "elastic-runner-etcd:2379"})),
    "every node hosts": ("rendezvous", lambda o: _runtime_container(o)["env"][3].update(
        value="is_host=true,join_timeout=900")),
    "checkpoint dir": ("checkpoints", lambda o: o["TrainJob"]["spec"]["trainer"]["args"]
                       .__setitem__(0, "checkpoint.dir=/tmp/ck")),
    "config mount": ("command", lambda o: _runtime_container(o)["volumeMounts"][0].update(
        mountPath="/etc/config")),
    "processes": ("world_size", lambda o: o["TrainJob"]["spec"]["trainer"].update(
        numProcPerNode=4096)),  # more ranks than the global batch has samples
    "grace period": ("stop", lambda o: _runtime_job(o)["template"]["spec"].update(
        terminationGracePeriodSeconds=60)),
    "143 spends restarts": ("stop", lambda o: _runtime_job(o)["podFailurePolicy"]["rules"]
                            .pop(1)),
}


@pytest.mark.parametrize("fault", PLANTED)
def test_a_planted_fault_fails_its_cross_check(fault, tmp_path):
    check, mutate = PLANTED[fault]
    objects = _plant(mutate)
    assert CHECKS[check](objects, jobset(objects), tmp_path) != []
    assert CHECKS[check](_rendered(), jobset(), tmp_path) == []


def test_kubectl_apply_order_puts_the_runtime_before_the_trainjob():
    kinds = [o["kind"] for o in _rendered()]
    assert kinds.index("ClusterTrainingRuntime") < kinds.index("TrainJob")


# ------------------------------------------------------------------ operator rehearsal

REHEARSAL_STEPS = 24


@pytest.mark.slow
def test_trainer_rehearsal_pods_rendezvous_at_node_0_and_restart_together(launch, tmp_path):
    """N "pods" with the PET_* that Trainer injects (node ranks 0..N-1) train together through
    c10d at node 0; pod 1 is SIGKILLed; its Job fails and the failure policy restarts the JobSet:
    the other pod is stopped (SIGTERM, as its deletion does), every pod starts again, resumes
    from the newest checkpoint and finishes; every sample of every epoch exactly once."""
    js = jobset()
    nodes = node_job(js)["parallelism"]
    config = tmp_path / "etc" / "job.yaml"
    config.parent.mkdir()
    config.write_text(config_text(_rendered()))
    ck, trace = tmp_path / "checkpoints", tmp_path / "trace"
    args = command_args(js)
    c = node_container(js)
    store = free_port()  # 29400 may be taken here; the pods' DNS name is node 0's loopback
    ports = {rank: free_port() for rank in range(nodes)}

    def start(attempt: int) -> dict[int, Any]:
        pods = {}
        for rank in range(nodes):
            env = pod_env(js, rank, "127.0.0.1")
            env.update(PET_MASTER_ADDR="127.0.0.1", PET_MASTER_PORT=str(store),
                       PET_RDZV_CONF="read_timeout=120,join_timeout=120")
            argv = [sys.executable, "-m", "elastic_runner", *c["command"][1:], *c["args"]]
            argv[argv.index(args.config)] = str(config)  # the ConfigMap, "mounted" here
            argv += [f"checkpoint.dir={ck}", f"metrics.port={ports[rank]}",
                     "metrics.address=127.0.0.1", "metrics.linger_seconds=0",
                     f"training.max_steps={REHEARSAL_STEPS}", "early_stopping.enabled=false",
                     "checkpoint.every_steps=5", "data.num_workers=0",
                     f"audit.trace_dir={trace}",
                     # pod 1's SIGKILL fails the other pod's collectives; its workers wait this
                     # long for their agent to name a failed peer (none of theirs failed), then
                     # exit to the SIGTERM of the JobSet restart (10 s by default; above
                     # recovery.node_timeout_seconds, 5)
                     "recovery.detect_timeout_seconds=6"]
            pods[rank] = launch(argv, name=f"node-{rank}-attempt-{attempt}", env=env)
        return pods

    pods = start(0)
    world = nodes * int(pod_env(js, 0, "")["PET_NPROC_PER_NODE"])

    def checkpointed() -> bool:
        found = ckpt.latest_valid(ck) if ck.is_dir() else None
        return found is not None and found.world_size == world and found.step >= 10

    wait_until(checkpointed, 240, f"a checkpoint of step 10 at world size {world}")
    pods[1].kill_all()  # the pod is lost: its container ends with SIGKILL (exit 137)
    assert pods[1].proc.returncode == -signal.SIGKILL
    assert action_for(js, 128 + signal.SIGKILL) == "RestartJobSet"

    # BlockingRecreate: every old pod is deleted (SIGTERM) and gone before new ones start
    for rank, pod in pods.items():
        if rank != 1:
            pod.proc.send_signal(signal.SIGTERM)
            code = pod.wait(timeout=120)
            assert code not in (0, EXIT_BAD_INPUT, EXIT_FENCED, EXIT_CRASH_LOOP), pod.output[-3000:]
    newest = ckpt.latest_valid(ck).step

    pods = start(1)
    for pod in pods.values():
        assert pod.wait(timeout=300) == 0, pod.output[-3000:]
        assert f"rendezvous: c10d at 127.0.0.1:{store}" in pod.output
    out = "".join(pod.output for pod in pods.values())  # rank 0 may be on either pod
    assert f"resumed from {ck / f'step-{newest:08d}'}:" in out
    results = json.loads((ck / "results.json").read_text())
    assert results["step"] == REHEARSAL_STEPS
    sizes = world_sizes(trace)
    assert sizes == [world] * REHEARSAL_STEPS  # fixed size: every step at N x processes
    # job.yaml: digits, batch.global_batch_size 96; the JobSet restart resumes a checkpoint
    # every rank reached: nothing repaired
    reports = assert_exact_audit(trace, steps=REHEARSAL_STEPS, global_batch=96,
                                 num_samples=DIGITS_TRAIN)
    assert all(r.seen_once == r.expected for r in reports if r.complete)
