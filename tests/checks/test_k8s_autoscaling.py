"""deploy/k8s/hpa.yaml and the prometheus-adapter rule it needs: the autoscaler scales the
Deployment on phasewatch's own queue gauge, the metric name it asks for is the one the
adapter rule serves, and the manifest is valid Kubernetes (strict, every supported
release). tests/e2e/fleet/test_many_proxies.py runs the adapter rule's query on a real Prometheus."""

from __future__ import annotations

import copy
import re

import kubernetes_validate
import pytest
import yaml
from prometheus_client import Gauge

from proxy.measure.metrics import Metrics

from ..support.servers import ROOT
from .test_obs_deploy import k8s_versions

K8S = ROOT / "deploy" / "k8s"


def load(name: str) -> dict:
    return yaml.safe_load((K8S / name).read_text())


def adapter_rule() -> dict:
    (rule,) = load("prometheus-adapter/rules.yaml")["rules"]
    return rule


def test_hpa_scales_the_deployment_within_the_disruption_budget():
    hpa, dep, pdb = load("hpa.yaml"), load("deployment.yaml"), load("poddisruptionbudget.yaml")
    ref = hpa["spec"]["scaleTargetRef"]
    assert (ref["apiVersion"], ref["kind"], ref["name"]) == (
        dep["apiVersion"],
        dep["kind"],
        dep["metadata"]["name"],
    )
    spec = hpa["spec"]
    assert pdb["spec"]["minAvailable"] < spec["minReplicas"] <= spec["maxReplicas"]
    assert spec["minReplicas"] <= dep["spec"]["replicas"] <= spec["maxReplicas"]
    assert "hpa.yaml" in load("kustomization.yaml")["resources"]
    # scaling down drains one replica at a time
    (down,) = spec["behavior"]["scaleDown"]["policies"]
    assert (down["type"], down["value"]) == ("Pods", 1)


def test_hpa_metric_is_the_queue_gauge_the_adapter_serves_per_pod():
    (metric,) = load("hpa.yaml")["spec"]["metrics"]
    assert metric["type"] == "Pods"
    assert metric["pods"]["target"]["type"] == "AverageValue"
    rule = adapter_rule()
    series = re.fullmatch(r"(\w+)\{(.*)\}", rule["seriesQuery"])
    assert series, rule["seriesQuery"]
    family = series.group(1)
    # a gauge phasewatch really has: requests waiting at the admission gate
    gauge = Metrics().queued_requests
    assert isinstance(gauge, Gauge) and gauge._name == family
    # the name the adapter gives it is the one the autoscaler asks for
    as_python = re.sub(r"\$\{(\d+)\}", r"\\g<\1>", rule["name"]["as"])
    assert re.sub(rule["name"]["matches"], as_python, family) == metric["pods"]["metric"]["name"]
    # per pod: the series must carry the namespace and pod labels the adapter maps
    assert rule["resources"]["overrides"] == {
        "namespace": {"resource": "namespace"},
        "pod": {"resource": "pod"},
    }
    assert 'namespace!=""' in series.group(2) and 'pod!=""' in series.group(2)
    used = set(re.findall(r"<<\.(\w+)>>", rule["metricsQuery"]))
    assert used == {"Series", "LabelMatchers", "GroupBy"}


def test_hpa_is_valid_kubernetes_and_validation_catches_a_broken_one():
    hpa = load("hpa.yaml")
    for version in k8s_versions():
        kubernetes_validate.validate(hpa, version, strict=True)
    misspelt = copy.deepcopy(hpa)
    target = misspelt["spec"]["metrics"][0]["pods"]["target"]
    target["averagevalue"] = target.pop("averageValue")
    wrong_type = copy.deepcopy(hpa)
    wrong_type["spec"]["minReplicas"] = "two"
    for doc in (misspelt, wrong_type):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(doc, k8s_versions()[-1], strict=True)
