"""deploy/k8s, the replicas topology, started for real with ``podman kube play``: two
phasewatch replicas (the Deployment played as "phasewatch-0" and "phasewatch-1", one pod
each with a host port of its own) in front of two shared engines (simulated vLLMs, pods of
their own on kube play's network, which resolves pod names: the replicas reach them by
name, as they would a Service), a client sending through both replicas at once, and a real Prometheus scraping
the replicas and the engines.

Both replicas read one ConfigMap, as replicas do: both engines as upstreams (one pool per
model), power from engine 0's dcgm-exporter page (its three GPUs, mapped to it). What
holds for any attribution: requests and tokens summed over replicas equal the engines'
own counts; each replica reads every joule of the GPUs (so the energy is taken once per
GPU, not summed over replicas); and each replica's ledger adds up to the counter it read.
That the replicas' *attributed* energy also sums to the GPUs' busy energy needs each
counter step divided by the engine's own running count (issue 50, item 1).
"""

from __future__ import annotations

import concurrent.futures
import copy
import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from ..support.kustomize import render
from ..support.prometheus import PromServer
from .kubeprom import SCRAPE_S, Prom, attributed, gpu_counters, idle, seen, unattributed
from .podman import ROOT, Podman, free_port, poll
from .test_kube_play import pod_podman, require_catatonit
from .test_kube_sidecar import chat

pytestmark = pytest.mark.container

K8S = ROOT / "deploy" / "k8s"
REPLICAS = 2
ENGINES = 2
SIM_PORT = 8000


def decode_tokens(labels: str = "") -> str:
    """Tokens the replicas relayed (the series appear with a replica's first request)."""
    return f'sum(phasewatch_tokens_total{{phase="decode"{labels}}} or vector(0))'


def engine_pods(image: str, ports: list[int]) -> list[dict]:
    """The shared engines: simulated vLLMs (three GPUs behind a dcgm-exporter page, the
    `ampere` sensor, 100 ms collections); the host port only for Prometheus's truth."""
    return [
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": f"engine-{i}"},
            "spec": {
                "containers": [
                    {
                        "name": "engine",
                        "image": image,
                        "args": [
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
                        "ports": [
                            {"containerPort": SIM_PORT, "hostPort": port, "hostIP": "127.0.0.1"}
                        ],
                        "securityContext": {"runAsNonRoot": True, "runAsUser": 10001},
                    }
                ]
            },
        }
        for i, port in enumerate(ports)
    ]


def replicas_playable(image: str, engines: list[str], ports: list[int]) -> list[dict]:
    """The base's ConfigMap and one Deployment per replica, changed only where a pod on
    this machine must differ: the engines' host names (ENGINES), power from engine 0's page (its
    GPUs mapped to it), this run's image, one replica per Deployment on a loopback port."""
    docs = render(K8S)
    (dep,) = [d for d in docs if d["kind"] == "Deployment"]
    (cm,) = [
        copy.deepcopy(d)
        for d in docs
        if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "phasewatch"
    ]
    cm["data"]["PHASEWATCH_UPSTREAM"] = ",".join(
        f"e{i}=http://{host}:{SIM_PORT}" for i, host in enumerate(engines)
    )
    cm["data"]["PHASEWATCH_POWER_DCGM_URL"] = f"http://{engines[0]}:{SIM_PORT}/metrics"
    cm["data"]["PHASEWATCH_POWER_GPU"] = "0=e0,1=e0,2=e0"
    played = []
    for i, port in enumerate(ports):
        d = copy.deepcopy(dep)
        d["metadata"]["name"] = f"{dep['metadata']['name']}-{i}"
        d["spec"]["replicas"] = 1
        proxy = d["spec"]["template"]["spec"]["containers"][0]
        proxy["image"] = image
        for p in proxy["ports"]:
            if p["name"] == "http":
                p["hostPort"], p["hostIP"] = port, "127.0.0.1"
        played.append(d)
    return [cm, *played]


class Fleet(Prom):
    def __init__(self, prom: PromServer, replicas: list[int], engines: list[int]) -> None:
        super().__init__(prom)
        self.replicas, self.engines = replicas, engines
        self.urls = [f"http://127.0.0.1:{p}" for p in replicas]
        self.t0 = self.t1 = 0.0

    def over(self, expr: str) -> float:
        """A count's change from before the traffic to after it (both idle moments)."""
        return self.value(expr, self.t1) - self.value(expr, self.t0)

    def energy(self, selector: str) -> float:
        """A counter's change between the same moments, interpolated (kubeprom)."""
        return self.counter_over(selector, self.t0, self.t1)

    def replica(self, port: int) -> str:
        return f'{{instance="127.0.0.1:{port}"}}'


