"""The relay's one per-event path (proxy.core.pipe): every relayed body goes upstream
read → tap → client write in the upstream connection's callback, through the answer's
ClientOut. The relay runs in-process over the real upstream transport (a loopback engine
that sends one event per write); the ASGI scope carries a recording ClientOut. What the
client gets must be the engine's bytes in order, measured as ever; a client that stops
reading pauses the upstream read (and its deadline) until it catches up; a write that
fails ends the request with its error, the upstream connection closed."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import pytest

from proxy.core import Relay, RelayOptions
from proxy.extensions import CLIENT_OUT
from proxy.fleet import Upstream, UpstreamOptions, Upstreams, UpstreamSpec
from proxy.measure.metrics import Metrics
from proxy.measure.recorder import Recorder
from proxy.transport import ClientOptions

CHAT = json.dumps(
    {"model": "m", "stream": True, "stream_options": {"include_usage": True}, "messages": []}
).encode()
WHOLE = json.dumps({"model": "m", "messages": []}).encode()
EVENTS = [
    b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n',
    *[b'data: {"choices":[{"index":0,"delta":{"content":"t%d"}}]}\n\n' % i for i in range(20)],
    b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n',
    b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":21,"total_tokens":26}}\n\n',
    b"data: [DONE]\n\n",
]
ANSWER = json.dumps(
    {
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12},
    }
).encode()


async def _request(reader: asyncio.StreamReader) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    await reader.readexactly(length)


def engine(together: int = 1, written: asyncio.Event | None = None):
    """A paced engine: one event per write, its last `together` events and the body's
    end in one write; `written` is set once it has written everything."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _request(reader)
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        for event in EVENTS[: len(EVENTS) - together]:
            writer.write(b"%x\r\n%b\r\n" % (len(event), event))
            await writer.drain()
            await asyncio.sleep(0.005)
        last = EVENTS[len(EVENTS) - together :]
        writer.write(b"".join(b"%x\r\n%b\r\n" % (len(e), e) for e in last) + b"0\r\n\r\n")
        await writer.drain()
        if written is not None:
            written.set()
        writer.close()

    return serve


async def whole_engine(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """An engine answering a whole JSON body with a content-length, in two writes."""
    await _request(reader)
    writer.write(
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
        % len(ANSWER)
        + ANSWER[:20]
    )
    await writer.drain()
    await asyncio.sleep(0.005)
    writer.write(ANSWER[20:])
    await writer.drain()
    writer.close()


class Out:
    """A recording ClientOut: each write as (body, framed); `fail_at` makes that write
    raise; `pause_at` pauses the client (flow(True)) after that write."""

    def __init__(self, fail_at: int = 0, pause_at: int = 0) -> None:
        self.gone = False
        self.paused = False
        self.writes: list[tuple[bytes, bytes | None]] = []
        self.fail_at, self.pause_at = fail_at, pause_at
        self.lost: Callable[[], None] | None = None
        self.flow: Callable[[bool], None] | None = None
        self.wrote = asyncio.Event()

    def write(self, body: bytes, framed: bytes | None = None) -> None:
        if not body:
            return
        if len(self.writes) + 1 == self.fail_at:
            raise RuntimeError("the client's socket failed")
        self.writes.append((body, framed))
        self.wrote.set()
        if len(self.writes) == self.pause_at:
            self.set_paused(True)

    def watch(self, lost, flow=None) -> None:
        self.lost, self.flow = lost, flow

    def set_paused(self, paused: bool) -> None:
        self.paused = paused
        if self.flow is not None:
            self.flow(paused)


def relay_to(port: int, finished: list, read_timeout: float = 600.0) -> Relay:
    metrics = Metrics()
    options = UpstreamOptions(client=ClientOptions(read_timeout=read_timeout))
    upstream = Upstream(
        UpstreamSpec("eng", f"http://127.0.0.1:{port}", engine="vllm"), options, metrics
    )
    upstream.models = {"m"}
    upstreams = Upstreams([upstream])
    upstreams.probed = True
    recorder = Recorder(metrics, access_lines=False)
    recorder.listeners.append(lambda ex, f: finished.append(ex))
    return Relay(upstreams, recorder, RelayOptions(max_body_bytes=1 << 20))


async def relayed(serve, out: Out, body: bytes = CHAT, during=None, read_timeout=600.0):
    """One chat through the relay to the engine `serve`, written to `out`: the ASGI
    messages and the recorded exchange. `during(relay)`, if given, runs beside it."""
    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    finished: list = []
    relay = relay_to(server.sockets[0].getsockname()[1], finished, read_timeout)
    messages: list[dict] = []
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/chat/completions",
        "raw_path": b"/v1/chat/completions",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json")],
        "extensions": {CLIENT_OUT: out},
    }
    first = True

    async def receive() -> dict:
        nonlocal first
        if first:
            first = False
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()
        return {}

    async def send(msg: dict) -> None:
        messages.append(msg)

    try:
        if during is None:
            await relay(scope, receive, send)
        else:
            await asyncio.gather(relay(scope, receive, send), during(relay))
    finally:
        server.close()
        await relay.upstreams.all[0].aclose()
    return messages, finished[0]


