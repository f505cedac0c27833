"""The image run the way deploy/k8s/deployment.yaml runs it: its user, a read-only root
file system, no capabilities, no privilege escalation, and its emptyDir volumes as the
only writable places, with PHASEWATCH_WORKERS=2 (which makes prometheus-client's
multiprocess folder under /tmp)."""

from __future__ import annotations

import os

import pytest
import yaml

from .podman import ROOT, CrashLoop

pytestmark = pytest.mark.container

METRICS = (
    "import urllib.request; print(urllib.request.urlopen("
    "'http://127.0.0.1:8090/metrics', timeout=5).read().decode())"
)


def _pod_flags(with_volumes: bool) -> list[str]:
    pod = yaml.safe_load((ROOT / "deploy/k8s/deployment.yaml").read_text())["spec"]["template"][
        "spec"
    ]
    container = pod["containers"][0]
    sec, pod_sec = container["securityContext"], pod["securityContext"]
    flags = ["--user", f"{pod_sec['runAsUser']}:{pod_sec['runAsGroup']}"]
    if sec.get("readOnlyRootFilesystem"):
        flags += ["--read-only", "--read-only-tmpfs=false"]  # podman's own /tmp tmpfs: off
    if "ALL" in sec.get("capabilities", {}).get("drop", []):
        flags += ["--cap-drop", "ALL"]
    if sec.get("allowPrivilegeEscalation") is False:
        flags += ["--security-opt", "no-new-privileges"]
    empty_dirs = {v["name"] for v in pod.get("volumes", []) if "emptyDir" in v}
    if with_volumes:
        for mount in container.get("volumeMounts", []):
            if mount["name"] in empty_dirs:
                flags += ["--tmpfs", f"{mount['mountPath']}:rw,mode=1777"]
    for env in container["env"]:
        flags += ["-e", f"{env['name']}={env['value']}"]
    flags += ["-e", "PHASEWATCH_WORKERS=2", "-e", "PHASEWATCH_UPSTREAM=http://127.0.0.1:9"]
    return flags


@pytest.fixture
def run(podman):
    names = []

    def start(image: str, *flags: str) -> str:
        name = f"pwk8s-{os.getpid()}-{len(names)}"
        names.append(name)
        podman.run("run", "-d", "--name", name, *flags, image, "serve")
        return name

    yield start
    for name in names:
        podman.run("rm", "-f", name, check=False)


def test_image_runs_as_the_deployment_runs_it(podman, image, run):
    name = run(image, *_pod_flags(with_volumes=True))
    podman.wait_healthy(name, timeout=90)
    text = podman.exec_python(name, METRICS).decode()
    assert "phasewatch_upstream_up" in text
    assert any(
        d.startswith("phasewatch-metrics-") for d in podman.out("exec", name, "ls", "/tmp").split()
    )
    assert podman.run("exec", name, "touch", "/probe", check=False).returncode != 0  # read-only


def test_without_the_tmp_volume_the_workers_cannot_start(podman, image, run):
    """What the emptyDir is for: the same pod without it fails at start, with the reason."""
    name = run(image, *_pod_flags(with_volumes=False))
    with pytest.raises(CrashLoop) as info:
        podman.wait_healthy(name, timeout=60)
    assert "Read-only file system" in str(info.value) or "No usable temporary" in str(info.value), (
        str(info.value)
    )
