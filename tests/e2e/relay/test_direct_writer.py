"""What the server offers the relay beside ASGI (proxy.runtime.cycle), on the real guarded
protocol over loopback. The synchronous writer (``phasewatch.write``): ready only while a
chunked answer is under way to a client that is there, what it puts reaches the client in
order with what ``send`` sends, and a HEAD answer never takes a write. The hang-up hook
(``phasewatch.gone``): the relay's callback is called once when the client leaves while it
watches, never after it stops watching, and a reply watching through it needs no task."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import socket
import weakref
from collections.abc import AsyncIterator

import uvicorn

from proxy.core.answer import Reply
from proxy.extensions import GONE, WRITE
from proxy.runtime.http1 import guarded_protocol

from ...support.servers import free_port


def _serve(app, port: int) -> uvicorn.Server:
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=port,
        http=guarded_protocol(64 * 1024, 10.0, lambda reason: None),
        lifespan="off",
        log_config=None,
    )
    return uvicorn.Server(config)


@contextlib.asynccontextmanager
async def served(app) -> AsyncIterator[int]:
    """`app` served on a loopback port (yielded) by uvicorn with the guarded protocol."""
    port = free_port()
    server = _serve(app, port)
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield port
    finally:
        server.should_exit = True
        await task


async def _leave_after_head(port: int, done: asyncio.Event, path: bytes = b"/") -> None:
    """A GET of `path` whose client reads the answer's head and leaves; returns once the
    application has set `done`."""
    reader, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(b"GET " + path + b" HTTP/1.1\r\nhost: x\r\n\r\n")
    await reader.readuntil(b"\r\n\r\n")
    w.close()
    await asyncio.wait_for(done.wait(), 30)


def exchange(port: int, request: bytes) -> bytes:
    """`request` sent on a new connection; the answer read to its chunked end (a HEAD
    answer: to its head)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(request)
        out = b""
        while not out.endswith(b"0\r\n\r\n") and not (
            request.startswith(b"HEAD") and out.endswith(b"\r\n\r\n")
        ):
            got = s.recv(65536)
            if not got:
                break
            out += got
        return out


def test_the_writer_is_ready_only_while_a_chunked_answer_is_under_way():
    seen: list[tuple[str, str, bool]] = []

    async def app(scope, receive, send):
        writer = scope["extensions"][WRITE]
        method = scope["method"]
        seen.append((method, "before the head", writer.ready()))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        seen.append((method, "head sent", writer.ready()))
        if writer.ready():
            writer.put(b"pushed ")
            writer.put(b"framed ", b"7\r\nframed \r\n")
        await send({"type": "http.response.body", "body": b"sent", "more_body": False})
        seen.append((method, "answer complete", writer.ready()))

    async def main() -> tuple[bytes, bytes]:
        async with served(app) as port:
            get = await asyncio.to_thread(exchange, port, b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            head = await asyncio.to_thread(exchange, port, b"HEAD / HTTP/1.1\r\nhost: x\r\n\r\n")
        return get, head

    get, head = asyncio.run(main())
    assert get.split(b"\r\n\r\n", 1)[1] == (
        b"7\r\npushed \r\n7\r\nframed \r\n4\r\nsent\r\n0\r\n\r\n"
    ), get
    assert b"pushed" not in head
    assert seen == [
        ("GET", "before the head", False),
        ("GET", "head sent", True),
        ("GET", "answer complete", False),
        ("HEAD", "before the head", False),
        ("HEAD", "head sent", False),
        ("HEAD", "answer complete", False),
    ]


def test_the_writer_is_not_ready_once_the_client_has_gone():
    states: list[bool] = []
    gone = asyncio.Event()

    async def app(scope, receive, send):
        writer = scope["extensions"][WRITE]
        await send({"type": "http.response.start", "status": 200, "headers": []})
        states.append(writer.ready())
        await receive()  # the request's body
        await receive()  # returns once the client has left
        states.append(writer.ready())
        gone.set()

    async def main() -> None:
        async with served(app) as port:
            await _leave_after_head(port, gone)

    asyncio.run(main())
    assert states == [True, False]


def test_a_finished_answer_needs_no_garbage_collector():
    """The writer sits in its cycle's scope and refers back to the cycle weakly: once the
    connection's next request has begun, the last answer's cycle (its scope, headers and
    writer) is freed at once, not left for the collector (which it would otherwise keep
    busy, one cycle of objects a request)."""
    cycles: list[weakref.ref] = []

    async def app(scope, receive, send):
        cycles.append(weakref.ref(send.__self__))  # the RequestResponseCycle
        assert scope["extensions"][WRITE].ready() is False
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok", "more_body": False})

    assert _first_cycle_freed(app, cycles), "the first answer's cycle outlived its request"


def test_a_hang_up_calls_the_watching_relay_back_once():
    calls: list[str] = []
    done = asyncio.Event()

    async def app(scope, receive, send):
        watch = scope["extensions"][GONE]
        await receive()  # the request's (empty) body
        path = scope["path"]
        watch(lambda: calls.append(path))
        if path == "/unwatched":
            watch(None)  # taken back: a hang-up now calls nothing
        await send({"type": "http.response.start", "status": 200, "headers": []})
        assert (await receive())["type"] == "http.disconnect"  # once the client has left
        done.set()

    async def main() -> None:
        async with served(app) as port:
            for path in (b"/watched", b"/unwatched"):
                done.clear()
                await _leave_after_head(port, done, path)

    asyncio.run(main())
    assert calls == ["/watched"]


def test_a_reply_watching_through_the_hook_is_cancelled_by_a_hang_up_without_a_task():
    seen: dict[str, object] = {}
    done = asyncio.Event()

    async def app(scope, receive, send):
        await receive()
        reply = Reply(send, gone=scope["extensions"][GONE])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        before = asyncio.all_tasks()
        async with reply.watching(receive):
            seen["tasks added"] = len(asyncio.all_tasks() - before)
            await asyncio.sleep(60)  # the engine's long prefill; the client leaves
            seen["slept through"] = True
        seen["disconnected"] = reply.disconnected
        done.set()

    async def main() -> None:
        async with served(app) as port:
            await _leave_after_head(port, done)

    asyncio.run(main())
    assert seen == {"tasks added": 0, "disconnected": True}


def test_a_watched_answer_needs_no_garbage_collector():
    """The reply's callback sits on the cycle while it watches (the callback refers to the
    reply, the reply to the cycle's send): a finished answer's cycle is freed at once, not
    left for the collector."""
    cycles: list[weakref.ref] = []

    async def app(scope, receive, send):
        cycles.append(weakref.ref(send.__self__))
        await receive()
        reply = Reply(send, gone=scope["extensions"][GONE])
        async with reply.watching(receive):
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await reply.end(b"ok")

    assert _first_cycle_freed(app, cycles), "the first answer's cycle outlived its request"


def _first_cycle_freed(app, cycles: list) -> bool:
    """Two requests on one connection to `app` (which keeps a weak reference to each
    request's cycle in `cycles`), the collector off: whether the first answer's cycle was
    freed once the second request had begun."""

    async def main() -> bool:
        async with served(app) as port:
            reader, w = await asyncio.open_connection("127.0.0.1", port)
            for _ in range(2):
                w.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
                await reader.readuntil(b"0\r\n\r\n")
            # the first answer's task ends at its last send; wait for that, not a time
            for _ in range(500):
                if cycles[0]() is None:
                    break
                await asyncio.sleep(0.01)
            freed = cycles[0]() is None
            w.close()
            return freed

    gc.disable()
    try:
        return asyncio.run(main())
    finally:
        gc.enable()
