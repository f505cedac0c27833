"""The transport through the real proxy (``phasewatch serve`` on loopback) with raw-socket
fake engines: an HTTPS engine behind a private CA (a stream byte-exact, its figures
recorded), an engine that dies mid-answer, and the TLS settings at start."""

from __future__ import annotations

import json
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import trustme

from ...support.fake_engine import FakeEngine, Reply, Request, response
from ...support.servers import ROOT, free_port, metric_samples, sample, start_proxy
from ..relay.test_relay_unit import EVENTS


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    ca = trustme.CA()
    d = tmp_path_factory.mktemp("tls")
    ca.cert_pem.write_to_path(str(d / "ca.pem"))
    cert = ca.issue_cert("localhost", "127.0.0.1")
    cert.cert_chain_pems[0].write_to_path(str(d / "cert.pem"))
    cert.private_key_pem.write_to_path(str(d / "key.pem"))
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    cert.configure_cert(ctx)
    return {"ca": str(d / "ca.pem"), "server": ctx, "cert": str(d / "cert.pem"),
            "key": str(d / "key.pem")}  # fmt: skip


def test_the_simulator_over_https_with_a_private_ca(tls):
    """The simulated vLLM behind TLS: detected, streamed byte-exact (the proxy's usage
    injection included), and its figures agree with the engine's own truth."""
    port = free_port()
    truth_log = Path(tempfile.mkstemp(prefix="pw-tls-truth-", suffix=".jsonl")[1])
    log = Path(tempfile.mkstemp(prefix="pw-tls-sim-", suffix=".log")[1])
    args = [tls["cert"], tls["key"], str(port), "--engine", "vllm", "--speed", "4"]
    args += ["--deterministic", "--jitter", "0", "--truth-log", str(truth_log)]
    sim = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "support" / "tls_sim.py"), *args],
        cwd=ROOT,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    verify = ssl.create_default_context(cafile=tls["ca"])
    url = f"https://localhost:{port}"
    proxy = None
    try:
        deadline = time.monotonic() + 30
        while True:
            assert sim.poll() is None, log.read_text()
            try:
                if httpx.get(url + "/health", verify=verify, timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        proxy = start_proxy(f"sim={url}", args=["--upstream-ca", tls["ca"]])
        model = httpx.get(proxy.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        body = {
            "model": model,
            "stream": True,
            "max_tokens": 40,
            "messages": [{"role": "user", "content": "tell me about TLS"}],
        }
        direct = httpx.post(url + "/v1/chat/completions", json=body, verify=verify, timeout=30)
        relayed = httpx.post(proxy.url + "/v1/chat/completions", json=body, timeout=30)
        assert relayed.status_code == 200
        assert relayed.content == direct.content  # usage asked for upstream, stripped again
        (line,) = _lines(proxy, "sim")
        truth = json.loads(truth_log.read_text().splitlines()[-1])
        assert int(line["completion_tokens"]) == truth["completion_tokens"] > 1
        assert int(line["prompt_tokens"]) == truth["prompt_tokens"]
        assert abs(float(line["decode_tps"]) / truth["decode_tokens_per_second"] - 1) < 0.05
        samples = metric_samples(proxy.url)
        assert sample(samples, "phasewatch_upstream_up", upstream="sim", engine="vllm") == 1
        print(
            f"TLS engine figures: ttft {float(line['ttft_s']) * 1e3:.1f} ms, decode "
            f"{float(line['decode_tps']):.1f} tok/s (engine truth "
            f"{truth['decode_tokens_per_second']:.1f}), prefill {line['prefill_tps']} tok/s"
        )
    finally:
        if proxy is not None:
            proxy.stop()
        sim.terminate()
        sim.wait(15)
        truth_log.unlink(missing_ok=True)
        log.unlink(missing_ok=True)


def _lines(proxy, upstream: str, n: int = 1, timeout: float = 10.0) -> list[dict]:
    """The proxy's request log lines for `upstream`, once `n` are written."""
    deadline = time.monotonic() + timeout
    while True:
        lines = [r for r in proxy.request_lines() if r.get("upstream") == upstream]
        if len(lines) >= n or time.monotonic() > deadline:
            return lines
        time.sleep(0.05)


def stream_reply(req: Request) -> Reply | None:
    if req.method == "POST" and req.target == "/v1/chat/completions":
        data = b"".join(EVENTS)
        return Reply(response(200, data, [("Content-Type", "text/event-stream")], chunked=True))
    return None  # the engine's standard answer


CHAT = {
    "model": "fake-model",
    "stream": True,
    "stream_options": {"include_usage": True},
    "messages": [{"role": "user", "content": "hi"}],
}


def test_https_engine_with_a_private_ca_end_to_end(tls):
    with FakeEngine(stream_reply, ssl_context=tls["server"]) as engine:
        direct = httpx.post(
            engine.url + "/v1/chat/completions", json=CHAT, verify=ssl.create_default_context(
                cafile=tls["ca"]
            ), timeout=10
        ).content  # fmt: skip
        proxy = start_proxy(
            f"eng={engine.url}",
            args=["--engine", "eng=vllm", "--upstream-ca", tls["ca"]],
        )
        try:
            with httpx.stream(
                "POST", proxy.url + "/v1/chat/completions", json=CHAT, timeout=10
            ) as resp:
                assert resp.status_code == 200
                relayed = b"".join(resp.iter_raw())
            assert relayed == direct == b"".join(EVENTS)
            (line,) = _lines(proxy, "eng")
            samples = metric_samples(proxy.url)
            assert sample(samples, "phasewatch_ttft_seconds_count", upstream="eng") == 1
            assert sample(samples, "phasewatch_requests_total", upstream="eng", outcome="ok") == 1
            assert line["outcome"] == "ok" and float(line["ttft_s"]) > 0
            assert (line["prompt_tokens"], line["completion_tokens"]) == ("5", "2")
        finally:
            proxy.stop()


def test_an_untrusted_engine_is_a_clear_502_and_insecure_is_warned(tls):
    with FakeEngine(stream_reply, ssl_context=tls["server"]) as engine:
        proxy = start_proxy(f"eng={engine.url}", args=["--engine", "eng=vllm"])
        try:
            resp = httpx.post(proxy.url + "/v1/chat/completions", json=CHAT, timeout=10)
            assert resp.status_code == 502
            assert "unreachable" in resp.json()["error"]["message"]
        finally:
            proxy.stop()
        proxy = start_proxy(
            f"eng={engine.url}", args=["--engine", "eng=vllm", "--upstream-insecure", "eng"]
        )
        try:
            resp = httpx.post(proxy.url + "/v1/chat/completions", json=CHAT, timeout=10)
            assert resp.content == b"".join(EVENTS)
            assert "verification is off" in proxy.log()
        finally:
            proxy.stop()


def test_an_engine_dying_mid_answer_is_an_error_never_a_short_success():
    def answer(req: Request) -> Reply | None:
        if req.target == "/v1/chat/completions":  # close-delimited, then a reset
            head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n"
            return Reply(head + EVENTS[0] + EVENTS[1], then="reset")
        if req.target == "/files/big":
            return Reply(response(200, b"x" * 3000, length=10221), then="reset")
        return None  # the engine's standard answer

    with FakeEngine(answer) as engine:
        proxy = start_proxy(f"eng={engine.url}", args=["--engine", "eng=vllm"])
        try:
            resp = httpx.post(proxy.url + "/v1/chat/completions", json=CHAT, timeout=10)
            assert resp.status_code == 200
            assert resp.content.startswith(EVENTS[0] + EVENTS[1])
            tail = resp.content[len(EVENTS[0] + EVENTS[1]) :]
            assert json.loads(tail.removeprefix(b"data: "))["error"]["message"]
            samples = metric_samples(proxy.url)
            assert sample(samples, "phasewatch_errors_total", upstream="eng", kind="midstream") == 1
            assert sample(samples, "phasewatch_requests_total", outcome="error") == 1
            with pytest.raises(httpx.RemoteProtocolError):
                httpx.get(proxy.url + "/files/big", timeout=10)
        finally:
            proxy.stop()


def test_bad_tls_settings_stop_start_up_with_one_line(tmp_path):
    missing = tmp_path / "missing.pem"
    bad = tmp_path / "bad.pem"
    bad.write_text("not a certificate")
    for flag, value, expect in [
        ("--upstream-ca", str(missing), "is not a readable file"),
        ("--upstream-ca", str(bad), "upstream TLS files"),
        ("--upstream-insecure", "nobody", "no upstream is named 'nobody'"),
    ]:
        out = subprocess.run(
            [sys.executable, "-m", "proxy", "serve", "--upstream", "a=https://127.0.0.1:1"]
            + [flag, value],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode != 0
        lines = [line for line in out.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and expect in lines[0], out.stderr
