"""The documented switch to a real engine (docs/observability.md, the header of
docker-compose.yml), started as written:

    PHASEWATCH_UPSTREAM=… PHASEWATCH_POWER_DCGM_URL= PHASEWATCH_POWER_GPU= \\
      docker compose … up -d --scale loadgen=0

The engine profiles need an NVIDIA GPU and images no registry here serves, so the
simulator, speaking llama-server's wire format (SIM_ENGINE=llamacpp), stands in for the
engine; everything else is the recipe: empty power settings must start the proxy (no
crash loop behind `restart: unless-stopped`), and it must neither sample the simulator's
made-up GPU power nor map GPUs to the simulator's models.
"""

from __future__ import annotations

import os

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ..support.servers import start_sim
from .podman import CrashLoop, free_port, poll

pytestmark = pytest.mark.container

PREFIX = "pwrecipe-"


@pytest.fixture
def project(podman):
    podman.remove_stale(PREFIX)
    name = f"{PREFIX}{os.getpid()}"
    yield name
    left = podman.teardown(name)
    assert not left, f"left behind after teardown: {left}"


def _up(podman, project: str, image: str, **env: str) -> tuple[str, int]:
    port = free_port()
    podman.compose(
        project,
        "up",
        "-d",
        "--no-build",
        "--scale",
        "loadgen=0",
        "phasewatch",
        "simulator",
        env={
            "PHASEWATCH_IMAGE": image,
            "BIND_ADDRESS": "127.0.0.1",
            "PROXY_PORT": str(port),
            **env,
        },
    )
    return podman.container(project, "phasewatch"), port


def test_documented_real_engine_recipe(podman, image, project):
    name, port = _up(
        podman,
        project,
        image,
        PHASEWATCH_UPSTREAM="llamacpp=http://simulator:8000",
        SIM_ENGINE="llamacpp",
        PHASEWATCH_POWER_DCGM_URL="",
        PHASEWATCH_POWER_GPU="",
    )
    env = podman.inspect(name)["Config"]["Env"]
    assert "PHASEWATCH_POWER_DCGM_URL=" in env and "PHASEWATCH_POWER_GPU=" in env  # set, empty
    podman.wait_healthy(podman.container(project, "simulator"))
    podman.wait_healthy(name)
    proxy = f"http://127.0.0.1:{port}"
    assert (
        podman.out(
            "ps",
            "-a",
            "--filter",
            f"label=io.podman.compose.project={project}",
            "--format",
            "{{.Names}}",
        )
        .split()
        .count(f"{project}_loadgen_1")
        == 0
    )

    facts: dict[str, set] = {}

    def measured():
        # (phasewatch may have started before the engine answered: until its next look at
        # the engine it does not know the dialect, so keep asking)
        r = httpx.post(
            proxy + "/completion",
            json={"prompt": "hello", "n_predict": 8, "stream": True},
            timeout=30,
        )
        assert r.status_code == 200 and b'"stop":true' in r.content, r.content[-500:]
        text = httpx.get(proxy + "/metrics", timeout=10).text
        facts.update(up=set(), ttft=set())
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "phasewatch_upstream_up" and sample.value == 1:
                    facts["up"].add((sample.labels["upstream"], sample.labels["engine"]))
                if sample.name == "phasewatch_ttft_seconds_count" and sample.value > 0:
                    facts["ttft"].add((sample.labels["model"], sample.labels["precision"]))
        ok = ("llamacpp", "llamacpp") in facts["up"] and any(p == "int4" for _, p in facts["ttft"])
        return text if ok else None

    try:
        text = poll("a llama-server stream measured, the engine detected", measured, 90, interval=2)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; seen: {facts}") from None
    # The power sampler had the whole start-up and request to sample: nothing from the
    # simulator's dcgm lines, no GPU mapped to a model.
    for family in (
        "phasewatch_gpu_energy_joules_total{",
        "phasewatch_gpu_power_sample_watts_count{",
        'source="dcgm"',
        "Llama-3.1-8B",
    ):
        assert family not in text, f"{family} in the recipe's /metrics"
    state = podman.inspect(name)
    assert state["State"]["Status"] == "running" and not state.get("RestartCount")


