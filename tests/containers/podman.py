"""podman and podman-compose, driven as CI drives them (docs: /CONTAINERS.md notes in the
README's "Deploying" section).

The engine settings this host needs live in a containers.conf of our own (runc with
cgroupfs: crun refuses the hybrid cgroup layout; explicit ulimits at or below the host's
hard limits), pointed to by CONTAINERS_CONF for every podman and podman-compose call.
Base images come from ``.ci/container-standins.sh`` (no registry is reachable); nothing is
ever pulled. Podman runs health checks from systemd timers, which this host lacks, so
:meth:`Podman.wait_healthy` runs each container's own check (``podman healthcheck run``)
until it passes.
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
STANDINS_HINT = "run .ci/container-standins.sh (it makes the local base images)"
#: The base images docker-compose.yml and deploy/Dockerfile name: local stand-ins.
BASE_IMAGES = (
    "docker.io/library/python:3.12-slim",
    "docker.io/library/python:3.12",
    "docker.io/prom/prometheus:v2.54.1",
    "docker.io/prom/alertmanager:v0.27.0",
)
HOST_CA = "/etc/ssl/certs/ca-certificates.crt"


class ContainersMissing(RuntimeError):
    """podman, podman-compose or a stand-in image is not there."""


class CrashLoop(AssertionError):
    """A container exited or restarted while we waited for it to become healthy."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def containers_conf(folder: Path) -> Path:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    hard = 1048576 if hard == resource.RLIM_INFINITY else hard
    path = folder / "containers.conf"
    path.write_text(
        "[containers]\n"
        f'default_ulimits = ["nofile={min(1024, hard)}:{hard}", "nproc=1024:4096"]\n'
        "[engine]\n"
        'runtime = "runc"\n'
        'cgroup_manager = "cgroupfs"\n'
        # nothing is ever pulled: every image is built or a local stand-in
        'pull_policy = "never"\n'
    )
    return path


