"""The push path (proxy.core.push): a stream's events written from the upstream
connection's callback through the server's ``phasewatch.write`` extension. The relay runs
in-process over the real upstream transport (a loopback engine that sends one event per
write); the ASGI scope carries a recording writer. What the client gets must be the
engine's bytes in order, whichever way each event went, and a failing writer must only
send the stream back through the relay task."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from proxy.core import Relay, RelayOptions
from proxy.core.limited import LimitedLog
from proxy.core.push import Push, Writer
from proxy.extensions import WRITE
from proxy.fleet import Upstream, UpstreamOptions, Upstreams, UpstreamSpec
from proxy.measure.metrics import Metrics
from proxy.measure.recorder import Recorder
from proxy.transport.wire import whole_chunk
from tests.unit.test_relay_unit import CHAT

EVENTS = [
    b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n',
    *[b'data: {"choices":[{"index":0,"delta":{"content":"t%d"}}]}\n\n' % i for i in range(20)],
    b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n',
    b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":21,"total_tokens":26}}\n\n',
    b"data: [DONE]\n\n",
]


async def engine(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    await reader.readexactly(length)
    writer.write(
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    for event in EVENTS:  # one event per read, as a paced engine sends them
        writer.write(b"%x\r\n%b\r\n" % (len(event), event))
        await writer.drain()
        await asyncio.sleep(0.005)
    writer.write(b"0\r\n\r\n")
    await writer.drain()
    writer.close()


async def engine_ending_with_its_last_events(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    """The engine above, but its last three events and the body's end in one write (as
    an engine that finishes, sends usage and ``[DONE]`` at once)."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    await reader.readexactly(length)
    writer.write(
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    for event in EVENTS[:-3]:
        writer.write(b"%x\r\n%b\r\n" % (len(event), event))
        await writer.drain()
        await asyncio.sleep(0.005)
    writer.write(b"".join(b"%x\r\n%b\r\n" % (len(e), e) for e in EVENTS[-3:]) + b"0\r\n\r\n")
    await writer.drain()
    writer.close()


def relay_to(port: int, finished: list | None = None) -> Relay:
    """The relay to a vLLM engine on `port` serving model "m" (`finished` gets each
    recorded exchange)."""
    metrics = Metrics()
    upstream = Upstream(
        UpstreamSpec("eng", f"http://127.0.0.1:{port}", engine="vllm"), UpstreamOptions(), metrics
    )
    upstream.models = {"m"}
    upstreams = Upstreams([upstream])
    upstreams.probed = True
    recorder = Recorder(metrics, access_lines=False)
    if finished is not None:
        recorder.listeners.append(lambda ex, f: finished.append(ex))
    return Relay(upstreams, recorder, RelayOptions(max_body_bytes=1 << 20))


def anything(body: bytes) -> None:
    """A client socket that takes every write."""


async def relayed(
    ready: Callable[[], bool],
    put: Callable[[bytes], None] = anything,
    own_write: bool = False,
    finished: list | None = None,
    serve=engine,
) -> tuple[list[tuple[str, bytes]], list[dict]]:
    """One streamed chat through the relay, the server's writer `ready` when it says so
    and its writes going to `put` (which may raise); what reached the client, in order,
    as ("send"|"write"|"framed"|"own", bytes), and the ASGI messages. `own_write`: the
    writer offers its own write of framed chunks too (as the server's does); `finished`
    gets the recorded exchange; `serve` is the engine."""
    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    relay = relay_to(server.sockets[0].getsockname()[1], finished)
    wire: list[tuple[str, bytes]] = []
    messages: list[dict] = []
    started = False

    def can_write() -> bool:
        return started and ready()

    misuse: list[object] = []  # an assert here would only send the stream to the task

    def direct(body: bytes, framed: bytes | None = None) -> None:
        if not (body and can_write()):  # written only right after ready() said yes
            misuse.append(body)
        put(body)
        # a read that was one whole chunk comes framed as the server frames it
        if framed is not None and framed != b"%x\r\n%b\r\n" % (len(body), body):
            misuse.append(framed)
        wire.append(("framed" if framed is not None else "write", body))

    def own(framed: bytes) -> None:
        body = whole_chunk(framed)
        if body is None or not can_write():  # a whole chunk, right after ready() said yes
            misuse.append(framed)
        put(body or b"")
        wire.append(("own", body or b""))

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/chat/completions",
        "raw_path": b"/v1/chat/completions",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json")],
        "extensions": {WRITE: Writer(can_write, direct, own if own_write else None)},
    }
    first = True

    async def receive() -> dict:
        nonlocal first
        if first:
            first = False
            return {"type": "http.request", "body": CHAT, "more_body": False}
        await asyncio.Event().wait()
        return {}

    async def send(msg: dict) -> None:
        nonlocal started
        messages.append(msg)
        started = True
        if msg.get("body"):
            wire.append(("send", msg["body"]))

    try:
        await relay(scope, receive, send)
    finally:
        server.close()
        await relay.upstreams.all[0].aclose()
    assert not misuse, misuse
    return wire, messages


