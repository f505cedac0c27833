"""A `--clients` name that is also a named key's name is refused at start: otherwise a
bare-key holder sending ``--client-header NAME`` would be counted (requests, tokens,
energy) as the holder of the named key. Through the real command line."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx

from ...support.servers import ROOT, metric_samples, sample, start_proxy

SECRET = "s3cret-team-a-key"
BARE = "bare-key-0123"


def serve(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "proxy", "serve", "--upstream", "http://127.0.0.1:9", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def one_error(res: subprocess.CompletedProcess) -> str:
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith("phasewatch: error:"), line
    assert SECRET not in line and BARE not in line  # keys never shown
    return line


def test_a_clients_name_equal_to_a_named_keys_name_stops_start_up():
    line = one_error(
        serve(
            "--api-key",
            f"team-a={SECRET}",
            "--api-key",
            BARE,
            "--client-header",
            "x-team",
            "--clients",
            "red,team-a",
        )
    )
    assert "--clients: 'team-a' is also the name of a named --api-key" in line, line


def test_the_same_clash_from_variables_stops_start_up():
    line = one_error(
        serve(
            env={
                "PHASEWATCH_API_KEY": f"team-a={SECRET},{BARE}",
                "PHASEWATCH_CLIENT_HEADER": "x-team",
                "PHASEWATCH_CLIENTS": "team-a blue",
            }
        )
    )
    assert "'team-a' is also the name of a named --api-key" in line, line


def test_distinct_names_start_and_a_header_cannot_claim_a_named_client():
    """No clash: the proxy starts; a bare key with x-team: team-a is 'other', not team-a
    (the name only a named key may give)."""
    proxy = start_proxy(
        "http://127.0.0.1:9",
        args=[
            "--api-key",
            f"team-a={SECRET}",
            "--api-key",
            BARE,
            "--client-header",
            "x-team",
            "--clients",
            "red,blue",
            "--metrics-public",
        ],
    )
    try:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        r = httpx.post(
            proxy.url + "/v1/chat/completions",
            json=body,
            headers={"authorization": f"Bearer {BARE}", "x-team": "team-a"},
            timeout=30,
        )
        assert r.status_code == 502  # the upstream is down; the request is still counted
        proxy.request_lines(at_least=1)
        s = metric_samples(proxy.url)
        assert sample(s, "phasewatch_requests_total", client="other") == 1
        assert sample(s, "phasewatch_requests_total", client="team-a") == 0
    finally:
        proxy.stop()
