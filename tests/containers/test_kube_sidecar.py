"""deploy/k8s-sidecar started for real with ``podman kube play``: two engine pods, each
with its phasewatch sidecar, traffic through both, and a real Prometheus scraping both
sidecars and both engines' GPU pages. The energy the sidecars attribute (requests' phases
and idle), summed in Prometheus, must equal what the simulated GPUs' own energy counters
say over the same time.

The overlay is rendered as kustomize renders it (tests/support/kustomize.py), and its
engine Deployment is played once per pod ("engine-0", "engine-1": podman plays one pod
per Deployment here, and each needs a host port of its own), changed only where a pod on
this machine must differ from one in a cluster: this run's image; the engine is the
simulator (`phasewatch simulate`: vLLM's wire, three GPUs behind a dcgm-exporter page
with the `ampere` sensor and 100 ms collections, as the demo), which also stands in for
the node's dcgm-exporter, so the power URL is the pod's localhost; the downward API's
values (pod name, node address) are filled in as the kubelet fills them; no GPU request;
and published ports on 127.0.0.1: phasewatch's (traffic and scrapes) and the engine's
(only so that Prometheus reads the GPUs' truth; clients never use it).
"""

from __future__ import annotations

import concurrent.futures
import copy
import json
import os
import time
from pathlib import Path

import httpx
import pytest
import yaml

from ..support.kustomize import expand_env, render
from ..support.prometheus import PromServer
from .kubeprom import (
    SCRAPE_S,
    Prom,
    attributed,
    gpu_counters,
    idle,
    seen,
    unattributed,
)
from .podman import ROOT, Podman, free_port, poll
from .test_kube_play import pod_podman, require_catatonit

pytestmark = pytest.mark.container

SIDECAR = ROOT / "deploy" / "k8s-sidecar"
FLEET_RULES = ROOT / "deploy" / "prometheus" / "rules" / "phasewatch-fleet.yml"
PODS = 2
SIM_PORT = 8000


def playable(image: str, ports: list[tuple[int, int]]) -> tuple[list[dict], dict]:
    """One engine Deployment per (phasewatch port, engine port) and the ConfigMap they
    read, changed as the module says; and the overlay's Deployment unchanged."""
    from proxy.sim.physics import DEFAULT_MODELS

    docs = render(SIDECAR)
    (dep,) = [
        d
        for d in docs
        if d["kind"] == "Deployment"
        and any(c["name"] == "phasewatch" for c in d["spec"]["template"]["spec"]["containers"])
    ]
    (ref,) = {
        src["configMapRef"]["name"]
        for c in dep["spec"]["template"]["spec"]["containers"]
        for src in c.get("envFrom", [])
    }
    (cm,) = [
        copy.deepcopy(d) for d in docs if (d["kind"], d["metadata"]["name"]) == ("ConfigMap", ref)
    ]
    # the simulator's three GPUs, each serving its model
    cm["data"]["PHASEWATCH_POWER_GPU"] = ",".join(
        f"{i}={m.id}" for i, m in enumerate(DEFAULT_MODELS)
    )
    played = []
    for i, (http_port, engine_port) in enumerate(ports):
        d = copy.deepcopy(dep)
        name = f"{dep['metadata']['name']}-{i}"
        d["metadata"]["name"] = name
        d["spec"]["replicas"] = 1
        spec = d["spec"]["template"]["spec"]
        containers = {c["name"]: c for c in spec["containers"]}
        proxy, engine = containers["phasewatch"], containers["engine"]
        proxy["image"] = image
        env = expand_env(proxy["env"], {"POD_NAME": name, "NODE_IP": "127.0.0.1"})
        env["PHASEWATCH_POWER_DCGM_URL"] = f"http://127.0.0.1:{SIM_PORT}/metrics"
        proxy["env"] = [{"name": k, "value": v} for k, v in env.items()]
        for port in proxy["ports"]:
            if port["name"] == "http":
                port["hostPort"], port["hostIP"] = http_port, "127.0.0.1"
        engine.update(
            image=image,
            args=[
                "simulate",
                "--host",
                "0.0.0.0",
                "--port",
                str(SIM_PORT),
                "--gpu-sensor",
                "ampere",
                "--dcgm-interval",
                "0.1",
                "--seed",
                str(i),
            ],
            ports=[
                {
                    "name": "engine",
                    "containerPort": SIM_PORT,
                    "hostPort": engine_port,
                    "hostIP": "127.0.0.1",
                }
            ],
            securityContext=copy.deepcopy(proxy["securityContext"]),
        )
        engine.pop("resources", None)
        played.append(d)
    return [cm, *played], dep


class Sidecars(Prom):
    def __init__(self, podman: Podman, ports: list[tuple[int, int]], prom: PromServer) -> None:
        super().__init__(prom)
        self.podman, self.ports, self.prom = podman, ports, prom
        self.urls = [f"http://127.0.0.1:{p}" for p, _ in ports]


