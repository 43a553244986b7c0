"""Render a Kustomize directory in Python, for the features ``deploy/k8s`` uses.

Supported: ``resources`` (files and directories with their own kustomization), ``labels``
(``pairs``, metadata only), ``generatorOptions.disableNameSuffixHash: true``,
``configMapGenerator`` (``files``, ``options.labels``), ``images`` (``newName``/``newTag``) and
``patches`` with a JSON 6902 patch file and a ``target`` (applied with the ``jsonpatch``
library). Anything else raises, so the renderer never silently differs from kustomize; where
``kubectl`` is installed, ``tests/test_deploy.py`` also checks that ``kubectl kustomize`` gives
the same objects.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonpatch
import yaml

SUPPORTED = {"apiVersion", "kind", "resources", "labels", "generatorOptions",
             "configMapGenerator", "images", "patches"}


def render(directory: Path) -> list[dict[str, Any]]:
    """The objects of the kustomization in ``directory``, in kustomize's resource order."""
    k = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(k) - SUPPORTED
    if unknown:
        raise NotImplementedError(f"{directory}: kustomization fields {sorted(unknown)}")
    objects: list[dict[str, Any]] = []
    for entry in k.get("resources", []):
        path = directory / entry
        if path.is_dir():
            objects += render(path)
        else:
            objects += [d for d in yaml.safe_load_all(path.read_text()) if d]
    if not k.get("generatorOptions", {}).get("disableNameSuffixHash") and k.get(
            "configMapGenerator"):
        raise NotImplementedError("name suffix hashes")
    for gen in k.get("configMapGenerator", []):
        objects.append(_config_map(directory, gen))
    for patch in k.get("patches", []):
        _patch(directory, patch, objects)
    for image in k.get("images", []):
        _images(objects, image)
    for labels in k.get("labels", []):
        if labels.get("includeSelectors") or labels.get("includeTemplates"):
            raise NotImplementedError("labels on selectors or templates")
        for obj in objects:
            obj.setdefault("metadata", {}).setdefault("labels", {}).update(labels["pairs"])
    return objects


def _config_map(directory: Path, gen: dict[str, Any]) -> dict[str, Any]:
    if set(gen) - {"name", "files", "options"}:
        raise NotImplementedError(f"configMapGenerator fields {sorted(gen)}")
    data = {Path(f).name: (directory / f).read_text() for f in gen.get("files", [])}
    meta: dict[str, Any] = {"name": gen["name"]}
    if gen.get("options", {}).get("labels"):
        meta["labels"] = dict(gen["options"]["labels"])
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data}


def _matches(obj: dict[str, Any], target: dict[str, Any]) -> bool:
    group, _, version = obj["apiVersion"].rpartition("/")
    return all(target.get(k) in (None, v) for k, v in (
        ("group", group), ("version", version), ("kind", obj["kind"]),
        ("name", obj["metadata"]["name"])))


def _patch(directory: Path, patch: dict[str, Any], objects: list[dict[str, Any]]) -> None:
    ops = yaml.safe_load((directory / patch["path"]).read_text())
    if not isinstance(ops, list):
        raise NotImplementedError("strategic-merge patches")
    hits = [i for i, o in enumerate(objects) if _matches(o, patch["target"])]
    if not hits:
        raise ValueError(f"patch {patch['path']}: no object matches {patch['target']}")
    for i in hits:
        objects[i] = jsonpatch.apply_patch(objects[i], ops)


def _images(objects: list[dict[str, Any]], image: dict[str, Any]) -> None:
    def visit(node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("containers", "initContainers") and isinstance(value, list):
                    for c in value:
                        name, _, _tag = c.get("image", "").partition(":")
                        if name == image["name"]:
                            new = image.get("newName", name)
                            c["image"] = f"{new}:{image['newTag']}" if "newTag" in image else new
                visit(value)
        elif isinstance(node, list):
            for v in node:
                visit(v)

    for obj in objects:
        visit(obj)


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [copy.deepcopy(o) for o in objects if o["kind"] == kind]
