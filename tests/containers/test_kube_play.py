"""deploy/k8s/ started for real with ``podman kube play``: the Deployment's pod, its
ConfigMap and its probes, from the manifests kustomization.yaml lists.

podman plays Pods, Deployments and ConfigMaps, not Services, ServiceMonitors or the
other kinds, so the play-able subset is generated here from the manifests themselves
(nothing is kept as a copy): the Deployment with this run's image, the ConfigMap it reads
its settings from, pointed at an engine simulator that runs as a second container of the
same pod (containers of a pod share localhost), and the http port published on loopback
(one replica: podman plays every replica, and only one can hold the host port).
The pod must become ready on the Deployment's own readiness probe path, and a request
through it must be measured.
"""

from __future__ import annotations

import copy
import os
import re
import shutil
from pathlib import Path

import httpx
import pytest
import yaml

from .podman import ROOT, Podman, containers_conf, free_port, poll

pytestmark = pytest.mark.container

K8S = ROOT / "deploy" / "k8s"
PLAYABLE = {"Deployment", "ConfigMap"}
SIM_PORT = 8000


def listed_manifests() -> list[dict]:
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    docs = []
    for name in kust["resources"]:
        docs += [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]
    return docs


def playable(image: str, host_port: int) -> tuple[list[dict], dict]:
    """The Deployment and the ConfigMaps it reads, changed only where a pod on this
    machine must differ from one in a cluster; and the unchanged Deployment."""
    docs = listed_manifests()
    (dep,) = [d for d in docs if d["kind"] == "Deployment"]
    pod = dep["spec"]["template"]["spec"]
    refs = {
        src["configMapRef"]["name"]
        for c in pod["containers"]
        for src in c.get("envFrom", [])
        if "configMapRef" in src
    }
    maps = [
        copy.deepcopy(d) for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] in refs
    ]
    assert maps, "the Deployment reads its settings from a ConfigMap"
    from proxy.sim.physics import DEFAULT_MODELS

    for cm in maps:
        data = cm["data"]
        # the engine is the simulator beside the proxy in the pod, and so is its DCGM page
        data["PHASEWATCH_UPSTREAM"] = f"sim=http://127.0.0.1:{SIM_PORT}"
        if "PHASEWATCH_POWER_DCGM_URL" in data:
            data["PHASEWATCH_POWER_DCGM_URL"] = f"http://127.0.0.1:{SIM_PORT}/metrics"
            data["PHASEWATCH_POWER_GPU"] = ",".join(
                f"{i}={m.id}" for i, m in enumerate(DEFAULT_MODELS)
            )
    played = copy.deepcopy(dep)
    played["spec"]["replicas"] = 1  # podman plays every replica: one can have the host port
    spec = played["spec"]["template"]["spec"]
    proxy = spec["containers"][0]
    proxy["image"] = image
    for port in proxy["ports"]:
        if port["name"] == "http":
            port["hostPort"], port["hostIP"] = host_port, "127.0.0.1"
    engine = {
        "name": "engine",
        "image": image,
        "args": ["simulate", "--host", "127.0.0.1", "--port", str(SIM_PORT), "--speed", "10"],
        "securityContext": copy.deepcopy(proxy["securityContext"]),
    }
    spec["containers"].append(engine)
    assert all(d["kind"] in PLAYABLE for d in [*maps, played])
    return [*maps, played], dep


def pod_podman(podman: Podman, folder: Path) -> Podman:
    """podman with the tier's settings, but each ulimit's soft and hard limit equal: podman
    4.3 gives a pod's infra container the default ulimits with soft and hard swapped
    (nofile soft 20000, hard 1024 here), which runc refuses."""
    conf = containers_conf(folder).read_text()
    conf = re.sub(
        r'"(\w+)=\d+:(\d+)"',
        lambda m: f'"{m[1]}={min(int(m[2]), 4096)}:{min(int(m[2]), 4096)}"',
        conf,
    )
    path = folder / "containers-pod.conf"
    path.write_text(conf)
    kube = copy.copy(podman)
    kube.env = {**podman.env, "CONTAINERS_CONF": str(path)}
    return kube


def require_catatonit() -> None:
    if shutil.which("catatonit") is None and not any(
        p.name == "catatonit" for p in Path("/usr/libexec/podman").glob("*")
    ):
        pytest.fail(
            "podman cannot make a pod's pause image without catatonit: apt-get install "
            "catatonit (bash .ci/run does it)",
            pytrace=False,
        )


