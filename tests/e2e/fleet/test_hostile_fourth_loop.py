"""Finding 4 of the fourth hostile pass: phasewatch as its own upstream.

``serve --upstream http://127.0.0.1:8090 --port 8090`` started, and one chat request then
fanned out to a thousand requests in flight. Now:

- an upstream whose address is the proxy's own listening address is refused at start, with
  a clear message and a non-zero exit;
- a loop the proxy cannot see at start (two proxies, each the other's upstream) ends at
  once: each proxy names itself in a ``Via`` header upstream, and a request arriving with
  its own name in it gets a 508 (counted as ``rejected_total{reason="loop"}``), which the
  proxies before it relay back to the client.
"""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest

from ...support.fake_engine import FakeEngine
from ...support.servers import ROOT, _spawn, free_port, metric_samples, sample, wait_for


def _serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "proxy", "serve", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=20,
    )


@pytest.mark.parametrize(
    "upstream, host",
    [
        ("http://127.0.0.1:{port}", "127.0.0.1"),
        ("http://localhost:{port}/v1", "127.0.0.1"),
        ("http://127.0.0.1:{port}", "0.0.0.0"),
        ("http://[::1]:{port}", "::"),
    ],
)
def test_the_proxys_own_address_as_its_upstream_is_refused_at_start(upstream, host):
    port = free_port()
    done = _serve("--upstream", upstream.format(port=port), "--port", str(port), "--host", host)
    assert done.returncode != 0, done.stdout + done.stderr
    said = done.stdout + done.stderr
    assert "own address" in said and str(port) in said, said
    assert "Traceback" not in said, said


def test_another_port_on_the_same_host_is_not_refused():
    engine = FakeEngine().start()
    try:
        port = free_port()
        proc, log = _spawn(
            ["serve", "--port", str(port), "--upstream", engine.url],
            port,
            "/phasewatch/ready",
        )
        try:
            r = httpx.post(
                f"http://127.0.0.1:{port}/v1/chat/completions",
                json={"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]},
                timeout=10,
            )
            assert r.status_code == 200, r.text
            via = engine.posts()[-1].header("via")
            assert via is not None and via.startswith("1.1 phasewatch-"), via
        finally:
            proc.terminate()
            proc.wait(30)
    finally:
        engine.stop()


def test_a_loop_through_another_proxy_ends_at_once_with_an_error():
    pa, pb = free_port(), free_port()
    common = ["--engine", "openai"]
    a = b = None
    try:
        a = _spawn(
            ["serve", "--port", str(pa), "--upstream", f"http://127.0.0.1:{pb}", *common],
            pa,
            "/phasewatch/health",
        )
        b = _spawn(
            ["serve", "--port", str(pb), "--upstream", f"http://127.0.0.1:{pa}", *common],
            pb,
            "/phasewatch/health",
        )

        def refused() -> float:
            return sum(
                sample(
                    metric_samples(f"http://127.0.0.1:{p}"),
                    "phasewatch_rejected_total",
                    reason="loop",
                )
                for p in (pa, pb)
            )

        def chat() -> httpx.Response:
            return httpx.post(
                f"http://127.0.0.1:{pa}/v1/chat/completions",
                json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
                timeout=30,
            )

        first = chat()  # (waits for the proxies' first probes of each other)
        assert first.status_code == 508, first.text
        before = refused()  # (their probes of each other loop too, and are cut)
        start = time.monotonic()
        r = chat()
        took = time.monotonic() - start
        loops = refused() - before
        print(
            f"a loop through two proxies: {r.status_code} after {took:.3f} s, {loops:.0f} refused"
        )
        assert r.status_code == 508, r.text
        assert "loop" in r.json()["error"]["message"]
        # the chat request's own refusal, and perhaps a probe's: not a fan-out
        assert 1 <= loops <= 4
        # each proxy sent it once: a request no longer fans out
        wait_for(
            lambda: all(
                sample(metric_samples(f"http://127.0.0.1:{p}"), "phasewatch_in_flight_requests")
                == 0
                for p in (pa, pb)
            ),
            10,
            "nothing left in flight",
        )
        log_a = a[1].read_text()
        assert "Traceback" not in log_a and "Traceback" not in b[1].read_text()
    finally:
        for s in (a, b):
            if s is not None:
                s[0].terminate()
                s[0].wait(30)
