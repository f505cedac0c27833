"""The project's docker-compose.yml, started for real: phasewatch, the simulator, the load
generator, Prometheus and Alertmanager (Grafana has no stand-in image here; its dashboards'
queries are checked against a real Prometheus in tests/e2e/observability/test_observability.py).

One stack for the module, on host ports of its own (published on 127.0.0.1 only), torn
down whatever happens: containers, network and volumes. The tests run in file order; the
last one stops phasewatch with SIGTERM.
"""

from __future__ import annotations

import base64
import json
import os
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from .podman import CrashLoop, Podman, free_port, poll

pytestmark = pytest.mark.container

PROJECT_PREFIX = "pwtest-"
SERVICES = ("phasewatch", "simulator", "loadgen", "prometheus", "alertmanager")
OVERRIDE = "tests/containers/compose.ci.yml"
SIM_PRECISIONS = {"bf16", "fp8", "int4"}


class Stack:
    def __init__(self, podman: Podman, image: str) -> None:
        self.podman = podman
        self.project = f"{PROJECT_PREFIX}{os.getpid()}"
        self.ports = {
            "PROXY_PORT": free_port(),
            "PROMETHEUS_PORT": free_port(),
            "ALERTMANAGER_PORT": free_port(),
        }
        self.env = {
            **{k: str(v) for k, v in self.ports.items()},
            "BIND_ADDRESS": "127.0.0.1",
            "PHASEWATCH_IMAGE": image,
        }
        self.proxy = f"http://127.0.0.1:{self.ports['PROXY_PORT']}"
        self.prometheus = f"http://127.0.0.1:{self.ports['PROMETHEUS_PORT']}"
        self.alertmanager = f"http://127.0.0.1:{self.ports['ALERTMANAGER_PORT']}"
        self.generations_sent = 0

    def name(self, service: str) -> str:
        return self.podman.container(self.project, service)

    def up(self) -> None:
        t0 = time.monotonic()
        self.podman.compose(
            self.project,
            "up",
            "-d",
            "--no-build",
            *SERVICES,
            env=self.env,
            files=("docker-compose.yml", OVERRIDE),
        )
        for service in ("simulator", "phasewatch"):
            self.podman.wait_healthy(self.name(service))
        for url in (self.prometheus, self.alertmanager):  # no health check of their own
            poll(
                f"{url}/-/ready",
                lambda u=url: httpx.get(u + "/-/ready", timeout=5).status_code == 200,
                60,
                interval=0.5,
            )
        self.assert_steady()
        print(f"\ncompose up to healthy: {time.monotonic() - t0:.1f} s")

    def assert_steady(self) -> None:
        """Every service running and never restarted: `restart: unless-stopped` would
        otherwise turn a crash at start into a container that looks up now and then."""
        for service in SERVICES:
            state = self.podman.inspect(self.name(service))
            assert state["State"]["Status"] == "running" and not state.get("RestartCount"), (
                f"{service}: {state['State']['Status']}, {state.get('RestartCount')} restarts; "
                f"its log:\n{self.podman.logs(self.name(service))}"
            )

    def metrics(self) -> dict[str, float]:
        """phasewatch's /metrics through the published port: {name{labels}: value}."""
        text = httpx.get(self.proxy + "/metrics", timeout=10).text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                key = s.name + json.dumps(s.labels, sort_keys=True)
                out[key] = s.value
        return out

    def promql(self, query: str) -> list[dict]:
        r = httpx.get(self.prometheus + "/api/v1/query", params={"query": query}, timeout=10)
        r.raise_for_status()
        return r.json()["data"]["result"]


@pytest.fixture(scope="module")
def stack(podman, image):
    podman.remove_stale(PROJECT_PREFIX)
    s = Stack(podman, image)
    try:
        s.up()
        yield s
    finally:
        left = podman.teardown(s.project)
        assert not left, f"left behind after teardown: {left}"


def sample_sum(metrics: dict[str, float], name: str, **labels) -> float:
    total = 0.0
    for key, value in metrics.items():
        if not key.startswith(name + "{"):
            continue
        have = json.loads(key[len(name) :])
        if all(have.get(k) == v for k, v in labels.items()):
            total += value
    return total


def test_containers_run_as_the_image_user_not_root(stack):
    image = stack.podman.inspect(stack.env["PHASEWATCH_IMAGE"])
    assert image["Config"]["User"] == "10001:10001"
    health = image.get("Healthcheck") or image["Config"].get("Healthcheck") or {}
    assert "/phasewatch/health" in " ".join(health.get("Test", [])), (
        f"HEALTHCHECK lost (it needs build --format docker): {health}"
    )
    for service in ("phasewatch", "simulator", "loadgen"):
        status = stack.podman.out("exec", stack.name(service), "cat", "/proc/1/status")
        uids = next(line.split()[1:] for line in status.splitlines() if line.startswith("Uid:"))
        assert set(uids) == {"10001"}, (service, uids)
    # and the proxy really is PID 1 (exec form), so SIGTERM reaches it
    cmdline = stack.podman.out("exec", stack.name("phasewatch"), "cat", "/proc/1/cmdline")
    assert "phasewatch" in cmdline and "serve" in cmdline