@pytest.fixture
def kube(podman: Podman, image: str, tmp_path):
    require_catatonit()
    host_port = free_port()
    docs, dep = playable(image, host_port)
    path = tmp_path / f"phasewatch-kube-{os.getpid()}.yaml"
    path.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    pods = pod_podman(podman, tmp_path)
    try:
        pods.run("kube", "play", "--replace", str(path), timeout=300)
        yield {"url": f"http://127.0.0.1:{host_port}", "deployment": dep, "podman": pods}
    finally:
        pods.run("kube", "down", str(path), check=False, timeout=180)


def test_generated_subset_changes_only_what_a_local_pod_needs():
    image = "localhost/phasewatch:any"
    docs, dep = playable(image, 18090)
    played = next(d for d in docs if d["kind"] == "Deployment")
    assert played["spec"]["replicas"] == 1 < dep["spec"]["replicas"]
    assert {k: v for k, v in played["spec"].items() if k not in ("replicas", "template")} == {
        k: v for k, v in dep["spec"].items() if k not in ("replicas", "template")
    }
    original = dep["spec"]["template"]["spec"]
    got = played["spec"]["template"]["spec"]
    # the proxy container is the Deployment's but for the image and the loopback port
    proxy = copy.deepcopy(got["containers"][0])
    assert proxy.pop("image") == image
    for port in proxy["ports"]:
        port.pop("hostPort", None), port.pop("hostIP", None)
    want = copy.deepcopy(original["containers"][0])
    want.pop("image")
    assert proxy == want
    assert {k: v for k, v in got.items() if k != "containers"} == {
        k: v for k, v in original.items() if k != "containers"
    }
    assert [c["name"] for c in got["containers"]] == [original["containers"][0]["name"], "engine"]
    # what podman cannot play is left out, and it is what kustomization lists
    kinds = {d["kind"] for d in listed_manifests()}
    assert {"Service", "ServiceMonitor", "PrometheusRule", "HorizontalPodAutoscaler"} <= kinds


def test_deployment_pod_becomes_ready_and_measures_a_request(kube):
    podman, url, dep = kube["podman"], kube["url"], kube["deployment"]
    container = dep["spec"]["template"]["spec"]["containers"][0]
    ready_path = container["readinessProbe"]["httpGet"]["path"]
    name = dep["metadata"]["name"]

    def pod_running():
        pods = podman.out("pod", "ps", "--format", "{{.Name}} {{.Status}}", check=False)
        return [line for line in pods.splitlines() if line.startswith(name) and "Running" in line]

    poll("the pod is running", pod_running, timeout=120)
    # ready: the readiness probe's own path answers 200 over the published port
    poll(
        f"{ready_path} answers 200",
        lambda: httpx.get(url + ready_path, timeout=5).status_code == 200,
        timeout=120,
    )
    # the proxy found the engine in the pod (its own readiness page lists the upstream up)
    poll(
        "the simulator upstream is up",
        lambda: all(
            u["up"] for u in httpx.get(url + "/phasewatch/ready", timeout=5).json()["upstreams"]
        ),
        timeout=60,
    )
    models = [m["id"] for m in httpx.get(url + "/v1/models", timeout=10).json()["data"]]
    assert models
    r = httpx.post(
        url + "/v1/chat/completions",
        json={
            "model": models[0],
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 12,
        },
        timeout=60,
    )
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]

    def measured():
        text = httpx.get(url + "/metrics", timeout=10).text
        ok = [
            line
            for line in text.splitlines()
            if line.startswith("phasewatch_requests_total{") and 'outcome="ok"' in line
        ]
        decode = [
            line
            for line in text.splitlines()
            if line.startswith("phasewatch_tokens_total{") and 'phase="decode"' in line
        ]
        return (ok, decode) if ok and decode else None

    ok, decode = poll("the request is measured", measured, timeout=30)
    assert sum(float(line.rsplit(" ", 1)[1]) for line in ok) == 1.0, ok
    assert sum(float(line.rsplit(" ", 1)[1]) for line in decode) == usage["completion_tokens"]
    assert all(f'model="{models[0]}"' in line for line in ok)
    # and the ConfigMap's power source works inside the pod: the simulator's GPUs sampled
    poll(
        "GPU power sampled from the engine container",
        lambda: (
            'phasewatch_power_sampling_up{source="dcgm"} 1.0'
            in httpx.get(url + "/metrics", timeout=10).text
        ),
        timeout=30,
    )
