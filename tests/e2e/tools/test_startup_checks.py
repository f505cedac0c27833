"""Mistakes caught at start: an OpenAI-style ``/v1`` upstream URL, settings that mean
nothing (an unknown precision, a GPU mapped to a model no upstream has, a misspelt
variable), a port already in use; and the start-up log saying where phasewatch's own
pages are. Through the real command line."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from proxy.services.power import GpuMap
from proxy.settings import parse_upstream
from proxy.sim import build_app

from ...support.hostile import closed_port
from ...support.replay import ThreadServer
from ...support.servers import (
    ROOT,
    _spawn,
    free_port,
    metric_samples,
    sample,
    start_proxy,
    start_sim,
    wait_for,
)

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


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
    """The one error line of a refused start (warnings may come before it)."""
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("phasewatch: error:")]
    assert len(errors) == 1 and res.stderr.rstrip().endswith(errors[0]), res.stderr
    return errors[0]


# --- the upstream URL ---------------------------------------------------------------------


def test_parse_upstream_keeps_base_paths_and_drops_an_openai_v1():
    assert parse_upstream("http://gpu1:8000") == (None, "http://gpu1:8000", None)
    assert parse_upstream("a=http://gw/tenant-a/") == ("a", "http://gw/tenant-a", None)
    for spec, base in (
        ("http://gpu1:8000/v1", "http://gpu1:8000"),
        ("b=http://gpu1:8000/v1/", "http://gpu1:8000"),
        ("http://gw/tenant-a/v1", "http://gw/tenant-a"),
    ):
        _, url, note = parse_upstream(spec)
        assert url == base and note is not None and "ends in /v1" in note, spec
    with pytest.raises(ValueError, match=r"http\(s\)://host\[:port\]\[/base-path\]"):
        parse_upstream("gpu1:8000")


def test_a_v1_upstream_is_corrected_said_and_measured(sim):
    proxy = start_proxy(f"sim={sim.url}/v1")
    try:
        (line,) = [ln for ln in proxy.log().splitlines() if "ends in /v1" in ln]
        assert "level=warning" in line and f"relaying to {sim.url} instead" in line
        ready = httpx.get(proxy.url + "/phasewatch/ready").json()
        assert ready["upstreams"][0]["url"] == sim.url and ready["upstreams"][0]["engine"] == "vllm"
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="k", max_retries=0)
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        s = metric_samples(proxy.url)
        assert sample(s, "phasewatch_requests_total", model=MODEL, outcome="ok") == 1
    finally:
        proxy.stop()


def test_an_ollama_api_upstream_is_corrected_and_said_like_v1():
    sim = start_sim("ollama", speed=8.0)
    proxy = start_proxy(f"ol={sim.url}/api/")
    try:
        (line,) = [ln for ln in proxy.log().splitlines() if "ends in /api" in ln]
        assert "level=warning" in line and f"relaying to {sim.url} instead" in line
        (up,) = httpx.get(proxy.url + "/phasewatch/ready").json()["upstreams"]
        assert up["url"] == sim.url and up["engine"] == "ollama" and up["up"]
    finally:
        proxy.stop()
        sim.stop()


def test_an_upstream_down_at_start_is_said_with_its_cause():
    port = closed_port()
    proxy = start_proxy(f"gone=http://127.0.0.1:{port}")
    try:
        wait_for(lambda: "is not answering its model list" in proxy.log(), what="the warning")
        (line,) = [ln for ln in proxy.log().splitlines() if "not answering its model list" in ln]
        assert "level=warning" in line and "connection refused" in line, line
        assert "model list not read" not in line
    finally:
        proxy.stop()


def test_a_base_path_is_kept_and_requests_go_under_it():
    sim_app = build_app("vllm", speed=8.0, deterministic=True)

    async def under_tenant(scope, receive, send):
        """The simulator mounted under /tenant-a (a gateway's path per tenant)."""
        if scope["type"] == "http":
            if not scope["path"].startswith("/tenant-a/"):
                await send({"type": "http.response.start", "status": 404, "headers": []})
                await send({"type": "http.response.body", "body": b"outside /tenant-a"})
                return
            path = scope["path"].removeprefix("/tenant-a")
            scope = {**scope, "path": path, "raw_path": path.encode()}
        await sim_app(scope, receive, send)

    upstream = ThreadServer(under_tenant, free_port()).start()
    proxy = start_proxy(f"t={upstream.url}/tenant-a")
    try:
        assert not [ln for ln in proxy.log().splitlines() if "level=warning" in ln]
        assert httpx.get(proxy.url + "/phasewatch/ready").json()["upstreams"][0]["engine"] == "vllm"
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="k", max_retries=0)
        answer = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True
        )
        assert "".join(c.choices[0].delta.content or "" for c in answer if c.choices)
        s = metric_samples(proxy.url)
        assert sample(s, "phasewatch_requests_total", upstream="t", model=MODEL) == 1
    finally:
        proxy.stop()
        upstream.stop()


# --- meaningless settings -------------------------------------------------------------------


@pytest.mark.parametrize(
    "args,needle",
    [
        (
            ["--precision", "m=weird9"],
            "--precision: 'weird9' (for model 'm') is not a precision phasewatch knows",
        ),
        (["--engine", "foo=vllm"], "--engine: no upstream is named 'foo'"),
        (["--engine", "a=foo"], "--engine: 'foo' is not an engine phasewatch knows"),
        (["--upstream-key", "foo=k"], "--upstream-key: no upstream is named 'foo'"),
        (["--power-gpu", "0"], "--power-gpu: '0' is not a GPU=UPSTREAM or GPU=MODEL pair"),
    ],
)
def test_meaningless_settings_are_refused_in_one_line(args, needle):
    line = error_line(run("serve", "--upstream", "a=http://127.0.0.1:1", *args))
    assert line.startswith("phasewatch: error: " + needle.split(":")[0]) and needle in line


