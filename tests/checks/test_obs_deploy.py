"""Deployment files: docker-compose.yml, deploy/Dockerfile, Grafana provisioning,
Alertmanager and the Kubernetes manifests parse, reference files that exist, agree with
each other, and speak phasewatch's real command line and settings. (No Docker or cluster
here: these are static cross-checks; the rules and dashboards themselves are exercised
against a real Prometheus in test_observability.py.)"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from proxy.settings import Settings
from proxy.tools.cli import build_parser

from ..support.servers import ROOT

K8S = ROOT / "deploy" / "k8s"
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
RULES = ROOT / "deploy" / "prometheus" / "rules"


def load(path: Path):
    return yaml.safe_load(path.read_text())


def compose() -> dict:
    return load(COMPOSE)


def settings_env() -> set[str]:
    return {"PHASEWATCH_" + name.upper() for name in Settings.model_fields}


def promtool() -> str:
    path = shutil.which("promtool") or (
        "/usr/bin/promtool" if Path("/usr/bin/promtool").exists() else None
    )
    if path is None:
        pytest.fail("promtool is not installed: apt-get install -y prometheus")
    return path


# --- docker compose ----------------------------------------------------------------------------


def test_compose_default_stack_and_profiles():
    services = compose()["services"]
    default = {name for name, s in services.items() if not s.get("profiles")}
    assert {"phasewatch", "simulator", "prometheus", "grafana", "alertmanager"} <= default
    engines = {"ollama": "ollama", "vllm": "vllm", "llama-server": "llamacpp"}
    for service, profile in engines.items():
        s = services[service]
        assert s["profiles"] == [profile]
        devices = s["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"], service
    for name in default:  # the default stack needs no GPU
        assert "deploy" not in services[name], name


def test_compose_bind_mounts_and_build_exist():
    for name, s in compose()["services"].items():
        for volume in s.get("volumes", []):
            source = volume.split(":", 1)[0]
            if source.startswith("./"):
                assert (ROOT / source).exists(), f"{name}: {source} does not exist"
        build = s.get("build")
        if build:
            assert (ROOT / build["context"] / build["dockerfile"]).is_file(), name


def _mount(service: dict, source: str) -> str:
    for volume in service["volumes"]:
        parts = volume.split(":")
        if parts[0] == source:
            return parts[1]
    raise AssertionError(f"{source} is not mounted")


def test_compose_commands_are_phasewatch_cli():
    services = compose()["services"]
    parser = build_parser()
    for name in ("phasewatch", "simulator"):
        argv = [re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", a) for a in services[name]["command"]]
        args = parser.parse_args(argv)  # exits (fails the test) on an unknown flag
        assert args.command == {"phasewatch": "serve", "simulator": "simulate"}[name]
    sim = parser.parse_args(
        [re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", a) for a in services["simulator"]["command"]]
    )
    assert sim.host == "0.0.0.0"
    # the load generator's inline program compiles and calls the real traffic generator
    code = services["loadgen"]["command"][0]
    compile(code, "loadgen", "exec")
    from proxy.sim.traffic import run_traffic  # noqa: F401 - it exists

    assert "run_traffic" in code and "http://phasewatch:8090" in code


def _default(value: str) -> str:
    m = re.fullmatch(r"\$\{[A-Z_]+:?-(.*)\}", value)
    return m.group(1) if m else value


def _published(service: dict) -> list[str]:
    """The service's ports with every ${VAR:-default} at its default."""
    return [re.sub(r"\$\{[A-Z_]+:?-([^}]*)\}", r"\1", p) for p in service.get("ports", [])]


def test_compose_publishes_on_loopback_by_default():
    for name, s in compose()["services"].items():
        for port in s.get("ports", []):
            assert port.startswith("${BIND_ADDRESS:-127.0.0.1}:"), (name, port)


def test_compose_stop_grace_covers_the_proxys_drain():
    phasewatch = compose()["services"]["phasewatch"]
    grace = float(phasewatch["stop_grace_period"].rstrip("s"))
    assert grace > Settings.model_fields["shutdown_grace"].default


