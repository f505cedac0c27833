"""Render a kustomization the way ``kubectl kustomize`` does, for the subset deploy/k8s and
deploy/k8s-sidecar use: no kustomize binary is among CI's packages (Debian has none).

Supported, and refused otherwise (an unsupported field is an error, never ignored):
``resources`` (files, and folders holding a kustomization), ``namespace`` (set on every
namespaced object, as kustomize does), and ``patches`` of the strategic-merge kind, from a
file (``path``) or inline (``patch``), matched to one object by kind and name. A patch
merges maps key by key (``null`` removes a key), lists of named maps (containers, env,
ports, volumes) item by item by name, replaces other lists, and ``$patch: delete`` removes
the object. tests/checks/test_k8s_sidecar.py checks these rules on small cases.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import yaml

SUPPORTED = {"apiVersion", "kind", "resources", "namespace", "patches"}
#: Objects kustomize leaves without a namespace (the ones deploy/k8s* use).
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition"}


class Unsupported(ValueError):
    """The kustomization uses something this renderer does not do."""


def render(folder: Path) -> list[dict]:
    """Every object the kustomization in FOLDER makes, in kustomize's order of resources."""
    kust = yaml.safe_load((folder / "kustomization.yaml").read_text())
    unknown = set(kust) - SUPPORTED
    if unknown:
        raise Unsupported(f"{folder}/kustomization.yaml: {sorted(unknown)} not supported")
    docs: list[dict] = []
    for entry in kust.get("resources", []):
        path = (folder / entry).resolve()
        if path.is_dir():
            docs += render(path)
        else:
            docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    for patch in kust.get("patches", []):
        if set(patch) - {"path", "patch"} or len(patch) != 1:
            raise Unsupported(f"patch {patch!r}: only one of path or patch (strategic merge)")
        text = (folder / patch["path"]).read_text() if "path" in patch else patch["patch"]
        for doc in (d for d in yaml.safe_load_all(text) if d):
            docs = apply_patch(docs, doc)
    if "namespace" in kust:
        for doc in docs:
            if doc["kind"] not in CLUSTER_SCOPED:
                doc.setdefault("metadata", {})["namespace"] = kust["namespace"]
    return docs


def apply_patch(docs: list[dict], patch: dict) -> list[dict]:
    """DOCS with PATCH applied to the one object of its kind and name."""
    key = (patch["kind"], patch["metadata"]["name"])
    hits = [i for i, d in enumerate(docs) if (d["kind"], d["metadata"]["name"]) == key]
    if len(hits) != 1:
        raise Unsupported(f"patch for {key}: {len(hits)} objects match, kustomize needs one")
    (i,) = hits
    if patch.get("$patch") == "delete":
        return docs[:i] + docs[i + 1 :]
    out = list(docs)
    out[i] = merge(docs[i], {k: v for k, v in patch.items() if k != "$patch"})
    return out


def merge(base: Any, patch: Any) -> Any:
    """Strategic merge of PATCH into BASE (neither is changed)."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = copy.deepcopy(base)
        for k, v in patch.items():
            if v is None:
                out.pop(k, None)
            else:
                out[k] = merge(base[k], v) if k in base else copy.deepcopy(v)
        return out
    if isinstance(base, list) and isinstance(patch, list) and _named(base) and _named(patch):
        out = copy.deepcopy(base)
        names = [item["name"] for item in out]
        for item in patch:
            if item["name"] in names:
                j = names.index(item["name"])
                out[j] = merge(out[j], item)
            else:
                out.append(copy.deepcopy(item))
        return out
    return copy.deepcopy(patch)


def _named(items: list) -> bool:
    return bool(items) and all(isinstance(x, dict) and "name" in x for x in items)


def expand_env(env: list[dict], fields: dict[str, str]) -> dict[str, str]:
    """A container's ``env`` as the kubelet makes it: ``$(NAME)`` replaced by a variable
    defined earlier in the list, FIELDS standing for the downward API's values
    (``valueFrom``); a reference to a variable defined later, or not at all, stays as
    written, as Kubernetes leaves it."""
    out: dict[str, str] = {}
    for var in env:
        if "valueFrom" in var:
            out[var["name"]] = fields[var["name"]]
        else:
            out[var["name"]] = re.sub(
                r"\$\((\w+)\)", lambda m: out.get(m[1], m[0]), str(var["value"])
            )
    return out