@pytest.fixture(scope="module")
def fleet(podman: Podman, image: str, tmp_path_factory) -> Iterator[Fleet]:
    require_catatonit()
    tmp: Path = tmp_path_factory.mktemp("replicas")
    pods = pod_podman(podman, tmp)
    engine_ports = [free_port() for _ in range(ENGINES)]
    replica_ports = [free_port() for _ in range(REPLICAS)]
    engines_yaml = tmp / f"phasewatch-engines-{os.getpid()}.yaml"
    replicas_yaml = tmp / f"phasewatch-replicas-{os.getpid()}.yaml"
    engines_yaml.write_text(yaml.safe_dump_all(engine_pods(image, engine_ports), sort_keys=False))
    prom = None
    try:
        pods.run("kube", "play", "--replace", str(engines_yaml), timeout=300)
        # kube play's network resolves pod names, as a cluster resolves Services
        docs = replicas_playable(image, [f"engine-{i}" for i in range(ENGINES)], replica_ports)
        replicas_yaml.write_text(yaml.safe_dump_all(docs, sort_keys=False))
        pods.run("kube", "play", "--replace", str(replicas_yaml), timeout=300)
        prom_dir = tmp / "prom"
        prom_dir.mkdir()
        prom = PromServer(
            {
                "global": {"scrape_interval": f"{SCRAPE_S}s", "evaluation_interval": "1s"},
                "scrape_configs": [
                    {
                        "job_name": "phasewatch",
                        "static_configs": [{"targets": [f"127.0.0.1:{p}" for p in replica_ports]}],
                    },
                    {
                        "job_name": "engine",
                        "static_configs": [{"targets": [f"127.0.0.1:{p}" for p in engine_ports]}],
                    },
                ],
            },
            prom_dir,
        )
        f = Fleet(prom, replica_ports, engine_ports)
        run_traffic(f)
        yield f
    finally:
        if prom is not None:
            prom.stop()
        pods.run("kube", "down", str(replicas_yaml), check=False, timeout=180)
        pods.run("kube", "down", str(engines_yaml), check=False, timeout=180)


def run_traffic(f: Fleet) -> None:
    t_start = time.monotonic()
    for url in f.urls:
        poll(
            f"{url}/phasewatch/ready",
            lambda u=url: httpx.get(u + "/phasewatch/ready", timeout=5).status_code == 200,
            timeout=180,
        )
    poll(
        "Prometheus has both replicas' GPU series and both engines",
        lambda: (
            f.value("count(phasewatch_gpu_energy_joules_total)") == 3 * REPLICAS
            and f.value("count(up == 1)") == REPLICAS + ENGINES
        ),
        timeout=60,
    )
    time.sleep(3 * SCRAPE_S)
    f.t0 = time.time()
    models = [m["id"] for m in httpx.get(f.urls[0] + "/v1/models", timeout=10).json()["data"]]
    # both replicas at once, every model: each engine runs both replicas' requests together
    jobs = [(url, models[i % len(models)], i) for url in f.urls for i in range(6)]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        tokens = list(pool.map(lambda j: chat(*j), jobs))
    assert all(n > 0 for n in tokens), tokens

    def settled():
        now = time.time()
        return (
            f.value("sum(phasewatch_in_flight_requests)", now) == 0
            and f.value('sum(vllm:num_requests_running{job="engine"})', now) == 0
            and now
        )

    poll("the requests end", settled, timeout=60)
    time.sleep(3 * SCRAPE_S)
    f.t1 = time.time()
    time.sleep(2 * SCRAPE_S)  # samples after t1 for every series
    print(f"\nreplicas: traffic and settling took {time.monotonic() - t_start:.1f} s")


def test_requests_and_tokens_sum_over_replicas_to_the_engines_counts(fleet: Fleet):
    relayed = fleet.over(decode_tokens())
    generated = fleet.over('sum(vllm:generation_tokens_total{job="engine"})')
    assert relayed == generated > 0
    by_replica = [fleet.over(decode_tokens(f',instance="127.0.0.1:{p}"')) for p in fleet.replicas]
    assert all(n > 0 for n in by_replica), by_replica
    # both engines served: the pool spreads each model over them
    per_engine = [
        fleet.over(f'sum(vllm:generation_tokens_total{{instance="127.0.0.1:{p}"}})')
        for p in fleet.engines
    ]
    assert all(n > 0 for n in per_engine), per_engine


def test_each_replica_reads_every_joule_and_its_ledger_adds_up(fleet: Fleet):
    truth = fleet.energy(gpu_counters(f'{{instance="127.0.0.1:{fleet.engines[0]}"}}')) / 1000
    for port in fleet.replicas:
        sel = fleet.replica(port)
        read = fleet.energy(seen(sel))
        split = sum(
            fleet.value(f"sum({x} or vector(0))", fleet.t1)
            for x in (attributed(sel), unattributed(sel), idle(sel))
        )
        counter = fleet.value(f"sum({seen(sel)})", fleet.t1)
        print(
            f"replica {port}: read {read:.0f} J of the GPUs' {truth:.0f} J; split {split:.1f} J of {counter:.1f} J"
        )
        # every replica reads all of engine 0's GPUs (counted once per GPU, not summed)
        # (8 %: on a loaded box a replica reads up to 6.1 % above the GPU's own counter,
        # as the sidecars do (docs/kubernetes.md); one summing the GPU twice is 100 % off)
        assert abs(read / truth - 1) < 0.08, (port, read, truth)
        # attributed + unattributed + idle = the counter it read
        assert abs(split - counter) < 1.0, (port, split, counter)
    both = fleet.energy(seen())  # each replica's read, summed: REPLICAS times the GPU's
    assert abs(both / truth - REPLICAS) < 0.08 * REPLICAS, (both, truth)


def test_replicas_attributed_energy_sums_to_the_gpus_busy_energy(fleet: Fleet):
    """Each replica charges only its own share of what the engine ran: summed over
    replicas, the attributed energy is what the GPUs drew while the engine ran anything
    (a replica's counter less its idle), not a multiple of it."""
    sel = fleet.replica(fleet.replicas[0])
    busy = fleet.energy(seen(sel)) - fleet.energy(idle(sel))
    shares = sum(fleet.energy(attributed(fleet.replica(p))) for p in fleet.replicas)
    print(f"replicas' attributed energy {shares:.0f} J, the GPUs' busy energy {busy:.0f} J")
    assert busy > 0
    # the issue's bound for each replica against its requests' truth is 15 %
    assert abs(shares / busy - 1) < 0.10, (shares, busy)
