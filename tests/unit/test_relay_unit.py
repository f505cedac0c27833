"""The relay without subprocesses: its upstream transport injected (``httpx.MockTransport``
through ``ClientOptions.transport``), the ASGI app called directly. What the engine gets,
what the client gets, and what is counted, for the cases the transport can make."""

from __future__ import annotations

import asyncio
import json

import httpx

from proxy.core import Relay, RelayOptions
from proxy.fleet import Upstream, UpstreamOptions, Upstreams, UpstreamSpec
from proxy.measure.metrics import Metrics
from proxy.measure.recorder import Recorder
from proxy.transport import ClientOptions


def relay_with(handler, engine: str = "vllm") -> tuple[Relay, Metrics]:
    metrics = Metrics()
    options = UpstreamOptions(client=ClientOptions(transport=httpx.MockTransport(handler)))
    upstream = Upstream(UpstreamSpec("eng", "http://engine.test", engine=engine), options, metrics)
    upstream.models = {"m"}
    upstreams = Upstreams([upstream])
    upstreams.probed = True
    options = RelayOptions(inject_usage=True, max_body_bytes=1 << 20)
    relay = Relay(upstreams, Recorder(metrics, access_lines=False), options)
    return relay, metrics


async def call(relay: Relay, method: str, path: str, body: bytes = b"", headers=()) -> list[dict]:
    """One request through the ASGI app; the messages it sent back."""
    scope = {
        "type": "http",
        "method": method,
        "path": path.split("?")[0],
        "raw_path": path.split("?")[0].encode(),
        "query_string": path.partition("?")[2].encode(),
        "headers": [(k.encode(), v.encode()) for k, v in headers],
    }
    sent: list[dict] = []
    first = True

    async def receive() -> dict:
        nonlocal first
        if first:
            first = False
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # the client stays connected
        return {}

    async def send(msg: dict) -> None:
        sent.append(msg)

    await relay(scope, receive, send)
    return sent


async def streamed(*parts: bytes):
    """A response body as a transport gives it: streamed, not read in advance (a Response
    built from bytes counts as consumed, and the relay streams every body)."""
    for part in parts:
        yield part


def body_of(sent: list[dict]) -> bytes:
    return b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def count(metrics: Metrics, name: str, **labels) -> float:
    total = 0.0
    for family in metrics.registry.collect():
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


CHAT = json.dumps(
    {"model": "m", "stream": True, "stream_options": {"include_usage": True}, "messages": []}
).encode()
EVENTS = [
    b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n',
    b'data: {"choices":[{"index":0,"delta":{"content":"Hi"}}]}\n\n',
    b'data: {"choices":[{"index":0,"delta":{"content":" there"},"finish_reason":"stop"}]}\n\n',
    b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2,"total_tokens":7}}\n\n',
    b"data: [DONE]\n\n",
]


async def test_exactly_the_clients_end_to_end_headers_reach_the_engine():
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, content=streamed(b'{"ok": true}'))

    relay, _ = relay_with(handler)
    headers = [
        ("host", "proxy.test"),
        ("content-type", "application/json"),
        ("connection", "keep-alive, x-hop"),
        ("x-hop", "dropped"),
        ("x-custom", "kept"),
        ("content-length", "2"),
    ]
    sent = await call(relay, "POST", "/v1/embeddings?a=%20b", b"{}", headers)
    assert sent[0]["status"] == 200
    (req,) = seen
    assert req.headers.raw == [
        (b"Host", b"engine.test"),
        (b"content-type", b"application/json"),
        (b"x-custom", b"kept"),
        (b"Content-Length", b"2"),
    ]
    assert req.url.raw_path == b"/v1/embeddings?a=%20b"
    assert req.content == b"{}"


async def test_a_stream_is_relayed_byte_exact_and_measured():
    def handler(request: httpx.Request) -> httpx.Response:
        async def events():
            for e in EVENTS:
                yield e

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=events())

    relay, metrics = relay_with(handler)
    sent = await call(relay, "POST", "/v1/chat/completions", CHAT)
    assert sent[0]["status"] == 200
    assert body_of(sent) == b"".join(EVENTS)
    assert count(metrics, "phasewatch_ttft_seconds_count") == 1
    assert count(metrics, "phasewatch_requests_total", outcome="ok") == 1


async def test_an_engine_failing_mid_stream_ends_it_with_an_error_event():
    def handler(request: httpx.Request) -> httpx.Response:
        async def events():
            yield EVENTS[0]
            yield EVENTS[1]
            raise httpx.RemoteProtocolError("upstream closed the connection")

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=events())

    relay, metrics = relay_with(handler)
    sent = await call(relay, "POST", "/v1/chat/completions", CHAT)
    data = body_of(sent)
    assert data.startswith(EVENTS[0] + EVENTS[1])
    last = data[len(EVENTS[0] + EVENTS[1]) :]
    assert last.startswith(b"data: ") and b'"error"' in last and last.endswith(b"\n\n")
    assert json.loads(last[len(b"data: ") :])["error"]["message"]
    assert sent[-1]["more_body"] is False
    assert count(metrics, "phasewatch_requests_total", outcome="error") == 1
    assert count(metrics, "phasewatch_errors_total", kind="midstream") == 1


async def test_a_plain_body_cut_short_is_left_cut():
    def handler(request: httpx.Request) -> httpx.Response:
        async def parts():
            yield b"x" * 3000
            raise httpx.ReadError("connection reset")

        return httpx.Response(200, headers={"content-length": "10221"}, content=parts())

    relay, _ = relay_with(handler)
    sent = await call(relay, "GET", "/files/big")
    assert sent[0]["status"] == 200
    assert body_of(sent) == b"x" * 3000
    # never a final message: the server closes the connection and the client sees it cut
    assert all(m.get("more_body", True) for m in sent if m["type"] == "http.response.body")


async def test_upstream_failures_map_to_clear_answers():
    cases = [
        (httpx.ConnectError("refused"), 502, "connect"),
        (httpx.ConnectTimeout("slow"), 504, "timeout"),
        (httpx.ReadTimeout("silent"), 504, "timeout"),
        (httpx.PoolTimeout("busy"), 503, "pool"),
        (httpx.RemoteProtocolError("head over 65536 bytes"), 502, "protocol"),
    ]
    for exc, status, kind in cases:

        def handler(request: httpx.Request, exc=exc) -> httpx.Response:
            raise exc

        relay, metrics = relay_with(handler)
        sent = await call(relay, "POST", "/v1/chat/completions", CHAT)
        assert sent[0]["status"] == status, exc
        error = json.loads(body_of(sent))["error"]
        assert error["type"] == kind and str(exc) in error["message"]
        assert count(metrics, "phasewatch_errors_total", kind=kind) == 1


async def test_a_protocol_switch_is_not_relayed():
    closed = []

    def handler(request: httpx.Request) -> httpx.Response:
        async def nothing():
            try:
                yield b""
            finally:
                closed.append(True)

        return httpx.Response(101, headers={"upgrade": "websocket"}, content=nothing())

    relay, _ = relay_with(handler)
    sent = await call(relay, "GET", "/ws", headers=[("upgrade", "websocket")])
    assert sent[0]["status"] == 502
    assert "101" in json.loads(body_of(sent))["error"]["message"]