def test_loadgen_fills_ttft_and_decode_histograms(stack):
    def filled():
        m = stack.metrics()
        ttft = sample_sum(m, "phasewatch_ttft_seconds_count")
        decode = sample_sum(m, "phasewatch_decode_tokens_per_second_count", source="proxy")
        precisions = {
            json.loads(k[len("phasewatch_ttft_seconds_count") :])["precision"]
            for k, v in m.items()
            if k.startswith("phasewatch_ttft_seconds_count{") and v
        }
        # (requests sent before phasewatch's first look at the simulator's model list are
        # labelled model="other": wait for the simulator's own precisions)
        if (
            ttft > stack.generations_sent
            and decode > stack.generations_sent
            and precisions & SIM_PRECISIONS
        ):
            return precisions
        return None

    poll("loadgen's requests in phasewatch's TTFT and decode histograms, by precision", filled, 180)


def test_default_stack_samples_the_simulators_power(stack):
    """As documented for the default stack: power from the simulator's dcgm lines, each
    simulated GPU mapped to its model (the recipe test checks that the real-engine switch
    turns exactly this off)."""

    def sampled():
        m = stack.metrics()
        energy = {
            json.loads(k[len("phasewatch_gpu_energy_joules_total") :])["model"]
            for k, v in m.items()
            if k.startswith("phasewatch_gpu_energy_joules_total{") and v > 0
        }
        return (
            energy
            if sample_sum(m, "phasewatch_power_sampling_up", source="dcgm") == 1
            and len(energy) == 3
            else None
        )

    models = poll("GPU energy of the three simulated GPUs, by model", sampled, 60)
    assert models == set(_models(stack))


def _models(stack) -> list[str]:
    data = httpx.get(stack.proxy + "/v1/models", timeout=10).json()["data"]
    return sorted(m["id"] for m in data)


DIRECT = """
import base64, http.client, sys
conn = http.client.HTTPConnection("simulator", 8000, timeout=60)
conn.request("POST", sys.argv[1], body=sys.argv[2].encode(), headers={"Content-Type": "application/json"})
r = conn.getresponse()
sys.stdout.write(str(r.status) + " " + base64.b64encode(r.read()).decode())
"""


def _direct(stack, path: str, body: str) -> tuple[int, bytes]:
    """The same request straight to the simulator, from inside the stack's network."""
    out = stack.podman.run(
        "exec", stack.name("phasewatch"), "python", "-c", DIRECT, path, body
    ).stdout.decode()
    status, data = out.split(" ", 1)
    return int(status), base64.b64decode(data)


def test_streams_are_the_simulators_bytes(stack):
    models = _models(stack)
    assert len(models) == 3, models
    cases = [
        (
            "/v1/chat/completions",
            {
                "model": models[0],
                "stream": True,
                "max_tokens": 24,
                "messages": [{"role": "user", "content": "byte test one"}],
            },
        ),
        (
            "/v1/chat/completions",
            {
                "model": models[1],
                "stream": True,
                "max_tokens": 16,
                "stream_options": {"include_usage": True},
                "messages": [{"role": "user", "content": "byte test two"}],
            },
        ),
        (
            "/v1/completions",
            {"model": models[2], "stream": True, "max_tokens": 12, "prompt": "byte test three"},
        ),
        (
            "/v1/chat/completions",
            {
                "model": models[2],
                "max_tokens": 8,
                "messages": [{"role": "user", "content": "byte test four"}],
            },
        ),
    ]
    for path, obj in cases:
        body = json.dumps(obj)
        with httpx.stream(
            "POST",
            stack.proxy + path,
            content=body,
            timeout=60,
            headers={"Content-Type": "application/json"},
        ) as r:
            proxied = b"".join(r.iter_raw())
            status = r.status_code
        stack.generations_sent += 1
        want_status, want = _direct(stack, path, body)
        assert status == want_status == 200, (path, status, want_status, proxied[:300])
        assert proxied == want, (
            f"{path} {obj.get('stream')}: proxied bytes differ from the simulator's"
        )
        if obj.get("stream"):
            assert proxied.endswith(b"data: [DONE]\n\n")
            assert proxied.count(b"data: ") > 3


