"""`phasewatch demo --rate`: negative (or not a number) refused in one line, 0 runs the
simulator and proxy with no background traffic (a quiet engine to benchmark)."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest

from ...support.servers import ROOT, free_port, metric_samples, sample


@pytest.mark.parametrize("rate", ["-1", "nan"])
def test_a_negative_rate_is_refused(rate):
    res = subprocess.run(
        [sys.executable, "-m", "proxy", "demo", "--rate", rate, "--port", str(free_port())],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2
    assert res.stderr.strip().splitlines()[-1] == (
        "phasewatch: error: --rate must not be negative (requests per second; 0: no traffic)"
    )


def test_rate_zero_sends_nothing():
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "proxy",
            "demo",
            "--rate",
            "0",
            "--port",
            str(port),
            "--duration",
            "30",
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/v1/models", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        time.sleep(3)  # a demo with traffic sends ~3 requests in that time
        assert sample(metric_samples(url), "phasewatch_requests_total") == 0
        # a request of our own is served and counted
        r = httpx.post(
            url + "/v1/chat/completions",
            json={
                "model": "meta-llama/Llama-3.1-8B-Instruct",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4,
            },
            timeout=30,
        )
        assert r.status_code == 200
        assert sample(metric_samples(url), "phasewatch_requests_total") == 1
    finally:
        proc.terminate()
        proc.wait(30)
