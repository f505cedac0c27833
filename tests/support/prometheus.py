"""A real Prometheus server (Debian's ``prometheus`` package) on a free loopback port, and
the promtool beside it: what the rule and dashboard tests run queries through."""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from .servers import free_port


def tool(name: str) -> str:
    path = shutil.which(name) or (f"/usr/bin/{name}" if Path(f"/usr/bin/{name}").exists() else None)
    if path is None:
        pytest.fail(
            f"{name} is not installed: apt-get install -y prometheus "
            f"(Debian's package ships promtool and the prometheus server)"
        )
    return path


class PromServer:
    def __init__(self, config: dict, tmp: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = tmp / "prometheus.yml"
        cfg.write_text(yaml.safe_dump(config))
        self.log_path = tmp / "prometheus.log"
        self.proc = subprocess.Popen(
            [
                tool("prometheus"),
                f"--config.file={cfg}",
                f"--storage.tsdb.path={tmp / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--storage.tsdb.retention.time=1h",
                "--log.level=warn",
            ],
            stdout=self.log_path.open("wb"),
            stderr=subprocess.STDOUT,
            cwd=tmp,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("prometheus exited:\n" + self.log_path.read_text())
            try:
                if httpx.get(self.url + "/-/ready", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError("prometheus did not start:\n" + self.log_path.read_text())

    def query(self, expr: str) -> list[dict]:
        r = httpx.get(self.url + "/api/v1/query", params={"query": expr}, timeout=30)
        body = r.json()
        assert body.get("status") == "success", f"{expr}\n-> {body}"
        return body["data"]["result"]

    def api(self, path: str, **params) -> dict:
        r = httpx.get(self.url + path, params=params, timeout=30)
        r.raise_for_status()
        return r.json()["data"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
