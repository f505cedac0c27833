"""The mistakes a new operator makes in the first hour, through the real command line:
a near-miss of an access-control variable refuses to start (not an open proxy), a full
endpoint URL as upstream is caught at start, both spellings of the TLS file flags work, a
misspelt flag gets a suggestion and serve's own usage, a bad variable is named as the
variable, ``--engine vllm`` needs no name with one upstream, and the demo says its power is
simulated and logs one server start (the proxy's), not the simulator's as well."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

from ...support.servers import ROOT, start_proxy


def run(*args, env=None, timeout=60):
    return subprocess.run(
        [sys.executable, "-m", "proxy", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def error_line(res: subprocess.CompletedProcess) -> str:
    """The one error line of a refused start."""
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("phasewatch: error:")]
    assert len(errors) == 1 and res.stderr.rstrip().endswith(errors[0]), res.stderr
    return errors[0]


@pytest.mark.parametrize(
    "variable",
    ["PHASEWATCH_APIKEY", "PHASEWATCH_API_KEYS", "PHASEWATCH_API_TOKEN", "PHASEWATCH_CLIENT_KEY"],
)
def test_a_near_miss_of_the_key_variable_refuses_to_start(sim, variable):
    res = run("serve", "--upstream", sim.url, "--port", "0", env={variable: "s3cret-value"})
    line = error_line(res)
    assert (
        variable in line and "refusing to start" in line and "looks like PHASEWATCH_API_KEY" in line
    )
    assert "s3cret-value" not in res.stderr  # a name, never the value


def test_other_misspelt_variables_still_only_warn(sim):
    env = {"PHASEWATCH_UPSTREM_TIMEOUT": "3", "PHASEWATCH_UPSTREM": "x"}
    proxy = start_proxy(f"sim={sim.url}", env=env)
    try:
        assert httpx.get(proxy.url + "/phasewatch/health").status_code == 200
        for name in env:
            assert f"{name} is not a phasewatch setting and is ignored" in proxy.log()
    finally:
        proxy.stop()


@pytest.mark.parametrize(
    ("url", "base"),
    [
        ("http://127.0.0.1:8000/v1/chat/completions", "http://127.0.0.1:8000"),
        ("gpu=http://10.0.0.5:8000/v1/completions/", "http://10.0.0.5:8000"),
        ("http://gw/tenant-a/v1/chat/completions", "http://gw/tenant-a"),
        ("http://127.0.0.1:11434/api/chat", "http://127.0.0.1:11434"),
        ("http://127.0.0.1:8080/completion", "http://127.0.0.1:8080"),
    ],
)
def test_an_endpoint_url_as_upstream_is_caught_at_start(url, base):
    line = error_line(run("serve", "--upstream", url, "--port", "0"))
    assert "endpoint URL" in line and f"base URL, {base} " in line, line


def test_a_misspelt_flag_gets_a_suggestion_and_serves_own_usage(sim):
    res = run("serve", "--upstream", sim.url, "--max-concurency", "4")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "did you mean --max-concurrency?" in res.stderr, res.stderr
    usage = [ln for ln in res.stderr.splitlines() if ln.startswith("usage:")]
    assert usage and usage[0].startswith("usage: phasewatch serve "), res.stderr
    assert "{serve,simulate" not in res.stderr  # not the top-level usage
    assert len(res.stderr.splitlines()) <= 3, res.stderr


def test_a_bad_variable_is_named_as_the_variable_and_a_bad_flag_as_the_flag(sim):
    line = error_line(
        run("serve", "--upstream", sim.url, env={"PHASEWATCH_MAX_CONCURRENCY": "lots"})
    )
    assert (
        line.startswith("phasewatch: error: PHASEWATCH_MAX_CONCURRENCY (--max-concurrency):")
        and "'lots'" in line
    )
    line = error_line(run("serve", "--upstream", sim.url, "--max-concurrency", "lots"))
    assert line.startswith("phasewatch: error: --max-concurrency:"), line


def test_both_spellings_of_the_tls_file_flags(sim, tmp_path):
    trustme = pytest.importorskip("trustme")
    missing = str(tmp_path / "nope.pem")
    for args, env in (
        (["--upstream-ca-file", missing], None),
        (["--upstream-ca", missing], None),
        ([], {"PHASEWATCH_UPSTREAM_CA_FILE": missing}),
    ):
        line = error_line(run("serve", "--upstream", sim.url, *args, env=env))
        assert "--upstream-ca:" in line and "not a readable file" in line, line
    line = error_line(run("serve", "--upstream", sim.url, "--upstream-cert-file", missing))
    assert "--upstream-cert:" in line, line
    # both given: refused rather than one silently winning
    both = run(
        "serve",
        "--upstream",
        sim.url,
        "--upstream-ca",
        missing,
        env={"PHASEWATCH_UPSTREAM_CA_FILE": missing},
    )
    assert "both given" in error_line(both)
    # a real CA under the second spelling: accepted, and the proxy starts
    ca = tmp_path / "ca.pem"
    trustme.CA().cert_pem.write_to_path(str(ca))
    proxy = start_proxy(f"sim={sim.url}", args=["--upstream-ca-file", str(ca)])
    try:
        assert httpx.get(proxy.url + "/phasewatch/health").status_code == 200
        assert "PHASEWATCH_UPSTREAM_CA_FILE" not in proxy.log()
    finally:
        proxy.stop()


def test_engine_without_a_name_with_one_upstream(sim):
    # the simulator is a vLLM: the override shows as its own, not the detected one
    proxy = start_proxy(sim.url, args=["--engine", "openai"])
    try:
        ready = httpx.get(proxy.url + "/phasewatch/ready").json()
        assert ready["upstreams"][0]["engine"] == "openai", ready
        assert "(engine openai)" in proxy.log()
    finally:
        proxy.stop()
    line = error_line(
        run(
            "serve", "--upstream", f"a={sim.url}", "--upstream", f"b={sim.url}/", "--engine", "vllm"
        )
    )
    assert "--engine vllm" in line and "NAME=vllm" in line and "a, b" in line, line


def test_the_demo_says_its_gpus_and_their_power_are_simulated():
    from ...support.servers import free_port

    res = run("demo", "--port", str(free_port()), "--rate", "0", "--duration", "2", timeout=90)
    assert res.returncode == 0, res.stderr[-2000:]
    (line,) = [ln for ln in res.stderr.splitlines() if 'msg="demo:' in ln]
    assert "simulated vllm engine" in line and "3 simulated GPUs" in line, line
    assert "fake dcgm-exporter" in line and "simulated, not measured" in line, line


def test_the_demo_logs_one_server_start_and_stop_the_proxys():
    """The simulator's server shares uvicorn's logger with the proxy's; its lifecycle lines
    would read as the proxy starting twice. Each appears once, and it is the proxy's: its
    relaying line comes between waiting for and completing the application's start-up."""
    from ...support.servers import free_port

    res = run("demo", "--port", str(free_port()), "--rate", "0", "--duration", "2", timeout=90)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = res.stderr.splitlines()
    lifecycle = [
        "Started server process",
        "Waiting for application startup.",
        "Application startup complete.",
        "Shutting down",
        "Waiting for application shutdown.",
        "Application shutdown complete.",
        "Finished server process",
    ]
    where = {}
    for text in lifecycle:
        found = [i for i, ln in enumerate(lines) if "logger=uvicorn.error" in ln and text in ln]
        assert len(found) == 1, (text, res.stderr[-3000:])
        where[text] = found[0]
    (relaying,) = [i for i, ln in enumerate(lines) if "relaying to sim" in ln]
    assert where["Waiting for application startup."] < relaying, res.stderr[-3000:]
    assert relaying < where["Application startup complete."], res.stderr[-3000:]
    assert sorted(where.values()) == [where[t] for t in lifecycle], res.stderr[-3000:]