def test_events_go_out_from_the_callback_in_order():
    wire, messages = asyncio.run(relayed(lambda: True))
    assert messages[0]["status"] == 200
    assert b"".join(b for _, b in wire) == b"".join(EVENTS)
    # the stream's events went out through the writer, not a task wake-up each, and the
    # engine's reads of one chunk each went out as they came, not parsed and reframed
    assert sum(1 for how, _ in wire if how != "send") >= len(EVENTS) // 2, wire
    assert any(how == "framed" for how, _ in wire), wire
    assert messages[-1]["more_body"] is False


def test_paced_token_events_go_out_in_one_call_through_the_servers_own_write():
    """With the server's own write of framed chunks (as ``runtime.cycle`` offers it),
    each read that is one plain token event goes out through it as it came, counted by
    the tap's shortcut exactly as without it: same bytes, same measurement."""
    plain_done: list = []
    plain, _ = asyncio.run(relayed(lambda: True, finished=plain_done))
    own_done: list = []
    wire, messages = asyncio.run(relayed(lambda: True, own_write=True, finished=own_done))
    assert b"".join(b for _, b in wire) == b"".join(EVENTS)
    assert sum(1 for how, _ in wire if how == "own") >= 10, wire  # the 20 token events
    assert not any(how == "own" for how, _ in plain)
    (a,), (b,) = plain_done, own_done
    assert a.marks.output_events == b.marks.output_events == 21  # role + 20 tokens
    assert a.gaps is not None and b.gaps is not None
    assert sum(a.gaps[0]) == sum(b.gaps[0]) == 20
    assert messages[-1]["more_body"] is False


def test_a_body_ending_in_its_last_read_is_relayed_whole_and_measured():
    """When the engine's last read holds its last events and the body's end, those
    events go out in order, measured as ever, and the answer ends with an empty final
    message, as a body whose end comes in a read of its own does."""
    for own_write in (False, True):
        done: list = []
        wire, messages = asyncio.run(
            relayed(
                lambda: True,
                own_write=own_write,
                finished=done,
                serve=engine_ending_with_its_last_events,
            )
        )
        assert b"".join(b for _, b in wire) == b"".join(EVENTS)
        assert messages[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
        assert done[0].marks.output_events == 21 and done[0].tap.done
    _, messages = asyncio.run(relayed(lambda: True))
    assert messages[-1] == {"type": "http.response.body", "body": b"", "more_body": False}


def test_a_failing_own_write_holds_the_counted_event_for_the_task(caplog):
    """The server's write failing after the tap counted the event: the event goes out
    from the task (first), counted once; the push path is given up, said once."""
    calls = 0

    def flaky(body: bytes) -> None:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("boom")

    done: list = []
    with caplog.at_level(logging.WARNING):
        wire, _ = asyncio.run(relayed(lambda: True, flaky, own_write=True, finished=done))
    assert b"".join(b for _, b in wire) == b"".join(EVENTS)  # nothing lost, nothing twice
    assert any(how == "own" for how, _ in wire) and any(how == "send" for how, _ in wire)
    assert done[0].marks.output_events == 21
    assert len([r for r in caplog.records if "push path failed" in r.getMessage()]) == 1


def test_a_writer_that_cannot_write_leaves_it_to_the_task():
    wire, _ = asyncio.run(relayed(lambda: False))
    assert b"".join(b for _, b in wire) == b"".join(EVENTS)
    assert all(how == "send" for how, _ in wire)


def test_a_writer_that_raises_falls_back_to_the_task(caplog):
    calls = 0

    def flaky(body: bytes) -> None:
        nonlocal calls
        calls += 1
        if calls > 2:
            raise RuntimeError("boom")

    with caplog.at_level(logging.WARNING):
        wire, messages = asyncio.run(relayed(lambda: True, flaky))
    assert b"".join(b for _, b in wire) == b"".join(EVENTS)  # nothing lost, nothing twice
    assert any(how != "send" for how, _ in wire) and any(how == "send" for how, _ in wire)
    said = [r for r in caplog.records if "push path failed" in r.getMessage()]
    assert len(said) == 1, said
    assert messages[-1]["more_body"] is False


#: A writer that can always write, and takes the writes.
WRITABLE = Writer(lambda: True, lambda body, framed=None: None)


def test_a_tap_that_raises_in_the_sink_leaves_the_chunk_to_the_task():
    installed = []

    def feed(chunk: bytes, now: float) -> bytes:
        raise ValueError("tap bug")

    push = Push(installed.append, feed, WRITABLE, LimitedLog(logging.getLogger("t")))
    assert push.sink(b"data: x\n\n") is False  # not taken: the task feeds it itself
    assert installed == [None]  # and the push path is given up for the stream


def test_the_sink_refuses_while_the_task_sends():
    fed = []
    push = Push(
        lambda s: None,
        lambda chunk, now: fed.append(chunk) or chunk,
        WRITABLE,
        LimitedLog(logging.getLogger("t")),
    )
    assert push.take() == b""
    assert push.sink(b"a") is False and fed == []
    push.busy = False
    assert push.sink(b"b") is True and fed == [b"b"]
