"""Faults injected one by one: hang-ups in every phase, engine faults, access keys, the
metrics address, graceful shutdown, slow readers — and nothing leaks. (Odd request bodies
and the body limit: test_relay_bodies.py.)"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import threading
import time

import httpx
import openai
import pytest

from ...support.fake_engine import FakeEngine, Request, chunk, json_bytes
from ...support.servers import free_port, metric_samples, sample, start_proxy, start_sim

MODEL = "hugging-quants/Llama-3.1-8B-Instruct-AWQ-INT4"
BF16 = "meta-llama/Llama-3.1-8B-Instruct"


def _wait(predicate, timeout=3.0, step=0.01):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if predicate():
            return time.monotonic() - t0
        time.sleep(step)
    raise AssertionError("condition not reached in time")


def _wait_truth(sim, request_id: str, timeout: float = 30.0) -> dict:
    """The engine's record of one request, once written."""
    deadline = time.monotonic() + timeout
    while True:
        for t in sim.truth():
            if t["request_id"] == request_id:
                return t
        assert time.monotonic() < deadline, f"no engine record of {request_id}"
        time.sleep(0.02)


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


# --- a scriptable engine ------------------------------------------------------------------


EVENTS_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)


class ScriptedEngine:
    """What the shared fake engine (:attr:`engine`, listing model "m") does with each
    generation request, set by each test: echo, status, garbage, silence, a firehose, a
    stream without its terminator."""

    def __init__(self) -> None:
        self.mode = "echo"
        self.sent = 0
        self.engine = FakeEngine(models=["m"], script=self.script)

    @property
    def probes(self) -> list[dict]:
        """The headers of the proxy's own model-list calls."""
        return [
            {k.lower(): v for k, v in r.headers}
            for r in self.engine.requests
            if r.target.split("?", 1)[0] == "/v1/models"
        ]

    async def script(self, req: Request, reader, writer) -> None:
        if req.method != "POST":
            writer.write(json_bytes(404, b'{"detail":"Not Found"}'))
            await writer.drain()
            return
        headers = {k.lower(): v for k, v in req.headers}
        mode = self.mode
        if mode == "echo":
            writer.write(json_bytes(200, json.dumps(headers).encode()))
        elif mode == "status500":
            writer.write(json_bytes(500, b'{"error":{"message":"CUDA out of memory","code":500}}'))
        elif mode == "garbage":
            writer.write(json_bytes(200, b"<html>not json \xff\xfe</html>"))
        elif mode == "firehose":
            writer.write(EVENTS_HEAD)
            event = (
                b'data: {"choices":[{"index":0,"delta":{"content":"' + b"x" * 65500 + b'"}}]}\n\n'
            )
            for _ in range(8192):
                writer.write(chunk(event))
                self.sent += len(event)
                await writer.drain()
            writer.write(b"0\r\n\r\n")
        elif mode == "silent":
            await asyncio.sleep(30)
        elif mode == "truncated":
            writer.write(EVENTS_HEAD)
            for i in range(3):
                event = {
                    "id": "x",
                    "object": "chat.completion.chunk",
                    "created": 1,
                    "model": "m",
                    "choices": [
                        {
                            "index": 0,
                            "delta": {"content": f"t{i}"},
                            "finish_reason": "stop" if i == 2 else None,
                        }
                    ],
                }
                writer.write(
                    chunk(b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n")
                )
            writer.write(b"0\r\n\r\n")
        await writer.drain()


@pytest.fixture(scope="module")
def scripted():
    faults = ScriptedEngine()
    with faults.engine as engine:
        yield faults, engine


# --- hang-ups -------------------------------------------------------------------------------


def _hang_up_after(url: str, body: dict, events: int) -> float:
    """Stream, read `events` SSE events (0: none, not even the headers), hang up; returns
    the monotonic hang-up time."""
    if not events:
        host, port = url.rsplit("/", 1)[1].split(":")
        payload = json.dumps(body).encode()
        with socket.create_connection((host, int(port))) as s:
            s.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                b"application/json\r\ncontent-length: "
                + str(len(payload)).encode()
                + b"\r\n\r\n"
                + payload
            )
            time.sleep(0.3)
            t = time.monotonic()
        return t
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as resp:
        seen = 0
        for chunk in resp.iter_raw():
            seen += chunk.count(b"\n\n")
            if seen >= events:
                break
        t = time.monotonic()
    return t


