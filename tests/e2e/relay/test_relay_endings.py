"""How a stream's ending is counted when the client leaves near its end: leaving once
``[DONE]`` is out is no abort, while leaving as phasewatch holds the finish event for the
usage it asked for is an abort in the usage phase, and the engine's connection is closed.
The client and the engine are real peers on loopback (the proxy in process)."""

from __future__ import annotations

import asyncio
import json

import httpx

from ...support.fake_engine import SSE_HEAD, FakeEngine, Request, chunk
from .test_relay_unit import count, recorded, relay_to, streaming

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


def stream_until(url: str, enough) -> bytes:
    """A streamed chat whose client hangs up (closes its connection) once `enough(received
    bytes)` holds."""
    got = b""
    with httpx.stream("POST", url + "/v1/chat/completions", content=BODY, timeout=10) as resp:
        assert resp.status_code == 200
        for part in resp.iter_raw():
            got += part
            if enough(got):
                break
    return got


def test_leaving_after_done_is_not_an_abort():
    # [DONE] is out, the response lingers a moment before its last chunk (the finish
    # event held for the usage goes out, with what followed it, when usage or the end
    # of the body comes)
    script = streaming(*events(), b"data: [DONE]\n\n", pause_end=1.0)
    with FakeEngine(models=["m"], script=script) as engine, relay_to(engine, "openai") as proxy:
        got = stream_until(proxy.url, lambda got: got.endswith(b"data: [DONE]\n\n"))
        assert got.endswith(b"data: [DONE]\n\n")
        recorded(proxy)
        assert count(proxy.metrics, "phasewatch_requests_total") == 1
        assert count(proxy.metrics, "phasewatch_requests_total", outcome="ok") == 1
        assert count(proxy.metrics, "phasewatch_aborts_total") == 0


def test_a_hang_up_while_usage_is_awaited_is_a_usage_phase_abort():
    async def script(req: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        writer.write(SSE_HEAD)
        for e in events():  # the finish event is out; the usage event is slow to come
            writer.write(chunk(e))
            await writer.drain()
        try:
            await asyncio.wait_for(reader.read(1), 30)  # b"": the proxy closed
            engine.event("closed").set()
        finally:
            writer.close()

    engine = FakeEngine(models=["m"], script=script)
    with engine, relay_to(engine, "openai") as proxy:
        got = stream_until(proxy.url, lambda got: got.count(b"\n\n") >= 2)
        assert got == b"".join(events()[:2])  # the finish event is held for the usage
        assert engine.event("closed").wait(5)  # the engine's connection was closed
        recorded(proxy)
        assert count(proxy.metrics, "phasewatch_aborts_total", phase="usage") == 1
        assert count(proxy.metrics, "phasewatch_requests_total", outcome="aborted") == 1