def test_a_crash_at_start_is_reported_not_restarted_away(podman, image, project):
    """The stack's wait (podman.wait_healthy) sees through `restart: unless-stopped`: a
    setting that stops the proxy at start fails fast with the proxy's own message."""
    name, _ = _up(podman, project, image, PHASEWATCH_POWER_DCGM_URL="not-a-url")
    # a crash loop is told apart from a slow start: CrashLoop, not a timeout
    with pytest.raises(CrashLoop) as info:
        podman.wait_healthy(name, timeout=60)
    assert "--power-dcgm-url" in str(info.value), str(info.value)
    assert podman.inspect(name)["HostConfig"]["RestartPolicy"]["Name"] == "unless-stopped"


def test_the_real_engine_override_reaches_an_engine_on_the_host(podman, image, project):
    """deploy/compose.real-engine.yml as its header gives it for podman-compose: an engine
    already running on the host (a simulated llama-server listening on every address),
    reached from the proxy's container as host.containers.internal; nothing drags the
    simulator or its load generator in, and no simulated watts are sampled."""
    sim = start_sim("llamacpp", speed=8.0, extra=["--host", "0.0.0.0"])
    try:
        port = free_port()
        podman.compose(
            project,
            "up",
            "-d",
            "--no-build",
            # as the override's header gives it for podman-compose 1.0.3, which ignores
            # profiles (Grafana has no stand-in image here: left out)
            "phasewatch",
            "prometheus",
            "alertmanager",
            files=("docker-compose.yml", "deploy/compose.real-engine.yml"),
            env={
                "PHASEWATCH_IMAGE": image,
                "BIND_ADDRESS": "127.0.0.1",
                "PROXY_PORT": str(port),
                "HOST_GATEWAY": "127.0.0.1",  # podman 4 refuses host-gateway (the header)
                "PHASEWATCH_UPSTREAM": "host=http://host.containers.internal:"
                + sim.url.rsplit(":", 1)[1],
            },
        )
        names = podman.out(
            "ps",
            "-a",
            "--filter",
            f"label=io.podman.compose.project={project}",
            "--format",
            "{{.Names}}",
        ).split()
        assert not any(n.endswith(("_simulator_1", "_loadgen_1")) for n in names), names
        name = podman.container(project, "phasewatch")
        podman.wait_healthy(name)
        proxy = f"http://127.0.0.1:{port}"

        def answered():
            # (the proxy may start before it has looked at the engine: keep asking)
            r = httpx.post(
                proxy + "/completion",
                json={"prompt": "hello from the host", "n_predict": 8, "stream": True},
                timeout=30,
            )
            return r.status_code == 200 and b'"stop":true' in r.content

        poll("a stream through the proxy to the host's engine", answered, 90, interval=2)
        seen: dict = {}

        def agrees():
            text = httpx.get(proxy + "/metrics", timeout=10).text
            tokens = sum(
                s.value
                for f in text_string_to_metric_families(text)
                for s in f.samples
                if s.name == "phasewatch_tokens_total"
                and s.labels.get("phase") == "decode"
                and s.labels.get("upstream") == "host"
            )
            truth = sum(t["completion_tokens"] for t in sim.truth() if not t.get("aborted"))
            seen.update(tokens=tokens, truth=truth)
            return text if tokens and tokens == truth else None

        try:
            text = poll("the proxy's decode tokens equal the engine's truth", agrees, 30)
        except AssertionError as exc:
            raise AssertionError(f"{exc}: {seen}") from None
        for family in ("phasewatch_gpu_energy_joules_total{", 'source="dcgm"'):
            assert family not in text, f"{family} in /metrics: the simulator's watts leaked in"
    finally:
        sim.stop()
