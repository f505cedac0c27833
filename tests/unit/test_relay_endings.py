"""How a stream's ending is counted when the client leaves near its end, in process (the
relay alone decides it; no socket is needed): leaving once ``[DONE]`` is out is no abort,
while leaving as phasewatch holds the finish event for the usage it asked for is an abort
in the usage phase, and the engine's response is closed."""

from __future__ import annotations

import asyncio
import json

import httpx

from proxy.core import Relay, RelayOptions
from proxy.fleet import Upstream, UpstreamOptions, Upstreams, UpstreamSpec
from proxy.measure.metrics import Metrics
from proxy.measure.recorder import Recorder
from proxy.transport import ClientOptions

from .test_relay_unit import count

#: The client asks for no usage: phasewatch asks the engine for it (inject_usage).
BODY = json.dumps({"model": "m", "messages": [], "stream": True}).encode()


def events(n: int = 3) -> list[bytes]:
    """`n` compact token events, the last with finish_reason "stop"."""
    out = []
    for i in range(n):
        event = {
            "id": "x",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "m",
            "choices": [
                {
                    "index": 0,
                    "delta": {"content": f"t{i}"},
                    "finish_reason": "stop" if i == n - 1 else None,
                }
            ],
        }
        out.append(b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n")
    return out


def relay_streaming(body) -> tuple[Relay, Metrics]:
    """A relay in front of one engine (generic OpenAI, model "m") streaming `body()`."""

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body())

    metrics = Metrics()
    options = UpstreamOptions(client=ClientOptions(transport=httpx.MockTransport(handler)))
    upstream = Upstream(
        UpstreamSpec("eng", "http://engine.test", engine="openai"), options, metrics
    )
    upstream.models = {"m"}
    upstreams = Upstreams([upstream])
    upstreams.probed = True
    relay = Relay(
        upstreams,
        Recorder(metrics, access_lines=False),
        RelayOptions(inject_usage=True, max_body_bytes=1 << 20),
    )
    return relay, metrics


async def stream_until(relay: Relay, enough) -> bytes:
    """A streamed chat whose client hangs up once `enough(received bytes)` holds."""
    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions",
             "raw_path": b"/v1/chat/completions", "query_string": b"", "headers": []}  # fmt: skip
    got = b""
    gone = asyncio.Event()
    first = True

    async def receive() -> dict:
        nonlocal first
        if first:
            first = False
            return {"type": "http.request", "body": BODY, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(msg: dict) -> None:
        nonlocal got
        got += msg.get("body", b"")
        if enough(got):
            gone.set()

    await asyncio.wait_for(relay(scope, receive, send), 10)
    return got


async def test_leaving_after_done_is_not_an_abort():
    async def body():
        for e in events():
            yield e
        yield b"data: [DONE]\n\n"
        await asyncio.sleep(1.0)  # [DONE] is out, the connection lingers a moment

    relay, metrics = relay_streaming(body)
    got = await stream_until(relay, lambda got: got.endswith(b"data: [DONE]\n\n"))
    assert got.endswith(b"data: [DONE]\n\n")
    assert count(metrics, "phasewatch_requests_total") == 1
    assert count(metrics, "phasewatch_requests_total", outcome="ok") == 1
    assert count(metrics, "phasewatch_aborts_total") == 0


async def test_a_hang_up_while_usage_is_awaited_is_a_usage_phase_abort():
    closed = asyncio.Event()

    async def body():
        try:  # the finish event is out; the usage event is slow to come
            for e in events():
                yield e
            await asyncio.sleep(30)
        finally:
            closed.set()

    relay, metrics = relay_streaming(body)
    got = await stream_until(relay, lambda got: got.count(b"\n\n") >= 2)
    assert got == b"".join(events()[:2])  # the finish event is held for the usage
    await asyncio.wait_for(closed.wait(), 2.0)  # the engine's response was closed
    assert count(metrics, "phasewatch_aborts_total", phase="usage") == 1
    assert count(metrics, "phasewatch_requests_total", outcome="aborted") == 1