def test_compose_header_real_engine_example_clears_the_simulators_power():
    header = "".join(
        line for line in COMPOSE.read_text().splitlines(keepends=True) if line.startswith("#")
    )
    example = header[header.index("PHASEWATCH_UPSTREAM=ollama") :]
    example = example[: example.index("--scale loadgen=0")]
    assert "PHASEWATCH_POWER_DCGM_URL= " in example and "PHASEWATCH_POWER_GPU= " in example
    docs = (ROOT / "docs" / "observability.md").read_text()
    assert docs.count("PHASEWATCH_POWER_DCGM_URL= PHASEWATCH_POWER_GPU=") >= 3


def test_compose_phasewatch_env_are_real_settings_and_point_at_services():
    services = compose()["services"]
    env = services["phasewatch"]["environment"]
    assert set(env) <= settings_env(), set(env) - settings_env()
    settings = Settings(
        **{
            k.removeprefix("PHASEWATCH_").lower(): _default(str(v))
            for k, v in env.items()
            if k not in ("PHASEWATCH_UPSTREAM", "PHASEWATCH_POWER_GPU")
        },
        upstream=_default(env["PHASEWATCH_UPSTREAM"]),
        power_gpu=_default(env["PHASEWATCH_POWER_GPU"]),
    )
    ((name, url),) = [(u.name, u.url) for u in settings.upstreams]
    host, port = urlsplit(url).hostname, urlsplit(url).port
    assert host == "simulator" and str(port) in services["simulator"]["command"]
    assert urlsplit(settings.power_dcgm_url).hostname == "simulator"
    from proxy.sim.physics import DEFAULT_MODELS

    assert settings.power_options().power_gpu == {
        str(i): m.id for i, m in enumerate(DEFAULT_MODELS)
    }
    assert f"127.0.0.1:{settings.port}:{settings.port}" in _published(services["phasewatch"])