def test_hang_up_in_prefill_and_decode_cancels_the_engine():
    sim = start_sim("vllm", speed=1.0)
    proxy = start_proxy(f"sim={sim.url}")
    try:
        # prefill: a 12K-token prompt takes ~2.6 s to prefill on the simulated GPU
        body = {
            "model": BF16,
            "messages": [{"role": "user", "content": "w " * 12000}],
            "max_tokens": 50,
            "stream": True,
        }
        t_hang = _hang_up_after(proxy.url, body, 0)
        _wait(lambda: len(sim.truth()) == 1)
        truth = sim.truth()[-1]
        assert truth["aborted"] and truth["t_first"] is None
        prefill_cancel = truth["t_end"] - t_hang
        # decode
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 2000,
            "stream": True,
            "ignore_eos": True,
        }
        t_hang = _hang_up_after(proxy.url, body, 5)
        _wait(lambda: len(sim.truth()) == 2)
        truth = sim.truth()[-1]
        assert truth["aborted"] and 0 < truth["completion_tokens"] < 100
        decode_cancel = truth["t_end"] - t_hang
        print(
            f"engine cancelled {prefill_cancel * 1e3:.1f} ms after a hang-up in prefill, "
            f"{decode_cancel * 1e3:.1f} ms in decode"
        )
        # how fast is a benchmark figure (printed above); what the engine's own record shows
        # is the contract: no first token after a hang-up in prefill, and a decode cut off a
        # few tokens after the client left, not run to its 2,000
        time.sleep(0.2)
        s = metric_samples(proxy.url)
        assert sample(s, "phasewatch_aborts_total", phase="prefill") == 1
        assert sample(s, "phasewatch_aborts_total", phase="decode") == 1
        assert sample(s, "phasewatch_requests_total", outcome="aborted") == 2
        assert sample(metric_samples(sim.url), "vllm:num_requests_running") == 0
    finally:
        proxy.stop()
        sim.stop()


def test_hang_up_while_queued():
    """(The hang-ups while usage is awaited and after [DONE] are the relay's alone:
    test_relay_endings.py.)"""
    sim = start_sim("vllm", speed=1.0)
    proxy = start_proxy(f"sim={sim.url}", args=["--max-concurrency", "1"])
    try:
        long = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 300,
            "stream": True,
            "ignore_eos": True,
        }
        holder = threading.Thread(
            target=lambda: httpx.post(proxy.url + "/v1/chat/completions", json=long, timeout=30)
        )
        holder.start()
        _wait(
            lambda: sample(metric_samples(proxy.url), "phasewatch_in_flight_requests") == 1,
            timeout=30,
        )
        _hang_up_after(proxy.url, long, 0)  # waits in the proxy's queue, then hangs up
        holder.join()
        _wait(
            lambda: sample(metric_samples(proxy.url), "phasewatch_aborts_total", phase="queue") == 1
        )
        assert sample(metric_samples(proxy.url), "phasewatch_queued_requests") == 0
    finally:
        proxy.stop()
        sim.stop()