@pytest.fixture
def sidecars(podman: Podman, image: str, tmp_path: Path):
    require_catatonit()
    ports = [(free_port(), free_port()) for _ in range(PODS)]
    docs, _ = playable(image, ports)
    path = tmp_path / f"phasewatch-sidecar-{os.getpid()}.yaml"
    path.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    pods = pod_podman(podman, tmp_path)
    prom = None
    try:
        pods.run("kube", "play", "--replace", str(path), timeout=300)
        prom_dir = tmp_path / "prom"
        prom_dir.mkdir()
        config = {
            "global": {"scrape_interval": f"{SCRAPE_S}s", "evaluation_interval": "1s"},
            "rule_files": [str(FLEET_RULES)],
            "scrape_configs": [
                {
                    "job_name": "phasewatch",
                    "static_configs": [{"targets": [f"127.0.0.1:{p}" for p, _ in ports]}],
                },
                {
                    "job_name": "engine",
                    "static_configs": [{"targets": [f"127.0.0.1:{e}" for _, e in ports]}],
                },
            ],
        }
        prom = PromServer(config, prom_dir)
        yield Sidecars(pods, ports, prom)
    finally:
        if prom is not None:
            prom.stop()
        pods.run("kube", "down", str(path), check=False, timeout=180)


def chat(url: str, model: str, i: int) -> int:
    """One streamed chat request; the tokens it generated."""
    tokens = 0
    with httpx.stream(
        "POST",
        url + "/v1/chat/completions",
        json={
            "model": model,
            "messages": [{"role": "user", "content": f"request {i}: " + "tell me a story " * 40}],
            "max_tokens": 200,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        timeout=120,
    ) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line.removeprefix("data: ")).get("usage")
                tokens = usage["completion_tokens"] if usage else tokens
    return tokens


def test_sidecars_attribute_every_joule_of_their_gpus(sidecars: Sidecars):
    t_start = time.monotonic()
    for url in sidecars.urls:  # ready: the engine beside it answers
        poll(
            f"{url}/phasewatch/ready",
            lambda u=url: httpx.get(u + "/phasewatch/ready", timeout=5).status_code == 200,
            timeout=180,
        )
    print(f"\nboth pods ready after {time.monotonic() - t_start:.1f} s")
    # every sidecar samples its three GPUs and Prometheus has both sidecars and both engines
    poll(
        "Prometheus scrapes 2 sidecars x 3 GPUs and 2 engines x 3 GPUs",
        lambda: (
            sidecars.value("count(phasewatch_gpu_energy_joules_total)") == 6
            and sidecars.value(f"count({gpu_counters()})") == 6
            and sidecars.value("count(up == 1)") == 4
        ),
        timeout=60,
        interval=0.5,
    )
    time.sleep(3 * SCRAPE_S)  # a scrape or two of both idle before the traffic
    t0 = time.time()
    models = [
        m["id"] for m in httpx.get(sidecars.urls[0] + "/v1/models", timeout=10).json()["data"]
    ]
    assert len(models) == 3
    # traffic through both pods, every model (GPU), a few at once on each
    jobs = [(url, models[i % 3], i) for url in sidecars.urls for i in range(6)]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        tokens = list(pool.map(lambda j: chat(*j), jobs))
    assert all(n > 0 for n in tokens), tokens

    # settled: each sidecar's ledger has split all its GPUs' energy (attributed +
    # unattributed + idle = the counter it read), and Prometheus has scraped that
    def ledger(sel: str = "") -> list[str]:
        return [attributed(sel), unattributed(sel), idle(sel)]

    def settled():
        now = time.time()
        split = sum(sidecars.value(f"sum({x} or vector(0))", now) for x in ledger())
        inflight = sidecars.value("sum(phasewatch_in_flight_requests)", now)
        return inflight == 0 and abs(split - sidecars.value(f"sum({seen()})", now)) < 1.0 and now

    poll("the sidecars' ledgers settle", settled, timeout=60, interval=SCRAPE_S)
    time.sleep(3 * SCRAPE_S)
    t1 = time.time()
    time.sleep(2 * SCRAPE_S)  # samples after t1 for every series

    def over(selector: str) -> float:
        return sidecars.counter_over(selector, t0, t1)

    requests_j, others_j, idle_j = (over(x) for x in ledger())
    truth = over(gpu_counters()) / 1000
    print(
        f"over {t1 - t0:.1f} s: attributed {requests_j:.0f} J + unattributed {others_j:.0f} J"
        f" + idle {idle_j:.0f} J = {requests_j + others_j + idle_j:.0f} J; the GPUs' "
        f"counters {truth:.0f} J (ratio {(requests_j + others_j + idle_j) / truth:.4f})"
    )
    # (within 5 %: on a loaded 2-core box the sidecars read 1-4.4 % above the GPUs' own
    # counters, always above, also before the engine-count ledger; its cause is open, see
    # docs/kubernetes.md. The faults this guards against are 60-130 % off.)
    assert abs((requests_j + others_j + idle_j) / truth - 1) < 0.05, (requests_j, idle_j, truth)
    # a sidecar sees every request of its engine: nothing is anyone else's
    assert others_j < 0.02 * truth, others_j
    # and per pod: each sidecar's sum is its own engine's GPUs, its requests drew energy
    for http_port, engine_port in sidecars.ports:
        own = f'{{instance="127.0.0.1:{http_port}"}}'
        pod = [over(x) for x in ledger(own)]
        gpus = over(gpu_counters(f'{{instance="127.0.0.1:{engine_port}"}}')) / 1000
        print(f"  pod at {http_port}: {sum(pod):.0f} J attributed + idle, its GPUs {gpus:.0f} J")
        assert pod[0] > 0 and abs(sum(pod) / gpus - 1) < 0.06, (http_port, pod, gpus)
    # the fleet rule keeps the pods apart (upstream = pod name): two upstreams
    upstreams = poll(
        "the fleet power rule",
        lambda: sidecars.value("count(phasewatch:fleet_gpu_power_watts:rate5m)") == PODS,
        timeout=30,
        interval=1,
    )
    assert upstreams
    print(f"test body {time.monotonic() - t_start:.1f} s")