class Podman:
    def __init__(self) -> None:
        missing = [tool for tool in ("podman", "podman-compose") if shutil.which(tool) is None]
        if missing:
            raise ContainersMissing(
                f"{' and '.join(missing)} not installed: apt-get install podman podman-compose "
                "runc golang-github-containernetworking-plugin-dnsname (bash .ci/run does it)"
            )
        self.dir = Path(tempfile.mkdtemp(prefix="pw-podman-"))
        self.env = {**os.environ, "CONTAINERS_CONF": str(containers_conf(self.dir))}
        for image in BASE_IMAGES:
            if self.run("image", "exists", image, check=False).returncode != 0:
                raise ContainersMissing(f"stand-in image {image} is missing: {STANDINS_HINT}")

    # --- plain podman ------------------------------------------------------------------
    def run(
        self, *args: str, check: bool = True, timeout: float = 300, input: bytes | None = None
    ) -> subprocess.CompletedProcess:
        r = subprocess.run(
            ["podman", *args],
            check=False,
            env=self.env,
            capture_output=True,
            timeout=timeout,
            input=input,
        )
        if check and r.returncode != 0:
            raise AssertionError(
                f"podman {' '.join(args)} failed ({r.returncode}):\n"
                f"{r.stdout.decode(errors='replace')[-2000:]}"
                f"{r.stderr.decode(errors='replace')[-3000:]}"
            )
        return r

    def out(self, *args: str, **kw) -> str:
        return self.run(*args, **kw).stdout.decode().strip()

    def build(self, tag: str) -> float:
        """deploy/Dockerfile from the repository root; seconds taken. Docker format keeps
        HEALTHCHECK; pip inside reaches the package registry through the host network."""
        t0 = time.monotonic()
        self.run(
            "build",
            "--format",
            "docker",
            "--pull=never",
            "--network",
            "host",
            "-v",
            f"{HOST_CA}:{HOST_CA}:ro",
            "-f",
            "deploy/Dockerfile",
            "-t",
            tag,
            str(ROOT),
            timeout=900,
        )
        return time.monotonic() - t0

    def inspect(self, name: str) -> dict:
        return json.loads(self.out("inspect", name))[0]

    def logs(self, name: str, tail: int = 40) -> str:
        r = self.run("logs", "--tail", str(tail), name, check=False)
        return (r.stdout + r.stderr).decode(errors="replace")

    def last_words(self, name: str, timeout: float = 20.0) -> str:
        """The log of a container that crashed. Just after a restart its log is empty
        (podman keeps the current run's): wait for the next run to say something."""
        deadline = time.monotonic() + timeout
        while True:
            text = self.logs(name)
            if text.strip() or time.monotonic() > deadline:
                return text
            time.sleep(0.5)

    def wait_healthy(self, name: str, timeout: float = 120.0) -> float:
        """Run the container's own health check until it passes; seconds taken. Raises
        CrashLoop at once when the container exits or restarts meanwhile (a restart
        policy would otherwise hide a crash loop behind a running state)."""
        t0 = time.monotonic()
        while True:
            state = self.inspect(name)
            restarts = state.get("RestartCount", 0)
            if restarts or state["State"]["Status"] not in ("running", "created", "configured"):
                raise CrashLoop(
                    f"{name}: {state['State']['Status']}, exit code "
                    f"{state['State'].get('ExitCode')}, {restarts} restarts; "
                    f"its log:\n{self.last_words(name)}"
                )
            if self.run("healthcheck", "run", name, check=False).returncode == 0:
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout:
                raise AssertionError(
                    f"{name} not healthy after {timeout:.0f} s; its log:\n{self.logs(name)}"
                )
            time.sleep(0.5)

    def exec_python(self, name: str, code: str, timeout: float = 60) -> bytes:
        return self.run("exec", name, "python", "-c", code, timeout=timeout).stdout

    # --- compose -----------------------------------------------------------------------
    def compose(
        self,
        project: str,
        *args: str,
        env: dict | None = None,
        files: tuple[str, ...] = ("docker-compose.yml",),
        check: bool = True,
        timeout: float = 300,
    ) -> subprocess.CompletedProcess:
        argv = ["podman-compose", "-p", project]
        for f in files:
            argv += ["-f", str(ROOT / f)]
        # Only what the caller sets reaches the file's ${VARIABLES}: none of the caller's
        # own environment (a PHASEWATCH_UPSTREAM there would change the stack).
        text = "".join((ROOT / f).read_text() for f in files)
        used = set(re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)", text))
        base = {
            k: v for k, v in self.env.items() if k not in used and not k.startswith("PHASEWATCH_")
        }
        r = subprocess.run(
            [*argv, *args],
            check=False,
            env={**base, **(env or {})},
            cwd=ROOT,
            capture_output=True,
            timeout=timeout,
        )
        if check and r.returncode != 0:
            raise AssertionError(
                f"{' '.join(argv + list(args))} failed ({r.returncode}):\n"
                f"{r.stdout.decode(errors='replace')[-3000:]}"
                f"{r.stderr.decode(errors='replace')[-3000:]}"
            )
        return r

    def container(self, project: str, service: str) -> str:
        return f"{project}_{service}_1"

    def teardown(self, project: str) -> list[str]:
        """Remove every container, volume and network of the project, whatever state it is
        in; returns what was still there afterwards (should be nothing)."""
        label = f"label=io.podman.compose.project={project}"
        self.compose(project, "down", "-v", "-t", "5", check=False, timeout=180)
        for cid in self.out("ps", "-aq", "--filter", label, check=False).split():
            self.run("rm", "-f", "-v", cid, check=False)
        for vol in self.out("volume", "ls", "-q", "--filter", label, check=False).split():
            self.run("volume", "rm", "-f", vol, check=False)
        for net in self.out(
            "network", "ls", "-q", "--filter", f"name=^{project}_", check=False
        ).split():
            self.run("network", "rm", "-f", net, check=False)
        left = self.out("ps", "-aq", "--filter", label, check=False).split()
        left += self.out("volume", "ls", "-q", "--filter", label, check=False).split()
        left += self.out(
            "network", "ls", "-q", "--filter", f"name=^{project}_", check=False
        ).split()
        return left

    def remove_stale(self, prefix: str) -> None:
        """Stacks of earlier test runs whose process is gone (a killed run cannot tear
        down); stacks of runs still alive (another checkout's) are left alone. Project
        names end in the owning pytest's pid."""
        listing = self.out("ps", "-a", "--format", "json", check=False) or "[]"
        projects = {
            (c.get("Labels") or {}).get("io.podman.compose.project", "")
            for c in json.loads(listing)
        }
        for project in sorted(p for p in projects if p.startswith(prefix)):
            try:
                os.kill(int(project.rsplit("-", 1)[1]), 0)
                continue  # its run is still going
            except ProcessLookupError:
                pass
            except (ValueError, IndexError, PermissionError):
                continue
            self.teardown(project)

    def remove_stale_images(self, repo: str, prefix: str) -> None:
        """Tags REPO:PREFIX<pid> of runs whose process is gone."""
        for tag in self.out(
            "images", "--format", "{{.Tag}}", "--filter", f"reference={repo}", check=False
        ).split():
            if not tag.startswith(prefix):
                continue
            try:
                os.kill(int(tag[len(prefix) :]), 0)
            except ProcessLookupError:
                self.run("rmi", "-f", f"{repo}:{tag}", check=False)
            except (ValueError, PermissionError):
                pass


def poll(what: str, check, timeout: float, interval: float = 1.0):
    """check() until it returns something truthy; its last value (or error) on failure."""
    deadline = time.monotonic() + timeout
    last = None
    while True:
        try:
            last = check()
            if last:
                return last
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            last = repr(exc)
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:.0f} s (last: {last!r:.1500})")
        time.sleep(interval)
