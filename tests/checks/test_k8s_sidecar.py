"""deploy/k8s-sidecar, the sidecar topology: rendered as kustomize renders it
(tests/support/kustomize.py), it puts phasewatch in every engine pod, leaves the engine
reachable only through it, drops the base's stand-alone proxy, speaks phasewatch's real
settings and is valid Kubernetes. tests/containers/test_kube_sidecar.py plays it for real."""

from __future__ import annotations

import copy
from urllib.parse import urlsplit

import kubernetes_validate
import pytest

from proxy.api import OPEN_PATHS
from proxy.settings import Settings

from ..support.kustomize import Unsupported, apply_patch, expand_env, merge, render
from ..support.servers import ROOT
from .test_obs_deploy import NOT_KUBERNETES_API, k8s_versions, settings_env

SIDECAR = ROOT / "deploy" / "k8s-sidecar"


def objects() -> dict[tuple[str, str], dict]:
    return {(d["kind"], d["metadata"]["name"]): d for d in render(SIDECAR)}


def sidecar_pod() -> tuple[dict, dict, dict]:
    """The engine Deployment, its engine container and its phasewatch container."""
    dep = objects()["Deployment", "vllm"]
    containers = {c["name"]: c for c in dep["spec"]["template"]["spec"]["containers"]}
    return dep, containers["engine"], containers["phasewatch"]


def test_renderer_merges_deletes_and_refuses_as_kustomize_does():
    base = {
        "kind": "Deployment",
        "metadata": {"name": "d"},
        "spec": {
            "containers": [
                {"name": "a", "env": [{"name": "X", "value": "1"}], "args": ["x", "y"]},
                {"name": "b", "image": "b:1"},
            ],
            "keep": 1,
            "drop": 2,
        },
    }
    patched = merge(
        base,
        {
            "spec": {
                "containers": [
                    {"name": "a", "env": [{"name": "Y", "value": "2"}], "args": ["z"]},
                    {"name": "c", "image": "c:1"},
                ],
                "drop": None,
            }
        },
    )
    a, b, c = patched["spec"]["containers"]
    assert a["env"] == [{"name": "X", "value": "1"}, {"name": "Y", "value": "2"}]
    assert a["args"] == ["z"]  # lists of plain values are replaced
    assert (b, c) == (base["spec"]["containers"][1], {"name": "c", "image": "c:1"})
    assert patched["spec"]["keep"] == 1 and "drop" not in patched["spec"]
    assert "drop" in base["spec"]  # the base is not changed
    other = {"kind": "Service", "metadata": {"name": "d"}}
    gone = apply_patch(
        [base, other], {"$patch": "delete", "kind": "Deployment", "metadata": {"name": "d"}}
    )
    assert gone == [other]
    with pytest.raises(Unsupported):
        apply_patch([base], {"kind": "Deployment", "metadata": {"name": "missing"}})


def test_renderer_refuses_what_it_does_not_do(tmp_path):
    (tmp_path / "kustomization.yaml").write_text("resources: []\nimages:\n  - name: x\n")
    with pytest.raises(Unsupported, match="images"):
        render(tmp_path)


def test_overlay_replaces_the_standalone_proxy_with_sidecars():
    objs = objects()
    base = {(d["kind"], d["metadata"]["name"]) for d in render(ROOT / "deploy" / "k8s")}
    gone = {
        ("Deployment", "phasewatch"),
        ("Service", "phasewatch"),
        ("PodDisruptionBudget", "phasewatch"),
        ("HorizontalPodAutoscaler", "phasewatch"),
    }
    assert gone <= base and not gone & set(objs)
    # the monitoring stays: scrape config, rules, dashboards, the settings
    kept = base - gone
    assert kept <= set(objs)
    assert {("ServiceMonitor", "phasewatch"), ("PrometheusRule", "phasewatch")} <= kept
    assert set(objs) - kept == {("Deployment", "vllm"), ("Service", "vllm")}
    assert all(
        d["metadata"].get("namespace") == "phasewatch"
        for k, d in objs.items()
        if k[0] != "Namespace"
    )


def test_engine_is_reached_only_through_its_pods_phasewatch():
    objs = objects()
    dep, engine, proxy = sidecar_pod()
    assert dep["spec"]["replicas"] >= 2
    assert engine["args"][engine["args"].index("--host") + 1] == "127.0.0.1"
    engine_port = int(engine["args"][engine["args"].index("--port") + 1])
    env = expand_env(proxy["env"], {"POD_NAME": "vllm-7d9c-x2x7k", "NODE_IP": "10.0.0.7"})
    # one upstream, the engine on the pod's localhost, named after the pod
    name, url = env["PHASEWATCH_UPSTREAM"].split("=", 1)
    assert name == "vllm-7d9c-x2x7k"
    assert (urlsplit(url).hostname, urlsplit(url).port) == ("127.0.0.1", engine_port)
    assert env["PHASEWATCH_POWER_DCGM_URL"] == "http://10.0.0.7:9400/metrics"
    # the Service sends clients to phasewatch's port in the engine pods
    svc = objs["Service", "vllm"]
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    (port,) = svc["spec"]["ports"]
    (http,) = [p for p in proxy["ports"] if p["name"] == port["targetPort"]]
    assert http["containerPort"] == int(env["PHASEWATCH_PORT"])
    assert not engine.get("ports")
    # the base's ServiceMonitor scrapes each pod's phasewatch through that Service
    mon = objs["ServiceMonitor", "phasewatch"]
    assert mon["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert {e["port"] for e in mon["spec"]["endpoints"]} == {port["name"]}
    # ready only once the engine beside it answers, and the probes need no key
    assert proxy["readinessProbe"]["httpGet"]["path"] == "/phasewatch/ready"
    assert {
        proxy["readinessProbe"]["httpGet"]["path"],
        proxy["livenessProbe"]["httpGet"]["path"],
    } <= OPEN_PATHS


def test_sidecar_settings_are_phasewatch_settings():
    objs = objects()
    _, _, proxy = sidecar_pod()
    (ref,) = proxy["envFrom"]
    data = objs["ConfigMap", ref["configMapRef"]["name"]]["data"]
    # the pod's own values replace the base's cluster-wide ones
    assert "PHASEWATCH_UPSTREAM" not in data and "PHASEWATCH_POWER_DCGM_URL" not in data
    env = expand_env(proxy["env"], {"POD_NAME": "vllm-0", "NODE_IP": "10.0.0.7"})
    assert not [v for v in env.values() if "$(" in v], "a reference to a later variable"
    settings = {k: v for k, v in {**data, **env}.items() if k.startswith("PHASEWATCH_")}
    assert set(settings) <= settings_env()
    s = Settings(**{k.removeprefix("PHASEWATCH_").lower(): v for k, v in settings.items()})
    assert s.power_dcgm_url == "http://10.0.0.7:9400/metrics"
    # a reference the kubelet could not expand is left unexpanded, and seen above
    broken = copy.deepcopy(proxy["env"])
    broken.append(broken.pop(0))  # POD_NAME after its use
    assert (
        "$(POD_NAME)"
        in expand_env(broken, {"POD_NAME": "p", "NODE_IP": "n"})["PHASEWATCH_UPSTREAM"]
    )


def test_overlay_is_valid_kubernetes():
    versions = k8s_versions()
    checked = set()
    for (kind, name), doc in objects().items():
        if kind in NOT_KUBERNETES_API:
            continue
        for version in versions:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{kind}/{name} is not valid for Kubernetes {version}: {exc.message}")
        checked.add(kind)
    assert {"Deployment", "Service", "ConfigMap", "Namespace"} <= checked