def test_prometheus_in_the_stack_scrapes_phasewatch(stack):
    def up():
        targets = httpx.get(stack.prometheus + "/api/v1/targets", timeout=10).json()
        health = {t["labels"]["job"]: t["health"] for t in targets["data"]["activeTargets"]}
        return health if health.get("phasewatch") == "up" and health.get("engine") == "up" else None

    health = poll("Prometheus's targets phasewatch and engine up", up, 90)
    assert health["phasewatch"] == "up"
    ams = httpx.get(stack.prometheus + "/api/v1/alertmanagers", timeout=10).json()
    assert any("alertmanager:9093" in a["url"] for a in ams["data"]["activeAlertmanagers"]), ams
    assert httpx.get(stack.alertmanager + "/-/ready", timeout=10).status_code == 200

    # the proxy's own series, as Prometheus stored them
    def stored():
        series = stack.promql(
            'sum by (model, precision) (phasewatch_requests_total{job="phasewatch"})'
        )
        return {s["metric"]["precision"] for s in series} & SIM_PRECISIONS

    poll("phasewatch_requests_total of the simulator's models in Prometheus", stored, 90)


def test_recording_rules_evaluate_and_produce_series(stack):
    def rules_ok():
        groups = httpx.get(stack.prometheus + "/api/v1/rules", timeout=10).json()["data"]["groups"]
        rules = [r for g in groups for r in g["rules"]]
        evaluated = [r for r in rules if r.get("lastEvaluation", "").startswith("0001") is False]
        return rules if rules and len(evaluated) == len(rules) else None

    rules = poll("every rule evaluated once", rules_ok, 90)
    bad = [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"]
    assert not bad, bad
    names = {r["name"] for r in rules if r["type"] == "recording"}
    assert {"phasewatch:ttft_seconds:p95_5m", "phasewatch:decode_tokens_per_second:p50_5m"} <= names

    def produced():
        got = {}
        for name in (
            "phasewatch:ttft_seconds:p95_5m",
            "phasewatch:decode_tokens_per_second:p50_5m",
            "phasewatch:requests:rate5m",
        ):
            result = stack.promql(name)
            if not {s["metric"].get("precision") for s in result} & SIM_PRECISIONS:
                return None
            got[name] = result
        return got

    got = poll("recording rules' series for the simulator's models", produced, 180, interval=3)
    for name, result in got.items():
        for s in result:
            assert "instance" not in s["metric"], (name, s["metric"])  # replicas aggregated


def test_no_container_restarted(stack):
    stack.assert_steady()


def test_sigterm_drains_in_flight_streams(stack):
    """`podman stop` (compose down/stop do the same): SIGTERM to the proxy (PID 1); the
    stream in flight finishes whole, readiness and new requests get 503 while liveness
    stays 200, then it exits 0, not killed."""
    name = stack.name("phasewatch")
    # the slowest model (bf16, ~50 tok/s simulated): ~12 s of stream, well inside the
    # proxy's 30 s grace, long enough to see the drain while it flows
    model = next(m for m in _models(stack) if m.startswith("meta-llama/"))
    tokens = 600
    body = {
        "model": model,
        "stream": True,
        "max_tokens": tokens,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": "a long answer, please"}],
    }
    chunks: list[bytes] = []
    first = threading.Event()
    errors: list[BaseException] = []

    def stream():
        try:
            with httpx.stream(
                "POST", stack.proxy + "/v1/chat/completions", json=body, timeout=120
            ) as r:
                for chunk in r.iter_raw():
                    chunks.append(chunk)
                    if b'"content":"' in chunk and b'"content":""' not in chunk:
                        first.set()
        except BaseException as exc:
            errors.append(exc)
        finally:
            first.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert first.wait(60)
    stopper = threading.Thread(
        target=lambda: stack.podman.run("stop", "-t", "60", name, timeout=120)
    )
    stopper.start()

    def refused():  # readiness and new requests are turned away while it drains
        ready = httpx.get(stack.proxy + "/phasewatch/ready", timeout=5).status_code
        new = httpx.post(
            stack.proxy + "/v1/chat/completions", json={**body, "max_tokens": 4}, timeout=10
        ).status_code
        return (ready, new) if ready == 503 and new == 503 else None

    assert poll("503 for readiness and new requests while draining", refused, 30, interval=0.2)
    # liveness (the image's HEALTHCHECK) stays up: a draining proxy is not a broken one
    assert httpx.get(stack.proxy + "/phasewatch/health", timeout=5).status_code == 200
    assert reader.is_alive(), "the in-flight stream ended before the drain was seen"
    reader.join(120)
    stopper.join(120)
    assert not errors, errors
    data = b"".join(chunks)
    assert data.endswith(b"data: [DONE]\n\n"), data[-300:]
    assert data.count(b'"content":"') >= tokens
    state = stack.podman.inspect(name)
    assert state["State"]["Status"] == "exited"
    assert state["State"]["ExitCode"] == 0, (state["State"], stack.podman.logs(name))
    assert state.get("RestartCount", 0) == 0
    with pytest.raises(CrashLoop):  # stopped stays stopped (restart: unless-stopped)
        stack.podman.wait_healthy(name, timeout=5)