def test_compose_prometheus_grafana_alertmanager_wiring():
    services = compose()["services"]
    prom = services["prometheus"]
    config_dir = _mount(prom, "./deploy/prometheus")
    assert f"--config.file={config_dir}/prometheus.yml" in prom["command"]
    # the 7-day baseline of DecodeRateRegression needs more than 7 days of data
    retention = next(a for a in prom["command"] if "retention.time" in a)
    assert int(retention.split("=")[1].rstrip("d")) > 7
    config = load(ROOT / "deploy" / "prometheus" / "prometheus.yml")
    targets = {
        t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]
    }
    for target in targets:
        host, port = target.split(":")
        if host == "localhost":
            continue
        assert host in services, f"prometheus scrapes {target}, which is no compose service"
    assert "phasewatch:8090" in targets and "simulator:8000" in targets
    am = config["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"]
    assert am == ["alertmanager:9093"] and "127.0.0.1:9093:9093" in _published(
        services["alertmanager"]
    )
    assert _mount(services["alertmanager"], "./deploy/alertmanager/alertmanager.yml") in " ".join(
        services["alertmanager"]["command"]
    )

    grafana = services["grafana"]
    env = grafana["environment"]
    assert (
        env["GF_AUTH_ANONYMOUS_ENABLED"] == "true" and env["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    )
    provisioning = _mount(grafana, "./grafana/provisioning")
    dashboards = _mount(grafana, "./grafana/dashboards")
    assert provisioning == "/etc/grafana/provisioning"
    provider = load(ROOT / "grafana" / "provisioning" / "dashboards" / "phasewatch.yml")[
        "providers"
    ][0]
    assert provider["options"]["path"] == dashboards
    home = env["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (
        home.startswith(dashboards + "/")
        and (ROOT / "grafana" / "dashboards" / Path(home).name).is_file()
    )
    ds = load(ROOT / "grafana" / "provisioning" / "datasources" / "prometheus.yml")["datasources"][
        0
    ]
    assert ds["type"] == "prometheus" and urlsplit(ds["url"]).hostname == "prometheus"
    assert f"127.0.0.1:{urlsplit(ds['url']).port}:9090" in _published(prom)


def test_alertmanager_config():
    config = load(ROOT / "deploy" / "alertmanager" / "alertmanager.yml")
    receivers = {r["name"] for r in config["receivers"]}
    assert config["route"]["receiver"] in receivers
    for route in config["route"].get("routes", []):
        assert route["receiver"] in receivers
    assert "upstream" in config["route"]["group_by"]
    # the labels it matches on are the ones the alert rules set
    severities = {
        r["labels"]["severity"]
        for p in RULES.glob("phasewatch-alerts.yml")
        for g in load(p)["groups"]
        for r in g["rules"]
    }
    for rule in config["inhibit_rules"]:
        for m in rule["source_matchers"] + rule["target_matchers"]:
            assert m.split("=")[1].strip('"') in severities


# --- Dockerfile -------------------------------------------------------------------------------


def test_dockerfile_small_nonroot_with_healthcheck():
    text = DOCKERFILE.read_text()
    assert re.search(r"^FROM python:3\.\d+-slim", text, re.M)
    user = re.findall(r"^USER (\S+)", text, re.M)
    assert user and not user[-1].startswith(("root", "0")), user
    health = re.search(r"^HEALTHCHECK .*(\n\s+.*)*", text, re.M).group(0)
    assert "/phasewatch/health" in health
    for src in re.findall(r"^COPY (?!--from)(.+) \S+$", text, re.M):
        for path in src.split():
            assert (ROOT / path).exists(), f"COPY {path}: not in the repository"
    assert 'ENTRYPOINT ["phasewatch"]' in text
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'phasewatch = "proxy.tools.cli:main"' in pyproject
    ignore = (ROOT / "deploy" / "Dockerfile.dockerignore").read_text()
    assert "!proxy/" in ignore


# --- Kubernetes ------------------------------------------------------------------------------


def manifests() -> dict[str, list[dict]]:
    return {
        p.name: [d for d in yaml.safe_load_all(p.read_text()) if d]
        for p in sorted(K8S.glob("*.yaml"))
    }


def by_kind() -> dict[str, dict]:
    out = {}
    for docs in manifests().values():
        for d in docs:
            out.setdefault(d["kind"], d)
    return out


def test_k8s_manifests_parse_and_kustomization_lists_them_all():
    kust = load(K8S / "kustomization.yaml")
    listed = set(kust["resources"])
    files = {n for n in manifests() if n != "kustomization.yaml"}
    assert listed == files
    for name in listed:
        for d in manifests()[name]:
            assert d["apiVersion"] and d["kind"] and d["metadata"]["name"], name


def test_k8s_generated_manifests_are_up_to_date():
    res = subprocess.run(
        [sys.executable, str(K8S / "generate.py"), "--check"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stdout + res.stderr


def test_k8s_prometheusrule_is_the_rule_files():
    rule = by_kind()["PrometheusRule"]
    groups = []
    for path in sorted(p for p in RULES.glob("*.yml") if not p.name.endswith("_test.yml")):
        groups += load(path)["groups"]
    assert rule["spec"]["groups"] == groups
    assert {r.get("alert") for g in groups for r in g["rules"]} >= {
        "DecodeRateRegression",
        "TTFTSLOBreach",
    }
    # and the embedded groups are valid rules for promtool
    with tempfile.NamedTemporaryFile("w", suffix=".yml") as f:
        yaml.safe_dump({"groups": rule["spec"]["groups"]}, f)
        f.flush()
        res = subprocess.run([promtool(), "check", "rules", f.name], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def test_k8s_dashboards_configmap_is_the_dashboards():
    cm = next(
        d
        for docs in manifests().values()
        for d in docs
        if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "phasewatch-dashboards"
    )
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    files = {
        p.name: p.read_text() for p in sorted((ROOT / "grafana" / "dashboards").glob("*.json"))
    }
    assert cm["data"] == files
    for text in cm["data"].values():
        json.loads(text)
    # small enough for `kubectl apply` (its last-applied annotation is limited to 256 KiB)
    assert len((K8S / "grafana-dashboards-configmap.yaml").read_bytes()) < 256 * 1024


def test_k8s_deployment_service_servicemonitor_agree():
    kinds = by_kind()
    dep, svc, sm = kinds["Deployment"], kinds["Service"], kinds["ServiceMonitor"]
    spec = dep["spec"]
    assert spec["replicas"] >= 2
    pod_labels = spec["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= pod_labels.items()
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    container = spec["template"]["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert svc["spec"]["ports"][0]["targetPort"] in ports
    assert sm["spec"]["endpoints"][0]["port"] == svc["spec"]["ports"][0]["name"]
    assert sm["spec"]["endpoints"][0]["path"] == "/metrics"
    # the job label the ServiceMonitor gives is the one PhasewatchDown watches
    assert svc["metadata"]["labels"][sm["spec"]["jobLabel"]] == "phasewatch"
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/phasewatch/health"
        assert container[probe]["httpGet"]["port"] in ports
    env = {e["name"]: e["value"] for e in container["env"]}
    assert set(env) <= settings_env()
    assert int(env["PHASEWATCH_PORT"]) == ports["http"]
    assert build_parser().parse_args(container["args"]).command == "serve"
    pod_sec = spec["template"]["spec"]["securityContext"]
    assert pod_sec["runAsNonRoot"] and pod_sec["runAsUser"] != 0
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    # graceful drain fits in the pod's termination grace period
    assert (
        float(env["PHASEWATCH_SHUTDOWN_GRACE"])
        < spec["template"]["spec"]["terminationGracePeriodSeconds"]
    )
    # its config map holds real settings that parse
    config = next(
        d
        for docs in manifests().values()
        for d in docs
        if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "phasewatch"
    )
    ref = container["envFrom"][0]["configMapRef"]["name"]
    assert ref == config["metadata"]["name"]
    assert set(config["data"]) <= settings_env()
    Settings(**{k.removeprefix("PHASEWATCH_").lower(): v for k, v in config["data"].items()})


# Kinds that are no part of the Kubernetes API (the Prometheus Operator's CRDs and
# kustomize's own file): kubernetes-validate has no schema for them; the checks above
# cover their fields.
NOT_KUBERNETES_API = {"Kustomization", "ServiceMonitor", "PrometheusRule"}


def k8s_versions() -> list[str]:
    """Every Kubernetes minor release from 1.29 to the newest kubernetes-validate ships."""
    from kubernetes_validate.utils import all_versions

    def key(v: str) -> tuple[int, ...]:
        return tuple(int(x) for x in v.split("."))

    return sorted({v for v in all_versions() if key(v) >= (1, 29)}, key=key)


def test_k8s_manifests_validate_against_kubernetes_api_schemas():
    import kubernetes_validate

    versions = k8s_versions()
    assert len(versions) >= 2, versions
    checked = set()
    for name, docs in manifests().items():
        for doc in docs:
            if doc["kind"] in NOT_KUBERNETES_API:
                assert doc["apiVersion"] in (
                    "monitoring.coreos.com/v1",
                    "kustomize.config.k8s.io/v1beta1",
                )
                continue
            for version in versions:
                try:  # strict: an unknown or misspelt field is an error too
                    kubernetes_validate.validate(doc, version, strict=True)
                except kubernetes_validate.ValidationError as exc:
                    pytest.fail(
                        f"{name} ({doc['kind']}) is not valid for Kubernetes {version}: "
                        f"{'.'.join(map(str, exc.path))}: {exc.message}"
                    )
            checked.add(doc["kind"])
    assert {"Deployment", "Service", "ConfigMap", "Namespace", "PodDisruptionBudget"} <= checked


def test_k8s_validation_catches_a_broken_deployment():
    import copy

    import kubernetes_validate

    dep = by_kind()["Deployment"]
    broken = copy.deepcopy(dep)
    broken["spec"]["template"]["spec"]["containers"][0]["volumeMounts"][0]["mountpath"] = broken[
        "spec"
    ]["template"]["spec"]["containers"][0]["volumeMounts"][0].pop("mountPath")
    wrong_type = copy.deepcopy(dep)
    wrong_type["spec"]["replicas"] = "three"
    for doc in (broken, wrong_type):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(doc, k8s_versions()[-1], strict=True)


def test_k8s_read_only_root_has_a_writable_tmp():
    """readOnlyRootFilesystem: the proxy writes to /tmp (tempfile's default: --workers N
    makes prometheus-client's multiprocess folder there), so /tmp must be an emptyDir.
    The container test runs the image the same way (read-only root, /tmp mounted)."""
    pod = by_kind()["Deployment"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "/tmp" in mounts, mounts
    assert "emptyDir" in volumes[mounts["/tmp"]]
    env = {e["name"] for e in container["env"]}
    assert "TMPDIR" not in env  # tempfile then uses /tmp