def test_known_precisions_and_schemes_are_accepted():
    from proxy.settings import Settings

    for value in ("bf16", "INT4", "Q4_K_M", "q8_0", "AWQ", "GPTQ", "W8A8", "NVFP4", "unknown"):
        Settings(upstream=["http://127.0.0.1:1"], precision=[f"m={value}"])


def test_a_misspelt_variable_is_named_with_the_nearest_setting():
    res = run("serve", env={"PHASEWATCH_UPSTREM": "http://127.0.0.1:8000"})
    (warning,) = [ln for ln in res.stderr.splitlines() if "level=warning" in ln]
    assert "PHASEWATCH_UPSTREM" in warning and "did you mean PHASEWATCH_UPSTREAM?" in warning
    assert "127.0.0.1:8000" not in warning  # names only, never values
    assert "no upstream" in error_line(res)
    # the other commands' variables and the test tier's are no misspellings
    quiet = run("serve", env={"PHASEWATCH_SIM_SPEED": "2", "PHASEWATCH_REAL_ENGINES": "0"})
    assert "level=warning" not in quiet.stderr


def test_a_gpu_mapped_to_a_model_nobody_lists_is_warned_about(sim):
    proxy = start_proxy(
        f"sim={sim.url}",
        args=[
            *("--power-source", "dcgm", "--power-dcgm-url", sim.url + "/metrics"),
            *("--power-gpu", "0=nosuchmodel", "--power-gpu", "1=sim"),
            *("--power-gpu", f"2={MODEL}", "--power-gpu", "3=extra", "--models", "extra"),
        ],
    )
    try:
        deadline = time.monotonic() + 20
        while "--power-gpu" not in proxy.log() and time.monotonic() < deadline:
            time.sleep(0.1)
        lines = [ln for ln in proxy.log().splitlines() if "--power-gpu" in ln]
        assert len(lines) == 1, lines  # the upstream name, the listed and the --models one pass
        assert "level=warning" in lines[0] and "--power-gpu 0=nosuchmodel" in lines[0]
    finally:
        proxy.stop()


def test_a_gpu_mapped_to_a_model_is_resolved_once_the_lists_are_known():
    from types import SimpleNamespace

    def upstream(name):
        u = SimpleNamespace(name=name, models=set(), configured_models=set())
        u.serves = lambda m: m in u.models
        return u

    a, b = upstream("a"), upstream("b")
    ups = [a, b]
    gpus = GpuMap({"0": "m-int4"}, ups, lambda m: next((u for u in ups if u.serves(m)), ups[0]))
    assert gpus.unresolved() == {"0": "m-int4"}
    assert gpus.owners("0")[0].upstream is a  # not listed yet: the first upstream, for now
    b.models.add("m-int4")  # b's list arrives
    assert gpus.unresolved() == {}
    assert gpus.owners("0")[0].upstream is b and gpus.owners("0")[0].model == "m-int4"


# --- ports --------------------------------------------------------------------------------------


@pytest.fixture
def taken():
    s = socket.create_server(("127.0.0.1", 0))
    yield s.getsockname()[1]
    s.close()


@pytest.mark.parametrize(
    "extra,flag",
    [
        ([], "--port"),
        (["--workers", "2"], "--port"),
        (["--metrics-port", "TAKEN"], "--metrics-port"),
        (["--workers", "2", "--metrics-port", "TAKEN"], "--metrics-port"),
    ],
)
def test_a_port_in_use_is_one_line_before_anything_starts(taken, extra, flag):
    port = taken if flag == "--port" else free_port()
    extra = [str(taken) if x == "TAKEN" else x for x in extra]
    res = run("serve", "--upstream", "http://127.0.0.1:1", "--port", str(port), *extra)
    assert error_line(res) == f"phasewatch: error: {flag}: {taken} is in use"
    assert "relaying" not in res.stderr and "worker" not in res.stderr


def test_serve_says_where_its_pages_are(sim):
    port = free_port()
    metrics = free_port()
    proc, log = _spawn(
        ["serve", "--upstream", sim.url, "--port", str(port), "--metrics-port", str(metrics)],
        port,
        "/phasewatch/health",
    )
    try:
        deadline = time.monotonic() + 10
        while "serving on" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        (line,) = [ln for ln in log.read_text().splitlines() if "serving on" in ln]
        base = f"http://127.0.0.1:{port}"
        for where in (
            f"status page {base}/phasewatch/",
            f"metrics http://127.0.0.1:{metrics}/metrics",
            f"API docs {base}/phasewatch/docs",
            f"readiness {base}/phasewatch/ready",
        ):
            assert where in line, where
        assert httpx.get(f"http://127.0.0.1:{metrics}/metrics").status_code == 200
    finally:
        proc.terminate()
        proc.wait(timeout=15)
        log.unlink(missing_ok=True)


def test_demo_says_where_its_pages_are():
    port = free_port()
    res = run("demo", "--port", str(port), "--speed", "20", "--duration", "1", timeout=90)
    assert res.returncode == 0, res.stderr
    (line,) = [ln for ln in res.stderr.splitlines() if "serving on" in ln]
    base = f"http://127.0.0.1:{port}"
    for where in (f"{base}/phasewatch/", f"{base}/metrics", f"{base}/phasewatch/docs"):
        assert where in line, where


def test_demo_port_in_use_is_one_line(taken):
    line = error_line(run("demo", "--port", str(taken)))
    assert line == f"phasewatch: error: --port: {taken} is in use"