def test_a_thousand_aborted_streams_leak_nothing():
    sim = start_sim("vllm", speed=50.0, max_num_seqs=64)
    proxy = start_proxy(f"sim={sim.url}", args=["--log-format", "none"])
    try:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 30000,
            "stream": True,
            "ignore_eos": True,
        }

        async def abort_one(client):
            async with client.stream("POST", proxy.url + "/v1/chat/completions", json=body) as resp:
                async for chunk in resp.aiter_raw():
                    if b"content" in chunk:
                        break

        async def main():
            for _ in range(20):
                async with httpx.AsyncClient(timeout=30) as client:
                    await asyncio.gather(*(abort_one(client) for _ in range(50)))

        httpx.post(
            proxy.url + "/v1/chat/completions", json={**body, "max_tokens": 3}
        ).raise_for_status()
        fds_before = _fds(proxy.proc.pid)
        tasks_before = httpx.get(proxy.url + "/phasewatch/debug").json()["tasks"]
        asyncio.run(main())
        _wait(
            lambda: sample(metric_samples(proxy.url), "phasewatch_in_flight_requests") == 0,
            timeout=10,
        )
        _wait(lambda: sample(metric_samples(sim.url), "vllm:num_requests_running") == 0, timeout=10)
        s = metric_samples(proxy.url)
        assert sample(s, "phasewatch_requests_total", outcome="aborted") == 1000
        engine = metric_samples(sim.url)
        aborted = sample(engine, "phasewatch_sim_aborted_requests_total")
        finished = sample(engine, "phasewatch_sim_finished_requests_total")
        # the engine's own record of any request it did not see aborted says which way it
        # went (finished: the proxy kept the upstream open; neither: the engine missed it)
        unaborted = [
            {k: t.get(k) for k in ("request_id", "completion_tokens", "t_recv", "t_end")}
            for t in sim.truth()
            if not t["aborted"] and t["completion_tokens"] != 3
        ]
        assert aborted == 1000, (aborted, finished, unaborted[:5])
        state = httpx.get(proxy.url + "/phasewatch/debug").json()
        assert state["busy"] == 0
        # the server's own background tasks as before the aborts (a probe or a scan may be
        # running at either moment), no per-request leftovers
        assert state["tasks"] <= tasks_before + 2, (tasks_before, state)
        # every upstream connection of an aborted stream was closed, not pooled or leaked
        _wait(lambda: _fds(proxy.proc.pid) <= fds_before + 2, timeout=5)
    finally:
        proxy.stop()
        sim.stop()


# --- engine faults -----------------------------------------------------------------------


def test_engine_faults_give_clear_errors_and_the_proxy_keeps_serving(scripted):
    engine, server = scripted
    proxy = start_proxy(f"scripted={server.url}", args=["--read-timeout", "0.5"])
    dns = start_proxy("nowhere=http://phasewatch-test.invalid:8000")
    try:
        url = proxy.url + "/v1/chat/completions"
        body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
        engine.mode = "status500"  # the engine's own error bytes pass through
        r = httpx.post(url, json=body)
        assert (
            r.status_code == 500
            and r.content == b'{"error":{"message":"CUDA out of memory","code":500}}'
        )
        engine.mode = "garbage"
        r = httpx.post(url, json=body)
        assert r.status_code == 200 and r.content == b"<html>not json \xff\xfe</html>"
        engine.mode = "silent"
        r = httpx.post(url, json=body)
        assert r.status_code == 504 and "did not answer in time" in r.json()["error"]["message"]
        engine.mode = "truncated"
        r = httpx.post(url, json={**body, "stream": True})
        last = json.loads(r.content.split(b"\n\n")[-2][len(b"data: ") :])
        assert "without its terminator" in last["error"]["message"]
        r = httpx.post(dns.url + "/v1/chat/completions", json=body)
        assert r.status_code == 502 and "phasewatch-test.invalid" in r.json()["error"]["message"]
        engine.mode = "echo"
        assert httpx.post(url, json=body).status_code == 200  # still serving
        s = metric_samples(proxy.url)
        assert sample(s, "phasewatch_errors_total", kind="upstream_status") == 1
        assert sample(s, "phasewatch_errors_total", kind="protocol") == 1
        assert sample(s, "phasewatch_errors_total", kind="timeout") == 1
        assert sample(s, "phasewatch_errors_total", kind="truncated") == 1
        assert sample(metric_samples(dns.url), "phasewatch_errors_total", kind="connect") == 1
    finally:
        engine.mode = "echo"
        proxy.stop()
        dns.stop()


# --- access ---------------------------------------------------------------------------------


