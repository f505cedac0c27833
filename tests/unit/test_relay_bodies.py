"""Request bodies through the relay, in process (no socket is needed to see them): a body
no parser expects reaches the engine as the client sent it, and the body limit is a 413
whether the length is declared or only found while reading, with nothing sent upstream."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from proxy.core import Relay, RelayOptions
from proxy.fleet import Upstream, UpstreamOptions, Upstreams, UpstreamSpec
from proxy.measure.metrics import Metrics
from proxy.measure.recorder import Recorder
from proxy.transport import ClientOptions

from .test_relay_unit import body_of, count, streamed


def relay_seeing(seen: list[httpx.Request], **options) -> tuple[Relay, Metrics]:
    """A relay in front of one engine ("openai", model "m") that records each request it
    is sent and answers 200."""

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, content=streamed(b'{"ok":true}'))

    metrics = Metrics()
    upstream_options = UpstreamOptions(client=ClientOptions(transport=httpx.MockTransport(handler)))
    upstream = Upstream(
        UpstreamSpec("eng", "http://engine.test", engine="openai"), upstream_options, metrics
    )
    upstream.models = {"m"}
    upstreams = Upstreams([upstream])
    upstreams.probed = True
    relay = Relay(upstreams, Recorder(metrics, access_lines=False), RelayOptions(**options))
    return relay, metrics


async def post(relay: Relay, pieces: list[bytes], headers: list[tuple[str, str]]) -> list[dict]:
    """POST /v1/chat/completions with the body in `pieces` (one ASGI message each)."""
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/chat/completions",
        "raw_path": b"/v1/chat/completions",
        "query_string": b"",
        "headers": [(k.encode(), v.encode()) for k, v in headers],
    }
    messages = [
        {"type": "http.request", "body": p, "more_body": i < len(pieces) - 1}
        for i, p in enumerate(pieces)
    ]
    sent: list[dict] = []

    async def receive() -> dict:
        if messages:
            return messages.pop(0)
        await asyncio.Event().wait()  # the client stays connected
        return {}

    async def send(msg: dict) -> None:
        sent.append(msg)

    await relay(scope, receive, send)
    return sent


@pytest.mark.parametrize(
    "body",
    [
        b"not json at all",
        b"[" * 100000 + b"]" * 100000,  # deeper than any JSON parser recurses
        b'{"model": 5, "stream": "yes", "stream_options": [1], "messages": {}}',
        b'{"model": null, "stream": true, "stream_options": "x"}',
        b'{"model": "m", "stream": 1}',
        b'{"model": "m", "stream": true, "stream_options": null}',
        '{"model": "m\u0000\ud83d\ude00", "stream": false}'.encode("utf-8", "surrogatepass"),
        b"\xff\xfe\x00garbage",
    ],
)
async def test_odd_bodies_reach_the_engine_unaltered(body):
    seen: list[httpx.Request] = []
    relay, _ = relay_seeing(seen)
    headers = [("content-type", "application/json"), ("content-length", str(len(body)))]
    sent = await post(relay, [body], headers)
    assert sent[0]["status"] == 200
    (request,) = seen
    assert request.content == body


async def test_body_limit_is_a_413():
    seen: list[httpx.Request] = []
    relay, metrics = relay_seeing(seen, max_body_bytes=1000)
    sent = await post(relay, [b"x" * 1001], [("content-length", "1001")])
    assert sent[0]["status"] == 413
    assert "1000 bytes" in json.loads(body_of(sent))["error"]["message"]
    # no content-length: the limit still holds while reading
    sent = await post(relay, [b"y" * 100] * 20, [("transfer-encoding", "chunked")])
    assert sent[0]["status"] == 413
    assert seen == []  # nothing reached the engine
    assert count(metrics, "phasewatch_rejected_total", reason="body_too_large") == 2
