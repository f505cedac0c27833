"""The compose files as a new user meets them, read as compose reads them (YAML, variables
interpolated, the override merged): the default stack samples the simulator's power only
because the simulator runs; the documented switch to a real engine (one on the host, or an
engine profile) starts no simulator and reads no watts from it; the host's engine is
reachable by name; model names and health checks agree between compose, the Dockerfile and
the docs; the README's first screen says how to run it with Docker or podman."""

from __future__ import annotations

import copy
import re
from urllib.parse import urlsplit

import pytest
import yaml

from proxy.sim.engine import DEFAULT_MODELS

from ..support.servers import ROOT

BASE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
OVERRIDE_PATH = "deploy/compose.real-engine.yml"
OVERRIDE = yaml.safe_load((ROOT / OVERRIDE_PATH).read_text())
DOCS = (ROOT / "docs" / "observability.md").read_text()
README = (ROOT / "README.md").read_text()
DOCKERFILE = (ROOT / "deploy" / "Dockerfile").read_text()

_VAR = re.compile(r"\$\{(\w+)(?:(:?-)([^}]*))?\}")


def interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's ${VAR} (unset: blank), ${VAR:-default} (unset or empty) and
    ${VAR-default} (unset)."""

    def one(m: re.Match) -> str:
        name, op, default = m.groups()
        if op is None:
            return env.get(name, "")
        if name in env and (op == "-" or env[name] != ""):
            return env[name]
        return default

    return _VAR.sub(one, value)


def merged(*files: dict) -> dict:
    """Later files over earlier ones, as compose merges: mappings key by key, the
    environment by variable, sequences such as extra_hosts appended, profiles replaced."""
    out = copy.deepcopy(files[0])
    for f in files[1:]:
        for name, svc in f.get("services", {}).items():
            into = out["services"].setdefault(name, {})
            for k, v in svc.items():
                if k == "environment":
                    into.setdefault(k, {}).update(v)
                elif k == "extra_hosts":
                    into[k] = into.get(k, []) + v
                else:
                    into[k] = v
    return out


def started(config: dict, profiles: set[str]) -> set[str]:
    return {
        name
        for name, svc in config["services"].items()
        if not svc.get("profiles") or set(svc["profiles"]) & profiles
    }


def proxy_env(config: dict, env: dict[str, str]) -> dict[str, str]:
    return {
        k: interpolate(str(v), env)
        for k, v in config["services"]["phasewatch"]["environment"].items()
    }


def engine_profiles() -> set[str]:
    return {p for svc in BASE["services"].values() for p in svc.get("profiles", []) if p != "dcgm"}


SWITCHES = [
    ({}, set()),  # an engine on the host at the override's default address
    ({"PHASEWATCH_UPSTREAM": "ollama=http://host.docker.internal:11434"}, set()),
    ({"PHASEWATCH_UPSTREAM": "vllm=http://vllm:8000"}, {"vllm"}),
    ({"PHASEWATCH_UPSTREAM": "ollama=http://ollama:11434"}, {"ollama"}),
    ({"PHASEWATCH_UPSTREAM": "llamacpp=http://llama-server:8080"}, {"llamacpp"}),
]


def test_the_default_stack_reads_the_simulators_power_because_the_simulator_runs():
    env = proxy_env(BASE, {})
    running = started(BASE, set())
    assert {"phasewatch", "simulator", "loadgen", "prometheus"} <= running
    host = urlsplit(env["PHASEWATCH_POWER_DCGM_URL"]).hostname
    assert host == "simulator" and host in running
    assert urlsplit(env["PHASEWATCH_UPSTREAM"].split("=", 1)[1]).hostname == "simulator"
    # the GPUs are mapped to the models the simulator serves
    mapped = {item.split("=", 1)[1] for item in env["PHASEWATCH_POWER_GPU"].split(",")}
    assert mapped == {m.id for m in DEFAULT_MODELS}


@pytest.mark.parametrize(("env", "profiles"), SWITCHES)
def test_the_real_engine_switch_keeps_no_simulator_watts(env, profiles):
    config = merged(BASE, OVERRIDE)
    running = started(config, profiles)
    assert "simulator" not in running and "loadgen" not in running, running
    assert "phasewatch" in running and "prometheus" in running
    values = proxy_env(config, env)
    assert values["PHASEWATCH_POWER_DCGM_URL"] == "" and values["PHASEWATCH_POWER_GPU"] == ""
    assert not any("simulator" in v for v in values.values()), values
    for name, url in (u.split("=", 1) for u in values["PHASEWATCH_UPSTREAM"].split(",")):
        host = urlsplit(url).hostname
        # the engine is a started service, or this host by the name the override maps
        assert host in running or host == "host.docker.internal", (name, url, running)
    assert profiles <= engine_profiles()


def test_a_real_gpus_dcgm_is_still_taken_through_the_switch():
    config = merged(BASE, OVERRIDE)
    env = {"PHASEWATCH_POWER_DCGM_URL": "http://dcgm-exporter:9400/metrics"}
    values = proxy_env(config, env)
    assert values["PHASEWATCH_POWER_DCGM_URL"] == env["PHASEWATCH_POWER_DCGM_URL"]
    assert "dcgm-exporter" in started(config, {"dcgm"})


def test_an_engine_on_the_host_is_reachable_by_name():
    hosts = [
        interpolate(h, {}) for h in merged(BASE, OVERRIDE)["services"]["phasewatch"]["extra_hosts"]
    ]
    assert "host.docker.internal:host-gateway" in hosts
    # podman before 5 refuses host-gateway: an address of one's own replaces it
    podman = [
        interpolate(h, {"HOST_GATEWAY": "127.0.0.1"})
        for h in OVERRIDE["services"]["phasewatch"]["extra_hosts"]
    ]
    assert podman == ["host.docker.internal:127.0.0.1"]
    assert "HOST_GATEWAY=127.0.0.1" in DOCS
    default = interpolate(
        OVERRIDE["services"]["phasewatch"]["environment"]["PHASEWATCH_UPSTREAM"], {}
    )
    assert urlsplit(default.split("=", 1)[1]).hostname == "host.docker.internal"
    # documented, with podman's own name for the host too
    for text in (DOCS, (ROOT / OVERRIDE_PATH).read_text()):
        assert "host.docker.internal" in text and "host.containers.internal" in text
    # nothing in the base file changes: the CI tier runs it on podman without host-gateway
    assert "extra_hosts" not in BASE["services"]["phasewatch"]


def test_model_names_agree_between_compose_and_the_docs():
    vllm = BASE["services"]["vllm"]["command"]
    default = interpolate(vllm[vllm.index("--model") + 1], {})
    assert default in DOCS, default  # the docs name the profile's default model
    for m in DEFAULT_MODELS:  # the simulator's models, as compose maps its GPUs
        assert m.id in BASE["services"]["phasewatch"]["environment"]["PHASEWATCH_POWER_GPU"]
    # every model a documented --power-gpu example maps is one a documented engine serves
    for target in re.findall(r"PHASEWATCH_POWER_GPU=\d+=(\S+?)\s", DOCS):
        assert target in DOCS.replace(f"={target}", ""), target


def test_health_checks_agree_between_the_dockerfile_and_compose():
    check = re.search(r"HEALTHCHECK .*\n\s+CMD (.*)", DOCKERFILE)
    assert check is not None and "/phasewatch/health" in check.group(1)
    sim = " ".join(BASE["services"]["simulator"]["healthcheck"]["test"])
    path = re.search(r"127\.0\.0\.1:8000(/[\w/]+)", sim).group(1)
    comment = "".join(
        ln for ln in DOCKERFILE.splitlines(keepends=True) if ln.startswith("#")
    ).replace("\n# ", " ")
    assert f"simulator's {path}" in comment, (path, comment)
    assert "/health)" not in comment  # not a check compose does not use
    # the proxy's service keeps the image's own check
    assert "healthcheck" not in BASE["services"]["phasewatch"]


def test_the_readme_first_screen_runs_the_stack_with_docker_or_podman():
    first = README.split("\n## ", 1)[0]
    assert "docker compose up" in first and "podman compose up" in first
    build = re.search(r"podman build (.*?) -t (\S+) \.", first)
    assert build is not None and "--format docker" in build.group(1)
    assert build.group(2) == BASE["x-phasewatch"]["image"].split(":-", 1)[1].rstrip("}")
    assert OVERRIDE_PATH in first and "host.docker.internal" in first
    assert "podman compose" in DOCS and "podman build --format docker" in DOCS