def test_proxy_keys_and_engine_keys(scripted):
    engine, server = scripted
    engine.mode = "echo"
    env = {
        "PHASEWATCH_API_KEY": "pw-key-1,pw-key-2",
        "PHASEWATCH_UPSTREAM_KEY": "eng=sk-engine-secret",
    }
    proxy = start_proxy(f"eng={server.url}", env=env)
    open_proxy = start_proxy(f"eng={server.url}")
    try:
        url = proxy.url + "/v1/chat/completions"
        body = {"model": "m", "messages": []}
        r = httpx.post(url, json=body)
        assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")
        assert (
            httpx.post(url, json=body, headers={"authorization": "Bearer wrong"}).status_code == 401
        )
        r = httpx.post(url, json=body, headers={"authorization": "Bearer pw-key-2"})
        assert r.status_code == 200
        assert r.json()["authorization"] == "Bearer sk-engine-secret"  # engine key, not ours
        r = httpx.post(url, json=body, headers={"x-api-key": "pw-key-1"})
        assert (
            r.json()["authorization"] == "Bearer sk-engine-secret" and "x-api-key" not in r.json()
        )
        # the openai SDK sends its api_key as a Bearer token: a phasewatch key works as is
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="pw-key-1", max_retries=0)
        client.models.list()
        # the proxy's own calls to the engine (model lists) carry the engine key too
        assert any(p.get("authorization") == "Bearer sk-engine-secret" for p in engine.probes)
        # with no keys configured, the client's own Authorization reaches the engine
        r = httpx.post(
            open_proxy.url + "/v1/chat/completions",
            json=body,
            headers={"authorization": "Bearer client-own"},
        )
        assert r.json()["authorization"] == "Bearer client-own"
        # secrets appear in no log line and no metric
        exported = httpx.get(proxy.url + "/metrics", headers={"x-api-key": "pw-key-1"}).text
        for secret in ("pw-key-1", "pw-key-2", "sk-engine-secret"):
            assert secret not in proxy.log() and secret not in exported
    finally:
        proxy.stop()
        open_proxy.stop()


def test_no_prompt_or_completion_text_in_logs_or_metrics():
    sim = start_sim("vllm", speed=20.0, deterministic=True)
    proxy = start_proxy(f"sim={sim.url}", args=["--log-level", "debug"])
    try:
        secret_prompt = "zebra-quartz-prompt-marker"
        r = httpx.post(
            proxy.url + "/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": secret_prompt}],
                "max_tokens": 12,
                "stream": True,
            },
            headers={"x-request-id": "req-42"},
        )
        words = [
            json.loads(e[6:])["choices"][0]["delta"].get("content", "")
            for e in r.content.split(b"\n\n")
            if e.startswith(b"data: {")
        ]
        completion = "".join(words).strip()
        text = proxy.log() + httpx.get(proxy.url + "/metrics").text
        assert secret_prompt not in text
        assert completion and completion not in text
        assert "request_id=req-42" in proxy.log()  # the client's request id is logged...
        truth = _wait_truth(sim, "req-42")
        assert truth["request_id"] == "req-42"  # ...and propagated to the engine
    finally:
        proxy.stop()
        sim.stop()


def test_metrics_on_their_own_port():
    sim = start_sim("vllm", speed=20.0)
    mport = free_port()
    proxy = start_proxy(f"sim={sim.url}", args=["--metrics-port", str(mport)])
    try:
        own = httpx.get(f"http://127.0.0.1:{mport}/metrics").text
        assert "phasewatch_requests_total" in own or "phasewatch_upstream_up" in own
        relayed = httpx.get(proxy.url + "/metrics").text  # now the engine's own /metrics
        assert "vllm:num_requests_running" in relayed and "phasewatch_upstream_up" not in relayed
        proxy.stop()
        # the metrics server shares uvicorn's logger: its own start and stop lines would
        # read as the proxy starting twice, so each lifecycle line is there once
        lines = [ln for ln in proxy.log().splitlines() if "logger=uvicorn.error" in ln]
        for text in ("Started server process", "Shutting down", "Finished server process"):
            assert sum(text in ln for ln in lines) == 1, (text, lines)
    finally:
        proxy.stop()
        sim.stop()


# --- shutdown -------------------------------------------------------------------------------