def test_events_go_out_from_the_callback_in_order_framed_as_they_came():
    out = Out()
    messages, ex = asyncio.run(relayed(engine(), out))
    assert messages[0]["status"] == 200
    assert b"".join(b for b, _ in out.writes) == b"".join(EVENTS)
    # the engine's reads of one chunk each went out with their own framing
    framed = [(b, f) for b, f in out.writes if f is not None]
    assert len(framed) >= 10, out.writes
    assert all(f == b"%x\r\n%b\r\n" % (len(b), b) for b, f in framed)
    # only the ending goes through ASGI: the head, then one empty last message
    assert messages[1:] == [{"type": "http.response.body", "body": b"", "more_body": False}]
    assert ex.outcome == "ok" and ex.marks.output_events == 21 and ex.tap.done
    assert ex.gaps is not None and sum(ex.gaps[0]) == 20


def test_a_body_ending_in_its_last_read_is_relayed_whole_and_measured():
    out = Out()
    messages, ex = asyncio.run(relayed(engine(together=3), out))
    assert b"".join(b for b, _ in out.writes) == b"".join(EVENTS)
    assert messages[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    assert ex.outcome == "ok" and ex.marks.output_events == 21 and ex.tap.done


def test_a_whole_body_goes_out_as_it_came_and_its_usage_is_read():
    out = Out()
    messages, ex = asyncio.run(relayed(whole_engine, out, body=WHOLE))
    assert b"".join(b for b, _ in out.writes) == ANSWER
    assert all(f is None for _, f in out.writes)
    assert (b"content-length", b"%d" % len(ANSWER)) in messages[0]["headers"]
    assert messages[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    assert ex.outcome == "ok" and ex.result is not None
    assert ex.result.usage.completion_tokens == 7


def test_a_slow_client_pauses_the_upstream_read_and_its_deadline():
    """The client pauses after the third write: nothing more is written while it is
    paused, though the engine has written its whole answer; the read deadline (shorter
    than the pause) does not fire; once the client resumes the stream ends whole."""
    written = asyncio.Event()
    out = Out(pause_at=3)
    seen: dict[str, int] = {}

    async def during(relay) -> None:
        await asyncio.wait_for(written.wait(), 30)
        while not out.paused:
            await out.wrote.wait()
            out.wrote.clear()
        seen["at pause"] = len(out.writes)
        loop = asyncio.get_running_loop()
        until = loop.time() + 3 * 0.2  # three read deadlines
        while loop.time() < until:
            await asyncio.sleep(0.05)
        seen["before resume"] = len(out.writes)
        out.set_paused(False)

    messages, ex = asyncio.run(
        relayed(engine(written=written), out, during=during, read_timeout=0.2)
    )
    assert seen["at pause"] == seen["before resume"] == 3
    assert b"".join(b for b, _ in out.writes) == b"".join(EVENTS)
    assert ex.outcome == "ok" and ex.marks.output_events == 21 and ex.tap.done
    assert messages[-1]["more_body"] is False


def test_a_write_that_fails_ends_the_request_with_its_error():
    out = Out(fail_at=4)
    with pytest.raises(RuntimeError, match="socket failed"):
        asyncio.run(relayed(engine(), out))
    assert len(out.writes) == 3