def test_sigterm_drains_in_flight_streams_and_refuses_new_ones():
    sim = start_sim("vllm", speed=1.0)
    proxy = start_proxy(f"sim={sim.url}", args=["--shutdown-grace", "20"])
    try:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 200,
            "stream": True,
            "ignore_eos": True,
        }
        result = {}

        def stream():
            r = httpx.post(proxy.url + "/v1/chat/completions", json=body, timeout=30)
            result["body"] = r.content

        t = threading.Thread(target=stream)
        t.start()
        _wait(
            lambda: sample(metric_samples(proxy.url), "phasewatch_in_flight_requests") == 1,
            timeout=30,
        )
        proxy.proc.send_signal(signal.SIGTERM)
        _wait(lambda: httpx.get(proxy.url + "/phasewatch/health").json()["draining"], timeout=30)
        r = httpx.post(proxy.url + "/v1/chat/completions", json=body)
        assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
        # readiness says "send no more" (load balancers move on); liveness stays 200, so an
        # orchestrator does not kill the process while it drains
        assert httpx.get(proxy.url + "/phasewatch/ready").status_code == 503
        health = httpx.get(proxy.url + "/phasewatch/health")
        assert health.status_code == 200 and health.json()["draining"] is True
        t.join(timeout=20)
        assert result["body"].endswith(b"data: [DONE]\n\n")  # the in-flight stream completed
        assert result["body"].count(b'"content":"') >= 200
        proxy.proc.wait(timeout=10)  # then the proxy exits by itself
    finally:
        proxy.stop()
        sim.stop()


# --- slow readers -----------------------------------------------------------------------------


def _rss_mib(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def test_stalled_readers_push_back_to_the_engine(scripted):
    """A client that stops reading must stop the engine, not grow the proxy's memory.

    The engine here is a firehose of 64 KiB events (512 MiB in all). With backpressure
    its writes block once the kernel's socket buffers are full; without it the proxy
    would read everything into memory."""
    engine, server = scripted
    engine.mode = "firehose"
    engine.sent = 0
    proxy = start_proxy(f"scripted={server.url}", args=["--log-format", "none"])
    socks = []
    try:
        rss_before = _rss_mib(proxy.proc.pid)
        port = int(proxy.url.rsplit(":", 1)[1])
        payload = json.dumps({"model": "m", "messages": [], "stream": True}).encode()
        for _ in range(2):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect(("127.0.0.1", port))
            s.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                b"content-length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload
            )
            socks.append(s)  # and never read

        def stalled():
            a = engine.sent
            time.sleep(1.0)
            return engine.sent == a and a > 0

        _wait(stalled, timeout=60, step=0.1)
        growth = _rss_mib(proxy.proc.pid) - rss_before
        print(
            f"engine held back after {engine.sent / 2**20:.1f} MiB of 1024 MiB; "
            f"proxy RSS grew {growth:.1f} MiB"
        )
        assert engine.sent < 128 * 2**20  # kernel socket buffers, not the whole stream
        assert growth < 32
    finally:
        for s in socks:
            s.close()
        proxy.stop()
        engine.mode = "echo"


async def endless_metrics(req: Request, reader, writer) -> None:
    """A /metrics page that never ends (~450 MiB): the proxy's scrape must stop reading it."""
    writer.write(
        b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    line = b'vllm:num_requests_running{model_name="m"} 1.0\n' * 20000
    for _ in range(512):
        writer.write(chunk(line))
        await writer.drain()
    writer.write(b"0\r\n\r\n")
    await writer.drain()


def test_a_huge_engine_metrics_page_is_not_read_whole():
    server = FakeEngine(
        models=["m"],
        script=endless_metrics,
        script_takes=lambda req: req.target.split("?", 1)[0] == "/metrics",
    ).start()
    proxy = start_proxy(
        f"huge={server.url}", args=["--engine", "huge=vllm", "--engine-scrape", "0.5"]
    )
    try:
        time.sleep(3)
        s = metric_samples(proxy.url)
        assert sample(s, "phasewatch_engine_scrape_up", upstream="huge") == 0
        assert _rss_mib(proxy.proc.pid) < 200
    finally:
        proxy.stop()
        server.stop()
